// The group's life: its parts (who is who, the requests of an operation, the notice of a
// broken group), its teardown, and how a timeout or another member's notice breaks it.
#include "group/impl.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <string_view>
#include <thread>

#include "common/checks.hpp"

namespace meshrt {
namespace group_internal {

// ---- who is who ---------------------------------------------------------------------

std::string Members::me() const {
  return fmt::format("group rank {} (parent rank {}) of {}", rank, parent_ranks[static_cast<std::size_t>(rank)], size);
}

std::string Members::peer(int r) const {
  return fmt::format("group rank {} (parent rank {})", r, parent_ranks[static_cast<std::size_t>(r)]);
}

std::string Members::peers(const std::vector<int>& rs) const {
  std::vector<int> p;
  for (int r : rs) p.push_back(parent_ranks[static_cast<std::size_t>(r)]);
  return fmt::format("group ranks {} (parent ranks {})", int_list(rs), int_list(p));
}

std::string Members::where(const char* op, int src) const {
  return fmt::format("{} on {} from {}", op, me(), peer(src));
}

void Members::check_peer(const char* op, int r, const char* role) const {
  if (r < 0 || r >= size) {
    throw UsageError(
        fmt::format("{} on {}: {} rank {} is not a group rank (expected 0..{})", op, me(), role, r, size - 1));
  }
}

// ---- the requests of an operation ---------------------------------------------------

bool Requests::wait_all(std::span<MPI_Request> reqs, Clock::time_point dl, std::size_t bytes) {
  if (reqs.empty()) return true;
  Backoff backoff(group_wait(bytes));
  if (reqs.size() == 1) {
    for (;;) {
      int done = 0;
      MESHRT_MPI_CHECK(MPI_Test(&reqs[0], &done, MPI_STATUS_IGNORE));
      if (done) return true;
      if (backoff.expired(dl)) return false;
      backoff.pause();
    }
  }
  idx.resize(reqs.size());
  // Counted down: the call that completes the last request ends the wait.
  auto pending = static_cast<std::size_t>(
      std::count_if(reqs.begin(), reqs.end(), [](MPI_Request r) { return r != MPI_REQUEST_NULL; }));
  for (;;) {
    int outcount = 0;
    MESHRT_MPI_CHECK(
        MPI_Testsome(static_cast<int>(reqs.size()), reqs.data(), &outcount, idx.data(), MPI_STATUSES_IGNORE));
    if (outcount == MPI_UNDEFINED) return true;  // no active request left
    if (outcount > 0) {
      pending -= std::min(pending, static_cast<std::size_t>(outcount));
      if (pending == 0) return true;
      backoff.reset();  // data is moving: keep polling closely
      continue;
    }
    if (backoff.expired(dl)) return false;
    backoff.pause();
  }
}

std::vector<std::size_t> Requests::pending(std::span<MPI_Request> reqs) {
  std::vector<std::size_t> out;
  for (std::size_t i = 0; i < reqs.size(); ++i) {
    if (reqs[i] == MPI_REQUEST_NULL) continue;
    int done = 0;
    MESHRT_MPI_IGNORE(MPI_Request_get_status(reqs[i], &done, MPI_STATUS_IGNORE));  // failed: reads as pending
    if (!done) out.push_back(i);
  }
  return out;
}

void Requests::cancel_receives(std::span<MPI_Request> reqs) {
  for (auto& r : reqs) {
    if (r == MPI_REQUEST_NULL) continue;
    MESHRT_MPI_IGNORE(MPI_Cancel(&r));  // withdrawing after an error or timeout already raised
    MESHRT_MPI_IGNORE(MPI_Request_free(&r));
  }
}

Requests::Withdrawn Requests::withdraw(MPI_Request& r, MPI_Status& st) {
  MESHRT_MPI_IGNORE(MPI_Cancel(&r));  // a failed cancel or test reads as not done: Stuck
  const auto until = Clock::now() + std::chrono::milliseconds(50);
  for (;;) {
    int done = 0;
    MESHRT_MPI_IGNORE(MPI_Test(&r, &done, &st));
    if (done) {
      int cancelled = 0;
      MESHRT_MPI_IGNORE(MPI_Test_cancelled(&st, &cancelled));
      return cancelled ? Withdrawn::Cancelled : Withdrawn::Completed;
    }
    if (Clock::now() >= until) {
      MESHRT_MPI_IGNORE(MPI_Request_free(&r));
      return Withdrawn::Stuck;
    }
    std::this_thread::yield();
  }
}

std::vector<int> Requests::late_of(std::span<MPI_Request> reqs, const std::vector<int>& owner) {
  std::vector<int> out;
  for (std::size_t i : pending(reqs)) {
    if (std::find(out.begin(), out.end(), owner[i]) == out.end()) out.push_back(owner[i]);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// ---- the notice of a broken group ---------------------------------------------------

void BrokenWord::tell(MPI_Comm comm, const Members& who, const char* op, double seconds, std::uint64_t seq,
                      BrokenWhy why, std::string_view text) {
  if (comm == MPI_COMM_NULL || who.size < 2 || notice_) return;
  notice_ = std::make_unique<BrokenNotice>();
  notice_->why = why;
  notice_->seq = seq;
  notice_->seconds = seconds;
  std::strncpy(notice_->op, op, sizeof notice_->op - 1);
  text.copy(notice_->text, std::min(text.size(), sizeof notice_->text - 1));
  for (int p = 0; p < who.size; ++p) {
    if (p == who.rank) continue;
    sends_.push_back(MPI_REQUEST_NULL);
    // Ignored on purpose: the timeout being raised says more than a failed notice would.
    MESHRT_MPI_IGNORE(
        MPI_Isend(notice_.get(), static_cast<int>(sizeof *notice_), MPI_BYTE, p, kBrokenTag, comm, &sends_.back()));
  }
}

void BrokenWord::release() noexcept {
  if (sends_.empty()) return;
  int done = 0;
  MESHRT_MPI_IGNORE(MPI_Testall(static_cast<int>(sends_.size()), sends_.data(), &done,
                                MPI_STATUSES_IGNORE));  // failed: reads as not done
  if (!done) {
    for (MPI_Request& r : sends_) {
      if (r != MPI_REQUEST_NULL) MESHRT_MPI_IGNORE(MPI_Request_free(&r));
    }
    (void)notice_.release();  // MPI may still read it
  }
  sends_.clear();
}

}  // namespace group_internal

using namespace group_internal;

// ---- teardown and breaking ----------------------------------------------------------

void StatelessGroup::Impl::release() noexcept {
  if (comm == MPI_COMM_NULL) return;
  int finalized = 0;
  MESHRT_MPI_IGNORE(MPI_Finalized(&finalized));  // noexcept teardown, as the frees below
  if (!finalized) {
    broken.release();
    if (notice_req != MPI_REQUEST_NULL) {
      // MPI must not write a late notice into freed memory: a receive that cannot be
      // withdrawn keeps its buffer, leaked on purpose.
      MPI_Status st;
      const Requests::Withdrawn w = Requests::withdraw(notice_req, st);
      if (w == Requests::Withdrawn::Stuck) (void)notice_in.release();
      if (w != Requests::Withdrawn::Cancelled) notice_arrived = true;
    }
    if (!unusable_after.empty() || notice_arrived || message_waiting()) {
      // A broken group may have messages no member will ever receive (first messages and
      // notices to members that never came), as has one with a message waiting unreceived.
      // MPI may give a freed communicator's context to the next one made (MPICH does),
      // where they would match as that group's: so the communicator is kept, unused, until
      // MPI_Finalize (docs/ARCHITECTURE.md section 5).
      comm = MPI_COMM_NULL;
      inter = MPI_COMM_NULL;
      return;
    }
    if (inter != MPI_COMM_NULL) {
      // Open MPI 4.1.4 hangs in MPI_Comm_disconnect of the merged intracommunicator
      // (even with no traffic on it), but disconnects the intercommunicator it came
      // from cleanly; the merged one is freed first so that nothing else connects them.
      MESHRT_MPI_IGNORE(MPI_Comm_free(&comm));
      MESHRT_MPI_IGNORE(MPI_Comm_disconnect(&inter));
    } else {
      MESHRT_MPI_IGNORE(MPI_Comm_free(&comm));
    }
  }
  comm = MPI_COMM_NULL;
}

void StatelessGroup::Impl::check_usable(const char* op) {
  if (comm == MPI_COMM_NULL) throw UsageError(fmt::format("{}: the group has been disconnected or moved from", op));
  if (!unusable_after.empty()) {
    throw UsageError(
        fmt::format("{} on {}: group is unusable after {}; create a new group", op, who.me(), unusable_after));
  }
  check_not_broken(op);
}

bool StatelessGroup::Impl::message_waiting() noexcept {
  int flag = 0;
  MESHRT_MPI_IGNORE(MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm, &flag, MPI_STATUS_IGNORE));  // failed: none seen
  return flag != 0;
}

bool StatelessGroup::Impl::notice_waiting() {
  if (notice_arrived) return true;
  if (notice_req == MPI_REQUEST_NULL) {
    if (who.size < 2 || notice_in) return false;  // posted once; a completed one is kept in notice_arrived
    notice_in = std::make_unique<BrokenNotice>();
    MESHRT_MPI_CHECK(MPI_Irecv(notice_in.get(), static_cast<int>(sizeof *notice_in), MPI_BYTE, MPI_ANY_SOURCE,
                               kBrokenTag, comm, &notice_req));
  }
  int flag = 0;
  MESHRT_MPI_CHECK(MPI_Test(&notice_req, &flag, &notice_st));
  notice_arrived = flag != 0;
  return notice_arrived;
}

void StatelessGroup::Impl::check_not_broken(const char* op) {
  if (!notice_waiting()) return;
  BrokenNotice& n = *notice_in;
  const MPI_Status& st = notice_st;
  n.op[sizeof n.op - 1] = '\0';
  n.text[sizeof n.text - 1] = '\0';
  const int from = st.MPI_SOURCE;
  if (n.magic == kBrokenMagic && n.why == BrokenWhy::Disagreement) {
    // The member that found the disagreement raised it; this one raises it too, now or
    // at its next call if its own part of that collective had completed.
    break_group(fmt::format("{} found a disagreement in {} #{} (seen in {})", who.peer(from), n.op, n.seq, op));
    throw UsageError(fmt::format(
        "{} on {}: the members disagree on the collective: {} found in {} #{}: {}; the group is unusable now "
        "(every member raises this, in that call or its next): create a new group",
        op, who.me(), who.peer(from), n.op, n.seq, n.text));
  }
  const std::string what =
      n.magic == kBrokenMagic ? fmt::format("{} timed out in {}{} after {} s and broke the group", who.peer(from), n.op,
                                            std::string_view(n.op) == "send_obj" || std::string_view(n.op) == "recv_obj"
                                                ? std::string()
                                                : fmt::format(" #{}", n.seq),
                                            n.seconds)
                              : fmt::format("{} broke the group", who.peer(from));
  break_group(fmt::format("{} (seen in {})", what, op));
  throw TimeoutError(fmt::format("{} on {}: {} before this rank's call could complete with it (it did not wait for "
                                 "this rank); the group is unusable now: create a new group",
                                 op, who.me(), what),
                     {}, true);
}

void StatelessGroup::Impl::timed_out(const char* op, const Timeout& t, const std::string& waiting_for,
                                     const std::vector<int>& missing, bool breaks_group) {
  if (breaks_group) {
    break_group(fmt::format("a timeout in {}", op));
    // Every other member hears of it (check_not_broken).
    broken.tell(comm, who, op, seconds(t), coll_seq == 0 ? 0 : coll_seq - 1);
  }
  throw TimeoutError(
      fmt::format("{} timed out after {} s on {}: {}{}; {}", op, seconds(t), who.me(), waiting_for,
                  missing.empty() ? std::string() : fmt::format("; missing {}", who.peers(missing)),
                  breaks_group ? "the group is unusable now (messages of this operation may still be in flight)"
                               : "the group is still usable"),
      missing, breaks_group);
}

void StatelessGroup::Impl::disagreed(const char* op, std::uint64_t seq, const std::string& what) {
  break_group(fmt::format("a disagreement in {}", op));
  // Every other member hears of it (check_not_broken), in its wait or at its next call:
  // a broadcast's root and the receivers that agreed may have completed their part.
  broken.tell(comm, who, op, 0, seq, BrokenWhy::Disagreement, what);
  throw UsageError(
      fmt::format("{} on {}: the members disagree on the collective: {}; the group is unusable now (every member "
                  "raises this, in that call or its next): create a new group",
                  op, who.me(), what));
}

void StatelessGroup::Impl::break_group(std::string why) {
  unusable_after = std::move(why);
  (void)buf.release();  // abandoned to pending sends and receives, see Buffers
  buf = std::make_unique<Buffers>();
}

}  // namespace meshrt
