// StatelessGroup's transfers: every MPI call of the group module lives here.
//
// Wire protocol. Every object travels as one "first message" on the operation's header
// tag (one tag for every collective, see "collectives" below): a 64-byte WireHeader, the
// sender's type name, and (for small objects) the whole payload, so a small object costs
// exactly one MPI message. Larger payloads follow on
// the operation's chunk tag as ceil(total / chunk) messages of at most `chunk` bytes,
// sent from and received into the object's own memory where the type allows (raw types)
// or the serialization buffer. MPI matches by (source, tag) and never overtakes between
// a pair, so messages of different senders never mix and one sender's are FIFO.
//
// Receiving: a first message is received with a pre-posted MPI_Irecv into a per-peer
// buffer of the largest first-message size (kFirstMax), straight from MPI's eager path
// (no probe, no unexpected-queue copy); a receive that times out is cancelled, so the
// late message stays queued for the next call. The first chunk of a large payload is
// probed before anything is allocated (a corrupt header never makes a rank allocate),
// then every chunk is received in place. all_gather_obj posts all its receives before it
// sends, and takes the parts in whatever order they come.
//
// Waiting: non-blocking MPI progressed with MPI_Test/MPI_Testsome in a loop that polls
// back to back for a few dozen tries, then yields between polls for a while (200 us, or
// about twice a transfer's time at 1 GB/s while a large payload moves: a sleeping rank
// stalls a shared-memory transfer) and then sleeps with growing intervals (up to 1 ms),
// so a waiting rank does not burn a core on an oversubscribed machine.
#include "meshrt/group.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <filesystem>
#include <fstream>
#include <thread>

#include "common/backoff.hpp"
#include "common/checks.hpp"
#include "common/comm_creation.hpp"
#include "common/hash.hpp"
#include "meshrt/internal/mpi_session.hpp"
#include "meshrt/internal/settings.hpp"

namespace meshrt {
namespace {

using Clock = std::chrono::steady_clock;
using Seconds = std::chrono::duration<double>;

// One tag pair per operation kind, so a send can never be taken for a broadcast.
enum class Kind : std::uint8_t { Send = 1, Broadcast = 2, AllGather = 3, Barrier = 4 };
constexpr int header_tag(Kind k) {
  return 2 * static_cast<int>(k) - 1;
}
constexpr int chunk_tag(Kind k) {
  return 2 * static_cast<int>(k);
}
constexpr const char* kind_name(Kind k) {
  switch (k) {
    case Kind::Send:
      return "send_obj/recv_obj";
    case Kind::Broadcast:
      return "broadcast_obj";
    case Kind::AllGather:
      return "all_gather_obj";
    case Kind::Barrier:
      return "barrier";
  }
  return "?";
}

constexpr std::uint32_t kMagic = 0x4752544d;  // "MTRG"
constexpr std::uint16_t kVersion = 1;
// Objects up to this size travel inside the first message (one MPI message in all);
// above it the payload is sent from the object's memory without a packing copy.
constexpr std::size_t kInlineMax = 16 * 1024;
constexpr std::size_t kMaxTypeName = 4096;
// The largest first message: what a first-message receive is posted for.
constexpr std::size_t kFirstMax = 64 + kMaxTypeName + kInlineMax;
// Payloads move in messages of at most this size (or the group's chunk size if smaller):
// shared-memory transfers only advance while a rank calls into MPI, and a completed
// piece is the progress signal that keeps the waiting loop from sleeping mid-transfer.
constexpr std::size_t kPipelineBytes = std::size_t{1} << 20;
// Payloads up to this size are allocated as soon as their header is checked and every
// chunk's receive posted at once; larger ones only once their first chunk is there.
constexpr std::size_t kTrustedAlloc = std::size_t{1} << 20;

struct WireHeader {
  std::uint32_t magic;
  std::uint16_t version;
  std::uint8_t kind;
  std::uint8_t raw;
  std::uint64_t type_hash;
  std::uint64_t total;         // payload bytes
  std::uint64_t inline_bytes;  // payload bytes inside this message (0 or total)
  std::uint64_t chunk;         // size of every continuation chunk but the last
  std::uint64_t seq;           // the sender's count of operations of this kind
  std::int32_t root;           // broadcast: the root; otherwise the sender
  std::int32_t sender;
  std::uint32_t name_len;
  std::uint32_t reserved;
};
static_assert(sizeof(WireHeader) == 64);

// A collective's first message from one member: its header and the type name it carries
// (pointing into that member's inbox).
struct WireHeaderView {
  WireHeader h{};
  std::string_view type_name;
};

std::size_t physical_memory() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page <= 0) return std::size_t{1} << 40;
  return static_cast<std::size_t>(pages) * static_cast<std::size_t>(page);
}

Clock::time_point deadline_after(Seconds t) {
  // A "no limit" timeout is duration::max(), which overflows any time_point arithmetic.
  if (t >= Seconds(1e9)) return Clock::time_point::max();
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(t);
}

// Waits use the common back-off with kGroup's parameters (src/common/backoff.hpp says why);
// the yielding phase grows with the bytes in flight: shared-memory transfers only advance
// while both ranks call into MPI, and a sleeping sender stalls its receiver.
Clock::duration spin_for(std::size_t bytes) {
  // About twice as long as the bytes take at 1 GB/s.
  return std::max<Clock::duration>(detail::kGroup.yield, std::chrono::nanoseconds(2 * bytes));
}
using Backoff = detail::Backoff;
detail::BackoffPolicy group_wait(std::size_t bytes = 0) {
  return detail::kGroup.yielding_until(spin_for(bytes));
}

std::string int_list(const std::vector<int>& v) {
  return fmt::format("[{}]", fmt::join(v, ", "));
}

}  // namespace

namespace detail {

std::string readable_type_name(std::string name) {
  const auto replace_all = [&](std::string_view from, std::string_view to) {
    for (auto at = name.find(from); at != std::string::npos; at = name.find(from, at + to.size()))
      name.replace(at, from.size(), to);
  };
  replace_all("std::__cxx11::", "std::");
  // Drop ", std::allocator<...>" and the other defaults, with their nested brackets.
  for (const std::string_view arg : {", std::allocator<", ", std::char_traits<", ", std::less<", ", std::hash<",
                                     ", std::equal_to<", ", std::default_delete<"}) {
    for (auto at = name.find(arg); at != std::string::npos; at = name.find(arg, at)) {
      std::size_t end = at + arg.size();
      for (int depth = 1; end < name.size() && depth > 0; ++end) {
        if (name[end] == '<') ++depth;
        if (name[end] == '>') --depth;
      }
      name.erase(at, end - at);
    }
  }
  replace_all(" >", ">");
  replace_all("std::basic_string<char>", "std::string");
  replace_all("std::basic_string_view<char>", "std::string_view");
  return name;
}

std::uint64_t fnv1a(std::string_view text) {
  return fnv1a_64(text);
}

void serialize_failed(const TypeTag& tag, const char* what) {
  throw UsageError(fmt::format("cannot serialize an object of type {}: {}", tag.name, what));
}

void deserialize_failed(const TypeTag& tag, std::size_t size, const char* what, const std::string& where) {
  throw ProtocolError(
      fmt::format("{}: the {}-byte payload does not decode as {} (tag matched): {}", where, size, tag.name, what));
}

}  // namespace detail

// A member's word to the others that it broke the group in a timeout (on its own tag,
// after every operation's): a member that arrives late takes it and raises too, instead of
// completing with what the others left in flight.
constexpr int kBrokenTag = 2 * 5;
constexpr std::uint32_t kBrokenMagic = 0x6b6f7262;  // "brok"
struct BrokenNotice {
  std::uint32_t magic = kBrokenMagic;
  std::uint32_t reserved = 0;
  std::uint64_t seq = 0;  // the collective's sequence number (0 for a send or recv)
  double seconds = 0;     // the timeout that expired
  char op[32] = {};       // the operation, NUL-terminated
};

struct StatelessGroup::Impl {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0;
  int size = 0;
  std::vector<int> parent_ranks;
  Seconds timeout{};
  std::size_t chunk = 0;
  MPI_Comm inter = MPI_COMM_NULL;  // cross-job groups: the intercommunicator `comm` was merged from
  std::string unusable_after;      // why the group broke ("a timeout in barrier"); empty: usable
  std::uint64_t coll_seq = 0;      // collectives made so far (every kind: one order)
  // This member's notices that it broke the group, sent to every other (tell_broken); the
  // buffer lives until MPI is done with it (else it is abandoned, as Buffers are).
  std::unique_ptr<BrokenNotice> notice;
  std::vector<MPI_Request> notice_sends;
  // Sends to self never touch MPI (a send to self waits for its own receive, which this
  // rank cannot post while it waits): first messages and chunked payloads, in send order.
  std::deque<std::string> self_first;
  std::deque<std::string> self_chunks;
  // Buffers reused across calls. MPI may still read a pending send's buffer after a
  // timeout (Open MPI cannot cancel sends), so a breaking timeout abandons them: leaked
  // on purpose, never freed under MPI's feet.
  struct Buffers {
    std::string scratch;                   // serialization buffer
    std::string first;                     // the first message being sent
    std::vector<std::vector<char>> inbox;  // per peer: its first message, received in place (kFirstMax)
    std::vector<std::uint64_t> tokens;     // barrier: [0] sent, [1 + p] from peer p
  };
  std::unique_ptr<Buffers> buf = std::make_unique<Buffers>();
  std::size_t max_object = physical_memory();
  // Request lists reused across calls (no allocation on the hot path).
  std::vector<MPI_Request> sends, recvs, chunks;
  std::vector<int> send_owner, recv_owner, chunk_owner, idx;
  std::vector<std::size_t> chunk_len;
  std::vector<MPI_Status> statuses;

  ~Impl() { release(); }

  void release() noexcept {
    if (comm == MPI_COMM_NULL) return;
    int finalized = 0;
    MESHRT_MPI_IGNORE(MPI_Finalized(&finalized));  // noexcept teardown, as the frees below
    if (!finalized && !notice_sends.empty()) {
      int done = 0;
      MESHRT_MPI_IGNORE(MPI_Testall(static_cast<int>(notice_sends.size()), notice_sends.data(), &done,
                                    MPI_STATUSES_IGNORE));  // failed: reads as not done
      if (!done) {
        for (MPI_Request& r : notice_sends) {
          if (r != MPI_REQUEST_NULL) MESHRT_MPI_IGNORE(MPI_Request_free(&r));
        }
        (void)notice.release();  // MPI may still read it
      }
      notice_sends.clear();
    }
    if (!finalized) {
      // Disconnecting waits for pending traffic; after a timeout there may be some that
      // never completes, so a broken cross-job group is only freed.
      if (inter != MPI_COMM_NULL && unusable_after.empty()) {
        // Open MPI 4.1.4 hangs in MPI_Comm_disconnect of the merged intracommunicator
        // (even with no traffic on it), but disconnects the intercommunicator it came
        // from cleanly; the merged one is freed first so that nothing else connects them.
        MESHRT_MPI_IGNORE(MPI_Comm_free(&comm));
        MESHRT_MPI_IGNORE(MPI_Comm_disconnect(&inter));
      } else {
        MESHRT_MPI_IGNORE(MPI_Comm_free(&comm));
        if (inter != MPI_COMM_NULL) MESHRT_MPI_IGNORE(MPI_Comm_free(&inter));
      }
    }
    comm = MPI_COMM_NULL;
  }

  std::string me() const {
    return fmt::format("group rank {} (parent rank {}) of {}", rank, parent_ranks[static_cast<std::size_t>(rank)],
                       size);
  }
  std::string peer(int r) const {
    return fmt::format("group rank {} (parent rank {})", r, parent_ranks[static_cast<std::size_t>(r)]);
  }
  std::string peers(const std::vector<int>& rs) const {
    std::vector<int> p;
    for (int r : rs) p.push_back(parent_ranks[static_cast<std::size_t>(r)]);
    return fmt::format("group ranks {} (parent ranks {})", int_list(rs), int_list(p));
  }
  std::string where(const char* op, int src) const { return fmt::format("{} on {} from {}", op, me(), peer(src)); }

  void check_usable(const char* op) {
    if (comm == MPI_COMM_NULL) throw UsageError(fmt::format("{}: the group has been disconnected or moved from", op));
    if (!unusable_after.empty()) {
      throw UsageError(
          fmt::format("{} on {}: group is unusable after {}; create a new group", op, me(), unusable_after));
    }
    check_not_broken(op);
  }

  // Raises TimeoutError when another member has said it broke the group in a timeout
  // (tell_broken): its operation ended without this member, so what this one would
  // receive or complete now is what that operation left in flight.
  void check_not_broken(const char* op) {
    int flag = 0;
    MPI_Status st;
    MESHRT_MPI_CHECK(MPI_Iprobe(MPI_ANY_SOURCE, kBrokenTag, comm, &flag, &st));
    if (!flag) return;
    BrokenNotice n{};
    MESHRT_MPI_CHECK(
        MPI_Recv(&n, static_cast<int>(sizeof n), MPI_BYTE, st.MPI_SOURCE, kBrokenTag, comm, MPI_STATUS_IGNORE));
    n.op[sizeof n.op - 1] = '\0';
    const int from = st.MPI_SOURCE;
    const std::string what =
        n.magic == kBrokenMagic
            ? fmt::format("{} timed out in {}{} after {} s and broke the group", peer(from), n.op,
                          std::string_view(n.op) == "send_obj" || std::string_view(n.op) == "recv_obj"
                              ? std::string()
                              : fmt::format(" #{}", n.seq),
                          n.seconds)
            : fmt::format("{} broke the group", peer(from));
    break_group(fmt::format("{} (seen in {})", what, op));
    throw TimeoutError(fmt::format("{} on {}: {} before this rank's call could complete with it (it did not wait for "
                                   "this rank); the group is unusable now: create a new group",
                                   op, me(), what),
                       {}, true);
  }

  // Tells every other member that this one broke the group in `op` (check_not_broken).
  void tell_broken(const char* op, const Timeout& t, std::uint64_t seq) {
    if (comm == MPI_COMM_NULL || size < 2 || notice) return;
    notice = std::make_unique<BrokenNotice>();
    notice->seq = seq;
    notice->seconds = seconds(t);
    std::strncpy(notice->op, op, sizeof notice->op - 1);
    for (int p = 0; p < size; ++p) {
      if (p == rank) continue;
      notice_sends.push_back(MPI_REQUEST_NULL);
      // Ignored on purpose: the timeout being raised says more than a failed notice would.
      MESHRT_MPI_IGNORE(MPI_Isend(notice.get(), static_cast<int>(sizeof *notice), MPI_BYTE, p, kBrokenTag, comm,
                                  &notice_sends.back()));
    }
  }
  void check_peer(const char* op, int r, const char* role) const {
    if (r < 0 || r >= size) {
      throw UsageError(
          fmt::format("{} on {}: {} rank {} is not a group rank (expected 0..{})", op, me(), role, r, size - 1));
    }
  }
  Clock::time_point deadline(const Timeout& t) const { return deadline_after(t ? *t : timeout); }
  double seconds(const Timeout& t) const { return (t ? *t : timeout).count(); }

  [[noreturn]] void timed_out(const char* op, const Timeout& t, const std::string& waiting_for,
                              const std::vector<int>& missing, bool breaks_group) {
    if (breaks_group) {
      break_group(fmt::format("a timeout in {}", op));
      tell_broken(op, t, coll_seq == 0 ? 0 : coll_seq - 1);
    }
    throw TimeoutError(
        fmt::format("{} timed out after {} s on {}: {}{}; {}", op, seconds(t), me(), waiting_for,
                    missing.empty() ? std::string() : fmt::format("; missing {}", peers(missing)),
                    breaks_group ? "the group is unusable now (messages of this operation may still be in flight)"
                                 : "the group is still usable"),
        missing, breaks_group);
  }

  void break_group(std::string why) {
    unusable_after = std::move(why);
    (void)buf.release();  // abandoned to pending sends and receives, see Buffers
    buf = std::make_unique<Buffers>();
  }

  // Tests every request until all are done or the deadline passes; false on timeout.
  // `bytes`: how much data the requests move (how long to poll closely).
  bool wait_all(std::span<MPI_Request> reqs, Clock::time_point dl, std::size_t bytes) {
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
    for (;;) {
      int outcount = 0;
      MESHRT_MPI_CHECK(
          MPI_Testsome(static_cast<int>(reqs.size()), reqs.data(), &outcount, idx.data(), MPI_STATUSES_IGNORE));
      if (outcount == MPI_UNDEFINED) return true;  // no active request left
      if (outcount > 0) {
        backoff.reset();  // data is moving: keep polling closely
        continue;
      }
      if (backoff.expired(dl)) return false;
      backoff.pause();
    }
  }

  // Which of `reqs` are still pending (their index).
  static std::vector<std::size_t> pending(std::span<MPI_Request> reqs) {
    std::vector<std::size_t> out;
    for (std::size_t i = 0; i < reqs.size(); ++i) {
      if (reqs[i] == MPI_REQUEST_NULL) continue;
      int done = 0;
      MESHRT_MPI_IGNORE(MPI_Request_get_status(reqs[i], &done, MPI_STATUS_IGNORE));  // failed: reads as pending
      if (!done) out.push_back(i);
    }
    return out;
  }

  // Receives can be cancelled; what they would have matched stays queued in MPI.
  static void cancel_receives(std::span<MPI_Request> reqs) {
    for (auto& r : reqs) {
      if (r == MPI_REQUEST_NULL) continue;
      MESHRT_MPI_IGNORE(MPI_Cancel(&r));  // withdrawing after an error or timeout already raised
      MESHRT_MPI_IGNORE(MPI_Request_free(&r));
    }
  }

  // Withdraws a pending receive after a timeout. Cancelled: nothing was consumed.
  // Completed: the message arrived meanwhile (`st` is its status). Stuck: it matched a
  // message that is still arriving; the request is freed, its buffer must be abandoned.
  enum class Withdrawn { Cancelled, Completed, Stuck };
  static Withdrawn withdraw(MPI_Request& r, MPI_Status& st) {
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

  // The buffer first messages from `src` are received into (allocated on first use).
  char* inbox(int src) {
    auto& in = buf->inbox;
    if (in.size() != static_cast<std::size_t>(size)) in.resize(static_cast<std::size_t>(size));
    auto& b = in[static_cast<std::size_t>(src)];
    if (b.size() != kFirstMax) b.resize(kFirstMax);
    return b.data();
  }

  void post_first_recv(int src, Kind kind, MPI_Request& r) {
    MESHRT_MPI_CHECK(MPI_Irecv(inbox(src), static_cast<int>(kFirstMax), MPI_BYTE, src, header_tag(kind), comm, &r));
  }

  [[noreturn]] void first_failed(const char* op, int src, int rc) const {
    throw ProtocolError(
        fmt::format("{}: receiving the first message failed ({}): larger than any group message "
                    "(at most {} bytes), so not sent by a StatelessGroup",
                    where(op, src), detail::mpi_error_string(rc), kFirstMax));
  }

  // Receives the first message of an operation from `src` into its inbox: its size, or
  // -1 on timeout with nothing consumed, or -2 on timeout with a message half received
  // (the group must break).
  int recv_first(const char* op, Kind kind, int src, Clock::time_point dl) {
    MPI_Request r = MPI_REQUEST_NULL;
    post_first_recv(src, kind, r);
    MPI_Status st;
    Backoff backoff(group_wait());
    for (;;) {
      int done = 0;
      const int rc = MPI_Test(&r, &done, &st);
      if (rc != MPI_SUCCESS) first_failed(op, src, rc);
      if (done) break;
      if (backoff.expired(dl)) {
        const Withdrawn w = withdraw(r, st);
        if (w == Withdrawn::Cancelled) return -1;
        if (w == Withdrawn::Stuck) {
          (void)buf.release();  // MPI may still write into the inbox
          buf = std::make_unique<Buffers>();
          return -2;
        }
        if (st.MPI_ERROR != MPI_SUCCESS) first_failed(op, src, st.MPI_ERROR);
        break;  // arrived just in time
      }
      backoff.pause();
    }
    int bytes = 0;
    MESHRT_MPI_CHECK(MPI_Get_count(&st, MPI_BYTE, &bytes));
    return bytes;
  }

  // Packs the first message: header, type name, and the payload when it is small.
  void pack_first(Kind kind, const detail::TypeTag& type, bool raw, std::span<const char> payload, int root,
                  std::uint64_t op_seq) {
    WireHeader h{};
    h.magic = kMagic;
    h.version = kVersion;
    h.kind = static_cast<std::uint8_t>(kind);
    h.raw = raw ? 1 : 0;
    h.type_hash = type.hash;
    h.total = payload.size();
    const bool inl = goes_inline(payload.size(), chunk);
    h.inline_bytes = inl ? payload.size() : 0;
    h.chunk = wire_chunk();
    h.seq = op_seq;
    h.root = root;
    h.sender = rank;
    h.name_len = static_cast<std::uint32_t>(std::min(type.name.size(), kMaxTypeName));
    buf->first.resize(sizeof h + h.name_len + h.inline_bytes);
    std::memcpy(buf->first.data(), &h, sizeof h);
    std::memcpy(buf->first.data() + sizeof h, type.name.data(), h.name_len);
    if (inl && !payload.empty()) std::memcpy(buf->first.data() + sizeof h + h.name_len, payload.data(), payload.size());
  }

  std::size_t chunks_of(const WireHeader& h) const {
    if (h.inline_bytes == h.total) return 0;
    return static_cast<std::size_t>((h.total + h.chunk - 1) / h.chunk);
  }

  // Posts the continuation chunks of `payload` (none when it went inline) to `dst`.
  static bool goes_inline(std::size_t size, std::size_t chunk) { return size <= std::min(kInlineMax, chunk); }
  std::size_t wire_chunk() const { return std::min(chunk, kPipelineBytes); }

  void post_chunk_sends(Kind kind, std::span<const char> payload, int dst, std::vector<MPI_Request>& reqs) {
    if (goes_inline(payload.size(), chunk)) return;
    const std::size_t piece = wire_chunk();
    for (std::size_t off = 0; off < payload.size(); off += piece) {
      const std::size_t n = std::min(piece, payload.size() - off);
      MPI_Request r = MPI_REQUEST_NULL;
      MESHRT_MPI_CHECK(MPI_Isend(payload.data() + off, static_cast<int>(n), MPI_BYTE, dst, chunk_tag(kind), comm, &r));
      reqs.push_back(r);
    }
  }

  // Waits for a message with `tag` from `src`; false on timeout (nothing consumed).
  bool probe(int src, int tag, Clock::time_point dl, MPI_Message& msg, int& bytes) {
    Backoff backoff(group_wait());
    for (;;) {
      int found = 0;
      MPI_Status st;
      MESHRT_MPI_CHECK(MPI_Improbe(src, tag, comm, &found, &msg, &st));
      if (found) {
        MESHRT_MPI_CHECK(MPI_Get_count(&st, MPI_BYTE, &bytes));
        return true;
      }
      if (backoff.expired(dl)) return false;
      backoff.pause();
    }
  }

  // Checks a first message received from `src` (`bytes` of it in the inbox) against what
  // this rank expects and returns its header. `root` < 0: a point-to-point message (no
  // sequence check: FIFO per pair suffices).
  WireHeader check_first(const char* op, Kind kind, const detail::TypeTag& type, bool raw, int src, int root,
                         std::uint64_t my_seq, int bytes) {
    const char* data = buf->inbox[static_cast<std::size_t>(src)].data();
    const auto n = static_cast<std::size_t>(bytes);
    if (n < sizeof(WireHeader)) {
      throw ProtocolError(
          fmt::format("{}: expected a message of at least the {}-byte group header, found {} bytes "
                      "(truncated, or not sent by a StatelessGroup)",
                      where(op, src), sizeof(WireHeader), n));
    }
    WireHeader h;
    std::memcpy(&h, data, sizeof h);
    if (h.magic != kMagic || h.version != kVersion) {
      throw ProtocolError(
          fmt::format("{}: expected group header magic {:#x} version {}, found {:#x} version {} "
                      "(garbage, or not sent by a StatelessGroup)",
                      where(op, src), kMagic, kVersion, h.magic, h.version));
    }
    if (h.kind != static_cast<std::uint8_t>(kind) || h.sender != src) {
      // Relayed broadcasts carry the relaying rank as sender, so this holds for them too.
      throw ProtocolError(fmt::format("{}: expected a {} message from group rank {}, found kind {} from rank {}",
                                      where(op, src), kind_name(kind), src, h.kind, h.sender));
    }
    if (h.name_len > kMaxTypeName || h.inline_bytes > kInlineMax || n != sizeof h + h.name_len + h.inline_bytes) {
      throw ProtocolError(
          fmt::format("{}: header declares {} + {} name + {} payload bytes, found a {}-byte message "
                      "(truncated or corrupt)",
                      where(op, src), sizeof h, h.name_len, h.inline_bytes, n));
    }
    if (root >= 0 && (h.seq != my_seq || h.root != root)) {
      throw ProtocolError(
          fmt::format("{}: mismatched collective: expected {} #{} with root {}, found #{} with root {} "
                      "(the members did not make the same calls in the same order)",
                      where(op, src), kind_name(kind), my_seq, root, h.seq, h.root));
    }
    if (h.inline_bytes != h.total && (h.inline_bytes != 0 || h.chunk == 0 || h.chunk > INT32_MAX)) {
      throw ProtocolError(fmt::format("{}: header declares {} payload bytes, {} inline, chunks of {}: inconsistent",
                                      where(op, src), h.total, h.inline_bytes, h.chunk));
    }
    if (h.total > max_object) {
      throw ProtocolError(
          fmt::format("{}: header declares a {}-byte object, more than this machine's {} bytes of "
                      "memory (corrupt header)",
                      where(op, src), h.total, max_object));
    }
    const std::string_view their_name(data + sizeof h, h.name_len);
    if (h.type_hash != type.hash || their_name != type.name || h.raw != (raw ? 1 : 0)) {
      std::string message = fmt::format("{}: type mismatch: expected {} (tag {:016x}), found {} (tag {:016x})",
                                        where(op, src), type.name, type.hash, their_name, h.type_hash);
      // The whole object is taken off the wire, so the group stays usable and the next
      // receive from `src` gets the next object.
      if (kind == Kind::Send && !discard_payload(h, src)) {
        break_group(fmt::format("a type mismatch in {} whose chunks did not arrive", op));
        message += "; its chunks did not arrive in time: the group is unusable now";
      }
      throw UsageError(message);
    }
    return h;
  }

  // Takes the chunks of an object of the wrong type off the wire (or off the local queue
  // for a send to self) without keeping them. False if they did not arrive by the deadline.
  bool discard_payload(const WireHeader& h, int src) {
    const std::size_t nchunks = chunks_of(h);
    if (nchunks == 0) return true;
    if (src == rank) {
      if (!self_chunks.empty()) self_chunks.pop_front();
      return true;
    }
    std::vector<char> sinkhole;
    for (std::size_t i = 0; i < nchunks; ++i) {
      MPI_Message msg = MPI_MESSAGE_NULL;
      int bytes = 0;
      if (!probe(src, chunk_tag(Kind::Send), dl_, msg, bytes)) return false;
      sinkhole.resize(static_cast<std::size_t>(std::max(bytes, 1)));
      MESHRT_MPI_CHECK(MPI_Mrecv(sinkhole.data(), bytes, MPI_BYTE, &msg, MPI_STATUS_IGNORE));
    }
    return true;
  }

  // Starts receiving the payload described by `h` (its first message is in src's inbox)
  // into `sink`: an inline payload is copied now; otherwise the first chunk is awaited
  // and checked, the object allocated and a receive posted for every chunk, straight into
  // the sink's memory (appended to `chunks`, with their lengths and owner). False on
  // timeout (nothing consumed).
  bool start_payload(const char* op, Kind kind, const WireHeader& h, int first_src, detail::PayloadSink& sink,
                     Clock::time_point dl, char** out_ptr = nullptr, int chunk_src = -1) {
    const std::size_t nchunks = chunks_of(h);
    if (nchunks == 0) {
      char* out = sink.prepare(h.total);
      if (h.total) {
        std::memcpy(out, buf->inbox[static_cast<std::size_t>(first_src)].data() + sizeof h + h.name_len, h.total);
      }
      return true;
    }
    // The chunks come from `chunk_src` (a broadcast's parent in the tree) or the sender.
    const int src = chunk_src >= 0 ? chunk_src : first_src;
    if (src == rank) {
      // A send to self: the payload was queued locally (MPI would need a posted receive).
      if (self_chunks.empty() || self_chunks.front().size() != h.total) {
        throw ProtocolError(fmt::format(
            "{}: expected a {}-byte payload sent to itself, found {}", where(op, src), h.total,
            self_chunks.empty() ? std::string("none") : fmt::format("{} bytes", self_chunks.front().size())));
      }
      char* out = sink.prepare(h.total);
      std::memcpy(out, self_chunks.front().data(), h.total);
      self_chunks.pop_front();
      if (out_ptr) *out_ptr = out;
      return true;
    }
    auto len = [&](std::size_t i) { return std::min<std::size_t>(h.chunk, h.total - i * h.chunk); };
    if (h.total <= kTrustedAlloc) {
      // Small enough to allocate on the header's word: every chunk's receive is posted
      // at once (MPI checks the sizes: a longer chunk fails, a shorter one is caught by
      // check_chunk), so the transfer starts without a probe round.
      char* out = sink.prepare(h.total);
      if (out_ptr) *out_ptr = out;
      post_chunk_recvs(kind, h, src, out, 0, nchunks, len);
      return true;
    }
    // Allocate only once the first chunk is really there and has the declared size: a
    // corrupt header alone never makes this rank allocate what it declares.
    MPI_Message msg = MPI_MESSAGE_NULL;
    int bytes = 0;
    if (!probe(src, chunk_tag(kind), dl, msg, bytes)) return false;
    const std::size_t first_len = std::min<std::size_t>(h.chunk, h.total);
    char* out = nullptr;
    std::string problem;
    if (static_cast<std::size_t>(bytes) != first_len) {
      problem = fmt::format("expected a first chunk of {} bytes, found {} (corrupt stream)", first_len, bytes);
    } else {
      try {
        out = sink.prepare(h.total);
      } catch (const std::bad_alloc&) {
        problem = fmt::format("cannot allocate the declared {}-byte object", h.total);
      }
    }
    if (!problem.empty()) {
      std::vector<char> sinkhole(static_cast<std::size_t>(std::max(bytes, 1)));  // a matched message must be received
      MESHRT_MPI_IGNORE(MPI_Mrecv(sinkhole.data(), bytes, MPI_BYTE, &msg, MPI_STATUS_IGNORE));  // the problem is raised
      break_group(fmt::format("a broken chunked message in {}", op));
      throw ProtocolError(fmt::format("{}: {}", where(op, src), problem));
    }
    if (out_ptr) *out_ptr = out;
    chunks.push_back(MPI_REQUEST_NULL);
    chunk_len.push_back(len(0));
    chunk_owner.push_back(src);
    MESHRT_MPI_CHECK(MPI_Imrecv(out, bytes, MPI_BYTE, &msg, &chunks.back()));
    post_chunk_recvs(kind, h, src, out, 1, nchunks, len);
    return true;
  }

  template <class Len>
  void post_chunk_recvs(Kind kind, const WireHeader& h, int src, char* out, std::size_t from, std::size_t nchunks,
                        const Len& len) {
    for (std::size_t i = from; i < nchunks; ++i) {
      chunks.push_back(MPI_REQUEST_NULL);
      chunk_len.push_back(len(i));
      chunk_owner.push_back(src);
      MESHRT_MPI_CHECK(
          MPI_Irecv(out + i * h.chunk, static_cast<int>(len(i)), MPI_BYTE, src, chunk_tag(kind), comm, &chunks.back()));
    }
  }

  [[noreturn]] void chunk_failed(const char* op, int src, std::size_t i, const std::string& what) {
    cancel_receives(chunks);
    break_group(fmt::format("a broken chunked message in {}", op));
    throw ProtocolError(fmt::format("{}: chunk {}: {}", where(op, src), i, what));
  }

  // Checks a completed chunk receive's status against its expected length.
  void check_chunk(const char* op, std::size_t i, const MPI_Status& st, int rc) {
    const int src = chunk_owner[i];
    if (rc != MPI_SUCCESS) {
      chunk_failed(op, src, i,
                   fmt::format("{} bytes expected, failed: {}", chunk_len[i], detail::mpi_error_string(rc)));
    }
    int got = 0;
    MESHRT_MPI_CHECK(MPI_Get_count(&st, MPI_BYTE, &got));
    if (static_cast<std::size_t>(got) != chunk_len[i]) {
      chunk_failed(op, src, i, fmt::format("expected {} bytes, found {} (truncated stream)", chunk_len[i], got));
    }
  }

  // Waits for the receives start_payload posted, in order, sending each chunk on to
  // `forward` (broadcast relays) as soon as it is in. False on timeout (receives
  // cancelled).
  bool finish_payload_in_order(const char* op, Kind kind, const char* out, std::size_t chunk_size,
                               std::span<const int> forward, std::size_t total) {
    Backoff backoff(group_wait(total));
    for (std::size_t i = 0; i < chunks.size(); ++i) {
      MPI_Status st;
      for (;;) {
        int done = 0;
        const int rc = MPI_Test(&chunks[i], &done, &st);
        if (rc != MPI_SUCCESS) check_chunk(op, i, st, rc);
        if (done) break;
        if (backoff.expired(dl_)) {
          cancel_receives(chunks);
          return false;
        }
        backoff.pause();
      }
      backoff.reset();
      check_chunk(op, i, st, MPI_SUCCESS);
      for (int dst : forward) {
        MPI_Request r = MPI_REQUEST_NULL;
        MESHRT_MPI_CHECK(
            MPI_Isend(out + i * chunk_size, static_cast<int>(chunk_len[i]), MPI_BYTE, dst, chunk_tag(kind), comm, &r));
        sends.push_back(r);
        send_owner.push_back(dst);
      }
    }
    return true;
  }

  // Waits for every receive start_payload posted, in any order. False on timeout (the
  // pending ones are left for the caller to name and cancel).
  bool finish_payload_any(const char* op, std::size_t total) {
    if (chunks.empty()) return true;
    Backoff backoff(group_wait(total));
    idx.resize(chunks.size());
    statuses.resize(chunks.size());
    for (;;) {
      int outcount = 0;
      const int rc =
          MPI_Testsome(static_cast<int>(chunks.size()), chunks.data(), &outcount, idx.data(), statuses.data());
      if (outcount == MPI_UNDEFINED) return true;
      if (rc != MPI_SUCCESS && rc != MPI_ERR_IN_STATUS) {
        chunk_failed(op, chunk_owner[0], 0, detail::mpi_error_string(rc));
      }
      for (int k = 0; k < outcount; ++k) {
        const auto i = static_cast<std::size_t>(idx[static_cast<std::size_t>(k)]);
        const MPI_Status& st = statuses[static_cast<std::size_t>(k)];
        check_chunk(op, i, st, rc == MPI_ERR_IN_STATUS ? st.MPI_ERROR : MPI_SUCCESS);
      }
      if (outcount > 0) {
        backoff.reset();
        continue;
      }
      if (backoff.expired(dl_)) return false;
      backoff.pause();
    }
  }

  // The ranks among `owner` whose requests in `reqs` are still pending.
  std::vector<int> late_of(std::span<MPI_Request> reqs, const std::vector<int>& owner) {
    std::vector<int> out;
    for (std::size_t i : pending(reqs)) {
      if (std::find(out.begin(), out.end(), owner[i]) == out.end()) out.push_back(owner[i]);
    }
    std::sort(out.begin(), out.end());
    return out;
  }

  // Sends the packed first message and the payload's chunks to each of `dsts`.
  void post_sends(Kind kind, std::span<const char> payload, std::span<const int> dsts) {
    for (int dst : dsts) {
      MPI_Request r = MPI_REQUEST_NULL;
      MESHRT_MPI_CHECK(
          MPI_Isend(buf->first.data(), static_cast<int>(buf->first.size()), MPI_BYTE, dst, header_tag(kind), comm, &r));
      sends.push_back(r);
      post_chunk_sends(kind, payload, dst, sends);
      send_owner.resize(sends.size(), dst);
    }
  }

  // The exchange every collective starts with, and the check that the members agree
  // (defined with the collectives below).
  // Their results live in these (reused: no allocation per call).
  const std::vector<int>& exchange_first(const char* op, const Timeout& call_timeout, int root);
  const std::vector<WireHeaderView>& agree(const char* op, Kind kind, const detail::TypeTag& type, bool raw, int root,
                                           std::uint64_t seq, const std::vector<int>& sizes);
  std::vector<int> first_sizes;
  std::vector<WireHeaderView> first_headers;

  // Starts an operation: the request lists are empty, the deadline set.
  void begin(const Timeout& t) {
    sends.clear();
    recvs.clear();
    chunks.clear();
    send_owner.clear();
    recv_owner.clear();
    chunk_owner.clear();
    chunk_len.clear();
    dl_ = deadline(t);
  }
  Clock::time_point dl_{};
};

// ---- construction -------------------------------------------------------------------

StatelessGroup::StatelessGroup(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
StatelessGroup::StatelessGroup(StatelessGroup&&) noexcept = default;
StatelessGroup& StatelessGroup::operator=(StatelessGroup&&) noexcept = default;
StatelessGroup::~StatelessGroup() = default;

namespace {

Seconds option_timeout(const GroupOptions& o) {
  if (o.timeout) {
    if (o.timeout->count() < 0)
      throw UsageError(fmt::format("GroupOptions::timeout: expected >= 0 s, found {} s", o.timeout->count()));
    return o.timeout->count() == 0 ? Seconds::max() : *o.timeout;
  }
  return settings::kGroupTimeout.get();
}

std::size_t option_chunk(const GroupOptions& o) {
  const std::int64_t c = o.chunk_bytes ? static_cast<std::int64_t>(*o.chunk_bytes) : settings::kGroupChunkBytes.get();
  if (c < 1 || c > INT32_MAX) {
    throw UsageError(fmt::format("group chunk size: expected 1..{} bytes (an MPI count is an int), found {}{}",
                                 INT32_MAX, c, o.chunk_bytes ? " in GroupOptions" : " in MESHRT_GROUP_CHUNK_BYTES"));
  }
  return static_cast<std::size_t>(c);
}

// Groups never initialise MPI themselves: the program owns MPI_Init_thread and
// MPI_Finalize (or meshrt::run does), as with any MPI library; calling MPI before it is
// initialised (or after MPI_Finalize) aborts the job with no meshrt context.
void require_mpi(const char* op) {
  mpi_session::require_running(fmt::format("StatelessGroup::{}", op).c_str());
}

// ---- the members' agreement before a creation ---------------------------------------
//
// MPI_Comm_create_group and MPI_Comm_dup have no timeout: the members first agree, on the
// parent communicator with tag GroupOptions::create_tag (detail::CreationAgreement).
detail::CreationAgreement creation_agreement(const char* op, MPI_Comm parent, int me, const std::vector<int>& members,
                                             int tag, Seconds timeout) {
  detail::CreationWording wording{
      .op = op,
      .rank = [](int r) { return fmt::format("parent rank {}", r); },
      .ranks =
          [](const std::vector<int>& v) {
            return fmt::format("parent rank{} {}", v.size() == 1 ? "" : "s", int_list(v));
          },
      .what = "the group " + int_list(members),
      .late = fmt::format("(not called with this member list and tag {} within the timeout)", tag)};
  return detail::CreationAgreement(std::move(wording), parent, me, members, tag, timeout);
}

}  // namespace

std::unique_ptr<StatelessGroup::Impl> StatelessGroup::make_impl(MPI_Comm comm, std::vector<int> parent_ranks,
                                                                const GroupOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->comm = comm;  // owned from here on: freed by ~Impl even if the rest throws
  detail::set_error_policy(comm);
  MESHRT_MPI_CHECK(MPI_Comm_rank(comm, &impl->rank));
  MESHRT_MPI_CHECK(MPI_Comm_size(comm, &impl->size));
  impl->parent_ranks = std::move(parent_ranks);
  impl->timeout = option_timeout(options);
  impl->chunk = option_chunk(options);
  return impl;
}

StatelessGroup StatelessGroup::create(const std::vector<int>& members, MPI_Comm parent, const GroupOptions& options) {
  require_mpi("create");
  int parent_rank = 0, parent_size = 0;
  MESHRT_MPI_CHECK(MPI_Comm_rank(parent, &parent_rank));
  MESHRT_MPI_CHECK(MPI_Comm_size(parent, &parent_size));
  std::vector<int> sorted = members;
  std::sort(sorted.begin(), sorted.end());
  if (members.empty() || sorted.front() < 0 || sorted.back() >= parent_size ||
      std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
    throw UsageError(
        fmt::format("StatelessGroup::create on parent rank {}: expected distinct parent ranks in 0..{}, "
                    "found {}",
                    parent_rank, parent_size - 1, int_list(members)));
  }
  if (!std::binary_search(sorted.begin(), sorted.end(), parent_rank)) {
    throw UsageError(
        fmt::format("StatelessGroup::create on parent rank {}: only members call it, and {} does not "
                    "contain this rank",
                    parent_rank, int_list(members)));
  }
  if (options.create_tag < 0) {
    throw UsageError(fmt::format("StatelessGroup::create on parent rank {}: expected a create_tag >= 0, found {}",
                                 parent_rank, options.create_tag));
  }
  auto creation_lock = creation_agreement("StatelessGroup::create", parent, parent_rank, members, options.create_tag,
                                          option_timeout(options))
                           .run();
  MPI_Group parent_group = MPI_GROUP_NULL, group = MPI_GROUP_NULL;
  MESHRT_MPI_CHECK(MPI_Comm_group(parent, &parent_group));
  const int rc = MPI_Group_incl(parent_group, static_cast<int>(members.size()), members.data(), &group);
  MESHRT_MPI_IGNORE(MPI_Group_free(&parent_group));  // rc is the one to report
  MESHRT_MPI_CHECK(rc);
  MPI_Comm comm = MPI_COMM_NULL;
  const int rc2 = MPI_Comm_create_group(parent, group, options.create_tag, &comm);
  creation_lock.unlock();
  MESHRT_MPI_IGNORE(MPI_Group_free(&group));
  MESHRT_MPI_CHECK(rc2);
  return StatelessGroup(make_impl(comm, members, options));
}

StatelessGroup StatelessGroup::from_comm(MPI_Comm comm, const GroupOptions& options) {
  require_mpi("from_comm");
  int inter = 0;
  MESHRT_MPI_CHECK(MPI_Comm_test_inter(comm, &inter));
  if (inter) {
    throw UsageError(
        "StatelessGroup::from_comm: expected an intracommunicator, found an intercommunicator "
        "(merge it with MPI_Intercomm_merge first)");
  }
  int size = 0, me = 0;
  MESHRT_MPI_CHECK(MPI_Comm_size(comm, &size));
  MESHRT_MPI_CHECK(MPI_Comm_rank(comm, &me));
  std::vector<int> parent(static_cast<std::size_t>(size));
  for (int i = 0; i < size; ++i) parent[static_cast<std::size_t>(i)] = i;
  MPI_Comm dup = MPI_COMM_NULL;
  {
    const auto creation_lock =
        creation_agreement("StatelessGroup::from_comm", comm, me, parent, options.create_tag, option_timeout(options))
            .run();
    MESHRT_MPI_CHECK(MPI_Comm_dup(comm, &dup));
  }
  return StatelessGroup(make_impl(dup, std::move(parent), options));
}

// ---- across jobs --------------------------------------------------------------------

namespace {

// Writes `text` to `path` so that a reader never sees a partial file: tmp, then rename.
void write_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = fmt::format("{}.tmp.{}", path, getpid());
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text << '\n';
    out.flush();
    if (!out) throw UsageError(fmt::format("StatelessGroup::accept: cannot write the port file {}", tmp));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) throw UsageError(fmt::format("StatelessGroup::accept: cannot rename {} to {}: {}", tmp, path, ec.message()));
}

// The port name from "env:NAME" or from a file, waiting for the file up to `timeout`.
std::string read_port(const std::string& where, Seconds timeout) {
  if (where.rfind("env:", 0) == 0) {
    const char* v = std::getenv(where.substr(4).c_str());
    if (v == nullptr || *v == '\0') {
      throw UsageError(
          fmt::format("StatelessGroup::connect: expected an MPI port name in environment variable {}, "
                      "found it unset or empty",
                      where.substr(4)));
    }
    return v;
  }
  const auto dl = deadline_after(timeout);
  for (;;) {
    std::ifstream in(where);
    std::string line;
    if (in && std::getline(in, line) && !line.empty()) return line;
    if (Clock::now() >= dl) {
      throw TimeoutError(
          fmt::format("StatelessGroup::connect: the port file {} did not appear within {} s (is the "
                      "accepting job running, and started with the same --ompi-server?)",
                      where, timeout.count()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace

StatelessGroup StatelessGroup::accept(const std::string& port_file, MPI_Comm local, const GroupOptions& options) {
  return join(true, port_file, local, options);
}

StatelessGroup StatelessGroup::connect(const std::string& where, MPI_Comm local, const GroupOptions& options) {
  return join(false, where, local, options);
}

StatelessGroup StatelessGroup::join(bool accepting, const std::string& where, MPI_Comm local,
                                    const GroupOptions& options) {
  const char* op = accepting ? "StatelessGroup::accept" : "StatelessGroup::connect";
  require_mpi(accepting ? "accept" : "connect");
  MPI_Comm ldup = MPI_COMM_NULL;  // the caller's communicator is never used directly
  MESHRT_MPI_CHECK(MPI_Comm_dup(local, &ldup));
  detail::set_error_policy(ldup);
  struct FreeDup {
    MPI_Comm& c;
    ~FreeDup() { MESHRT_MPI_IGNORE(MPI_Comm_free(&c)); }
  } free_dup{ldup};
  int lrank = 0;
  MESHRT_MPI_CHECK(MPI_Comm_rank(ldup, &lrank));

  // Local rank 0 gets the port; it tells the others whether that worked, so a failure
  // raises on every rank instead of leaving them in MPI_Comm_accept/connect.
  std::array<char, MPI_MAX_PORT_NAME + 1> port{};
  std::string error;
  std::exception_ptr own_error;
  if (lrank == 0) {
    try {
      if (accepting) {
        MESHRT_MPI_CHECK(MPI_Open_port(MPI_INFO_NULL, port.data()));
        write_atomically(where, port.data());
      } else {
        const std::string name = read_port(where, option_timeout(options));
        if (name.size() > MPI_MAX_PORT_NAME) throw UsageError(fmt::format("{}: port name in {} too long", op, where));
        std::memcpy(port.data(), name.data(), name.size());
      }
    } catch (const std::exception& e) {
      error = e.what();
      own_error = std::current_exception();
    }
  }
  int failed = error.empty() ? 0 : 1;
  MESHRT_MPI_CHECK(MPI_Bcast(&failed, 1, MPI_INT, 0, ldup));
  if (failed) {
    if (own_error) std::rethrow_exception(own_error);
    throw UsageError(fmt::format("{}: local rank 0 failed to get the port: {}", op, error));
  }
  MPI_Comm inter = MPI_COMM_NULL;
  if (accepting) {
    // MPI_Comm_accept has no timeout: it waits until the other job connects.
    MESHRT_MPI_CHECK(MPI_Comm_accept(port.data(), MPI_INFO_NULL, 0, ldup, &inter));
    if (lrank == 0) {
      MESHRT_MPI_IGNORE(MPI_Close_port(port.data()));  // connected already; the port is not used again
      std::remove(where.c_str());                      // a later connect must not find a closed port
    }
  } else {
    MESHRT_MPI_CHECK(MPI_Comm_connect(port.data(), MPI_INFO_NULL, 0, ldup, &inter));
  }
  MPI_Comm merged = MPI_COMM_NULL;
  // The accepting job's ranks come first (high = 0).
  const int rc = MPI_Intercomm_merge(inter, accepting ? 0 : 1, &merged);
  if (rc != MPI_SUCCESS) MESHRT_MPI_IGNORE(MPI_Comm_disconnect(&inter));  // rc is reported
  MESHRT_MPI_CHECK(rc);
  // parent_rank(i): member i's rank in its own job's `local` communicator.
  int msize = 0;
  MESHRT_MPI_CHECK(MPI_Comm_size(merged, &msize));
  std::vector<int> parents(static_cast<std::size_t>(msize));
  const int rc2 = MPI_Allgather(&lrank, 1, MPI_INT, parents.data(), 1, MPI_INT, merged);
  if (rc2 != MPI_SUCCESS) {
    MESHRT_MPI_IGNORE(MPI_Comm_disconnect(&merged));  // rc2 is reported
    MESHRT_MPI_IGNORE(MPI_Comm_disconnect(&inter));
  }
  MESHRT_MPI_CHECK(rc2);
  auto impl = make_impl(merged, std::move(parents), options);
  impl->inter = inter;
  return StatelessGroup(std::move(impl));
}

// ---- accessors ----------------------------------------------------------------------

int StatelessGroup::rank() const {
  return impl_->rank;
}
int StatelessGroup::world_size() const {
  return impl_->size;
}
int StatelessGroup::parent_rank(int i) const {
  impl_->check_peer("parent_rank", i, "group");
  return impl_->parent_ranks[static_cast<std::size_t>(i)];
}
std::vector<int> StatelessGroup::members() const {
  return impl_->parent_ranks;
}
bool StatelessGroup::usable() const {
  return impl_ && impl_->comm != MPI_COMM_NULL && impl_->unusable_after.empty();
}
MPI_Comm StatelessGroup::comm() const {
  return impl_->comm;
}
std::chrono::duration<double> StatelessGroup::default_timeout() const {
  return impl_->timeout;
}
std::size_t StatelessGroup::chunk_bytes() const {
  return impl_->chunk;
}
std::string& StatelessGroup::scratch() {
  return impl_->buf->scratch;
}
void StatelessGroup::disconnect() {
  if (impl_) impl_->release();
}

std::string StatelessGroup::where(const char* op, int peer) const {
  return fmt::format("{} on {} from {}", op, impl_->me(), impl_->peer(peer));
}

// ---- point to point -----------------------------------------------------------------

void StatelessGroup::send_bytes(const detail::TypeTag& type, bool raw, std::span<const char> payload, int dst,
                                Timeout timeout) {
  Impl& g = *impl_;
  g.check_usable("send_obj");
  g.check_peer("send_obj", dst, "destination");
  g.begin(timeout);
  g.pack_first(Kind::Send, type, raw, payload, g.rank, 0);
  if (dst == g.rank) {
    g.self_first.push_back(g.buf->first);
    if (!Impl::goes_inline(payload.size(), g.chunk)) g.self_chunks.emplace_back(payload.data(), payload.size());
    return;
  }
  const int dsts[] = {dst};
  g.post_sends(Kind::Send, payload, dsts);
  if (!g.wait_all(g.sends, g.dl_, payload.size())) {
    g.timed_out("send_obj", timeout, fmt::format("{} has not received the {}-byte object", g.peer(dst), payload.size()),
                {dst}, true);
  }
}

void StatelessGroup::recv_bytes(const detail::TypeTag& type, bool raw, detail::PayloadSink& sink, int src,
                                Timeout timeout) {
  Impl& g = *impl_;
  g.check_usable("recv_obj");
  g.check_peer("recv_obj", src, "source");
  g.begin(timeout);
  int bytes = 0;
  if (src == g.rank) {
    if (g.self_first.empty()) {
      // Nothing can arrive while this rank waits: only this rank sends to itself.
      throw UsageError(
          fmt::format("recv_obj on {} from itself: expected an object sent to itself before, found none", g.me()));
    }
    const std::string first = std::move(g.self_first.front());
    g.self_first.pop_front();
    std::memcpy(g.inbox(src), first.data(), first.size());
    bytes = static_cast<int>(first.size());
  } else {
    bytes = g.recv_first("recv_obj", Kind::Send, src, g.dl_);
  }
  if (bytes < 0) {
    g.timed_out("recv_obj", timeout,
                bytes == -1 ? fmt::format("no {} object from {} arrived", type.name, g.peer(src))
                            : fmt::format("a message from {} was still arriving", g.peer(src)),
                {src}, bytes != -1);
  }
  const WireHeader h = g.check_first("recv_obj", Kind::Send, type, raw, src, -1, 0, bytes);
  char* out = nullptr;
  if (!g.start_payload("recv_obj", Kind::Send, h, src, sink, g.dl_, &out) ||
      !g.finish_payload_in_order("recv_obj", Kind::Send, out, h.chunk, {}, h.total)) {
    g.timed_out("recv_obj", timeout,
                fmt::format("the header of a {}-byte object from {} arrived, its chunks did not", h.total, g.peer(src)),
                {src}, true);
  }
}

// ---- collectives --------------------------------------------------------------------
//
// Every collective starts with the same exchange: each member sends its first message to
// every other member and receives theirs, all on one tag, before any payload chunk moves.
// So members that disagree on the operation, its root, its type or their order of calls
// all see it, each raises a UsageError naming the disagreement, and nothing of the
// operation is left in flight (the group stays usable). Small payloads ride inside the
// first messages (a broadcast's root's, every all_gather part), so that exchange is the
// whole operation: one message per pair of members.

namespace {
constexpr int kCollectiveTag = 2 * 5 - 1;  // after every Kind's header and chunk tags

const detail::TypeTag& barrier_tag() {
  static const detail::TypeTag tag{"(barrier)", detail::fnv1a("(barrier)")};
  return tag;
}

std::string describe_call(std::uint8_t kind, std::uint64_t seq, std::int32_t root, std::string_view type) {
  std::string what = kind >= 1 && kind <= 4 ? kind_name(static_cast<Kind>(kind)) : fmt::format("kind {}", kind);
  what += fmt::format(" #{}", seq);
  if (kind == static_cast<std::uint8_t>(Kind::Broadcast)) what += fmt::format(" with root {}", root);
  if (kind != static_cast<std::uint8_t>(Kind::Barrier)) what += fmt::format(" of {}", type);
  return what;
}
}  // namespace

// Posts the first-message receives from every peer, sends this rank's first message
// (buf->first) to every peer, and waits for every peer's: their sizes by group rank.
// Times out (breaking the group) naming the peers that did not arrive.
const std::vector<int>& StatelessGroup::Impl::exchange_first(const char* op, const Timeout& call_timeout, int root) {
  Impl& g = *this;
  const int n = g.size;
  std::vector<int>& sizes = first_sizes;
  sizes.assign(static_cast<std::size_t>(n), -1);
  for (int i = 1; i < n; ++i) {
    const int p = (g.rank - i + n) % n;
    g.recvs.push_back(MPI_REQUEST_NULL);
    g.recv_owner.push_back(p);
    MESHRT_MPI_CHECK(
        MPI_Irecv(g.inbox(p), static_cast<int>(kFirstMax), MPI_BYTE, p, kCollectiveTag, g.comm, &g.recvs.back()));
  }
  for (int i = 1; i < n; ++i) {
    const int p = (g.rank + i) % n;
    g.sends.push_back(MPI_REQUEST_NULL);
    g.send_owner.push_back(p);
    MESHRT_MPI_CHECK(MPI_Isend(g.buf->first.data(), static_cast<int>(g.buf->first.size()), MPI_BYTE, p, kCollectiveTag,
                               g.comm, &g.sends.back()));
  }
  Backoff backoff(group_wait());
  g.idx.resize(g.recvs.size());
  g.statuses.resize(g.recvs.size());
  for (;;) {
    int outcount = 0;
    const int rc =
        MPI_Testsome(static_cast<int>(g.recvs.size()), g.recvs.data(), &outcount, g.idx.data(), g.statuses.data());
    if (rc != MPI_SUCCESS && rc != MPI_ERR_IN_STATUS) MESHRT_MPI_CHECK(rc);
    if (outcount == MPI_UNDEFINED) break;
    for (int k = 0; k < outcount; ++k) {
      const auto i = static_cast<std::size_t>(g.idx[static_cast<std::size_t>(k)]);
      const MPI_Status& st = g.statuses[static_cast<std::size_t>(k)];
      const int p = g.recv_owner[i];
      if (rc == MPI_ERR_IN_STATUS && st.MPI_ERROR != MPI_SUCCESS) {
        for (auto& r : g.recvs) {
          MPI_Status ignored;
          if (r != MPI_REQUEST_NULL) (void)Impl::withdraw(r, ignored);
        }
        g.break_group(fmt::format("a failed {}", op));
        g.first_failed(op, p, st.MPI_ERROR);
      }
      MPI_Get_count(&st, MPI_BYTE, &sizes[static_cast<std::size_t>(p)]);
    }
    if (outcount > 0) {
      backoff.reset();
      continue;
    }
    if (backoff.expired(g.dl_)) {
      // Missing: the peers whose first message has not arrived (withdrawing a receive
      // that completes meanwhile means that peer did arrive).
      std::vector<int> missing;
      for (std::size_t i = 0; i < g.recvs.size(); ++i) {
        if (g.recvs[i] == MPI_REQUEST_NULL) continue;
        MPI_Status st;
        if (Impl::withdraw(g.recvs[i], st) != Impl::Withdrawn::Completed) missing.push_back(g.recv_owner[i]);
      }
      std::sort(missing.begin(), missing.end());
      const bool root_missing = root >= 0 && std::find(missing.begin(), missing.end(), root) != missing.end();
      std::vector<int> others;
      for (int m : missing) {
        if (m != root) others.push_back(m);
      }
      std::string waiting_for = fmt::format("the first messages of {} did not arrive", g.peers(missing));
      if (root_missing) {
        waiting_for = fmt::format("no object from the root {} arrived", g.peer(root));
        if (!others.empty()) waiting_for += fmt::format(", nor the first messages of {}", g.peers(others));
      }
      g.timed_out(op, call_timeout, waiting_for, missing, true);
    }
    backoff.pause();
  }
  return sizes;
}

// Checks every peer's first message against this rank's call (kind, sequence number,
// root, type): their headers, by group rank (this rank's own: from buf->first). A corrupt
// message is a ProtocolError and breaks the group; a disagreement is a UsageError naming
// every member that called something else, and leaves the group usable once this rank's
// first messages are taken (nothing else of the operation was sent).
const std::vector<WireHeaderView>& StatelessGroup::Impl::agree(const char* op, Kind kind, const detail::TypeTag& type,
                                                               bool raw, int root, std::uint64_t seq,
                                                               const std::vector<int>& sizes) {
  Impl& g = *this;
  std::vector<WireHeaderView>& headers = first_headers;
  headers.assign(sizes.size(), WireHeaderView{});
  std::vector<std::string> others;
  for (int p = 0; p < g.size; ++p) {
    WireHeaderView& v = headers[static_cast<std::size_t>(p)];
    if (p == g.rank) {
      std::memcpy(&v.h, g.buf->first.data(), sizeof v.h);
      continue;
    }
    const char* data = g.buf->inbox[static_cast<std::size_t>(p)].data();
    const auto n = static_cast<std::size_t>(sizes[static_cast<std::size_t>(p)]);
    std::string problem;
    if (n < sizeof(WireHeader)) {
      problem =
          fmt::format("expected a message of at least the {}-byte group header, found {} bytes", sizeof(WireHeader), n);
    } else {
      std::memcpy(&v.h, data, sizeof v.h);
      const WireHeader& h = v.h;
      if (h.magic != kMagic || h.version != kVersion) {
        problem = fmt::format("expected group header magic {:#x} version {}, found {:#x} version {}", kMagic, kVersion,
                              h.magic, h.version);
      } else if (h.sender != p || h.name_len > kMaxTypeName || h.inline_bytes > kInlineMax ||
                 n != sizeof h + h.name_len + h.inline_bytes) {
        problem = fmt::format("header from rank {} declares {} + {} name + {} payload bytes, found a {}-byte message",
                              h.sender, sizeof h, h.name_len, h.inline_bytes, n);
      } else if (h.inline_bytes != h.total && (h.inline_bytes != 0 || h.chunk == 0 || h.chunk > INT32_MAX)) {
        problem = fmt::format("header declares {} payload bytes, {} inline, chunks of {}: inconsistent", h.total,
                              h.inline_bytes, h.chunk);
      } else if (h.total > g.max_object) {
        problem = fmt::format("header declares a {}-byte object, more than this machine's {} bytes of memory", h.total,
                              g.max_object);
      }
    }
    if (!problem.empty()) {
      g.break_group(fmt::format("a corrupt message in {}", op));
      throw ProtocolError(
          fmt::format("{}: {} (garbage, truncated, or not sent by a StatelessGroup)", g.where(op, p), problem));
    }
    const WireHeader& h = v.h;
    v.type_name = std::string_view(data + sizeof h, h.name_len);
    const bool same =
        h.kind == static_cast<std::uint8_t>(kind) && h.seq == seq && (kind != Kind::Broadcast || h.root == root) &&
        (kind == Kind::Barrier || (h.type_hash == type.hash && v.type_name == type.name && h.raw == (raw ? 1 : 0)));
    if (!same) {
      others.push_back(fmt::format("{} called {}", g.peer(p), describe_call(h.kind, h.seq, h.root, v.type_name)));
    }
  }
  if (!others.empty()) {
    // Every member received every first message: nothing but this rank's own sends is
    // pending, and those its peers have taken or are taking.
    if (!g.wait_all(g.sends, g.dl_, 0)) g.break_group(fmt::format("a mismatched {}", op));
    throw UsageError(
        fmt::format("{} on {}: the members disagree on the collective: this rank called {}, but {}{}", op, g.me(),
                    describe_call(static_cast<std::uint8_t>(kind), seq, root,
                                  kind == Kind::Barrier ? std::string_view() : type.name),
                    fmt::join(others, "; "),
                    g.unusable_after.empty() ? "; the group is still usable" : "; the group is unusable now"));
  }
  return headers;
}

void StatelessGroup::broadcast_bytes(const detail::TypeTag& type, bool raw, std::span<const char> payload,
                                     detail::PayloadSink& sink, int src, Timeout timeout) {
  Impl& g = *impl_;
  const char* op = "broadcast_obj";
  g.check_usable(op);
  g.check_peer(op, src, "root");
  const std::uint64_t seq = g.coll_seq++;
  g.begin(timeout);
  const int n = g.size;
  const bool root = g.rank == src;
  // The root's first message carries the payload (inline when small); the others' carry
  // only what they called.
  g.pack_first(Kind::Broadcast, type, raw, root ? payload : std::span<const char>(), src, seq);
  const auto& headers = g.agree(op, Kind::Broadcast, type, raw, src, seq, g.exchange_first(op, timeout, src));
  g.check_not_broken(op);
  const WireHeader& h = headers[static_cast<std::size_t>(src)].h;
  // Chunks of a large payload go down a binomial tree over ranks relative to the root:
  // log2(n) rounds, like MPI_Bcast.
  const int rel = (g.rank - src + n) % n;
  int parent = -1;
  int top = 1;
  while (top < n) top <<= 1;
  int limit = top;
  for (int mask = 1; mask < n; mask <<= 1) {
    if (rel & mask) {
      parent = (rel - mask + src) % n;
      limit = mask;
      break;
    }
  }
  std::array<int, 32> child_buf{};
  std::size_t nchildren = 0;
  for (int mask = limit >> 1; mask >= 1; mask >>= 1) {
    if (rel + mask < n) child_buf[nchildren++] = (rel + mask + src) % n;
  }
  const std::span<const int> children(child_buf.data(), nchildren);
  if (root) {
    for (int c : children) {
      g.post_chunk_sends(Kind::Broadcast, payload, c, g.sends);
      g.send_owner.resize(g.sends.size(), c);
    }
  } else {
    char* out = nullptr;
    if (!g.start_payload(op, Kind::Broadcast, h, src, sink, g.dl_, &out, parent) ||
        !g.finish_payload_in_order(op, Kind::Broadcast, out, h.chunk, children, h.total)) {
      g.timed_out(op, timeout,
                  fmt::format("the header of a {}-byte object from the root {} arrived, its chunks from {} did not",
                              h.total, g.peer(src), g.peer(parent)),
                  {parent}, true);
    }
  }
  if (!g.wait_all(g.sends, g.dl_, h.total * nchildren)) {
    const auto late = g.late_of(g.sends, g.send_owner);
    g.timed_out(op, timeout, fmt::format("{} did not receive this rank's first message or its chunks", g.peers(late)),
                late, true);
  }
}

void StatelessGroup::all_gather_bytes(const detail::TypeTag& type, bool raw, std::span<const char> payload,
                                      std::span<detail::PayloadSink* const> sinks, Timeout timeout) {
  Impl& g = *impl_;
  const char* op = "all_gather_obj";
  g.check_usable(op);
  const std::uint64_t seq = g.coll_seq++;
  g.begin(timeout);
  const int n = g.size;
  g.pack_first(Kind::AllGather, type, raw, payload, -1, seq);
  const auto& headers = g.agree(op, Kind::AllGather, type, raw, -1, seq, g.exchange_first(op, timeout, -1));
  g.check_not_broken(op);
  char* own = sinks[static_cast<std::size_t>(g.rank)]->prepare(payload.size());
  if (!payload.empty()) std::memcpy(own, payload.data(), payload.size());
  // Direct exchange of the chunks of large parts: every rank sends to every other, so each
  // rank knows exactly whose part is missing. Peers in ring order spread the load. This
  // rank's chunks are posted before it waits for anyone's.
  for (int i = 1; i < n; ++i) {
    const int dst = (g.rank + i) % n;
    g.post_chunk_sends(Kind::AllGather, payload, dst, g.sends);
    g.send_owner.resize(g.sends.size(), dst);
  }
  std::size_t expected = payload.size() * static_cast<std::size_t>(n);
  try {
    for (int i = 1; i < n; ++i) {
      const int p = (g.rank - i + n) % n;
      const WireHeader& h = headers[static_cast<std::size_t>(p)].h;
      if (!g.start_payload(op, Kind::AllGather, h, p, *sinks[static_cast<std::size_t>(p)], g.dl_)) {
        g.timed_out(op, timeout,
                    fmt::format("the header of a {}-byte part from {} arrived, its chunks did not", h.total, g.peer(p)),
                    {p}, true);
      }
      expected += static_cast<std::size_t>(h.total);
    }
  } catch (...) {
    Impl::cancel_receives(g.chunks);
    if (g.unusable_after.empty()) g.break_group(fmt::format("a failed {}", op));
    throw;
  }
  if (!g.finish_payload_any(op, expected)) {
    const auto late = g.late_of(g.chunks, g.chunk_owner);
    Impl::cancel_receives(g.chunks);
    g.timed_out(op, timeout, fmt::format("the chunks of {}'s parts did not arrive", g.peers(late)), late, true);
  }
  if (!g.wait_all(g.sends, g.dl_, payload.size() * static_cast<std::size_t>(n))) {
    const auto late = g.late_of(g.sends, g.send_owner);
    g.timed_out(op, timeout, fmt::format("{} did not receive this rank's part", g.peers(late)), late, true);
  }
}

void StatelessGroup::barrier(Timeout timeout) {
  Impl& g = *impl_;
  const char* op = "barrier";
  g.check_usable(op);
  const std::uint64_t seq = g.coll_seq++;
  g.begin(timeout);
  if (g.size == 1) return;
  // Every rank tells every other that it arrived (n - 1 first messages of 64 bytes per
  // rank: at 2 and 4 ranks as many as a dissemination barrier's), so every rank can name
  // exactly who did not arrive.
  g.pack_first(Kind::Barrier, barrier_tag(), true, {}, -1, seq);
  (void)g.agree(op, Kind::Barrier, barrier_tag(), true, -1, seq, g.exchange_first(op, timeout, -1));
  // Every first message is here, but one may be what a member sent before it timed out.
  g.check_not_broken(op);
  if (!g.wait_all(g.sends, g.dl_, 0)) {
    g.timed_out(op, timeout, "every rank arrived, but this rank's tokens were not taken", {}, true);
  }
}

}  // namespace meshrt
