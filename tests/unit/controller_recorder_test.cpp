// The controller's Recorder on its own (src/controller/recorder.hpp): driven the way the
// session drives it, with tensors made by hand and no session, transport or MPI. What a
// recording keeps (local slots, ident offsets, captured tensors, each rank's share), what
// it refuses, and a replay's checks, graph flow and results.
#include <gtest/gtest.h>

#include <utility>
#include <vector>

#include "../support/expect_error.hpp"
#include "common/site.hpp"
#include "controller/recorder.hpp"
#include "controller/state.hpp"
#include "meshrt/internal/controller.hpp"

namespace meshrt {
namespace {

using namespace protocol;
using detail::ControllerState;
using detail::kCapturedSlot;
using detail::MeshState;
using detail::Node;
using detail::RecordedCommand;
using detail::Recorder;
using detail::RecordingState;
using detail::ReplayNodes;
using detail::StreamState;
using detail::TensorState;
using test::expect_contains;
using test::usage_error;

const CallSite kRecordSite = CallSite("step.cpp", "step", 7);
const CallSite kCallSite = CallSite("step.cpp", "step", 9);

Ref local(std::uint64_t slot) {
  return Ref{kLocalRef | slot};
}

std::shared_ptr<MeshState> make_mesh(std::vector<std::string> names, std::int64_t offset = 1) {
  auto m = std::make_shared<MeshState>();
  m->names = std::move(names);
  m->ranks = NDSlice::row_major({2}, offset);
  m->dests = {static_cast<int>(offset), static_cast<int>(offset) + 1};
  return m;
}

std::shared_ptr<StreamState> make_stream(std::string name) {
  auto s = std::make_shared<StreamState>();
  s->name = std::move(name);
  return s;
}

const std::shared_ptr<TensorState>& state_of(const DTensor& t) {
  return ControllerState::state_of(t);
}

// Drives a Recorder as ControllerState does: tensors take their refs and idents from it
// inside a recording, every use passes note_use, and every command is captured.
struct Desk {
  Recorder rec;
  std::shared_ptr<MeshState> mesh = make_mesh({"x"});
  std::shared_ptr<StreamState> stream = make_stream("default");
  std::uint64_t next_ref = 100;
  Ident next_ident = 1;

  std::shared_ptr<TensorState> tensor(Ref ref, TensorMeta meta = {}) {
    auto t = std::make_shared<TensorState>();
    t->ref = ref;
    t->meta = std::move(meta);
    t->home = mesh;
    t->stream = stream;
    t->node() = std::make_shared<Node>();
    return t;
  }
  // A tensor made outside any recording.
  DTensor outside() { return ControllerState::handle(tensor(Ref{next_ref++}), mesh); }
  // A call of `fn` with one result that reads `args` and changes `mutates`, to `dests`,
  // carrying `payload` bytes of arguments.
  DTensor call(const char* fn, const std::vector<DTensor>& args, const std::vector<DTensor>& mutates = {},
               std::vector<int> dests = {1, 2}, std::size_t payload = 0) {
    CallFunction c{.function = fn};
    std::vector<std::shared_ptr<Node>> inputs;
    for (const DTensor& a : args) {
      rec.note_use(*state_of(a), fn);
      c.args.emplace_back(state_of(a)->ref);
    }
    for (const DTensor& m : mutates) {
      rec.note_use(*state_of(m), fn);
      c.mutates.push_back(state_of(m)->ref);
    }
    c.ident = rec.active() ? rec.new_ident() : next_ident++;
    auto t = tensor(rec.active() ? rec.new_ref() : Ref{next_ref++});
    rec.note_new(t);
    t->node() = rec.active() ? rec.node(c.ident, fn, kCallSite) : std::make_shared<Node>();
    for (const DTensor& m : mutates) state_of(m)->node() = t->node();
    c.results = {t->ref};
    if (rec.active()) rec.capture(dests, c, payload);
    return ControllerState::handle(t, mesh);
  }
  // Records `body` on `examples` into a fresh RecordingState.
  std::pair<std::shared_ptr<RecordingState>, std::vector<Recorder::Share>> record(const std::vector<DTensor>& examples,
                                                                                  const Recorder::Body& body) {
    auto state = std::make_shared<RecordingState>();
    state->epoch = 1;
    auto shares = rec.record(*state, examples, body, kRecordSite);
    return {state, std::move(shares)};
  }
};

TEST(Recorder, OutsideARecordingRefusesOnlyTensorsMadeInOne) {
  Desk d;
  EXPECT_FALSE(d.rec.active());
  d.rec.refuse("synchronize");
  d.rec.refuse_record();
  DTensor x = d.outside();
  d.rec.note_use(*state_of(x), "reduce");
  d.rec.note_new(state_of(x));
  EXPECT_EQ(state_of(x)->recorded, 0u);
  state_of(x)->recorded = 3;
  expect_contains(usage_error([&] { d.rec.note_use(*state_of(x), "reduce"); }),
                  "reduce: the tensor was made inside a recording and exists on the workers only within a replay");
  state_of(x)->recorded = 0;
}

TEST(Recorder, KeepsLocalSlotsIdentOffsetsAndTheTensorsItCaptures) {
  Desk d;
  DTensor x = d.outside(), c = d.outside();
  const std::shared_ptr<Node> c_node = state_of(c)->node();
  DTensor leaked;
  auto [state, shares] = d.record({x}, [&](const std::vector<DTensor>& in) {
    EXPECT_TRUE(d.rec.active());
    EXPECT_EQ(state_of(in[0])->ref, local(0));
    DTensor y = d.call("f", {in[0], c});
    DTensor z = d.call("g", {y});
    EXPECT_EQ(state_of(y)->ref, local(1));
    EXPECT_EQ(state_of(z)->ref, local(2));
    // Inside, the captured tensor's node is the recording's; it is restored after.
    state_of(c)->node() = state_of(y)->node();
    leaked = z;
    return std::vector<DTensor>{z};
  });
  EXPECT_FALSE(d.rec.active());
  EXPECT_EQ(state_of(c)->node(), c_node);
  EXPECT_EQ(state->where.line(), kRecordSite.line());
  EXPECT_EQ(state->formals, 1u);
  EXPECT_EQ(state->locals, 2u);
  EXPECT_EQ(state->idents, 2u);
  ASSERT_EQ(state->captured.size(), 1u);
  EXPECT_EQ(state->captured[0].state, state_of(c));
  ASSERT_EQ(state->outputs.size(), 1u);
  EXPECT_EQ(state->outputs[0].slot, 2u);
  EXPECT_EQ(state->dests, (std::vector<int>{1, 2}));
  // The commands: ident offsets, the captured tensor named by its own ref, their words.
  ASSERT_EQ(state->commands.size(), 2u);
  const RecordedCommand& f = state->commands[0];
  EXPECT_EQ(f.offset, 1u);
  EXPECT_EQ(f.what.str(), "f");
  EXPECT_EQ(f.where.line(), kCallSite.line());
  EXPECT_EQ(f.flow, RecordedCommand::Flow::Node);
  EXPECT_EQ(f.reads, (std::vector<std::uint64_t>{0, kCapturedSlot | 0}));
  EXPECT_EQ(f.writes, (std::vector<std::uint64_t>{1}));
  const auto& call = std::get<CallFunction>(f.command);
  EXPECT_EQ(call.ident, 1u);
  EXPECT_EQ(call.args[1].as_ref(), state_of(c)->ref);
  EXPECT_EQ(state->commands[1].offset, 2u);
  // One share: both ranks take part in both commands; y is a temporary.
  ASSERT_EQ(shares.size(), 1u);
  EXPECT_EQ(shares[0].ranks, (std::vector<int>{1, 2}));
  EXPECT_EQ(shares[0].define.formals, 1u);
  EXPECT_EQ(shares[0].define.locals, 2u);
  EXPECT_EQ(shares[0].define.idents, 2u);
  EXPECT_EQ(shares[0].define.temporaries, (std::vector<Ref>{local(1)}));
  EXPECT_EQ(shares[0].define.commands.size(), 2u);
  // A tensor made inside exists only within a replay.
  expect_contains(usage_error([&] { d.rec.note_use(*state_of(leaked), "fetch"); }),
                  "fetch: the tensor was made inside a recording");
}

TEST(Recorder, RanksThatTakePartInTheSameCommandsShareOneDefinition) {
  Desk d;
  DTensor x = d.outside();
  auto [state, shares] = d.record({x}, [&](const std::vector<DTensor>& in) {
    DTensor a = d.call("on_both", {in[0]}, {}, {1, 2}, 10);
    DTensor b = d.call("on_two", {a}, {}, {2}, 5);
    DTensor c = d.call("on_three", {}, {}, {3}, 1);
    return std::vector<DTensor>{b, c};
  });
  EXPECT_EQ(state->dests, (std::vector<int>{1, 2, 3}));
  ASSERT_EQ(shares.size(), 3u);
  // Ordered by each share's commands: rank 1 has [0], rank 2 [0, 1], rank 3 [2].
  EXPECT_EQ(shares[0].ranks, (std::vector<int>{1}));
  EXPECT_EQ(shares[0].define.commands.size(), 1u);
  EXPECT_EQ(shares[0].payload, 10u);
  EXPECT_EQ(shares[1].ranks, (std::vector<int>{2}));
  EXPECT_EQ(shares[1].define.commands.size(), 2u);
  EXPECT_EQ(shares[1].payload, 15u);
  EXPECT_EQ(shares[2].ranks, (std::vector<int>{3}));
  EXPECT_EQ(shares[2].payload, 1u);
  // Every share deletes the same temporaries: a, the one value not returned.
  for (const auto& s : shares) EXPECT_EQ(s.define.temporaries, (std::vector<Ref>{local(1)}));
}

TEST(Recorder, RefusesWaitsNestingAndUndefinedResultsAndEndsTheRecordingAnyway) {
  Desk d;
  DTensor x = d.outside(), c = d.outside();
  const std::shared_ptr<Node> c_node = state_of(c)->node();
  const std::string waited = usage_error([&] {
    d.record({x}, [&](const std::vector<DTensor>& in) {
      d.call("f", {in[0], c});
      state_of(c)->lent().active = 1;
      d.rec.refuse("synchronize");
      return std::vector<DTensor>{};
    });
  });
  expect_contains(waited, "synchronize inside a recording (made at step.cpp:7 (step)): a recorded step cannot");
  expect_contains(waited, "(in the recording made at step.cpp:7 (step))");
  EXPECT_FALSE(d.rec.active());
  EXPECT_EQ(state_of(c)->node(), c_node);
  EXPECT_EQ(state_of(c)->lent().active, 0);

  expect_contains(usage_error([&] {
                    d.record({x}, [&](const std::vector<DTensor>&) {
                      d.rec.refuse_record();
                      return std::vector<DTensor>{};
                    });
                  }),
                  "record inside a recording (made at step.cpp:7 (step)): recordings do not nest");
  expect_contains(
      usage_error([&] { d.record({x}, [&](const std::vector<DTensor>&) { return std::vector<DTensor>{DTensor()}; }); }),
      "record: result 0 is an undefined DTensor");
  EXPECT_FALSE(d.rec.active());
}

TEST(Recorder, RefusesABorrowLeftOpen) {
  Desk d;
  DTensor x = d.outside();
  const std::string open = usage_error([&] {
    d.record({x}, [&](const std::vector<DTensor>& in) {
      DTensor b = d.call("borrow", {in[0]});
      state_of(b)->borrow.origin = state_of(in[0]);
      state_of(b)->borrow.where = kCallSite;
      return std::vector<DTensor>{};
    });
  });
  expect_contains(open, "record: a borrow made at step.cpp:9 (step) on stream 'default' was not dropped");
}

TEST(Recorder, CaptureRefusesWhatCannotBeRecordedAndArgumentsPastOneMessage) {
  Desk d;
  DTensor x = d.outside();
  const std::string fetch = test::error_of<Error>([&] {
    d.record({x}, [&](const std::vector<DTensor>&) {
      d.rec.capture({1}, FetchValue{}, 0);
      return std::vector<DTensor>{};
    });
  });
  expect_contains(fetch, "recording: FetchValue cannot be recorded");
  detail::set_payload_limit(100);
  const std::string big = usage_error([&] {
    d.record({x}, [&](const std::vector<DTensor>& in) {
      d.call("f", {in[0]}, {}, {1}, 60);
      d.call("g", {in[0]}, {}, {1}, 60);
      return std::vector<DTensor>{};
    });
  });
  detail::set_payload_limit(0);
  expect_contains(big, "the recording's commands would carry 120 bytes of arguments");
  expect_contains(big, "expected at most 100 in one recording");
}

TEST(Recorder, AReplayChecksItsInputsAgainstTheRecording) {
  Desk d;
  DTensor x = d.outside();
  auto [state, shares] =
      d.record({x}, [&](const std::vector<DTensor>& in) { return std::vector<DTensor>{d.call("f", {in[0]})}; });
  const RecordingState& r = *state;
  Recorder::check_arity(r, 1);
  EXPECT_EQ(Recorder::check_input(r, 0, x), "replay of the recording made at step.cpp:7 (step): input 0");
  expect_contains(usage_error([&] { Recorder::check_arity(r, 2); }), "expected 1 input(s), found 2");
  expect_contains(usage_error([&] { Recorder::check_input(r, 0, DTensor()); }), "input 0 is an undefined DTensor");

  auto other_meta = d.tensor(Ref{300}, TensorMeta({4}, DType::Float32));
  expect_contains(usage_error([&] { Recorder::check_input(r, 0, ControllerState::handle(other_meta, d.mesh)); }),
                  "as recorded, found");
  auto renamed = d.tensor(Ref{301});
  auto y_mesh = make_mesh({"y"});
  renamed->home = y_mesh;
  expect_contains(usage_error([&] { Recorder::check_input(r, 0, ControllerState::handle(renamed, y_mesh)); }),
                  "the dimension names are [y], recorded [x]");
  auto elsewhere = d.tensor(Ref{302});
  elsewhere->stream = make_stream("side");
  expect_contains(usage_error([&] { Recorder::check_input(r, 0, ControllerState::handle(elsewhere, d.mesh)); }),
                  "expected a tensor on stream 'default' as recorded, found one on stream 'side'");

  expect_contains(usage_error([&] {
                    d.record({x}, [&](const std::vector<DTensor>&) {
                      d.rec.refuse_replay(r);
                      return std::vector<DTensor>{};
                    });
                  }),
                  "a replay of the recording made at step.cpp:7 (step) inside the recording made at");
  d.rec.refuse_replay(r);
}

TEST(Recorder, AReplayFollowsTheRecordedSlotsAndMakesTheResults) {
  Desk d;
  DTensor x = d.outside(), c = d.outside();
  auto [state, shares] = d.record({x}, [&](const std::vector<DTensor>& in) {
    DTensor y = d.call("f", {in[0], c});      // slot 1, offset 1
    auto borrow = d.tensor(d.rec.new_ref());  // slot 2: a mutable borrow of y
    d.rec.note_new(borrow);
    borrow->borrow.origin = state_of(y);
    borrow->borrow.is_mutable = true;
    d.rec.capture({1, 2}, BorrowCreate{.result = borrow->ref, .tensor = state_of(y)->ref}, 0);
    DTensor b = ControllerState::handle(borrow, d.mesh);
    d.call("inc", {}, {b});  // slot 3, offset 2: changes the borrow
    state_of(b)->borrow.dropped = true;
    d.rec.capture({1, 2}, BorrowDrop{state_of(b)->ref}, 0);
    d.call("scale", {}, {in[0]});  // slot 4, offset 3: changes the input
    return std::vector<DTensor>{y, y, in[0], c};
  });
  const RecordingState& r = *state;
  EXPECT_TRUE(r.inputs[0].mutated);
  EXPECT_FALSE(r.captured[0].mutated);
  ASSERT_EQ(r.commands.size(), 5u);
  EXPECT_EQ(r.commands[1].flow, RecordedCommand::Flow::Alias);
  EXPECT_EQ(r.commands[3].flow, RecordedCommand::Flow::Join);

  // A replay on a: each invocation's node from the nodes it reads, as the session makes it.
  DTensor a = d.outside();
  const std::shared_ptr<Node> a_node = state_of(a)->node(), c_node = state_of(c)->node();
  ReplayNodes nodes = Recorder::nodes_before(r, {a});
  std::vector<std::shared_ptr<Node>> made;
  std::vector<std::vector<std::shared_ptr<Node>>> reads_of;
  std::shared_ptr<Node> joined_origin, joined_borrow, joined;
  Recorder::flow(
      r, nodes,
      [&](const RecordedCommand& rc, std::span<const std::shared_ptr<Node>> reads) {
        auto n = std::make_shared<Node>();
        n->ident = 40 + rc.offset - 1;
        made.push_back(n);
        reads_of.emplace_back(reads.begin(), reads.end());
        return n;
      },
      [&](const RecordedCommand&, const std::shared_ptr<Node>& origin, const std::shared_ptr<Node>& borrow) {
        joined_origin = origin;
        joined_borrow = borrow;
        joined = std::make_shared<Node>();
        return joined;
      });
  ASSERT_EQ(made.size(), 3u);
  EXPECT_EQ(reads_of[0], (std::vector<std::shared_ptr<Node>>{a_node, c_node}));
  EXPECT_EQ(made[0]->ident, 40u);
  EXPECT_EQ(made[2]->ident, 42u);
  // The borrow aliased y's node; the drop joins y's node with what the borrow's user made,
  // and y has the joined node from there on.
  EXPECT_EQ(joined_origin, made[0]);
  EXPECT_EQ(joined_borrow, made[1]);

  const std::vector<DTensor> out = Recorder::results(r, {a}, nodes, 500);
  ASSERT_EQ(out.size(), 4u);
  EXPECT_EQ(state_of(out[0])->ref, Ref{500});  // slot 1: ref_base + 1 - formals
  EXPECT_EQ(state_of(out[0])->node(), joined);
  EXPECT_EQ(state_of(out[1]), state_of(out[0]));  // one slot, one tensor
  EXPECT_EQ(state_of(out[2]), state_of(a));
  EXPECT_EQ(state_of(a)->node(), made[2]);  // the input the step changes takes its new node
  EXPECT_EQ(state_of(out[3]), state_of(c));
  EXPECT_EQ(state_of(c)->node(), c_node);
}

}  // namespace
}  // namespace meshrt
