#include "controller/recording.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <type_traits>
#include <variant>

#include "common/site.hpp"
#include "common/trace.hpp"
#include "meshrt/controller.hpp"

namespace meshrt::detail {

using protocol::kLocalRef;

namespace {

bool is_local(Ref r) {
  return (r.id & kLocalRef) != 0;
}

// The recorded function's mistake, named with the record() call.
template <class F>
auto in_recording(const CallSite& where, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const UsageError& e) {
    throw UsageError(fmt::format("{} (in the recording made at {})", e.what(), describe(where)));
  }
}

// Sets a recorded command's ident field to its offset; returns the offset.
Ident to_offset(protocol::Command& c) {
  return std::visit(
      [](auto& m) -> Ident {
        if constexpr (requires { m.ident; }) {
          m.ident &= ~kLocalRef;
          return m.ident;
        } else {
          return 0;
        }
      },
      c);
}

// "[dp=2, tp=2] over ranks <slice>", and the ranks that hold the value when they are more.
std::string mesh_words(const MeshState& mesh, const MeshState& home) {
  std::vector<std::string> dims;
  for (std::size_t d = 0; d < mesh.names.size(); ++d)
    dims.push_back(fmt::format("{}={}", mesh.names[d], mesh.ranks.sizes()[d]));
  std::string out = fmt::format("[{}] over ranks {}", fmt::join(dims, ", "), mesh.ranks.to_string());
  if (!(home.ranks == mesh.ranks)) out += fmt::format(" (a slice of a value held on ranks {})", home.ranks.to_string());
  return out;
}

// What differs between the recorded mesh and the replay's, for a message that would
// otherwise print two descriptions that look alike.
std::string mesh_difference(const MeshState& want, const MeshState& want_home, const MeshState& got,
                            const MeshState& got_home) {
  std::vector<std::string> parts;
  if (want.names != got.names) {
    parts.push_back(fmt::format("the dimension names are [{}], recorded [{}]", fmt::join(got.names, ", "),
                                fmt::join(want.names, ", ")));
  }
  if (!(want.ranks == got.ranks)) {
    parts.push_back(want.ranks.sizes() == got.ranks.sizes() ? std::string("the ranks differ")
                                                            : std::string("the sizes differ"));
  }
  if (!(want_home.ranks == got_home.ranks))
    parts.push_back("the value is held on other ranks (a slice of another mesh)");
  if (parts.empty()) return {};
  return fmt::format(": {}; replay on a tensor of the recorded mesh (rename or slice it as the recording did)",
                     fmt::join(parts, "; "));
}

}  // namespace

std::uint64_t RecordingContext::slot(Ref r) const {
  if (is_local(r)) return r.id & ~kLocalRef;
  const auto it = captured_index.find(r.id);
  if (it == captured_index.end()) throw Error(fmt::format("recording: ref {} is neither local nor captured", r.id));
  return kCapturedSlot | it->second;
}

RecordingState::~RecordingState() {
  auto ctl = controller.lock();
  if (!ctl || ctl->epoch() != epoch) return;
  ctl->defer_delete(dests, ref);
}

Ref ControllerState::new_tensor_ref() {
  if (recording_) return Ref{kLocalRef | recording_->next_slot++};
  return new_ref();
}

Ident ControllerState::new_ident(const char* label) {
  if (recording_) return kLocalRef | recording_->next_offset++;
  return tracker_.new_ident(label);
}

void ControllerState::refuse_in_recording(std::string_view what) const {
  if (!recording_) return;
  throw UsageError(fmt::format(
      "{} inside a recording (made at {}): a recorded step cannot bring values back to the controller or wait for "
      "the workers; return the tensor from the recorded function and use it after the replay",
      what, describe(recording_->where)));
}

void ControllerState::note_new(const std::shared_ptr<TensorState>& t) {
  if (!recording_) return;
  t->recorded = recording_->serial;
  const std::uint64_t slot = t->ref.id & ~kLocalRef;
  if (recording_->values.size() <= slot) recording_->values.resize(slot + 1);
  recording_->values[slot] = t;
}

void ControllerState::note_use(TensorState& t, std::string_view what) {
  if (t.recorded != 0 && (!recording_ || recording_->serial != t.recorded)) {
    throw UsageError(
        fmt::format("{}: the tensor was made inside a recording and exists on the workers only within a replay; "
                    "return it from the recorded function and use the replay's result",
                    what));
  }
  if (!recording_ || t.recorded != 0) return;
  auto [it, added] = recording_->captured_index.try_emplace(t.ref.id, recording_->captured.size());
  if (added) recording_->captured.push_back({t.shared_from_this(), t.node, t.lent});
}

void ControllerState::append_now(const std::vector<int>& dests, protocol::Command c, std::size_t payload) {
  batcher_.take_failure();
  send_deferred_drops();
  batcher_.append(dests, std::move(c), payload);
}

void ControllerState::capture(const std::vector<int>& dests, protocol::Command c, std::size_t payload) {
  using namespace protocol;
  // The workers get the recording in one message per share of ranks: its arguments
  // together are held to one call's limit.
  if (recording_->payload + payload > payload_limit()) {
    throw UsageError(fmt::format(
        "{}: the recording's commands would carry {} bytes of arguments (host tensors, strings), expected at most {} "
        "in one recording (the workers receive it as one control message, which MPI counts in an int); load the "
        "data on the workers with a kernel, or pass it as an input of the replay (a tensor made by from_host)",
        name(c), recording_->payload + payload, payload_limit()));
  }
  recording_->payload += payload;
  if (!std::holds_alternative<CallFunction>(c) && !std::holds_alternative<Reduce>(c) &&
      !std::holds_alternative<SendTensor>(c) && !std::holds_alternative<BorrowCreate>(c) &&
      !std::holds_alternative<BorrowFirstUse>(c) && !std::holds_alternative<BorrowDrop>(c)) {
    throw Error(fmt::format("recording: {} cannot be recorded", name(c)));
  }
  RecordedCommand rc;
  rc.dests = dests;
  rc.offset = to_offset(c);
  if (rc.offset != 0 && rc.offset <= recording_->described.size()) {
    rc.what = recording_->described[rc.offset - 1].first;
    rc.where = recording_->described[rc.offset - 1].second;
  }
  rc.command = std::move(c);
  rc.payload = payload;
  recording_->commands.push_back(std::move(rc));
}

std::shared_ptr<Node> ControllerState::recorded_node(Ident ident, Words what, const CallSite& where) {
  auto n = std::make_shared<Node>();
  n->ident = ident;
  n->where = where;
  if (ident != 0) {
    const Ident offset = ident & ~kLocalRef;
    if (recording_->described.size() < offset) recording_->described.resize(offset);
    recording_->described[offset - 1] = {what, where};
  }
  n->what = std::move(what);
  return n;
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

namespace {

// The reads, writes and graph flow of command `c` of the recording made in `ctx`.
void classify(const RecordingContext& ctx, RecordedCommand& rc) {
  using namespace protocol;
  auto slot = [&](Ref r) { return ctx.slot(r); };
  std::visit(
      [&](const auto& m) {
        using C = std::decay_t<decltype(m)>;
        if constexpr (std::is_same_v<C, CallFunction>) {
          rc.flow = RecordedCommand::Flow::Node;
          for (const Value& a : m.args) {
            a.for_each_leaf([&](const Value& leaf) {
              if (leaf.is_ref()) rc.reads.push_back(slot(leaf.as_ref()));
            });
          }
          for (Ref r : m.results) rc.writes.push_back(slot(r));
          for (Ref r : m.mutates) rc.writes.push_back(slot(r));
        } else if constexpr (std::is_same_v<C, Reduce> || std::is_same_v<C, SendTensor>) {
          rc.flow = RecordedCommand::Flow::Node;
          rc.reads.push_back(slot(m.tensor));
          rc.writes.push_back(slot(m.result));
        } else if constexpr (std::is_same_v<C, BorrowCreate>) {
          rc.flow = RecordedCommand::Flow::Alias;
          rc.reads.push_back(slot(m.tensor));
          rc.writes.push_back(slot(m.result));
        } else if constexpr (std::is_same_v<C, BorrowDrop>) {
          const std::uint64_t b = slot(m.borrow);
          const TensorState* borrow = (b & kCapturedSlot) == 0 && b < ctx.values.size() ? ctx.values[b].get() : nullptr;
          if (borrow && borrow->borrow.origin && borrow->borrow.is_mutable) {
            rc.flow = RecordedCommand::Flow::Join;
            rc.reads.push_back(b);
            rc.writes.push_back(slot(borrow->borrow.origin->ref));
          }
        }
      },
      rc.command);
}

}  // namespace

std::shared_ptr<RecordingState> ControllerState::record(
    const std::vector<DTensor>& examples, const std::function<std::vector<DTensor>(const std::vector<DTensor>&)>& body,
    const CallSite& where) {
  if (recording_) {
    throw UsageError(fmt::format(
        "record inside a recording (made at {}): recordings do not nest; record the inner steps' calls as part of "
        "this recording (call them in its body), or record them on their own outside it",
        describe(recording_->where)));
  }
  auto ctx = std::make_unique<RecordingContext>();
  ctx->serial = ++recordings_made_;
  ctx->where = where;
  ctx->formals = static_cast<std::uint32_t>(examples.size());
  ctx->next_slot = ctx->formals;
  auto state = std::make_shared<RecordingState>();
  state->controller = weak_from_this();
  state->epoch = epoch_;
  state->where = where;
  state->formals = ctx->formals;
  // The formals: tensors like the examples, named by local slots.
  std::vector<DTensor> formals;
  for (std::size_t i = 0; i < examples.size(); ++i) {
    const DTensor& e = examples[i];
    if (!e.state_) throw UsageError(fmt::format("record: example {} is an undefined DTensor", i));
    note_use(*e.state_, fmt::format("record: example {}", i));
    check_epoch(e.state_->epoch, "tensor");
    auto t = std::make_shared<TensorState>();
    t->controller = weak_from_this();
    t->epoch = epoch_;
    t->ref = Ref{kLocalRef | i};
    t->recorded = ctx->serial;
    t->meta = e.state_->meta;
    t->home = e.state_->home;
    t->stream = e.state_->stream;
    t->node = std::make_shared<Node>();
    ctx->values.push_back(t);
    formals.push_back(DTensor(t, e.mesh_));
    state->inputs.push_back({.meta = t->meta, .home = t->home, .mesh = e.mesh_, .stream = t->stream});
  }
  recording_ = std::move(ctx);
  RecordingContext& c = *recording_;
  // Whatever happens, the captured tensors leave the recording as they entered it.
  struct Restore {
    ControllerState& ctl;
    ~Restore() {
      for (auto& k : ctl.recording_->captured) {
        k.state->node = k.node;
        k.state->lent = k.lent;
      }
      ctl.recording_.reset();
    }
  } restore{*this};
  std::vector<DTensor> results = in_recording(where, [&] { return body(formals); });
  in_recording(where, [&] {
    for (const auto& v : c.values) {
      if (v && v->borrow.origin && !v->borrow.dropped) {
        throw UsageError(
            fmt::format("record: a borrow made at {} on stream '{}' was not dropped; drop it inside the "
                        "recorded function",
                        describe(v->borrow.where), v->stream->name));
      }
    }
    for (std::size_t i = 0; i < results.size(); ++i) {
      const DTensor& r = results[i];
      if (!r.state_) throw UsageError(fmt::format("record: result {} is an undefined DTensor", i));
      note_use(*r.state_, fmt::format("record: result {}", i));
    }
  });
  // Slots and idents are final: classify the commands, then the values.
  for (RecordedCommand& rc : c.commands) classify(c, rc);
  state->locals = c.next_slot - c.formals;
  state->idents = c.next_offset - 1;
  for (auto& k : c.captured) state->captured.push_back({k.state, false});
  std::vector<bool> kept(c.next_slot, false);
  for (const DTensor& r : results) {
    const std::uint64_t slot = c.slot(r.state_->ref);
    if ((slot & kCapturedSlot) == 0) kept[slot] = true;
    state->outputs.push_back(
        {.meta = r.state_->meta, .home = r.state_->home, .mesh = r.mesh_, .stream = r.state_->stream, .slot = slot});
  }
  for (const RecordedCommand& rc : c.commands) {
    for (std::uint64_t w : rc.writes) {
      if (w & kCapturedSlot)
        state->captured[w & ~kCapturedSlot].mutated = true;
      else if (w < c.formals)
        state->inputs[w].mutated = true;
    }
  }
  std::vector<Ref> temporaries;
  for (std::uint64_t s = c.formals; s < c.next_slot; ++s) {
    if (!kept[s]) temporaries.push_back(Ref{kLocalRef | s});
  }
  // Each rank is sent the commands it takes part in: ranks with the same share get one
  // DefineRecording together.
  std::map<int, std::vector<std::size_t>> shares;
  for (std::size_t i = 0; i < c.commands.size(); ++i) {
    for (int r : c.commands[i].dests) shares[r].push_back(i);
  }
  std::map<std::vector<std::size_t>, std::vector<int>> groups;
  for (auto& [rank, share] : shares) {
    groups[share].push_back(rank);
    state->dests.push_back(rank);
  }
  state->ref = new_ref();
  for (const auto& [share, ranks] : groups) {
    protocol::DefineRecording d{.recording = state->ref,
                                .formals = state->formals,
                                .locals = state->locals,
                                .idents = state->idents,
                                .temporaries = temporaries,
                                .commands = {}};
    d.commands.reserve(share.size());
    std::size_t payload = 0;
    for (std::size_t i : share) {
      d.commands.push_back(c.commands[i].command);
      payload += c.commands[i].payload;
    }
    append_now(ranks, std::move(d), payload);
  }
  state->commands = std::move(c.commands);
  state->meshes = std::move(c.meshes);
  state->streams = std::move(c.streams);
  return state;
}

std::vector<DTensor> ControllerState::replay(RecordingState& r, const std::vector<DTensor>& inputs,
                                             const CallSite& where) {
  if (recording_) {
    throw UsageError(fmt::format(
        "a replay of the recording made at {} inside the recording made at {}: recordings do not nest (a replay "
        "is not a command that can be recorded); call the recorded function's body itself inside this recording, "
        "or replay the two recordings one after the other outside it",
        describe(r.where), describe(recording_->where)));
  }
  check_epoch(r.epoch, "recording");
  if (inputs.size() != r.inputs.size()) {
    throw UsageError(fmt::format("replay of the recording made at {}: expected {} input(s), found {}",
                                 describe(r.where), r.inputs.size(), inputs.size()));
  }
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const DTensor& in = inputs[i];
    const RecordedValue& f = r.inputs[i];
    const std::string what = fmt::format("replay of the recording made at {}: input {}", describe(r.where), i);
    if (!in.state_) throw UsageError(what + " is an undefined DTensor");
    const TensorState& t = *in.state_;
    if (!(t.meta == f.meta)) {
      throw UsageError(
          fmt::format("{}: expected {} as recorded, found {}", what, f.meta.to_string(), t.meta.to_string()));
    }
    if (!(in.mesh_->ranks == f.mesh->ranks) || in.mesh_->names != f.mesh->names || !(t.home->ranks == f.home->ranks)) {
      throw UsageError(fmt::format("{}: expected a tensor on the mesh {} as recorded, found one on the mesh {}{}", what,
                                   mesh_words(*f.mesh, *f.home), mesh_words(*in.mesh_, *t.home),
                                   mesh_difference(*f.mesh, *f.home, *in.mesh_, *t.home)));
    }
    if (t.stream != f.stream) {
      throw UsageError(fmt::format("{}: expected a tensor on stream '{}' as recorded, found one on stream '{}'", what,
                                   f.stream->name, t.stream->name));
    }
    use_tensor(*this, *in.state_, *in.mesh_, *t.stream, f.mutated, what);
  }
  for (const auto& k : r.captured) {
    use_tensor(*this, *k.state, *k.state->home, *k.state->stream, k.mutated,
               fmt::format("replay of the recording made at {}: a tensor it captured", describe(r.where)));
  }
  // The replay's refs and idents, then the graph's nodes, command by command.
  const std::uint64_t ref_base = new_refs(r.locals);
  Ident ident_base = 0;
  for (std::uint64_t k = 0; k < r.idents; ++k) {
    const Ident i = tracker_.new_ident();
    if (k == 0) ident_base = i;
  }
  std::vector<std::shared_ptr<Node>> local(r.formals + r.locals), captured(r.captured.size());
  for (std::size_t i = 0; i < inputs.size(); ++i) local[i] = inputs[i].state_->node;
  for (std::size_t i = 0; i < r.captured.size(); ++i) captured[i] = r.captured[i].state->node;
  auto node = [&](std::uint64_t slot) -> std::shared_ptr<Node>& {
    return (slot & kCapturedSlot) ? captured[slot & ~kCapturedSlot] : local[slot];
  };
  std::vector<std::shared_ptr<Node>> reads;
  for (const RecordedCommand& rc : r.commands) {
    switch (rc.flow) {
      case RecordedCommand::Flow::Node: {
        reads.clear();
        for (std::uint64_t s : rc.reads) reads.push_back(node(s));
        const Ident ident = ident_base + rc.offset - 1;
        auto n = make_replay_node(ident, rc.what, rc.where, where, reads);
        for (std::uint64_t s : rc.writes) node(s) = n;
        tracker_.sent(rc.dests, ident);
        break;
      }
      case RecordedCommand::Flow::Alias:
        node(rc.writes[0]) = node(rc.reads[0]);
        break;
      case RecordedCommand::Flow::Join: {
        auto n = graph_.make_node(0, "drop of a mutable borrow", rc.where, {node(rc.writes[0]), node(rc.reads[0])});
        n->replayed_at = where;
        node(rc.writes[0]) = n;
        break;
      }
      case RecordedCommand::Flow::None:
        break;
    }
  }
  std::vector<Ref> actuals;
  actuals.reserve(inputs.size());
  for (const DTensor& in : inputs) actuals.push_back(in.state_->ref);
  append_now(r.dests,
             protocol::CallRecording{
                 .recording = r.ref, .actuals = std::move(actuals), .ref_base = ref_base, .ident_base = ident_base});
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (r.inputs[i].mutated) inputs[i].state_->node = local[i];
  }
  for (std::size_t i = 0; i < r.captured.size(); ++i) {
    if (r.captured[i].mutated) r.captured[i].state->node = captured[i];
  }
  std::vector<DTensor> out;
  out.reserve(r.outputs.size());
  std::unordered_map<std::uint64_t, std::shared_ptr<TensorState>> made;
  for (const RecordedValue& o : r.outputs) {
    if (o.slot & kCapturedSlot) {
      out.push_back(DTensor(r.captured[o.slot & ~kCapturedSlot].state, o.mesh));
    } else if (o.slot < r.formals) {
      out.push_back(DTensor(inputs[o.slot].state_, o.mesh));
    } else {
      auto& t = made[o.slot];
      if (!t) {
        t = std::make_shared<TensorState>();
        t->controller = weak_from_this();
        t->epoch = epoch_;
        t->ref = Ref{ref_base + (o.slot - r.formals)};
        t->meta = o.meta;
        t->home = o.home;
        t->stream = o.stream;
        t->node = local[o.slot];
      }
      out.push_back(DTensor(t, o.mesh));
    }
  }
  return out;
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
