// The recorder: the recording being made, what it becomes, and a replay's share of the
// controller's books (controller/recorder.hpp).
#include "controller/recorder.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <map>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <variant>

#include "common/site.hpp"
#include "controller/batcher.hpp"
#include "controller/state.hpp"

namespace meshrt::detail {

using protocol::kLocalRef;

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

namespace {

bool is_local(Ref r) {
  return (r.id & kLocalRef) != 0;
}

const std::shared_ptr<TensorState>& state_of(const DTensor& t) {
  return ControllerState::state_of(t);
}
const std::shared_ptr<MeshState>& mesh_of(const DTensor& t) {
  return ControllerState::mesh_of(t);
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
        } else if constexpr (std::is_same_v<C, Reduce> || std::is_same_v<C, SendTensor> ||
                             std::is_same_v<C, Collective>) {
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

Recorder::Recorder() = default;
Recorder::~Recorder() = default;

// ------------------------------------------------------------------ while a recording is made

void Recorder::refuse(std::string_view what) const {
  if (!ctx_) return;
  throw UsageError(fmt::format(
      "{} inside a recording (made at {}): a recorded step cannot bring values back to the controller or wait for "
      "the workers; return the tensor from the recorded function and use it after the replay",
      what, describe(ctx_->where)));
}

// A replay updates each input's and captured tensor's node on its own: one storage shared
// by two tensors of a step would keep only one of the step's writes (docs/guide.md
// "Declared views").
void Recorder::refuse_views(std::string_view function) const {
  if (!ctx_) return;
  throw UsageError(fmt::format(
      "{} inside a recording (made at {}): its shape function declares views, which a recorded step cannot make; "
      "make the view before record() and pass it to the step as an input",
      function, describe(ctx_->where)));
}

Ref Recorder::new_ref() {
  return Ref{kLocalRef | ctx_->next_slot++};
}

Ident Recorder::new_ident() {
  return kLocalRef | ctx_->next_offset++;
}

void Recorder::note_new(const std::shared_ptr<TensorState>& t) {
  if (!ctx_) return;
  t->recorded = ctx_->serial;
  const std::uint64_t slot = t->ref.id & ~kLocalRef;
  if (ctx_->values.size() <= slot) ctx_->values.resize(slot + 1);
  ctx_->values[slot] = t;
}

void Recorder::note_use(TensorState& t, std::string_view what) {
  if (t.recorded != 0 && (!ctx_ || ctx_->serial != t.recorded)) {
    throw UsageError(
        fmt::format("{}: the tensor was made inside a recording and exists on the workers only within a replay; "
                    "return it from the recorded function and use the replay's result",
                    what));
  }
  if (!ctx_ || t.recorded != 0) return;
  auto [it, added] = ctx_->captured_index.try_emplace(t.ref.id, ctx_->captured.size());
  if (!added) return;
  if (t.is_shared()) {
    for (const auto& k : ctx_->captured) {
      if (&k.state->storage() == &t.storage()) {
        ctx_->captured_index.erase(it);
        throw UsageError(fmt::format(
            "{}: the recording made at {} already uses a declared view of this tensor's storage (or its base): a "
            "recorded step may use one tensor of a storage; pass the one it needs, or copy it (meshrt.copy)",
            what, describe(ctx_->where)));
      }
    }
  }
  ctx_->captured.push_back({t.shared_from_this(), t.node(), t.lent()});
}

void Recorder::capture(const std::vector<int>& dests, protocol::Command c, std::size_t payload) {
  using namespace protocol;
  // The workers get the recording in one message per share of ranks: its arguments
  // together are held to one call's limit.
  if (ctx_->payload + payload > payload_limit()) {
    throw UsageError(fmt::format(
        "{}: the recording's commands would carry {} bytes of arguments (host tensors, strings), expected at most {} "
        "in one recording (the workers receive it as one control message, which MPI counts in an int); load the "
        "data on the workers with a kernel, or pass it as an input of the replay (a tensor made by from_host)",
        name(c), ctx_->payload + payload, payload_limit()));
  }
  ctx_->payload += payload;
  if (!std::holds_alternative<CallFunction>(c) && !std::holds_alternative<Reduce>(c) &&
      !std::holds_alternative<Collective>(c) && !std::holds_alternative<SendTensor>(c) &&
      !std::holds_alternative<BorrowCreate>(c) && !std::holds_alternative<BorrowFirstUse>(c) &&
      !std::holds_alternative<BorrowDrop>(c)) {
    throw Error(fmt::format("recording: {} cannot be recorded", name(c)));
  }
  RecordedCommand rc;
  rc.dests = dests;
  rc.offset = to_offset(c);
  if (rc.offset != 0 && rc.offset <= ctx_->described.size()) {
    rc.what = ctx_->described[rc.offset - 1].first;
    rc.where = ctx_->described[rc.offset - 1].second;
  }
  rc.command = std::move(c);
  rc.payload = payload;
  ctx_->commands.push_back(std::move(rc));
}

std::shared_ptr<Node> Recorder::node(Ident ident, Words what, const CallSite& where) {
  auto n = std::make_shared<Node>();
  n->ident = ident;
  n->where = where;
  if (ident != 0) {
    const Ident offset = ident & ~kLocalRef;
    if (ctx_->described.size() < offset) ctx_->described.resize(offset);
    ctx_->described[offset - 1] = {what, where};
  }
  n->what = std::move(what);
  return n;
}

void Recorder::keep(std::shared_ptr<MeshState> mesh) {
  ctx_->meshes.push_back(std::move(mesh));
}

void Recorder::keep(std::shared_ptr<StreamState> stream) {
  ctx_->streams.push_back(std::move(stream));
}

// ------------------------------------------------------------------ making one

void Recorder::refuse_record() const {
  if (!ctx_) return;
  throw UsageError(fmt::format(
      "record inside a recording (made at {}): recordings do not nest; record the inner steps' calls as part of "
      "this recording (call them in its body), or record them on their own outside it",
      describe(ctx_->where)));
}

std::vector<Recorder::Share> Recorder::record(RecordingState& state, const std::vector<DTensor>& examples,
                                              const Body& body, const CallSite& where) {
  std::vector<DTensor> formals = begin(state, examples, where);
  // Whatever happens, the captured tensors leave the recording as they entered it.
  struct Restore {
    Recorder& rec;
    ~Restore() {
      for (auto& k : rec.ctx_->captured) {
        k.state->node() = k.node;
        k.state->lent() = k.lent;
      }
      rec.ctx_.reset();
    }
  } restore{*this};
  std::vector<DTensor> results = in_recording(where, [&] { return body(formals); });
  in_recording(where, [&] { check_results(results); });
  return finish(state, results);
}

// Starts the recording: the formals are tensors like the examples, named by local slots.
std::vector<DTensor> Recorder::begin(RecordingState& state, const std::vector<DTensor>& examples,
                                     const CallSite& where) {
  auto ctx = std::make_unique<RecordingContext>();
  ctx->serial = ++made_;
  ctx->where = where;
  ctx->formals = static_cast<std::uint32_t>(examples.size());
  ctx->next_slot = ctx->formals;
  state.where = where;
  state.formals = ctx->formals;
  std::vector<DTensor> formals;
  for (std::size_t i = 0; i < examples.size(); ++i) {
    const TensorState& e = *state_of(examples[i]);
    auto t = std::make_shared<TensorState>();
    t->controller = state.controller;
    t->epoch = state.epoch;
    t->ref = Ref{kLocalRef | i};
    t->recorded = ctx->serial;
    t->meta = e.meta;
    t->home = e.home;
    t->stream = e.stream;
    t->node() = std::make_shared<Node>();
    ctx->values.push_back(t);
    formals.push_back(ControllerState::handle(t, mesh_of(examples[i])));
    state.inputs.push_back({.meta = t->meta, .home = t->home, .mesh = mesh_of(examples[i]), .stream = t->stream});
  }
  ctx_ = std::move(ctx);
  return formals;
}

// The recorded function returns defined tensors and leaves no borrow open.
void Recorder::check_results(const std::vector<DTensor>& results) {
  for (const auto& v : ctx_->values) {
    if (v && v->borrow.origin && !v->borrow.dropped) {
      throw UsageError(
          fmt::format("record: a borrow made at {} on stream '{}' was not dropped; drop it inside the "
                      "recorded function",
                      describe(v->borrow.where), v->stream->name));
    }
  }
  for (std::size_t i = 0; i < results.size(); ++i) {
    const std::shared_ptr<TensorState>& r = state_of(results[i]);
    if (!r) throw UsageError(fmt::format("record: result {} is an undefined DTensor", i));
    note_use(*r, fmt::format("record: result {}", i));
  }
}

// Slots and idents are final: the commands' flow, the values, and what each rank is sent.
std::vector<Recorder::Share> Recorder::finish(RecordingState& state, const std::vector<DTensor>& results) {
  RecordingContext& c = *ctx_;
  for (RecordedCommand& rc : c.commands) classify(c, rc);
  state.locals = c.next_slot - c.formals;
  state.idents = c.next_offset - 1;
  for (auto& k : c.captured) state.captured.push_back({k.state, false});
  std::vector<bool> kept(c.next_slot, false);
  for (const DTensor& r : results) {
    const TensorState& t = *state_of(r);
    const std::uint64_t slot = c.slot(t.ref);
    if ((slot & kCapturedSlot) == 0) kept[slot] = true;
    state.outputs.push_back({.meta = t.meta, .home = t.home, .mesh = mesh_of(r), .stream = t.stream, .slot = slot});
  }
  for (const RecordedCommand& rc : c.commands) {
    for (std::uint64_t w : rc.writes) {
      if (w & kCapturedSlot)
        state.captured[w & ~kCapturedSlot].mutated = true;
      else if (w < c.formals)
        state.inputs[w].mutated = true;
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
    state.dests.push_back(rank);
  }
  std::vector<Share> out;
  for (const auto& [share, ranks] : groups) {
    Share& s = out.emplace_back(Share{.ranks = ranks,
                                      .define = {.recording = Ref{},
                                                 .formals = state.formals,
                                                 .locals = state.locals,
                                                 .idents = state.idents,
                                                 .temporaries = temporaries,
                                                 .commands = {}},
                                      .payload = 0});
    s.define.commands.reserve(share.size());
    for (std::size_t i : share) {
      s.define.commands.push_back(c.commands[i].command);
      s.payload += c.commands[i].payload;
    }
  }
  state.commands = std::move(c.commands);
  state.meshes = std::move(c.meshes);
  state.streams = std::move(c.streams);
  return out;
}

// ------------------------------------------------------------------ replaying one

void Recorder::refuse_replay(const RecordingState& r) const {
  if (!ctx_) return;
  throw UsageError(fmt::format(
      "a replay of the recording made at {} inside the recording made at {}: recordings do not nest (a replay "
      "is not a command that can be recorded); call the recorded function's body itself inside this recording, "
      "or replay the two recordings one after the other outside it",
      describe(r.where), describe(ctx_->where)));
}

void Recorder::check_arity(const RecordingState& r, std::size_t inputs) {
  if (inputs != r.inputs.size()) {
    throw UsageError(fmt::format("replay of the recording made at {}: expected {} input(s), found {}",
                                 describe(r.where), r.inputs.size(), inputs));
  }
}

std::string Recorder::check_input(const RecordingState& r, std::size_t i, const DTensor& in) {
  const RecordedValue& f = r.inputs[i];
  std::string what = fmt::format("replay of the recording made at {}: input {}", describe(r.where), i);
  if (!state_of(in)) throw UsageError(what + " is an undefined DTensor");
  const TensorState& t = *state_of(in);
  const MeshState& mesh = *mesh_of(in);
  if (!(t.meta == f.meta)) {
    throw UsageError(
        fmt::format("{}: expected {} as recorded, found {}", what, f.meta.to_string(), t.meta.to_string()));
  }
  if (!(mesh.ranks == f.mesh->ranks) || mesh.names != f.mesh->names || !(t.home->ranks == f.home->ranks)) {
    throw UsageError(fmt::format("{}: expected a tensor on the mesh {} as recorded, found one on the mesh {}{}", what,
                                 mesh_words(*f.mesh, *f.home), mesh_words(mesh, *t.home),
                                 mesh_difference(*f.mesh, *f.home, mesh, *t.home)));
  }
  if (t.stream != f.stream) {
    throw UsageError(fmt::format("{}: expected a tensor on stream '{}' as recorded, found one on stream '{}'", what,
                                 f.stream->name, t.stream->name));
  }
  return what;
}

void Recorder::check_storages(const RecordingState& r, const std::vector<DTensor>& inputs) {
  std::vector<std::pair<const TensorState*, std::string>> seen;
  const auto add = [&](TensorState& t, std::string what) {
    if (!t.is_shared()) return;
    for (const auto& [other, other_what] : seen) {
      if (other != &t && &other->storage() == &t.storage()) {
        throw UsageError(fmt::format(
            "replay of the recording made at {}: {} and {} share one storage (a declared view and its base); a "
            "replay updates each of its tensors on its own, so it takes at most one tensor of a storage; copy one "
            "of them (meshrt.copy)",
            describe(r.where), other_what, what));
      }
    }
    seen.emplace_back(&t, std::move(what));
  };
  for (std::size_t i = 0; i < inputs.size(); ++i) add(*state_of(inputs[i]), fmt::format("input {}", i));
  for (std::size_t i = 0; i < r.captured.size(); ++i) add(*r.captured[i].state, fmt::format("captured tensor {}", i));
}

ReplayNodes Recorder::nodes_before(const RecordingState& r, const std::vector<DTensor>& inputs) {
  ReplayNodes nodes{.local = std::vector<std::shared_ptr<Node>>(r.formals + r.locals),
                    .captured = std::vector<std::shared_ptr<Node>>(r.captured.size())};
  for (std::size_t i = 0; i < inputs.size(); ++i) nodes.local[i] = state_of(inputs[i])->node();
  for (std::size_t i = 0; i < r.captured.size(); ++i) nodes.captured[i] = r.captured[i].state->node();
  return nodes;
}

std::vector<DTensor> Recorder::results(const RecordingState& r, const std::vector<DTensor>& inputs, ReplayNodes& nodes,
                                       std::uint64_t ref_base) {
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (r.inputs[i].mutated) state_of(inputs[i])->node() = nodes.local[i];
  }
  for (std::size_t i = 0; i < r.captured.size(); ++i) {
    if (r.captured[i].mutated) r.captured[i].state->node() = nodes.captured[i];
  }
  std::vector<DTensor> out;
  out.reserve(r.outputs.size());
  std::unordered_map<std::uint64_t, std::shared_ptr<TensorState>> made;
  for (const RecordedValue& o : r.outputs) {
    if (o.slot & kCapturedSlot) {
      out.push_back(ControllerState::handle(r.captured[o.slot & ~kCapturedSlot].state, o.mesh));
    } else if (o.slot < r.formals) {
      out.push_back(ControllerState::handle(state_of(inputs[o.slot]), o.mesh));
    } else {
      auto& t = made[o.slot];
      if (!t) {
        t = std::make_shared<TensorState>();
        t->controller = r.controller;
        t->epoch = r.epoch;
        t->ref = Ref{ref_base + (o.slot - r.formals)};
        t->meta = o.meta;
        t->home = o.home;
        t->stream = o.stream;
        t->node() = nodes.local[o.slot];
      }
      out.push_back(ControllerState::handle(t, o.mesh));
    }
  }
  return out;
}

}  // namespace meshrt::detail
