// The commands (controller -> worker) and replies (worker -> controller) of
// docs/ARCHITECTURE.md sections 3.2 and 3.3, the start-up Handshake, the out-of-band Query
// and QueryAnswer, and their wire codec.
//
// Every message encodes to one self-contained frame: a 4-byte header (magic 'm' 'r',
// protocol version, message kind) then the body. decode_* validate everything they read
// and raise ProtocolError naming what was expected, what was found and the byte offset;
// they never read past the span, never recurse deeper than kMaxDepth and never allocate
// more than the frame could describe. A decoded frame re-encodes to the same bytes.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "meshrt/ndslice.hpp"
#include "meshrt/reduction.hpp"
#include "meshrt/tensor.hpp"
#include "meshrt/value.hpp"

namespace meshrt {

// Reduction, name(Reduction) and parse_reduction come from meshrt/reduction.hpp.

namespace protocol {

// 4: SendTensor's from_order (a broadcast send). 3: CallFunction's keeps_object. Every
// frame carries it, and the start-up handshake compares it: a rank of another version
// fails the start, named.
inline constexpr std::uint8_t kVersion = 4;
// Deepest nesting of Values and CommandGroups a frame may hold.
inline constexpr int kMaxDepth = 64;

using Ident = std::uint64_t;

// ------------------------------------------------------------------ commands

struct CreateDeviceMesh {
  Ref result;
  std::vector<std::string> names;
  NDSlice ranks = NDSlice::row_major({});
  Device::Kind device = Device::Kind::Cpu;  // what the mesh is placed on
  friend bool operator==(const CreateDeviceMesh&, const CreateDeviceMesh&) = default;
};

struct CreateStream {
  Ref result;
  bool is_default = false;
  friend bool operator==(const CreateStream&, const CreateStream&) = default;
};

struct CallFunction {
  Ident ident = 0;
  std::vector<Ref> results;
  std::vector<Ref> mutates;
  std::string function;
  std::vector<Value> args;
  Ref stream;
  Ref mesh;  // the mesh it runs on: kernels see their coordinates in it
  // The function's object constructor runs, and results[0] is the object it returns
  // (docs/ARCHITECTURE.md section 3.2, worker objects).
  bool keeps_object = false;
  friend bool operator==(const CallFunction&, const CallFunction&) = default;
};

struct FetchValue {
  Ident ident = 0;
  std::vector<Ref> mutates;
  std::optional<std::string> function;  // a registered preprocessing function, or none
  Value value;
  Ref stream;
  friend bool operator==(const FetchValue&, const FetchValue&) = default;
};

struct Reduce {
  Ref result;
  Ref tensor;
  TensorMeta factory;  // zeros for a rank whose input is broken
  Ref mesh;
  Ref stream;
  std::string dim;
  Reduction reduction = Reduction::Sum;
  bool scatter = false;
  bool inplace = false;
  // The completion rule's ident: the worker reports it complete (or failed, with the
  // controller's call site) when the collective ends.
  Ident ident = 0;
  friend bool operator==(const Reduce&, const Reduce&) = default;
};

// A collective beyond Reduce's one dimension (docs/ARCHITECTURE.md section 3.6): over
// several mesh dimensions as one line (their ranks ranked row-major in the mesh's order of
// the dimensions), rooted (a reduce or gather to one position of that line, a broadcast or
// scatter from one), or a barrier. Reduce stays the frame of the common one-dimension
// reduction: the 8-byte hot path's.
struct Collective {
  CollectiveKind kind = CollectiveKind::Reduce;
  Ref result;  // 0 for a barrier; defined only on the root's ranks for a rooted reduce
  Ref tensor;  // 0 for a barrier; read only on the root's ranks for a broadcast or scatter
  TensorMeta factory;
  Ref mesh;
  Ref stream;
  std::vector<std::string> dims;  // in the mesh's order
  Reduction reduction = Reduction::Sum;
  bool scatter = false;
  bool inplace = false;
  std::int64_t root = -1;  // the root's position on the line of `dims`, or -1: none
  Ident ident = 0;         // as Reduce's
  friend bool operator==(const Collective&, const Collective&) = default;
};

struct SendTensor {
  Ref result;
  NDSlice from_ranks = NDSlice::row_major({});
  NDSlice to_ranks = NDSlice::row_major({});
  Ref tensor;
  TensorMeta factory;
  Ref stream;
  // A permutation send: from_ranks[i] sends to to_ranks[to_order[i]] (positions in
  // row-major order). Empty: to_ranks[i], by position.
  std::vector<std::int64_t> to_order;
  // A broadcast send (to_order empty): to_ranks[j] receives from from_ranks[from_order[j]],
  // so a source may send to several targets; to_ranks may be longer than from_ranks.
  std::vector<std::int64_t> from_order;
  Ident ident = 0;  // as Reduce's
  friend bool operator==(const SendTensor&, const SendTensor&) = default;
};

struct BorrowCreate {
  Ref result;
  Ref tensor;
  Ref from_stream;
  Ref to_stream;
  bool already_borrowed = false;
  friend bool operator==(const BorrowCreate&, const BorrowCreate&) = default;
};

struct BorrowFirstUse {
  Ref borrow;
  friend bool operator==(const BorrowFirstUse&, const BorrowFirstUse&) = default;
};

struct BorrowDrop {
  Ref borrow;
  friend bool operator==(const BorrowDrop&, const BorrowDrop&) = default;
};

struct DeleteRefs {
  std::vector<Ref> refs;
  friend bool operator==(const DeleteRefs&, const DeleteRefs&) = default;
};

struct RequestStatus {
  Ident ident = 0;
  friend bool operator==(const RequestStatus&, const RequestStatus&) = default;
};

struct Exit {
  bool restart = false;  // true: start a fresh event loop and reply Restarted
  friend bool operator==(const Exit&, const Exit&) = default;
};

// Recorded steps (docs/ARCHITECTURE.md section 3.9). Inside a DefineRecording's commands
// a ref with kLocalRef set names a slot of the recording: slots below `formals` are the
// replay's actual inputs, the others are fresh refs of each replay (ref_base + slot -
// formals); other refs (meshes, streams, tensors the recorded code captured) name
// themselves. An ident field holds the command's offset k (1..idents): the replay runs it
// as ident_base + k - 1.
inline constexpr std::uint64_t kLocalRef = std::uint64_t{1} << 63;

struct CommandGroup;
struct DefineRecording;
struct CallRecording;

using Command = std::variant<CreateDeviceMesh, CreateStream, CallFunction, FetchValue, Reduce, SendTensor, BorrowCreate,
                             BorrowFirstUse, BorrowDrop, DeleteRefs, CommandGroup, RequestStatus, Exit, DefineRecording,
                             CallRecording, Collective>;

// A recording's commands for this rank, kept under `recording` until a DeleteRefs names
// it. Only CallFunction, Reduce, Collective, SendTensor and the borrow commands may be
// recorded.
struct DefineRecording {
  Ref recording;
  std::uint32_t formals = 0;
  std::uint64_t locals = 0;      // slots formals .. formals + locals - 1
  std::uint64_t idents = 0;      // ident offsets 1 .. idents
  std::vector<Ref> temporaries;  // local refs deleted at the end of each replay
  std::vector<Command> commands;
  friend bool operator==(const DefineRecording& a, const DefineRecording& b);
};

// Runs a recording: one command for the whole step.
struct CallRecording {
  Ref recording;
  std::vector<Ref> actuals;  // one per formal
  std::uint64_t ref_base = 0;
  Ident ident_base = 0;
  friend bool operator==(const CallRecording&, const CallRecording&) = default;
};

struct CommandGroup {
  std::vector<Command> commands;
  friend bool operator==(const CommandGroup& a, const CommandGroup& b);
};

// ------------------------------------------------------------------ replies

struct Status {
  Ident first_uncompleted_ident = 0;
  std::uint64_t live_values = 0;  // values the worker holds (tensors, meshes, streams)
  friend bool operator==(const Status&, const Status&) = default;
};

struct RemoteFunctionFailed {
  Ident ident = 0;
  std::string error;           // the exception's what()
  std::int32_t rank = -1;      // the worker that failed
  std::string function;        // the remote function's name
  std::string exception_type;  // e.g. "std::runtime_error" (demangled)
  friend bool operator==(const RemoteFunctionFailed&, const RemoteFunctionFailed&) = default;
};

struct FetchResult {
  Ident ident = 0;
  Value value;
  friend bool operator==(const FetchResult&, const FetchResult&) = default;
};

struct Restarted {
  friend bool operator==(const Restarted&, const Restarted&) = default;
};

// Fan-in (docs/ARCHITECTURE.md section 8): what the root of a subtree of the status tree
// tells its parent (a worker, or the controller for a top node): every rank of the
// subtree has completed everything sent to it below `first_uncompleted_ident`. Failures
// and fetch results do not travel up the tree but straight to the controller, so a
// report says how many of those each rank had sent when it contributed (`direct_ranks`
// and `direct_counts`, only the ranks whose count changed since the node's previous
// report): the controller applies a report only once they have all arrived, which keeps
// the rule that a failure reaches it before any Status past it (section 3.3).
struct TreeStatus {
  Ident first_uncompleted_ident = 0;
  std::uint32_t epoch = 0;  // the workers' session (bumped by each restart)
  std::vector<std::int32_t> direct_ranks;
  std::vector<std::uint64_t> direct_counts;  // one per direct_ranks entry
  friend bool operator==(const TreeStatus&, const TreeStatus&) = default;
};

using Reply = std::variant<Status, RemoteFunctionFailed, FetchResult, Restarted, TreeStatus>;

// Exchanged by every rank at start-up: a rank that differs in any field fails the start.
struct Handshake {
  std::string meshrt_version;
  std::uint32_t protocol_version = kVersion;
  std::uint64_t function_table_hash = 0;
  std::int32_t thread_level = 0;  // MPI_THREAD_* granted
  std::int32_t rank = -1;
  std::string host;
  friend bool operator==(const Handshake&, const Handshake&) = default;
};

// ------------------------------------------------------------------ fan-out envelope

// A batch on its way down the fan-out tree (docs/ARCHITECTURE.md section 8). The
// controller sends one envelope to the first `fanout` ranks; the rank at position i of
// `ranks` forwards the same bytes to positions (i+1)*fanout .. (i+1)*fanout+fanout-1
// before it runs the payload (tree_children). A flat batch is an envelope whose fanout
// is its size: every rank hears it from the controller. `seqs[i]` numbers the command
// messages of ranks[i]: a worker hears from the controller and from several parents,
// and runs them in that order, never in arrival order, so FIFO order per channel holds.
struct Envelope {
  std::uint32_t fanout = 0;         // children per node, >= 1
  std::vector<std::int32_t> ranks;  // the destinations, in tree order, distinct
  std::vector<std::uint64_t> seqs;  // per destination, its message number (from 1)
  std::vector<std::byte> payload;   // one encoded Command frame
  friend bool operator==(const Envelope&, const Envelope&) = default;
};

// The positions in a tree of `n` nodes with `fanout` children each that node `position`
// sends to; position -1 is the controller (the root above the first `fanout` nodes).
inline std::pair<std::size_t, std::size_t> tree_children(std::size_t n, std::size_t fanout, std::int64_t position) {
  const std::size_t first = static_cast<std::size_t>(position + 1) * fanout;
  if (first >= n) return {n, n};
  return {first, std::min(n, first + fanout)};
}

// The status tree (fan-in, docs/ARCHITECTURE.md section 8) uses the same shape over the
// job's worker ranks: the parent of position p, or -1 for a top node (the controller's
// child).
inline std::int64_t tree_parent(std::size_t fanout, std::size_t position) {
  return position < fanout ? -1 : static_cast<std::int64_t>(position / fanout) - 1;
}

// ------------------------------------------------------------------ out-of-band queries

// The controller's questions to every worker's watch thread, answered even while the
// worker's event loop is stuck inside a function or a collective (worker/watch.cpp).
enum class QueryOp : std::uint8_t {
  State = 0,        // what the worker runs now: for the desync report of a timeout
  Dump = 1,         // log the flight recorder, and send it
  Abort = 2,        // abort NCCL communicators: the controller is about to end the job
  Trace = 3,        // send the rank's timeline so far (Controller::write_trace)
  TraceSwitch = 4,  // start (limit 1) or stop (limit 0) recording the timeline
};
inline constexpr int kNumQueryOps = 5;

struct Query {
  std::uint64_t id = 0;  // echoed by the answer, so the controller can drop stale answers
  QueryOp op = QueryOp::State;
  std::uint64_t limit = UINT64_MAX;  // Dump: only the newest `limit` records
  std::string reason;                // Dump: why it is asked (logged); Abort: the reason
  friend bool operator==(const Query&, const Query&) = default;
};

struct QueryAnswer {
  std::uint64_t query = 0;  // the Query's id; 0 when the query could not be read
  std::int32_t rank = -1;   // the worker that answers
  QueryOp op = QueryOp::State;
  // State: the Monitor's state as JSON text, open-ended by design (it grows with what the
  // flight recorder knows, and only the desync report reads it); Dump: the flight
  // recorder's text; Abort, TraceSwitch: empty; Trace: the rank's host, a NUL, the count
  // of events its rings dropped (8 bytes), then its trace events (64 bytes each).
  std::string payload;
  std::string error;  // non-empty: the watch could not answer, and why
  friend bool operator==(const QueryAnswer&, const QueryAnswer&) = default;
};

// "CallFunction", "FetchResult", ...
std::string_view name(const Command& c) noexcept;
// The name of the command with wire tag `tag` (its index in Command), or "?".
std::string_view command_name(std::size_t tag) noexcept;
std::string_view name(const Reply& r) noexcept;

// ------------------------------------------------------------------ codec

// A growable byte buffer for encoding, reused across messages: clear() keeps the
// allocation, and growth never zero-fills (a 1 MiB tensor costs one memcpy).
class Buffer {
 public:
  Buffer() = default;
  Buffer(Buffer&&) noexcept = default;
  Buffer& operator=(Buffer&&) noexcept = default;

  std::byte* data() noexcept { return data_.get(); }
  const std::byte* data() const noexcept { return data_.get(); }
  std::size_t size() const noexcept { return size_; }
  std::size_t capacity() const noexcept { return capacity_; }
  std::span<const std::byte> span() const noexcept { return {data_.get(), size_}; }
  void clear() noexcept { size_ = 0; }
  void reserve(std::size_t n);
  // Grows by n bytes (uninitialised) and returns a pointer to them.
  std::byte* extend(std::size_t n) {
    if (capacity_ - size_ < n) grow(n);
    std::byte* p = data_.get() + size_;
    size_ += n;
    return p;
  }

 private:
  void grow(std::size_t n);
  std::unique_ptr<std::byte[]> data_;
  std::size_t size_ = 0;
  std::size_t capacity_ = 0;
};

// encode_into appends one frame to `out` (call out.clear() first for a fresh message).
// A tensor must be on the CPU (the worker copies device data out first); encoding a CUDA
// tensor raises ProtocolError.
void encode_into(const Command& c, Buffer& out);
void encode_into(const Reply& r, Buffer& out);
void encode_into(const Handshake& h, Buffer& out);
void encode_into(const Query& q, Buffer& out);
void encode_into(const QueryAnswer& a, Buffer& out);
void encode_into(const Envelope& e, Buffer& out);
std::vector<std::byte> encode(const Command& c);
// The bytes encode(c) makes, and those a Value takes inside a frame, counted without
// copying anything: the controller checks a command's size against the control plane's
// limit before it is queued.
std::size_t encoded_size(const Command& c);
std::size_t encoded_size(const Value& v);
std::vector<std::byte> encode(const Reply& r);
std::vector<std::byte> encode(const Handshake& h);
std::vector<std::byte> encode(const Query& q);
std::vector<std::byte> encode(const QueryAnswer& a);
std::vector<std::byte> encode(const Envelope& e);

// Decodes exactly one frame that fills `bytes`; throws ProtocolError.
Command decode_command(std::span<const std::byte> bytes);
// A command frame's commands, each decoded in place into the command `slot()` returns: a
// group's one by one, nested groups flattened (a worker's queue takes them so, without
// moving each out of a group). On ProtocolError the slots already given hold partial
// commands, for the caller to drop.
void decode_commands(std::span<const std::byte> bytes, const std::function<Command&()>& slot);
Reply decode_reply(std::span<const std::byte> bytes);
Handshake decode_handshake(std::span<const std::byte> bytes);
Query decode_query(std::span<const std::byte> bytes);
QueryAnswer decode_query_answer(std::span<const std::byte> bytes);
Envelope decode_envelope(std::span<const std::byte> bytes);
// Whether `bytes` is an envelope frame (a worker's command channel carries envelopes and,
// with fan-out off, bare commands).
bool is_envelope(std::span<const std::byte> bytes) noexcept;

// Value on its own (used by FetchResult and by anything storing argument trees).
void encode_value(const Value& v, Buffer& out);
Value decode_value(std::span<const std::byte> bytes);

}  // namespace protocol
}  // namespace meshrt
