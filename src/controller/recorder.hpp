// The recorder (docs/ARCHITECTURE.md section 3.9): recorded steps on the controller.
// While a recording is made it takes what the handles issue instead of the batcher:
// tensors get slots local to the recording, invocations ident offsets, a tensor from
// outside is captured (kept, and named by its own ref), and every command is kept with
// its words and call site. At the end it turns that into a RecordingState and the
// DefineRecording each share of ranks receives. For a replay it checks the inputs against
// the recording, walks the recorded commands' slots so the session can make the
// dependency graph's nodes and the tracker's idents without running the recorded
// function or its shape functions again, and makes the results. Like the other parts it
// sends nothing and asks no other part: ControllerState feeds it and applies what it
// returns.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "controller/graph.hpp"
#include "controller/words.hpp"
#include "meshrt/call_site.hpp"
#include "meshrt/controller.hpp"
#include "meshrt/internal/protocol.hpp"

namespace meshrt::detail {

struct ControllerState;
struct MeshState;
struct RecordingContext;
struct StreamState;
struct TensorState;

// A slot of a recording: a formal or local value (its slot number), or a captured tensor
// (kCapturedSlot and its index).
inline constexpr std::uint64_t kCapturedSlot = std::uint64_t{1} << 62;

struct RecordedCommand {
  std::vector<int> dests;
  protocol::Command command;  // local refs and an ident offset, as DefineRecording holds them
  Ident offset = 0;           // its ident's offset, 0 for a borrow command
  std::size_t payload = 0;    // the bytes of its arguments (ControllerState::append)
  Words what;
  CallSite where{};
  // How a replay updates the graph: Node makes the command's node from `reads` and gives it
  // to `writes`; Alias gives writes[0] the node of reads[0] (a borrow); Join gives
  // writes[0] a node of its own and reads[0]'s (a mutable borrow dropped); None: nothing.
  enum class Flow : std::uint8_t { None, Node, Alias, Join } flow = Flow::None;
  std::vector<std::uint64_t> reads, writes;
};

// What the controller knows of one input or output of the step.
struct RecordedValue {
  TensorMeta meta;
  std::shared_ptr<MeshState> home;
  std::shared_ptr<MeshState> mesh;  // the handle's (sub-)mesh
  std::shared_ptr<StreamState> stream;
  std::uint64_t slot = 0;  // outputs: the slot (kCapturedSlot for a captured tensor)
  bool mutated = false;    // inputs: the step changes it
};

struct RecordingState {
  ~RecordingState();
  std::weak_ptr<ControllerState> controller;
  std::uint64_t epoch = 0;
  Ref ref;
  CallSite where{};
  std::vector<int> dests;  // every rank a command goes to, sorted
  std::uint32_t formals = 0;
  std::uint64_t locals = 0;
  std::uint64_t idents = 0;
  std::vector<RecordedValue> inputs, outputs;
  struct Captured {
    std::shared_ptr<TensorState> state;
    bool mutated = false;
  };
  std::vector<Captured> captured;
  std::vector<RecordedCommand> commands;
  // Kept alive: the workers' meshes and streams the commands name.
  std::vector<std::shared_ptr<MeshState>> meshes;
  std::vector<std::shared_ptr<StreamState>> streams;
};

// The dependency-graph nodes of a replay's slots: the formals and locals, then the
// captured tensors.
struct ReplayNodes {
  std::vector<std::shared_ptr<Node>> local, captured;
  std::shared_ptr<Node>& operator[](std::uint64_t slot) {
    return (slot & kCapturedSlot) ? captured[slot & ~kCapturedSlot] : local[slot];
  }
};

class Recorder {
 public:
  Recorder();
  ~Recorder();
  Recorder(const Recorder&) = delete;
  Recorder& operator=(const Recorder&) = delete;

  // ---- while a recording is made

  // Whether a recording is being made.
  bool active() const noexcept { return ctx_ != nullptr; }
  // UsageError when a recording is being made: `what` needs a value back, or is not recordable.
  void refuse(std::string_view what) const;
  // UsageError while recording: a call of `function`, which declares views.
  void refuse_views(std::string_view function) const;
  // Inside a recording: a tensor's ref is the next local slot, an ident the next offset
  // (both marked with protocol::kLocalRef).
  Ref new_ref();
  Ident new_ident();
  // Every use of a tensor passes here: inside a recording a tensor from outside is
  // captured (kept, and named by its own ref in the recorded commands); a tensor made in
  // a recording is refused outside it.
  void note_use(TensorState& t, std::string_view what);
  // A tensor made now: inside a recording, one of its values.
  void note_new(const std::shared_ptr<TensorState>& t);
  // `c` joins the recording instead of going to the workers; `payload`: the bytes of its
  // arguments, which together are held to one call's limit.
  void capture(const std::vector<int>& dests, protocol::Command c, std::size_t payload);
  // The node of an invocation made at record time (its words and call site are kept for
  // the recorded command with that ident).
  std::shared_ptr<Node> node(Ident ident, Words what, const CallSite& where);
  // A mesh or stream the recorded commands name, kept alive with the recording.
  void keep(std::shared_ptr<MeshState> mesh);
  void keep(std::shared_ptr<StreamState> stream);

  // ---- making one

  using Body = std::function<std::vector<DTensor>(const std::vector<DTensor>&)>;
  // What one share of ranks (those taking part in the same recorded commands) is sent:
  // its DefineRecording, whose `recording` the session fills in, and its argument bytes.
  struct Share {
    std::vector<int> ranks;
    protocol::DefineRecording define;
    std::size_t payload = 0;
  };
  // UsageError when a recording is being made: recordings do not nest.
  void refuse_record() const;
  // Records the commands `body` issues on formals like `examples` (defined and checked by
  // the session) into `state` (its controller and epoch set), and returns what each share
  // of ranks is sent. Whatever happens, the captured tensors leave the recording as they
  // entered it.
  std::vector<Share> record(RecordingState& state, const std::vector<DTensor>& examples, const Body& body,
                            const CallSite& where);

  // ---- replaying one

  // UsageError when a recording is being made: a replay is not a command to record.
  void refuse_replay(const RecordingState& r) const;
  // UsageError unless `inputs` is as many tensors as the recording has formals.
  static void check_arity(const RecordingState& r, std::size_t inputs);
  // UsageError unless input `i` has the recorded meta, mesh and stream; the words that
  // name it for the checks of its use.
  static std::string check_input(const RecordingState& r, std::size_t i, const DTensor& in);
  // The nodes of the inputs and captured tensors as the replay starts.
  // UsageError when two of a replay's inputs and captured tensors share one storage.
  static void check_storages(const RecordingState& r, const std::vector<DTensor>& inputs);
  static ReplayNodes nodes_before(const RecordingState& r, const std::vector<DTensor>& inputs);
  // The recorded commands' effect on `nodes`, in order: `invocation(rc, reads)` makes a
  // recorded invocation's node from the nodes it reads; `join(rc, origin, borrow)` that
  // of a mutable borrow's drop.
  template <class Invocation, class Join>
  static void flow(const RecordingState& r, ReplayNodes& nodes, Invocation&& invocation, Join&& join);
  // After the replay is sent: the inputs and captured tensors it changes take their new
  // nodes, and its results (fresh tensors from `ref_base`, or the input or captured
  // tensor the function returned).
  static std::vector<DTensor> results(const RecordingState& r, const std::vector<DTensor>& inputs, ReplayNodes& nodes,
                                      std::uint64_t ref_base);

 private:
  std::vector<DTensor> begin(RecordingState& state, const std::vector<DTensor>& examples, const CallSite& where);
  void check_results(const std::vector<DTensor>& results);
  std::vector<Share> finish(RecordingState& state, const std::vector<DTensor>& results);
  std::unique_ptr<RecordingContext> ctx_;  // the recording being made, or null
  std::uint64_t made_ = 0;                 // recordings begun: a recording's serial number
};

template <class Invocation, class Join>
void Recorder::flow(const RecordingState& r, ReplayNodes& nodes, Invocation&& invocation, Join&& join) {
  std::vector<std::shared_ptr<Node>> reads;
  for (const RecordedCommand& rc : r.commands) {
    switch (rc.flow) {
      case RecordedCommand::Flow::Node: {
        reads.clear();
        for (std::uint64_t s : rc.reads) reads.push_back(nodes[s]);
        auto n = invocation(rc, std::span<const std::shared_ptr<Node>>(reads));
        for (std::uint64_t s : rc.writes) nodes[s] = n;
        break;
      }
      case RecordedCommand::Flow::Alias:
        nodes[rc.writes[0]] = nodes[rc.reads[0]];
        break;
      case RecordedCommand::Flow::Join:
        nodes[rc.writes[0]] = join(rc, nodes[rc.writes[0]], nodes[rc.reads[0]]);
        break;
      case RecordedCommand::Flow::None:
        break;
    }
  }
}

}  // namespace meshrt::detail
