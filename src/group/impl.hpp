// StatelessGroup's state (docs/ARCHITECTURE.md section 5), shared by the module's files,
// one per phase as NCCL splits a transport: wire.hpp (the format), impl.cpp (the group's
// life: teardown, breaking, its parts), first_message.cpp and chunks.cpp (moving one
// object), create.cpp (making a group), cross_job.cpp (accept and connect), p2p.cpp and
// collectives.cpp (the operations). Every MPI call of the group module lives in these
// files. Private to src/group/.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "group/common.hpp"
#include "group/wire.hpp"
#include "meshrt/group.hpp"

namespace meshrt {
namespace group_internal {

// Who is who in a group, and the words that name them in errors.
struct Members {
  int rank = 0;
  int size = 0;
  std::vector<int> parent_ranks;

  std::string me() const;
  std::string peer(int r) const;
  std::string peers(const std::vector<int>& rs) const;
  std::string where(const char* op, int src) const;
  // UsageError unless `r` is a group rank; `role` says which argument it is.
  void check_peer(const char* op, int r, const char* role) const;
};

// The MPI requests of one operation, each with the member it is for, reused across calls
// (no allocation on the hot path), and the waits on them.
struct Requests {
  std::vector<MPI_Request> sends, recvs, chunks;
  std::vector<int> send_owner, recv_owner, chunk_owner, idx;
  std::vector<std::size_t> chunk_len;
  std::vector<MPI_Status> statuses;

  // An operation starts with every list empty.
  void clear() {
    sends.clear();
    recvs.clear();
    chunks.clear();
    send_owner.clear();
    recv_owner.clear();
    chunk_owner.clear();
    chunk_len.clear();
  }
  // Tests every request until all are done or the deadline passes; false on timeout.
  // `bytes`: how much data the requests move (how long to poll closely).
  bool wait_all(std::span<MPI_Request> reqs, Clock::time_point dl, std::size_t bytes);
  // Which of `reqs` are still pending (their index).
  static std::vector<std::size_t> pending(std::span<MPI_Request> reqs);
  // Receives can be cancelled; what they would have matched stays queued in MPI.
  static void cancel_receives(std::span<MPI_Request> reqs);
  // Withdraws a pending receive after a timeout. Cancelled: nothing was consumed.
  // Completed: the message arrived meanwhile (`st` is its status). Stuck: it matched a
  // message that is still arriving; the request is freed, its buffer must be abandoned.
  enum class Withdrawn { Cancelled, Completed, Stuck };
  static Withdrawn withdraw(MPI_Request& r, MPI_Status& st);
  // The ranks among `owner` whose requests in `reqs` are still pending.
  static std::vector<int> late_of(std::span<MPI_Request> reqs, const std::vector<int>& owner);
};

// This member's notice that it broke the group, sent to every other member (kBrokenTag);
// the buffer lives until MPI is done with it (else it is abandoned, as Buffers are).
class BrokenWord {
 public:
  // Sends it once: a later timeout of a broken group adds nothing.
  void tell(MPI_Comm comm, const Members& who, const char* op, double seconds, std::uint64_t seq,
            BrokenWhy why = BrokenWhy::Timeout, std::string_view text = {});
  // Teardown before MPI_Finalize: frees the sends, abandoning the notice to any not done.
  void release() noexcept;

 private:
  std::unique_ptr<BrokenNotice> notice_;
  std::vector<MPI_Request> sends_;
};

// GroupOptions::timeout (0: none) or else MESHRT_GROUP_TIMEOUT, checked.
Seconds option_timeout(const GroupOptions& o);
// GroupOptions::chunk_bytes or else MESHRT_GROUP_CHUNK_BYTES, checked.
std::size_t option_chunk(const GroupOptions& o);
// Groups never initialise MPI themselves: the program owns MPI_Init_thread and
// MPI_Finalize (or meshrt::run does), as with any MPI library; calling MPI before it is
// initialised (or after MPI_Finalize) aborts the job with no meshrt context.
void require_mpi(const char* op);

}  // namespace group_internal

struct StatelessGroup::Impl {
  using Clock = group_internal::Clock;
  using Seconds = group_internal::Seconds;
  using Kind = group_internal::Kind;
  using WireHeader = group_internal::WireHeader;
  using WireHeaderView = group_internal::WireHeaderView;

  MPI_Comm comm = MPI_COMM_NULL;
  group_internal::Members who;
  Seconds timeout{};
  std::size_t chunk = 0;
  MPI_Comm inter = MPI_COMM_NULL;  // cross-job groups: the intercommunicator `comm` was merged from
  std::string unusable_after;      // why the group broke ("a timeout in barrier"); empty: usable
  std::uint64_t coll_seq = 0;      // collectives made so far (every kind: one order)
  group_internal::BrokenWord broken;
  // Another member's notice is received into a receive posted at this member's first call
  // and kept posted: testing it costs one progress of MPI, a probe of the communicator
  // several (docs/ARCHITECTURE.md section 5).
  std::unique_ptr<group_internal::BrokenNotice> notice_in;
  MPI_Request notice_req = MPI_REQUEST_NULL;
  MPI_Status notice_st{};
  bool notice_arrived = false;
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
  std::size_t max_object = group_internal::physical_memory();
  group_internal::Requests req;
  Clock::time_point dl_{};

  ~Impl() { release(); }

  // ---- the group's life (impl.cpp)

  // Frees the communicator, or keeps it (unused) when the group is broken or a message
  // waits unreceived, see release().
  void release() noexcept;
  // Whether a message has arrived that this member has not received (another member's
  // notice that it broke the group, or what its operation left in flight).
  bool message_waiting() noexcept;
  void check_usable(const char* op);
  // Raises TimeoutError when another member has said it broke the group in a timeout
  // (BrokenWord): its operation ended without this member, so what this one would
  // receive or complete now is what that operation left in flight.
  void check_not_broken(const char* op);
  // Whether another member's notice waits (the slow path of every wait looks).
  bool notice_waiting();
  // This member found that the members disagree on a collective that not all of them
  // exchange first messages in (a broadcast): breaks the group, tells every other member
  // `what` (they raise it too, see check_not_broken) and raises it as a UsageError.
  [[noreturn]] void disagreed(const char* op, std::uint64_t seq, const std::string& what);
  [[noreturn]] void timed_out(const char* op, const Timeout& t, const std::string& waiting_for,
                              const std::vector<int>& missing, bool breaks_group);
  void break_group(std::string why);
  Clock::time_point deadline(const Timeout& t) const { return group_internal::deadline_after(t ? *t : timeout); }
  double seconds(const Timeout& t) const { return (t ? *t : timeout).count(); }
  // Starts an operation: the request lists are empty, the deadline set.
  void begin(const Timeout& t) {
    req.clear();
    dl_ = deadline(t);
  }

  // ---- first messages (first_message.cpp)

  // The buffer first messages from `src` are received into (allocated on first use).
  char* inbox(int src) {
    auto& in = buf->inbox;
    if (in.size() != static_cast<std::size_t>(who.size)) in.resize(static_cast<std::size_t>(who.size));
    auto& b = in[static_cast<std::size_t>(src)];
    if (b.size() != group_internal::kFirstMax) b.resize(group_internal::kFirstMax);
    return b.data();
  }
  void post_first_recv(int src, Kind kind, MPI_Request& r);
  [[noreturn]] void first_failed(const char* op, int src, int rc) const;
  // Receives the first message of an operation from `src` into its inbox: its size, or
  // -1 on timeout with nothing consumed, or -2 on timeout with a message half received
  // (the group must break).
  int recv_first(const char* op, Kind kind, int src, Clock::time_point dl);
  // Packs the first message: header, type name, and the payload when it is small.
  void pack_first(Kind kind, const detail::TypeTag& type, bool raw, std::span<const char> payload, int root,
                  std::uint64_t op_seq);
  // Checks a first message received from `src` (`bytes` of it in the inbox) against what
  // this rank expects and returns its header. `root` < 0: a point-to-point message (no
  // sequence check: FIFO per pair suffices).
  WireHeader check_first(const char* op, Kind kind, const detail::TypeTag& type, bool raw, int src, int root,
                         std::uint64_t my_seq, int bytes);
  // Takes the chunks of an object of the wrong type off the wire (or off the local queue
  // for a send to self) without keeping them. False if they did not arrive by the deadline.
  bool discard_payload(const WireHeader& h, int src);
  // Sends the packed first message and the payload's chunks to each of `dsts`.
  void post_sends(Kind kind, std::span<const char> payload, std::span<const int> dsts);
  // Waits for a message with `tag` from `src`; false on timeout (nothing consumed).
  bool probe(int src, int tag, Clock::time_point dl, MPI_Message& msg, int& bytes);

  // ---- payloads in chunks (chunks.cpp)

  std::size_t chunks_of(const WireHeader& h) const {
    if (h.inline_bytes == h.total) return 0;
    return static_cast<std::size_t>((h.total + h.chunk - 1) / h.chunk);
  }
  std::size_t wire_chunk() const { return std::min(chunk, group_internal::kPipelineBytes); }
  // Posts the continuation chunks of `payload` (none when it went inline) to `dst`.
  void post_chunk_sends(Kind kind, std::span<const char> payload, int dst, std::vector<MPI_Request>& reqs);
  // Starts receiving the payload described by `h` (its first message is in src's inbox)
  // into `sink`: an inline payload is copied now; otherwise the first chunk is awaited
  // and checked, the object allocated and a receive posted for every chunk, straight into
  // the sink's memory (appended to `chunks`, with their lengths and owner). False on
  // timeout (nothing consumed).
  bool start_payload(const char* op, Kind kind, const WireHeader& h, int first_src, detail::PayloadSink& sink,
                     Clock::time_point dl, char** out_ptr = nullptr, int chunk_src = -1);
  template <class Len>
  void post_chunk_recvs(Kind kind, const WireHeader& h, int src, char* out, std::size_t from, std::size_t nchunks,
                        const Len& len);
  [[noreturn]] void chunk_failed(const char* op, int src, std::size_t i, const std::string& what);
  // Checks a completed chunk receive's status against its expected length.
  void check_chunk(const char* op, std::size_t i, const MPI_Status& st, int rc);
  // Waits for the receives start_payload posted, in order, sending each chunk on to
  // `forward` (broadcast relays) as soon as it is in. False on timeout (receives
  // cancelled).
  bool finish_payload_in_order(const char* op, Kind kind, const char* out, std::size_t chunk_size,
                               std::span<const int> forward, std::size_t total);
  // Waits for every receive start_payload posted, in any order. False on timeout (the
  // pending ones are left for the caller to name and cancel).
  bool finish_payload_any(const char* op, std::size_t total);

  // ---- the start of every collective (collectives.cpp)

  // The exchange every collective starts with, and the check that the members agree.
  // Their results live in these (reused: no allocation per call).
  const std::vector<int>& exchange_first(const char* op, const Timeout& call_timeout, int root, std::uint64_t seq);
  const std::vector<WireHeaderView>& agree(const char* op, Kind kind, const detail::TypeTag& type, bool raw, int root,
                                           std::uint64_t seq, const std::vector<int>& sizes);
  void read_first(const char* op, int p, int bytes, WireHeaderView& v);
  static bool same_call(const WireHeaderView& v, Kind kind, const detail::TypeTag& type, bool raw, int root,
                        std::uint64_t seq);
  // A broadcast's receiver: the root's first message (in its inbox), checked.
  const WireHeader& recv_root_first(const char* op, const Timeout& call_timeout, const detail::TypeTag& type, bool raw,
                                    int src, std::uint64_t seq);
  // Waits for req.sends; false on timeout. Another member's notice raises.
  bool wait_sends(const char* op, std::size_t bytes);
  std::vector<int> first_sizes;
  std::vector<WireHeaderView> first_headers;
  WireHeaderView root_header;
};

}  // namespace meshrt
