#include "common/comm_creation.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <string_view>
#include <thread>

#include "common/backoff.hpp"
#include "common/checks.hpp"
#include "common/hash.hpp"
#include "common/mpi_wait.hpp"
#include "meshrt/error.hpp"

namespace meshrt::detail {

std::mutex& comm_creation_mutex() {
  static std::mutex m;
  return m;
}

namespace {

enum Handshake : std::uint64_t { kHello = 1, kCommit = 2, kAbort = 3 };
constexpr std::uint64_t kHandshakeMagic = 0x4d52544847524f50ull;  // "MRTHGROP"

std::string member_list(const std::vector<int>& members) {
  std::string out = "[";
  for (std::size_t i = 0; i < members.size(); ++i) out += (i ? ", " : "") + std::to_string(members[i]);
  return out + "]";
}

}  // namespace

CreationAgreement::CreationAgreement(CreationWording wording, MPI_Comm parent, int me, std::vector<int> members,
                                     int tag, std::chrono::duration<double> timeout)
    : wording_(std::move(wording)),
      parent_(parent),
      me_(me),
      members_(std::move(members)),
      tag_(tag),
      timeout_(timeout) {
  for (int m : members_) {
    if (m != me) peers_.push_back(m);
  }
  hash_ = fnv1a_64(member_list(members_));
  // Send buffers live until MPI is done with them: freed once every send completed (after
  // a successful agreement, every send was received), else left to MPI (a send to an
  // absent member may stay pending until MPI_Finalize).
  out_ = new std::array<Message, 4>{};
  for (std::uint64_t k : {kHello, kCommit, kAbort}) (*out_)[k] = {kHandshakeMagic, k, hash_, 0};
  in_.resize(peers_.size());
  recvs_.assign(peers_.size(), MPI_REQUEST_NULL);
}

CreationAgreement::~CreationAgreement() {
  cancel_recvs();
  if (!sends_done_ && !sends_.empty()) {
    // After a failed agreement: the sends are small (MPI's eager protocol), so they have
    // usually completed even when their receiver never came.
    int complete = 0;
    MESHRT_MPI_IGNORE(MPI_Testall(static_cast<int>(sends_.size()), sends_.data(), &complete, MPI_STATUSES_IGNORE));
    sends_done_ = complete != 0;
  }
  if (sends_done_ || sends_.empty()) {
    delete out_;
  } else {
    for (MPI_Request& r : sends_) {
      if (r != MPI_REQUEST_NULL) MESHRT_MPI_IGNORE(MPI_Request_free(&r));  // completes in the background
    }
  }
}

std::unique_lock<std::mutex> CreationAgreement::run() {
  const auto seconds = timeout_.count();
  // Step 1: HELLO.
  send_all(kHello);
  post_recvs();
  wait([&](std::size_t i, const Message& m) {
    if (m[1] == kHello) {
      if (m[2] != hash_) {
        fail_with(
            UsageError(fmt::format("{} on {}: {} called it with a different member list than {} (tag {}); every "
                                   "member must pass the same list",
                                   wording_.op, wording_.rank(me_), wording_.rank(peers_[i]), wording_.what, tag_)));
      }
      return true;
    }
    return false;  // a COMMIT or ABORT of an earlier attempt: skipped
  });
  if (!pending().empty()) {
    const std::vector<int> missing = pending();
    missing_ = static_cast<std::uint64_t>(missing.front()) + 1;
    fail_with(TimeoutError(fmt::format("{} timed out after {} s on {}: {} did not join {} {}", wording_.op, seconds,
                                       wording_.rank(me_), wording_.ranks(missing), wording_.what, wording_.late),
                           missing));
  }
  // This rank's communicator creations are serialised (comm_creation_mutex): the lock is
  // taken before COMMIT, so every member holds its own when it enters the creation, and
  // nothing else on a member can interleave with it.
  // Polled with try_lock rather than a timed_mutex's try_lock_until: that waits in
  // pthread_mutex_clocklock, which ThreadSanitizer does not see, so it reports the unlock
  // as one of an unlocked mutex.
  std::unique_lock lock(comm_creation_mutex(), std::defer_lock);
  const auto until = deadline_after(timeout_);
  while (!lock.try_lock() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  if (!lock.owns_lock()) {
    fail_with(TimeoutError(fmt::format("{} timed out after {} s on {}: every member of {} joined, but another "
                                       "communicator creation on this rank (a mesh's, or a group's on another thread) "
                                       "did not finish within the timeout",
                                       wording_.op, seconds, wording_.rank(me_), wording_.what),
                           std::vector<int>{me_}));
  }
  // Step 2: COMMIT, and every other member's COMMIT or ABORT.
  send_all(kCommit);
  post_recvs();
  std::vector<int> aborted;
  std::vector<int> late;
  wait([&](std::size_t i, const Message& m) {
    if (m[1] == kAbort) {
      aborted.push_back(peers_[i]);
      if (m[3] != 0) late.push_back(static_cast<int>(m[3] - 1));
    }
    return true;
  });
  if (!pending().empty()) {
    const std::vector<int> silent = pending();
    throw TimeoutError(
        fmt::format("{} timed out after {} s on {}: {} joined {} but sent neither COMMIT nor ABORT (do the "
                    "members use the same timeout?); members that did commit may be left in "
                    "MPI_Comm_create_group",
                    wording_.op, seconds, wording_.rank(me_), wording_.ranks(silent), wording_.what),
        silent);
  }
  if (!aborted.empty()) {
    std::sort(aborted.begin(), aborted.end());
    std::sort(late.begin(), late.end());
    late.erase(std::unique(late.begin(), late.end()), late.end());
    const std::string why = late.empty()
                                ? std::string("(their create timed out or failed before every member had joined)")
                                : fmt::format("when {} had not joined {}", wording_.ranks(late), wording_.late);
    throw TimeoutError(fmt::format("{} on {}: {} gave up on {} {}", wording_.op, wording_.rank(me_),
                                   wording_.ranks(aborted), wording_.what, why),
                       late.empty() ? aborted : late);
  }
  MESHRT_MPI_CHECK(MPI_Waitall(static_cast<int>(sends_.size()), sends_.data(), MPI_STATUSES_IGNORE));
  sends_.clear();
  sends_done_ = true;
  return lock;
}

void CreationAgreement::send_all(int kind) {
  Message& msg = (*out_)[static_cast<std::size_t>(kind)];
  if (kind == kAbort) msg[3] = missing_;
  for (int p : peers_) {
    MPI_Request r = MPI_REQUEST_NULL;
    MESHRT_MPI_CHECK(MPI_Isend(msg.data(), static_cast<int>(msg.size()), MPI_UINT64_T, p, tag_, parent_, &r));
    sends_.push_back(r);
  }
}

void CreationAgreement::post(std::size_t i) {
  MESHRT_MPI_CHECK(
      MPI_Irecv(in_[i].data(), static_cast<int>(in_[i].size()), MPI_UINT64_T, peers_[i], tag_, parent_, &recvs_[i]));
}

void CreationAgreement::post_recvs() {
  for (std::size_t i = 0; i < peers_.size(); ++i) post(i);
}

void CreationAgreement::wait(const std::function<bool(std::size_t, const Message&)>& accept) {
  if (recvs_.empty()) return;  // a creation of one
  const auto deadline = deadline_after(timeout_);
  Backoff backoff(kGroup);
  std::vector<int> idx(peers_.size());
  std::vector<MPI_Status> st(peers_.size());
  for (;;) {
    int outcount = 0;
    MESHRT_MPI_CHECK(MPI_Testsome(static_cast<int>(recvs_.size()), recvs_.data(), &outcount, idx.data(), st.data()));
    if (outcount == MPI_UNDEFINED) break;  // all taken
    for (int k = 0; k < outcount; ++k) {
      const auto i = static_cast<std::size_t>(idx[static_cast<std::size_t>(k)]);
      const Message& m = in_[i];
      if (m[0] != kHandshakeMagic || m[1] < kHello || m[1] > kAbort) {
        fail_with(ProtocolError(fmt::format(
            "{} on {}: expected a creation handshake message from {} on tag {}, found another message (does the "
            "program send on tag {} of the parent communicator?)",
            wording_.op, wording_.rank(me_), wording_.rank(peers_[i]), tag_, tag_)));
      }
      if (!accept(i, m)) post(i);
    }
    if (outcount > 0) {
      backoff.reset();
      continue;
    }
    if (backoff.expired(deadline)) break;
    backoff.pause();
  }
}

std::vector<int> CreationAgreement::pending() const {
  std::vector<int> out;
  for (std::size_t i = 0; i < peers_.size(); ++i) {
    if (recvs_[i] != MPI_REQUEST_NULL) out.push_back(peers_[i]);
  }
  return out;
}

void CreationAgreement::cancel_recvs() noexcept {
  for (MPI_Request& r : recvs_) {
    if (r == MPI_REQUEST_NULL) continue;
    // Cancelled, or taken in between (then the message is dropped: its sender will see
    // this member's ABORT).
    MESHRT_MPI_IGNORE(MPI_Cancel(&r));
    MESHRT_MPI_IGNORE(MPI_Wait(&r, MPI_STATUS_IGNORE));
  }
}

template <class E>
void CreationAgreement::fail_with(const E& e) {
  cancel_recvs();
  send_all(kAbort);
  throw e;
}

}  // namespace meshrt::detail
