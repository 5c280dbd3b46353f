// The worker's operation in flight (src/worker/in_flight.hpp) against a fake Pending: the
// completion mode per job shape, where the loop waits between polls, and how a completed,
// broken or failed operation lands in the environment and the replies.
#include <gtest/gtest.h>

#include <variant>

#include "meshrt/error.hpp"
#include "meshrt/internal/control.hpp"
#include "worker/env.hpp"
#include "worker/in_flight.hpp"
#include "worker/monitor.hpp"
#include "worker/reporter.hpp"

namespace meshrt::detail {
namespace {

using namespace protocol;

class FakePending : public Pending {
 public:
  bool test() override {
    if (throws) throw SystemError("MPI_Test failed");
    if (ready && !finished()) finish(std::move(outcome));
    return ready;
  }
  void idle(std::chrono::microseconds at_most) override { idled.push_back(at_most); }
  std::string describe() const override { return "fake all_reduce"; }

  bool ready = false;
  bool throws = false;
  Outcome outcome;
  std::vector<std::chrono::microseconds> idled;
};

WorkerOptions options(bool block_in_mpi, int status_parent = kNoStatusTree) {
  WorkerOptions o;
  o.rank = 1;
  o.block_in_mpi = block_in_mpi;
  o.status_parent = status_parent;
  o.status_interval_seconds = 1000;
  return o;
}

struct Rig {
  explicit Rig(WorkerOptions o) : opts(std::move(o)) {}
  WorkerOptions opts;
  std::shared_ptr<control::MemoryNetwork> net = control::MemoryNetwork::create();
  std::shared_ptr<control::Transport> worker = net->endpoint(1);
  Monitor monitor{1, 16};
  Env env{1};
  Reporter reporter{*worker, monitor, opts};
  InFlight in_flight{monitor, opts};

  FakePending& start(std::optional<std::size_t> cpu_bytes, Ident ident = 5) {
    auto op = std::make_unique<FakePending>();
    FakePending& fake = *op;
    // It reads ref 9 and writes ref 10, on stream 3.
    in_flight.start(std::move(op), Ref{10}, 0, "Reduce", ident, cpu_bytes,
                    Footprint{.stream = 3, .reads = {9}, .writes = {10}});
    return fake;
  }
};

Tensor scalar(float x) {
  Tensor t = Tensor::zeros(TensorMeta({}, DType::Float32));
  t.data<float>()[0] = x;
  return t;
}

TEST(WorkerInFlight, BlocksInMpiOnlyWithACorePerRankAndNoStatusTree) {
  Monitor monitor(1, 4);
  EXPECT_EQ(InFlight(monitor, options(true)).cpu_completion(), Completion::Blocking);
  EXPECT_EQ(InFlight(monitor, options(false)).cpu_completion(), Completion::Auto);
  EXPECT_EQ(InFlight(monitor, options(true, kStatusToController)).cpu_completion(), Completion::Auto);
}

TEST(WorkerInFlight, AJobOnTheCommThreadIsAwaitedInItsIdleForAtMostTheControlSleep) {
  Rig rig(options(false));
  FakePending& big = rig.start(kThreadMinBytes);
  Backoff flight(kInFlight);
  rig.in_flight.pause(flight);
  ASSERT_EQ(big.idled.size(), 1u);
  EXPECT_EQ(big.idled[0], kControl.max_sleep);
}

TEST(WorkerInFlight, ACompletedOperationDefinesItsResultAndCompletesItsIdent) {
  Rig rig(options(false));
  FakePending& op = rig.start(std::nullopt, 5);
  EXPECT_FALSE(rig.in_flight.poll(rig.env, rig.reporter));
  EXPECT_TRUE(rig.in_flight.active());
  op.outcome.tensor = scalar(3);
  op.ready = true;
  EXPECT_TRUE(rig.in_flight.poll(rig.env, rig.reporter));
  EXPECT_FALSE(rig.in_flight.active());
  const Found<Tensor> result = rig.env.find<Tensor>(Ref{10}, "result");
  ASSERT_TRUE(result);
  EXPECT_EQ(result->item(), 3.0);
  EXPECT_EQ(rig.reporter.reportable(), 6u);

  // A broken one (an input depended on a failure): its result is the marker.
  FakePending& broken = rig.start(std::nullopt, 7);
  broken.outcome.broken = DependentOnError{4};
  broken.ready = true;
  EXPECT_TRUE(rig.in_flight.poll(rig.env, rig.reporter));
  EXPECT_EQ(std::get<DependentOnError>(rig.env.input(Ref{10})).ident, 4u);
  EXPECT_EQ(rig.reporter.reportable(), 8u);
  EXPECT_EQ(rig.net->waiting(0, control::Tag::Reply), 0u) << "no failure to report";
}

// Later commands run while it is in flight only on another stream and away from its values;
// another collective, an exit, a borrow of what it touches wait.
TEST(WorkerInFlight, AdmitsOnlyCommandsThatDoNotDependOnIt) {
  Rig rig(options(false));
  (void)rig.start(std::nullopt, 5);
  auto call = [](std::uint64_t stream, std::vector<Value> args, std::vector<Ref> mutates = {}) {
    return Command(CallFunction{.ident = 6,
                                .results = {Ref{20}},
                                .mutates = std::move(mutates),
                                .function = "f",
                                .args = std::move(args),
                                .stream = Ref{stream},
                                .mesh = Ref{1}});
  };
  const InFlight& f = rig.in_flight;
  EXPECT_TRUE(f.admits(call(4, {Value(Ref{11}), Value(2.0)})));
  EXPECT_TRUE(f.admits(call(4, {Value(Ref{9})}))) << "reading what it reads";
  EXPECT_FALSE(f.admits(call(3, {Value(Ref{11})}))) << "its stream";
  EXPECT_FALSE(f.admits(call(4, {Value::list({Value(1), Value(Ref{10})})}))) << "its result, nested in a list";
  EXPECT_FALSE(f.admits(call(4, {}, {Ref{9}}))) << "mutating its input";
  EXPECT_TRUE(f.admits(
      Command(FetchValue{.ident = 6, .mutates = {}, .function = {}, .value = Value(Ref{11}), .stream = Ref{4}})));
  EXPECT_FALSE(f.admits(
      Command(FetchValue{.ident = 6, .mutates = {}, .function = {}, .value = Value(Ref{10}), .stream = Ref{4}})));
  EXPECT_TRUE(f.admits(Command(DeleteRefs{.refs = {Ref{11}, Ref{12}}})));
  EXPECT_FALSE(f.admits(Command(DeleteRefs{.refs = {Ref{11}, Ref{9}}}))) << "deleting its input";
  EXPECT_TRUE(f.admits(Command(BorrowCreate{
      .result = Ref{30}, .tensor = Ref{11}, .from_stream = Ref{3}, .to_stream = Ref{4}, .already_borrowed = false})));
  EXPECT_FALSE(f.admits(Command(BorrowCreate{
      .result = Ref{30}, .tensor = Ref{10}, .from_stream = Ref{3}, .to_stream = Ref{4}, .already_borrowed = false})));
  EXPECT_FALSE(f.admits(Command(BorrowDrop{.borrow = Ref{9}}))) << "the borrow it reduces";
  EXPECT_TRUE(f.admits(Command(RequestStatus{.ident = 6})));
  EXPECT_TRUE(f.admits(Command(CreateStream{.result = Ref{40}, .is_default = false})));
  EXPECT_FALSE(f.admits(Command(CreateDeviceMesh{.result = Ref{41}, .names = {"x"}, .ranks = NDSlice::row_major({1})})))
      << "a mesh's creation waits for its members";
  EXPECT_FALSE(f.admits(Command(Reduce{.result = Ref{21},
                                       .tensor = Ref{11},
                                       .factory = TensorMeta({}, DType::Float32),
                                       .mesh = Ref{1},
                                       .stream = Ref{4},
                                       .dim = "x"})))
      << "one operation in flight";
  EXPECT_FALSE(f.admits(Command(Exit{})));
}

// While it is in flight, later commands passing their idents claim nothing past it: the
// controller's completion rule.
TEST(WorkerInFlight, ItsIdentIsHeldBackWhileLaterCommandsComplete) {
  Rig rig(options(false));
  FakePending& op = rig.start(std::nullopt, 5);
  rig.reporter.hold(5);
  rig.reporter.passed(6);
  rig.reporter.passed(7);
  EXPECT_EQ(rig.reporter.reportable(), 5u);
  op.outcome.tensor = scalar(1);
  op.ready = true;
  EXPECT_TRUE(rig.in_flight.poll(rig.env, rig.reporter));
  EXPECT_EQ(rig.reporter.reportable(), 8u);
}

// The flight recorder's running command is the operation in flight again once a command
// that ran meanwhile finishes, and nothing once the operation ends: a report shows what the
// rank waits in.
TEST(WorkerInFlight, TheRecorderShowsTheOperationAgainAfterACommandRanMeanwhile) {
  Rig rig(options(false));
  auto queue = [&](const char* kind) {
    return rig.monitor.queued(std::chrono::steady_clock::now(), [&](CommandRecord& r) { r.kind = kind; });
  };
  const std::uint64_t reduce = queue("Reduce");
  const std::uint64_t call = queue("CallFunction");
  rig.monitor.running(reduce);
  auto op = std::make_unique<FakePending>();
  FakePending& fake = *op;
  rig.in_flight.start(std::move(op), Ref{10}, reduce, "Reduce", 5, std::nullopt, Footprint{.stream = 3});
  rig.monitor.running(call);
  EXPECT_EQ(rig.monitor.state()["current"]["kind"], "CallFunction");
  rig.monitor.finished(call, false);
  EXPECT_EQ(rig.monitor.state()["current"]["kind"], "Reduce");
  fake.outcome.tensor = scalar(1);
  fake.ready = true;
  EXPECT_TRUE(rig.in_flight.poll(rig.env, rig.reporter));
  EXPECT_TRUE(rig.monitor.state()["current"].is_null());
}

TEST(WorkerInFlight, AFailedOperationMarksItsResultAndIsReportedWithItsIdent) {
  Rig rig(options(false));
  FakePending& op = rig.start(std::nullopt, 5);
  op.throws = true;
  EXPECT_TRUE(rig.in_flight.poll(rig.env, rig.reporter));
  EXPECT_FALSE(rig.in_flight.active());
  EXPECT_EQ(std::get<DependentOnError>(rig.env.input(Ref{10})).ident, 5u);
  EXPECT_EQ(rig.reporter.reportable(), 6u);
  int from = -1;
  const auto bytes = rig.net->wait_for(0, control::Tag::Reply, std::chrono::seconds(5), &from);
  ASSERT_TRUE(bytes.has_value());
  const Reply r = decode_reply(*bytes);
  ASSERT_TRUE(std::holds_alternative<RemoteFunctionFailed>(r));
  const auto& f = std::get<RemoteFunctionFailed>(r);
  EXPECT_EQ(f.ident, 5u);
  EXPECT_EQ(f.rank, 1);
  EXPECT_EQ(f.function, "Reduce");
  EXPECT_EQ(f.exception_type, "meshrt::SystemError");
  EXPECT_NE(f.error.find("fake all_reduce failed on rank 1: "), std::string::npos) << f.error;
  EXPECT_NE(f.error.find("MPI_Test failed"), std::string::npos) << f.error;
}

// What a SIGTERM report shows (Monitor::recent): the newest commands that ran, oldest
// first, and a count of those queued behind them, not the queued ones themselves.
TEST(WorkerMonitor, RecentShowsTheCommandsThatRanAndCountsTheQueued) {
  Monitor monitor(3, 16);
  std::vector<std::uint64_t> seqs;
  for (int i = 0; i < 10; ++i) {
    seqs.push_back(monitor.queued(std::chrono::steady_clock::now(), [&](CommandRecord& r) {
      r.kind = "CallFunction";
      r.name = "f" + std::to_string(i);
    }));
  }
  for (int i = 0; i < 4; ++i) {
    monitor.running(seqs[static_cast<std::size_t>(i)]);
    monitor.finished(seqs[static_cast<std::size_t>(i)], false);
  }
  monitor.running(seqs[4]);
  const std::string text = monitor.recent(3);
  EXPECT_NE(text.find("flight recorder of rank 3 on "), std::string::npos) << text;
  EXPECT_NE(text.find("(the last 3 commands that ran, oldest first; 5 more queued behind them):\n"), std::string::npos)
      << text;
  const auto f2 = text.find("f2"), f3 = text.find("f3"), f4 = text.find("f4");
  EXPECT_TRUE(f2 != std::string::npos && f2 < f3 && f3 < f4) << text;
  EXPECT_EQ(text.find("f1"), std::string::npos) << text;
  EXPECT_EQ(text.find("f5"), std::string::npos) << text;
  EXPECT_EQ(text.find(" queued   "), std::string::npos) << text;  // no queued line

  Monitor ahead(4, 4);  // the controller far ahead: every entry queued
  for (int i = 0; i < 6; ++i)
    ahead.queued(std::chrono::steady_clock::now(), [](CommandRecord& r) { r.kind = "Reduce"; });
  EXPECT_NE(ahead.recent(3).find("all of its 4 entries are queued commands"), std::string::npos) << ahead.recent(3);
}

}  // namespace
}  // namespace meshrt::detail
