// Recorded steps on the controller (docs/ARCHITECTURE.md section 3.9): what a recording
// keeps while it is made (RecordingContext) and after (RecordingState), so a replay builds
// the dependency graph's nodes, the completion tracker's idents and the results of the
// step without running the recorded function or its shape functions again.
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

#include "controller/state.hpp"
#include "meshrt/call_site.hpp"

namespace meshrt::detail {

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

struct RecordingContext {
  std::uint64_t serial = 0;
  CallSite where{};
  std::uint32_t formals = 0;
  std::uint64_t next_slot = 0;
  Ident next_offset = 1;
  std::vector<std::pair<Words, CallSite>> described;  // by ident offset - 1
  std::vector<std::shared_ptr<TensorState>> values;   // by slot: formals and locals
  struct Captured {
    std::shared_ptr<TensorState> state;
    std::shared_ptr<Node> node;  // as it was before the recording (restored after it)
    TensorState::Lent lent;
  };
  std::vector<Captured> captured;
  std::unordered_map<std::uint64_t, std::uint32_t> captured_index;  // by ref id
  std::vector<RecordedCommand> commands;
  std::size_t payload = 0;  // the commands' argument bytes: a DefineRecording is one message
  std::vector<std::shared_ptr<MeshState>> meshes;
  std::vector<std::shared_ptr<StreamState>> streams;

  // The slot of tensor ref `r`, local or captured.
  std::uint64_t slot(Ref r) const;
};

}  // namespace meshrt::detail
