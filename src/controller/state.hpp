// The controller's internal state: the handles' states and the session (shared by
// controller.cpp and runtime.cpp).
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/site.hpp"
#include "controller/batcher.hpp"
#include "controller/completion.hpp"
#include "controller/diagnostics.hpp"
#include "controller/graph.hpp"
#include "controller/recorder.hpp"
#include "meshrt/call_site.hpp"
#include "meshrt/controller.hpp"
#include "meshrt/internal/control.hpp"
#include "meshrt/internal/controller.hpp"
#include "meshrt/internal/protocol.hpp"

namespace meshrt::detail {

using protocol::Ident;

// A mesh is a value with a lifetime: when the last handle (Mesh, DTensor, the
// session's cache of recent meshes) drops, its destructor queues the workers' delete,
// which frees the WorkerMesh and its communicators.
struct MeshState : std::enable_shared_from_this<MeshState> {
  ~MeshState();
  std::weak_ptr<ControllerState> controller;
  std::uint64_t epoch = 0;
  Ref ref;
  std::vector<std::string> names;
  NDSlice ranks = NDSlice::row_major({});
  Device::Kind kind = Device::Kind::Cpu;  // what it is placed on; slices keep it
  std::vector<int> dests;                 // ranks as a sorted list
  bool created = false;
  std::int64_t dim_index(std::string_view dim) const;  // throws UsageError naming the dims
  // "reduce sum with scatter over 'dp'" (reduce_ in place) for dimension d, made once.
  const Words& reduce_words(std::int64_t d, Reduction reduction, bool scatter, bool inplace);
  std::vector<Words> reduce_words_cache;  // by (dimension, reduction, scatter, in place)
  // What a to_mesh from this mesh to `to` says ("to_mesh [0,1] -> [2,3]") and the ranks it
  // goes to (both meshes' ranks, sorted), made once for a loop of sends to one target:
  // formatting and sorting them per call is a large share of the controller's work for
  // a small to_mesh.
  struct SendWords {
    NDSlice to = NDSlice::row_major({});
    Words what;
    std::vector<int> dests;
  };
  const SendWords& send_words(const MeshState& to);
  std::optional<SendWords> send_words_cache;  // for the last target
};

// As MeshState: the last handle (a Stream, a tensor on it) frees it on the workers.
struct StreamState : std::enable_shared_from_this<StreamState> {
  ~StreamState();
  std::weak_ptr<ControllerState> controller;
  std::uint64_t epoch = 0;
  Ref ref;
  std::string name;
  bool is_default = false;
  bool created = false;
};

struct TensorState : std::enable_shared_from_this<TensorState> {
  ~TensorState();
  std::weak_ptr<ControllerState> controller;
  std::uint64_t epoch = 0;
  Ref ref;
  // Made inside a recording (its number): a formal or a value of the recorded step, which
  // exists on the workers only within a replay. Never deleted; refused outside it.
  std::uint64_t recorded = 0;
  TensorMeta meta;
  // A worker object's value (Mesh::call_object): no tensor, so meta means nothing; it is
  // used on its home mesh only.
  bool object = false;
  std::shared_ptr<MeshState> home;  // the mesh whose ranks hold the value
  std::shared_ptr<StreamState> stream;
  // Borrows of this tensor that are active, and whether one of them is mutable.
  struct Lent {
    int active = 0;
    bool mutably = false;
    std::string to;  // the stream name of the mutable borrow
  };
  // What the tensor's storage has: its latest node (what the value was computed from) and
  // its active borrows. A declared view and its base share one (docs/ARCHITECTURE.md
  // section 3.7), so an in-place change, a borrow or a failure of either is the other's.
  struct Storage {
    std::shared_ptr<Node> node;
    Lent lent;
  };
  std::shared_ptr<Node>& node() noexcept { return storage().node; }
  Lent& lent() noexcept { return storage().lent; }
  Storage& storage() noexcept { return shared_ ? *shared_ : own_; }
  const Storage& storage() const noexcept { return shared_ ? *shared_ : own_; }
  // The storage as one views can share (a tensor that has none keeps its own inline).
  const std::shared_ptr<Storage>& share() {
    if (!shared_) shared_ = std::make_shared<Storage>(std::move(own_));
    return shared_;
  }
  void share_with(std::shared_ptr<Storage> s) { shared_ = std::move(s); }
  bool is_shared() const noexcept { return shared_ != nullptr; }
  // drop() of a tensor that is not a borrow: its value is freed on the workers, and every
  // later use of any handle to it names where.
  bool dropped = false;
  CallSite dropped_at{};
  // When this tensor is itself a borrow (origin set):
  struct Borrow {
    std::shared_ptr<TensorState> origin;
    bool is_mutable = false;
    bool first_use_sent = false;
    bool dropped = false;
    CallSite where{};       // the borrow() call, named by an implicit drop
    CallSite dropped_at{};  // the drop() call, named by a later use
  } borrow;

 private:
  Storage own_;
  std::shared_ptr<Storage> shared_;
};

struct FutureState {
  std::weak_ptr<ControllerState> controller;
  Ident ident = 0;
  int rank = -1;     // a fetch's; -1 for a completion (a barrier's), which brings no value
  std::string what;  // "fetch": its errors say "fetch (invocation 7)" (Subject)
  std::shared_ptr<Node> node;
  std::optional<Value> value;
  bool finished = false;
  bool checked = false;  // done() asked about it once
  std::exception_ptr error;
  // when_all's: the futures it waits for (then it has no ident, node or controller).
  std::vector<std::shared_ptr<FutureState>> parts;
  bool composite = false;
  // A fetch of several tensors: tensor i is item .second of part .first's list.
  std::vector<std::pair<std::size_t, std::size_t>> leaves;
};

// The controller's session: the handles' shared state and the five parts that implement
// docs/ARCHITECTURE.md section 3's rules, each with one job (batcher: the transport; tracker: the
// completion rule; graph: dependencies and failures; diagnostics: queries, reports,
// abort; recorder: recorded steps). Handles call its methods; it feeds each part what the
// others learn, so no part calls another but Diagnostics, which asks through the Batcher.
struct ControllerState : std::enable_shared_from_this<ControllerState> {
 public:
  ControllerState(std::shared_ptr<control::Transport> transport, int world_size, NDSlice workers);
  ~ControllerState();

  int world_size() const noexcept { return world_size_; }
  const NDSlice& worker_ranks() const noexcept { return worker_ranks_; }
  // The ranks that run a worker, sorted.
  const std::vector<int>& workers() const noexcept { return workers_; }
  // Bumped by restart_workers(): handles made before are stale.
  std::uint64_t epoch() const noexcept { return epoch_; }

  Ref new_ref() { return Ref{next_ref_++}; }
  // `n` consecutive refs (a replay's values); the first.
  std::uint64_t new_refs(std::uint64_t n) {
    const std::uint64_t first = next_ref_;
    next_ref_ += n;
    return first;
  }
  // A tensor's ref: inside a recording, the next local slot of the recording.
  // What a call's shape function sees of `args`: a meta where the workers will see a
  // tensor (None for a worker object); `tensors` gets the call's DTensors in order.
  static std::vector<Value> argument_metas(const std::vector<Arg>& args, std::vector<DTensor>& tensors);
  Ref new_tensor_ref();
  // Inside a recording, an ident offset of it (marked with protocol::kLocalRef).
  Ident new_ident(const char* label = nullptr);
  void check_epoch(std::uint64_t e, std::string_view what) const;

  // Queues `c` for `dests`; `ident`, when non-zero, is recorded as outstanding on every
  // destination. Inside a recording the command is recorded instead. `payload`: the bytes
  // of its arguments (Batcher::append), which the caller checked against payload_limit().
  void append(const std::vector<int>& dests, protocol::Command&& c, Ident ident = 0, std::size_t payload = 0);
  // Queues `c` now, also inside a recording (meshes, streams, the recording itself).
  void append_now(const std::vector<int>& dests, protocol::Command&& c, std::size_t payload = 0);
  // `ident` is outstanding on `dests`, sent inside a command that is not its own (a replay).
  void sent(const std::vector<int>& dests, Ident ident) { tracker_.sent(dests, ident); }

  // Recorded steps (the Recorder; controller/recording.cpp). UsageError when a recording
  // is being made: `what` needs a value back, or is not recordable.
  void refuse_in_recording(std::string_view what) const { recorder_.refuse(what); }
  bool recording() const noexcept { return recorder_.active(); }
  // UsageError when a recording is being made: `function` declares views.
  void refuse_views_in_recording(std::string_view function) const { recorder_.refuse_views(function); }
  // Every use of a tensor passes here (Recorder::note_use).
  void note_use(TensorState& t, std::string_view what) { recorder_.note_use(t, what); }
  // A tensor made now: inside a recording, one of its values.
  void note_new(const std::shared_ptr<TensorState>& t) { recorder_.note_new(t); }
  // Records the commands `body` issues on formals like `examples`.
  std::shared_ptr<RecordingState> record(const std::vector<DTensor>& examples, const Recorder::Body& body,
                                         const CallSite& where);
  std::vector<DTensor> replay(RecordingState& r, const std::vector<DTensor>& inputs, const CallSite& where);
  // A DTensor's state and (sub-)mesh, and a DTensor of them: DTensor befriends the session,
  // which lends this to its parts.
  static const std::shared_ptr<TensorState>& state_of(const DTensor& t) noexcept { return t.state_; }
  static const std::shared_ptr<MeshState>& mesh_of(const DTensor& t) noexcept { return t.mesh_; }
  static DTensor handle(std::shared_ptr<TensorState> t, std::shared_ptr<MeshState> mesh) {
    return DTensor(std::move(t), std::move(mesh));
  }
  void flush() { batcher_.flush(); }
  void flush_deferred();
  // For handle destructors: work for the next command, sent with it.
  void defer_delete(const std::vector<int>& dests, Ref ref, std::optional<std::size_t> value_bytes = std::nullopt) {
    batcher_.defer_delete(dests, ref, value_bytes);
  }
  // A borrow destroyed without drop(): the BorrowDrop goes out ahead of the next command
  // to any ranks, so it reaches the workers before the origin's next use, as drop()'s.
  void defer_drop(const std::vector<int>& dests, Ref ref) { pending_drops_.emplace_back(dests, ref); }

  // Takes every waiting reply and applies it to the tracker, the graph and the futures.
  void poll_replies();
  // Every ident <= the returned one is complete on every worker it was sent to.
  Ident frontier() const { return tracker_.frontier(); }
  // Sends RequestStatus(ident) to the workers that have not reported past `ident`.
  void request_status(Ident ident, bool idle_too = true);
  // How long wait_for() waits for workers to report by themselves before asking.
  static constexpr std::chrono::milliseconds kAskIdleAfter{1};
  // Waits until frontier() >= ident; throws TimeoutError after `timeout`. Past
  // MESHRT_STALL_WARNING (when that comes first) it prints the desync report once and
  // waits on.
  void wait_for(Ident ident, std::optional<std::chrono::duration<double>> timeout, const Subject& what);
  // Waits until every worker has run everything issued so far (a RequestStatus to all of
  // them under a new ident named `what`); failures stay for the futures and synchronize().
  void wait_for_issued(std::optional<std::chrono::duration<double>> timeout, const char* what);

  std::shared_ptr<Node> make_node(Ident ident, Words what, const CallSite& where,
                                  std::span<const std::shared_ptr<Node>> inputs);
  std::shared_ptr<Node> make_node(Ident ident, Words what, const CallSite& where,
                                  std::initializer_list<std::shared_ptr<Node>> inputs) {
    return make_node(ident, std::move(what), where, std::span(inputs.begin(), inputs.size()));
  }
  // A replayed command's node: `what` at `where` in the recorded function, run by the
  // replay at `replayed_at`.
  std::shared_ptr<Node> make_replay_node(Ident ident, const Words& what, const CallSite& where,
                                         const CallSite& replayed_at, std::span<const std::shared_ptr<Node>> inputs);
  // The same, safe from a destructor: never polls the transport.
  std::shared_ptr<Node> make_node_quietly(Words what, const CallSite& where,
                                          std::initializer_list<std::shared_ptr<Node>> inputs) {
    return graph_.make_node(0, std::move(what), where, inputs);
  }
  // The failure a node depends on (smallest ident), with the chain to it; null when clean.
  std::exception_ptr failure_of(const std::shared_ptr<Node>& node, const Subject& subject);
  // Raises the first failure no call has raised yet (synchronize), logging how many more.
  void raise_unobserved_failures();

  void register_fetch(Ident ident, const std::shared_ptr<FutureState>& future) { fetches_[ident] = future; }
  // A plain fetch's node words, "fetch from rank R": made once per rank, shared after.
  const Words& fetch_words(int rank);
  void forget_fetch(Ident ident) { fetches_.erase(ident); }

  std::shared_ptr<StreamState> stream(const std::string& name);
  // The default stream without a look-up by name once made (it lives as long as the session).
  std::shared_ptr<StreamState> default_stream() { return default_stream_ ? default_stream_ : stream("default"); }
  // A call's node words, the function's name: the last function's words again while calls
  // name the same function, so a loop's nodes share one copy of the name.
  Words function_words(const std::string& name) {
    if (function_words_.str() != name) function_words_ = Words(name);
    return function_words_;
  }
  // The live mesh with these names over these ranks, or null; and the record of a new
  // one. A mesh made again (a slice in a loop) is the same value, created once on the
  // workers: no new communicators after the first. The last kRecentMeshes made are kept
  // alive by the session so a loop that drops its slice each time still reuses it.
  std::shared_ptr<MeshState> find_mesh(const std::string& key);
  void remember_mesh(const std::string& key, const std::shared_ptr<MeshState>& mesh);
  static constexpr std::size_t kRecentMeshes = 16;
  void ensure_mesh(MeshState& mesh);
  void ensure_stream(StreamState& stream);

  std::uint64_t live_values(int rank) const { return tracker_.live_values(rank); }
  ControlTraffic traffic() const { return batcher_.traffic(); }
  std::uint64_t flusher_wakeups() { return batcher_.flusher_wakeups(); }
  std::string dump_flight_recorder() { return diagnostics_.dump_flight_recorder(); }
  std::uint64_t write_trace(const std::string& path) { return diagnostics_.write_trace(path); }
  void switch_trace(bool on) { diagnostics_.switch_trace(on); }
  [[noreturn]] void abort_job(const std::string& reason) { diagnostics_.abort_job(reason); }
  // The flight recorders the timeout that raised `error` gathered, when they went to no
  // log directory; empty for any other error. Runtime::session prints them once when the
  // error escapes the controller function: a program that handles it sees only its text.
  std::string unhandled_dumps(const std::exception_ptr& error) const;

  // Ends the workers' event loops and starts fresh ones; nothing made before survives.
  void restart_workers();
  // Waits for everything sent, then ends the workers' loops; aborts the job after
  // `timeout` rather than leave a rank waiting.
  void shutdown(std::chrono::duration<double> timeout);

 private:
  // The text of the last TimeoutError and the flight recorders gathered for it.
  std::string timeout_what_, timeout_dumps_;
  const int world_size_;
  const NDSlice worker_ranks_;
  const std::vector<int> workers_;
  // Fan-in: the status tree, when the job is above the fan-out threshold.
  std::optional<control::StatusTree> tree_;
  std::uint64_t epoch_ = 1;
  Batcher batcher_;
  CompletionTracker tracker_;
  DependencyGraph graph_;
  Diagnostics diagnostics_;
  Recorder recorder_;
  // MESHRT_STALL_WARNING, read once (Seconds::max(): off).
  const std::chrono::duration<double> stall_warning_;
  // A wait of `ident` past stall_warning_: the desync report to stderr, once.
  void report_stall(Ident ident, const std::string& what, std::chrono::duration<double> waited);
  std::uint64_t next_ref_ = 1;
  std::unordered_map<Ident, std::weak_ptr<FutureState>> fetches_;
  std::vector<Words> fetch_words_;  // by rank
  Words function_words_;            // function_words' last
  // Streams by name while some handle holds them; the default stream lives as long as
  // the session.
  std::map<std::string, std::weak_ptr<StreamState>> streams_;
  std::shared_ptr<StreamState> default_stream_;
  std::unordered_map<std::string, std::weak_ptr<MeshState>> meshes_;
  std::deque<std::shared_ptr<MeshState>> recent_meshes_;
  std::vector<std::pair<std::vector<int>, Ref>> pending_drops_;  // defer_drop's, sent by send_deferred_drops
  // MESHRT_TRACE: a call with an ident, on the controller's track.
  static void trace_call(Ident ident, const Words& what, const CallSite& where, const CallSite& replayed_at);

  // Appends a BorrowDrop for each deferred drop (defer_drop), ahead of what follows.
  void send_deferred_drops();
};

std::vector<int> to_dests(const NDSlice& slice);

// The checks every use of a tensor passes (stream, ranks, borrows, recordings), and the
// BorrowFirstUse it may need.
void use_tensor(ControllerState& ctl, TensorState& t, const MeshState& mesh, const StreamState& stream, bool mutate,
                std::string_view what);
// UsageError naming both meshes when a worker object among `args` is not of `mesh`.
void check_objects(const std::vector<DTensor>& args, const MeshState& mesh, std::string_view what);

}  // namespace meshrt::detail
