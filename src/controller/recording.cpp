// Recorded steps (docs/ARCHITECTURE.md section 3.9): the session's glue between the
// Recorder and the other parts, and the public handles (Controller::record, Recording).
#include <fmt/format.h>

#include "common/site.hpp"
#include "common/trace.hpp"
#include "controller/recorder.hpp"
#include "controller/state.hpp"
#include "meshrt/controller.hpp"

namespace meshrt::detail {

std::shared_ptr<RecordingState> ControllerState::record(const std::vector<DTensor>& examples,
                                                        const Recorder::Body& body, const CallSite& where) {
  recorder_.refuse_record();
  for (std::size_t i = 0; i < examples.size(); ++i) {
    const DTensor& e = examples[i];
    if (!e.state_) throw UsageError(fmt::format("record: example {} is an undefined DTensor", i));
    note_use(*e.state_, fmt::format("record: example {}", i));
    check_epoch(e.state_->epoch, "tensor");
  }
  auto state = std::make_shared<RecordingState>();
  state->controller = weak_from_this();
  state->epoch = epoch_;
  std::vector<Recorder::Share> shares = recorder_.record(*state, examples, body, where);
  state->ref = new_ref();
  for (Recorder::Share& s : shares) {
    s.define.recording = state->ref;
    append_now(s.ranks, std::move(s.define), s.payload);
  }
  return state;
}

// What issuing the recorded commands would have done to the controller's books, without
// the shape functions, the checks of each call or the encoding.
std::vector<DTensor> ControllerState::replay(RecordingState& r, const std::vector<DTensor>& inputs,
                                             const CallSite& where) {
  recorder_.refuse_replay(r);
  check_epoch(r.epoch, "recording");
  Recorder::check_arity(r, inputs.size());
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const std::string what = Recorder::check_input(r, i, inputs[i]);
    TensorState& t = *inputs[i].state_;
    use_tensor(*this, t, *inputs[i].mesh_, *t.stream, r.inputs[i].mutated, what);
  }
  for (const auto& k : r.captured) {
    use_tensor(*this, *k.state, *k.state->home, *k.state->stream, k.mutated,
               fmt::format("replay of the recording made at {}: a tensor it captured", describe(r.where)));
  }
  Recorder::check_storages(r, inputs);
  // The replay's refs and idents, then the graph's nodes, command by command.
  const std::uint64_t ref_base = new_refs(r.locals);
  Ident ident_base = 0;
  for (std::uint64_t k = 0; k < r.idents; ++k) {
    const Ident i = tracker_.new_ident();
    if (k == 0) ident_base = i;
  }
  ReplayNodes nodes = Recorder::nodes_before(r, inputs);
  Recorder::flow(
      r, nodes,
      [&](const RecordedCommand& rc, std::span<const std::shared_ptr<Node>> reads) {
        const Ident ident = ident_base + rc.offset - 1;
        auto n = make_replay_node(ident, rc.what, rc.where, where, reads);
        tracker_.sent(rc.dests, ident);
        return n;
      },
      [&](const RecordedCommand& rc, const std::shared_ptr<Node>& origin, const std::shared_ptr<Node>& borrow) {
        auto n = graph_.make_node(0, "drop of a mutable borrow", rc.where, {origin, borrow});
        n->replayed_at = where;
        return n;
      });
  std::vector<Ref> actuals;
  actuals.reserve(inputs.size());
  for (const DTensor& in : inputs) actuals.push_back(in.state_->ref);
  append_now(r.dests,
             protocol::CallRecording{
                 .recording = r.ref, .actuals = std::move(actuals), .ref_base = ref_base, .ident_base = ident_base});
  return Recorder::results(r, inputs, nodes, ref_base);
}

std::shared_ptr<Node> ControllerState::make_replay_node(Ident ident, const Words& what, const CallSite& where,
                                                        const CallSite& replayed_at,
                                                        std::span<const std::shared_ptr<Node>> inputs) {
  tracker_.describe(ident, what, where, replayed_at);
  if (trace::enabled()) trace_call(ident, what, where, replayed_at);
  auto n = graph_.make_node(ident, what, where, inputs);
  n->replayed_at = replayed_at;
  if (graph_.prune_due()) poll_replies();
  return n;
}

}  // namespace meshrt::detail

// ------------------------------------------------------------------ the public handles

namespace meshrt {

using detail::describe;

std::vector<DTensor> Recording::operator()(const std::vector<DTensor>& inputs, CallSite where) const {
  detail::refuse_on_worker_thread("a replay of a Recording");
  if (!state_) throw UsageError(fmt::format("replay of an undefined Recording (at {})", describe(where)));
  auto ctl = state_->controller.lock();
  if (!ctl) throw UsageError("this recording outlived its controller session");
  try {
    return ctl->replay(*state_, inputs, where);
  } catch (const UsageError& e) {
    throw UsageError(fmt::format("{} (at {})", e.what(), describe(where)));
  }
}

std::size_t Recording::num_inputs() const {
  return state_ ? state_->inputs.size() : 0;
}
std::size_t Recording::num_outputs() const {
  return state_ ? state_->outputs.size() : 0;
}
std::size_t Recording::num_commands() const {
  return state_ ? state_->commands.size() : 0;
}

Recording Controller::record(const std::vector<DTensor>& examples,
                             const std::function<std::vector<DTensor>(const std::vector<DTensor>&)>& body,
                             CallSite where) {
  detail::refuse_on_worker_thread("Controller::record");
  return Recording(state_->record(examples, body, where));
}

}  // namespace meshrt
