// The worker's event loop against a scripted controller over the in-memory transport:
// no mpiexec. The worker still needs MPI for its mesh communicators, so this test starts
// MPI as a singleton (MPI_Init_thread without mpiexec: one rank, MPI_COMM_WORLD of size
// 1), which MPI allows; rank 0 is then both the scripted controller and the worker, as
// in a real job where worker 0 runs beside the controller.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <span>
#include <string_view>
#include <thread>

#include "../support/expect_error.hpp"
#include "../support/scoped_env.hpp"
#include "controller/state.hpp"
#include "meshrt/functions.hpp"
#include "meshrt/internal/control.hpp"
#include "meshrt/internal/protocol.hpp"
#include "meshrt/internal/settings.hpp"
#include "meshrt/internal/worker.hpp"
#include "worker/idle.hpp"
#include "worker/monitor.hpp"

namespace meshrt {
namespace {

using namespace protocol;
using control::Tag;
using test::expect_contains;

class MpiSingleton : public ::testing::Environment {
 public:
  void SetUp() override {
    int provided = 0;
    ASSERT_EQ(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), MPI_SUCCESS);
    ASSERT_GE(provided, MPI_THREAD_MULTIPLE) << "the worker's loop runs beside the scripted controller";
  }
  void TearDown() override { MPI_Finalize(); }
};
const auto* const g_mpi = ::testing::AddGlobalTestEnvironment(new MpiSingleton);

constexpr auto kWait = std::chrono::seconds(30);

// Plays the controller by hand: sends commands, reads replies, runs the worker's serve()
// on a thread, and ends it with Exit at the end of each test.
class ScriptedController {
 public:
  explicit ScriptedController(double status_interval = 1.0, detail::Monitor* monitor = nullptr) {
    WorkerOptions o;
    o.monitor = monitor;
    o.rank = 0;
    o.world = MPI_COMM_WORLD;
    o.p2p = MPI_COMM_WORLD;
    o.status_interval_seconds = status_interval;
    o.transport = network_->endpoint(0);
    worker_ = std::thread([o] { Worker::serve(o); });
  }
  ~ScriptedController() {
    if (worker_.joinable()) {
      send(Exit{.restart = false});
      worker_.join();
    }
  }

  void send(Command c) { endpoint_->send(0, Tag::Command, std::make_shared<control::Bytes>(encode(c))); }
  void send_bytes(control::Bytes b) {
    endpoint_->send(0, Tag::Command, std::make_shared<control::Bytes>(std::move(b)));
  }

  Reply next() {
    int from = -1;
    auto bytes = network_->wait_for(0, Tag::Reply, kWait, &from);
    if (!bytes) throw std::runtime_error("the worker sent no reply within 30 s");
    EXPECT_EQ(from, 0);
    return decode_reply(*bytes);
  }
  // The next reply that is not a Status (Status comes whenever the worker moved).
  Reply next_not_status() {
    for (;;) {
      Reply r = next();
      if (!std::holds_alternative<Status>(r)) return r;
    }
  }
  template <class R>
  R expect(Reply r) {
    if (auto* x = std::get_if<R>(&r)) return *x;
    ADD_FAILURE() << "expected a " << name(Reply{R{}}) << ", found a " << name(r)
                  << (std::holds_alternative<RemoteFunctionFailed>(r) ? ": " + std::get<RemoteFunctionFailed>(r).error
                                                                      : "");
    return R{};
  }
  // Asks for status and returns the answer to that request (older Status skipped).
  Status status(Ident ident) {
    send(RequestStatus{ident});
    for (;;) {
      const Status s = expect<Status>(next());
      if (s.first_uncompleted_ident > ident || ::testing::Test::HasFailure()) return s;
    }
  }
  std::size_t waiting() const { return network_->waiting(0, Tag::Reply); }
  std::size_t waiting_commands() const { return network_->waiting(0, Tag::Command); }
  void finish() {
    send(Exit{.restart = false});
    worker_.join();
  }
  // After the test sent its own Exit.
  void finish_without_exit() { worker_.join(); }

 private:
  std::shared_ptr<control::MemoryNetwork> network_ = control::MemoryNetwork::create();
  std::shared_ptr<control::Transport> endpoint_ = network_->endpoint(0);
  std::thread worker_;
};

const NDSlice kOneRank = NDSlice::row_major({1});
const TensorMeta kVector({2}, DType::Float32);

std::vector<float> values_of(const Value& v) {
  const Tensor& t = v.as_tensor();
  const auto s = t.span<float>();
  return {s.begin(), s.end()};
}

CallFunction full(Ident ident, Ref result, float value, Ref stream = Ref{1}) {
  return CallFunction{.ident = ident,
                      .results = {result},
                      .mutates = {},
                      .function = "meshrt.full",
                      .args = {Value{2}, Value("float32"), Value(static_cast<double>(value))},
                      .stream = stream,
                      .mesh = Ref{2}};
}

Command setup() {
  return CommandGroup{{CreateStream{.result = Ref{1}, .is_default = true},
                       CreateDeviceMesh{.result = Ref{2}, .names = {"x"}, .ranks = kOneRank}}};
}

TEST(WorkerLoop, RunsEveryCommandKind) {
  ScriptedController ctl;
  ctl.send(setup());
  ctl.send(CommandGroup{{
      full(1, Ref{10}, 3),
      Reduce{.result = Ref{11},
             .tensor = Ref{10},
             .factory = kVector,
             .mesh = Ref{2},
             .stream = Ref{1},
             .dim = "x",
             .reduction = Reduction::Sum},
      SendTensor{.result = Ref{12},
                 .from_ranks = kOneRank,
                 .to_ranks = kOneRank,
                 .tensor = Ref{11},
                 .factory = kVector,
                 .stream = Ref{1}},
      CreateStream{.result = Ref{3}, .is_default = false},
      BorrowCreate{.result = Ref{13}, .tensor = Ref{12}, .from_stream = Ref{1}, .to_stream = Ref{3}},
      BorrowFirstUse{.borrow = Ref{13}},
      CallFunction{.ident = 2,
                   .results = {Ref{14}},
                   .function = "meshrt.add",
                   .args = {Value(Ref{13}), Value(Ref{13})},
                   .stream = Ref{3},
                   .mesh = Ref{2}},
      BorrowDrop{.borrow = Ref{13}},
  }});
  ctl.send(FetchValue{.ident = 3, .value = Value(Ref{14}), .stream = Ref{3}});
  const FetchResult r = ctl.expect<FetchResult>(ctl.next_not_status());
  EXPECT_EQ(r.ident, 3u);
  // full 3 -> sum over one rank -> send to itself -> borrowed and added to itself.
  EXPECT_EQ(values_of(r.value), (std::vector<float>{6, 6}));
  ctl.send(DeleteRefs{.refs = {Ref{10}, Ref{11}}});
  const Status s = ctl.status(4);
  EXPECT_EQ(s.first_uncompleted_ident, 5u);
  // Streams 1 and 3, mesh 2, tensors 12 and 14 and the borrow 13: 10 and 11 are deleted.
  EXPECT_EQ(s.live_values, 6u);
  ctl.finish();
  EXPECT_EQ(ctl.waiting(), 0u) << "no reply after Exit: nothing moved since the last Status";
}

// test.signature(x): writes x in place and returns a copy of what its kernel's
// ctx.signature() says: {outputs declared, first argument declared mutated}, or {-1, -1}
// where no shape function ran (a fetch's preprocess function).
Signature signature_shape(const ArgMetas& args) {
  return {.outputs = {args.tensor(0)}, .mutates = {0}};
}
std::vector<Tensor> signature_kernel(CallContext& ctx, Args&) {
  const Signature* s = ctx.signature();
  const float outputs = s ? static_cast<float>(s->outputs.size()) : -1.0f;
  const float mutated = s && !s->mutates.empty() ? static_cast<float>(s->mutates[0]) : -1.0f;
  return {Tensor::from<float>({2}, {outputs, mutated})};
}
MESHRT_REGISTER_FUNCTION("test.signature", signature_kernel, signature_shape);

// A kernel sees what the worker checks it against: its shape function's signature.
TEST(WorkerLoop, AKernelSeesTheSignatureItsShapeFunctionDeclared) {
  ScriptedController ctl;
  ctl.send(setup());
  ctl.send(CommandGroup{{
      full(1, Ref{10}, 3),
      CallFunction{.ident = 2,
                   .results = {Ref{11}},
                   .mutates = {Ref{10}},
                   .function = "test.signature",
                   .args = {Value(Ref{10})},
                   .stream = Ref{1},
                   .mesh = Ref{2}},
  }});
  ctl.send(FetchValue{.ident = 3, .value = Value(Ref{11}), .stream = Ref{1}});
  EXPECT_EQ(values_of(ctl.expect<FetchResult>(ctl.next_not_status()).value), (std::vector<float>{1, 0}));
  ctl.send(FetchValue{.ident = 4, .function = "test.signature", .value = Value(Ref{10}), .stream = Ref{1}});
  EXPECT_EQ(values_of(ctl.expect<FetchResult>(ctl.next_not_status()).value), (std::vector<float>{-1, -1}));
  ctl.finish();
}

// How many times `what` occurs in `text`.
std::size_t occurrences(std::string_view text, std::string_view what) {
  std::size_t n = 0;
  for (auto at = text.find(what); at != std::string_view::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(WorkerLoop, TheFlightRecorderNamesEachCollectiveAsItRanAndLeavesOutDeletes) {
  // The first collective of its kind is described while it joins (its communicator may
  // not exist yet), then as it ran; the next identical one as it ran from the start. The
  // deletes between them are not recorded.
  detail::Monitor recorder(0, 100);
  ScriptedController ctl(1.0, &recorder);
  auto sum = [](Ref result) {
    return Reduce{.result = result,
                  .tensor = Ref{10},
                  .factory = kVector,
                  .mesh = Ref{2},
                  .stream = Ref{1},
                  .dim = "x",
                  .reduction = Reduction::Sum};
  };
  ctl.send(setup());
  ctl.send(
      CommandGroup{{full(1, Ref{10}, 3), sum(Ref{11}), DeleteRefs{{Ref{11}}}, sum(Ref{12}), DeleteRefs{{Ref{12}}}}});
  ctl.status(2);
  ctl.finish();
  const std::string dump = recorder.dump();
  auto count = [&](std::string_view what) { return occurrences(dump, what); };
  EXPECT_EQ(count("done     Reduce all_reduce sum over dimension 'x'"), 2u) << dump;
  EXPECT_EQ(count("joining"), 0u) << dump;
  EXPECT_EQ(count("DeleteRefs"), 0u) << dump;
  EXPECT_EQ(count("CallFunction meshrt.full"), 1u) << dump;
}

TEST(WorkerLoop, TheFlightRecorderNamesEverySendOfALoopAsItRan) {
  // A loop of the same send reuses the words of the first; a send that differs (here in
  // its order) gets its own, and every one of them is recorded with what it did.
  detail::Monitor recorder(0, 100);
  ScriptedController ctl(1.0, &recorder);
  auto send = [](Ref result, std::vector<std::int64_t> order) {
    return SendTensor{.result = result,
                      .from_ranks = kOneRank,
                      .to_ranks = kOneRank,
                      .tensor = Ref{10},
                      .factory = kVector,
                      .stream = Ref{1},
                      .to_order = std::move(order)};
  };
  ctl.send(setup());
  ctl.send(
      CommandGroup{{full(1, Ref{10}, 3), send(Ref{11}, {}), send(Ref{12}, {}), send(Ref{13}, {0}), send(Ref{14}, {})}});
  ctl.send(FetchValue{.ident = 2, .value = Value(Ref{14}), .stream = Ref{1}});
  EXPECT_EQ(values_of(ctl.expect<FetchResult>(ctl.next_not_status()).value), (std::vector<float>{3, 3}));
  ctl.finish();
  const std::string dump = recorder.dump();
  auto count = [&](std::string_view what) { return occurrences(dump, what); };
  EXPECT_EQ(count("done     SendTensor send_tensor to itself (rank 0), 8 bytes, local copy"), 4u) << dump;
  EXPECT_EQ(count("joining"), 0u) << dump;
}

TEST(WorkerLoop, AFailingFunctionIsReportedOnceAndPoisonsWhatDependsOnIt) {
  ScriptedController ctl;
  ctl.send(setup());
  ctl.send(CallFunction{.ident = 1,
                        .results = {Ref{10}},
                        .function = "meshrt.fail",
                        .args = {Value("no luck"), Value::list()},
                        .stream = Ref{1},
                        .mesh = Ref{2}});
  const auto f = ctl.expect<RemoteFunctionFailed>(ctl.next_not_status());
  EXPECT_EQ(f.ident, 1u);
  EXPECT_EQ(f.rank, 0);
  EXPECT_EQ(f.function, "meshrt.fail");
  EXPECT_EQ(f.error, "no luck");
  EXPECT_EQ(f.exception_type, "std::runtime_error");
  // What depends on it neither runs nor reports again; the fetch sends no value.
  ctl.send(CallFunction{.ident = 2,
                        .results = {Ref{11}},
                        .function = "meshrt.add",
                        .args = {Value(Ref{10}), Value(Ref{10})},
                        .stream = Ref{1},
                        .mesh = Ref{2}});
  ctl.send(FetchValue{.ident = 3, .value = Value(Ref{11}), .stream = Ref{1}});
  EXPECT_EQ(ctl.status(3).first_uncompleted_ident, 4u);
  // A bad ref fails its invocation with a message that names the ref and the rank.
  ctl.send(FetchValue{.ident = 4, .value = Value(Ref{99}), .stream = Ref{1}});
  const auto bad = ctl.expect<RemoteFunctionFailed>(ctl.next_not_status());
  EXPECT_EQ(bad.ident, 4u);
  expect_contains(bad.error, "rank 0: argument ref 99 is not defined on this worker");
  // An undecodable frame is dropped and reported outside any invocation.
  control::Bytes garbage = encode(Command{RequestStatus{5}});
  garbage[4] = std::byte{200};
  ctl.send_bytes(garbage);
  const auto undecodable = ctl.expect<RemoteFunctionFailed>(ctl.next_not_status());
  EXPECT_EQ(undecodable.ident, 0u);
  EXPECT_EQ(undecodable.function, "<protocol>");
  expect_contains(undecodable.error, "expected a command tag in 0..15, found 200");
  // The worker goes on.
  EXPECT_EQ(ctl.status(6).first_uncompleted_ident, 7u);
}

TEST(WorkerLoop, AFailedReduceOrSendIsReportedWithItsIdentAndCompletesIt) {
  ScriptedController ctl;
  ctl.send(setup());
  ctl.send(full(1, Ref{10}, 1));
  // A reduce over a mesh ref that does not exist fails before it starts: its ident names
  // it (the controller knows the call site) and its result poisons what uses it.
  ctl.send(Reduce{.result = Ref{11},
                  .tensor = Ref{10},
                  .factory = kVector,
                  .mesh = Ref{77},
                  .stream = Ref{1},
                  .dim = "x",
                  .ident = 2});
  const auto f = ctl.expect<RemoteFunctionFailed>(ctl.next_not_status());
  EXPECT_EQ(f.ident, 2u);
  EXPECT_EQ(f.function, "Reduce");
  expect_contains(f.error, "mesh ref 77 is not defined");
  // A send whose input does not match its factory fails in flight, with its ident too.
  ctl.send(SendTensor{.result = Ref{12},
                      .from_ranks = kOneRank,
                      .to_ranks = kOneRank,
                      .tensor = Ref{10},
                      .factory = TensorMeta({3}, DType::Float64),
                      .stream = Ref{1},
                      .ident = 3});
  const auto g = ctl.expect<RemoteFunctionFailed>(ctl.next_not_status());
  EXPECT_EQ(g.ident, 3u);
  // Both are complete; what depends on the reduce's result is poisoned, not undefined.
  ctl.send(CallFunction{.ident = 4,
                        .results = {Ref{13}},
                        .function = "meshrt.copy",
                        .args = {Value(Ref{11})},
                        .stream = Ref{1},
                        .mesh = Ref{2}});
  EXPECT_EQ(ctl.status(4).first_uncompleted_ident, 5u);
  // No further failure (the controller traces it to ident 2). Whatever the worker still
  // sends before it exits is Status: the answer to the request above may come after a
  // Status the worker sent by itself when ident 4 completed.
  ctl.finish();
  while (ctl.waiting() > 0) {
    const Reply r = ctl.next();
    EXPECT_TRUE(std::holds_alternative<Status>(r)) << "found a " << name(r);
  }
}

TEST(WorkerLoop, SendsStatusWhenItMovedAndOnlyThen) {
  ScriptedController ctl(/*status_interval=*/0.01);
  ctl.send(setup());
  ctl.send(full(1, Ref{10}, 1));
  // Unasked: the worker ran out of work after completing invocation 1.
  Status s = ctl.expect<Status>(ctl.next());
  EXPECT_EQ(s.first_uncompleted_ident, 2u);
  // Nothing moved: no further Status over many intervals, though it is due each 10 ms.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(ctl.waiting(), 0u);
  // Asked, it answers even when nothing changed.
  ctl.send(RequestStatus{1});
  s = ctl.expect<Status>(ctl.next());
  EXPECT_EQ(s.first_uncompleted_ident, 2u);
  EXPECT_EQ(s.live_values, 3u);
}

TEST(WorkerLoop, RestartForgetsEveryValue) {
  ScriptedController ctl;
  ctl.send(setup());
  ctl.send(full(1, Ref{10}, 1));
  EXPECT_EQ(ctl.status(1).live_values, 3u);
  ctl.send(Exit{.restart = true});
  ctl.expect<Restarted>(ctl.next_not_status());
  // A fresh loop: the stream, the mesh and the tensor are gone.
  EXPECT_EQ(ctl.status(2).live_values, 0u);
  ctl.send(FetchValue{.ident = 3, .value = Value(Ref{10}), .stream = Ref{1}});
  const auto f = ctl.expect<RemoteFunctionFailed>(ctl.next_not_status());
  EXPECT_EQ(f.ident, 3u);
  expect_contains(f.error, "ref 10 is not defined on this worker");
  // And it runs work again.
  ctl.send(setup());
  ctl.send(full(4, Ref{10}, 2));
  ctl.send(FetchValue{.ident = 5, .value = Value(Ref{10}), .stream = Ref{1}});
  EXPECT_EQ(values_of(ctl.expect<FetchResult>(ctl.next_not_status()).value), (std::vector<float>{2, 2}));
}

TEST(WorkerLoop, DeletedValuesAreGoneAndTheirPlacesHoldTheNextOnes) {
  // The worker keeps the nodes of deleted values for the next definitions (up to 256);
  // 300 values, deleted together, pass that limit.
  ScriptedController ctl;
  ctl.send(setup());
  constexpr std::uint64_t kValues = 300;
  Ident ident = 1;
  std::vector<Ref> first;
  for (std::uint64_t i = 0; i < kValues; ++i) {
    first.push_back(Ref{100 + i});
    ctl.send(full(ident++, first.back(), static_cast<float>(i)));
  }
  EXPECT_EQ(ctl.status(ident - 1).live_values, kValues + 2);  // and the stream and the mesh
  ctl.send(DeleteRefs{.refs = first});
  EXPECT_EQ(ctl.status(ident++).live_values, 2u);
  // New refs, and one deleted ref defined again, each with its own value.
  for (std::uint64_t i = 0; i < kValues; ++i) ctl.send(full(ident++, Ref{1000 + i}, static_cast<float>(1000 + i)));
  ctl.send(full(ident++, Ref{100}, -1));
  EXPECT_EQ(ctl.status(ident - 1).live_values, kValues + 3);
  for (std::uint64_t i : {std::uint64_t{0}, std::uint64_t{1}, kValues / 2, kValues - 1}) {
    ctl.send(FetchValue{.ident = ident, .value = Value(Ref{1000 + i}), .stream = Ref{1}});
    const FetchResult r = ctl.expect<FetchResult>(ctl.next_not_status());
    EXPECT_EQ(r.ident, ident++);
    const auto v = static_cast<float>(1000 + i);
    EXPECT_EQ(values_of(r.value), (std::vector<float>{v, v})) << "ref " << 1000 + i;
  }
  ctl.send(FetchValue{.ident = ident, .value = Value(Ref{100}), .stream = Ref{1}});
  EXPECT_EQ(values_of(ctl.expect<FetchResult>(ctl.next_not_status()).value), (std::vector<float>{-1, -1}));
  ++ident;
  // A deleted ref stays deleted.
  ctl.send(FetchValue{.ident = ident, .value = Value(Ref{101}), .stream = Ref{1}});
  const auto f = ctl.expect<RemoteFunctionFailed>(ctl.next_not_status());
  EXPECT_EQ(f.ident, ident);
  expect_contains(f.error, "ref 101 is not defined on this worker");
  ctl.finish();
}

// ------------------------------------------------------------------ fan-out

control::Bytes envelope_bytes(std::vector<std::int32_t> ranks, std::vector<std::uint64_t> seqs, const Command& c) {
  return encode(Envelope{.fanout = 1, .ranks = std::move(ranks), .seqs = std::move(seqs), .payload = encode(c)});
}

TEST(WorkerLoop, RunsEnvelopesInTheirNumberedOrderNotInArrivalOrder) {
  ScriptedController ctl;
  // Number 2 overtakes number 1 (as one from the controller can pass one still in a
  // parent): nothing runs until number 1 is there, then both in order.
  ctl.send_bytes(envelope_bytes({0}, {2}, RequestStatus{5}));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(ctl.waiting(), 0u);
  ctl.send_bytes(envelope_bytes({0}, {1}, RequestStatus{3}));
  EXPECT_EQ(ctl.expect<Status>(ctl.next()).first_uncompleted_ident, 4u);
  EXPECT_EQ(ctl.expect<Status>(ctl.next()).first_uncompleted_ident, 6u);
  // An envelope that does not name this rank is refused, and said so.
  ctl.send_bytes(envelope_bytes({7}, {1}, RequestStatus{9}));
  const auto failed = ctl.expect<RemoteFunctionFailed>(ctl.next_not_status());
  expect_contains(failed.error, "reached rank 0, which is not one of them");
  ctl.send_bytes(envelope_bytes({0}, {3}, Exit{.restart = false}));
  ctl.finish_without_exit();
}

using test::ScopedEnv;

// The controller's endpoint, counting the protocol messages it sends and receives by what
// they carry, so that a test counts what it means (a fetch's messages) apart from the
// controller's safety-net asks (a RequestStatus after kAskIdleAfter, answered by a Status).
class CountingTransport : public control::Transport {
 public:
  explicit CountingTransport(std::shared_ptr<control::Transport> inner) : inner_(std::move(inner)) {}
  void reap() override { inner_->reap(); }
  bool drain(std::chrono::duration<double> timeout) override { return inner_->drain(timeout); }
  bool has_doorbells() const override { return inner_->has_doorbells(); }
  std::uint64_t rings(Tag tag) const override { return inner_->rings(tag); }
  void wait_ring(Tag tag, std::uint64_t seen, std::chrono::microseconds d) override { inner_->wait_ring(tag, seen, d); }

  std::atomic<std::uint64_t> fetch_values{0};  // command messages carrying a FetchValue
  std::atomic<std::uint64_t> asks{0};          // command messages that are a lone RequestStatus
  std::atomic<std::uint64_t> fetch_results{0}, statuses{0};

 protected:
  void do_send(const std::vector<int>& dests, Tag tag, std::shared_ptr<const control::Bytes> bytes) override {
    if (tag == Tag::Command) {
      const Command c = is_envelope(*bytes) ? decode_command(decode_envelope(*bytes).payload) : decode_command(*bytes);
      const auto* group = std::get_if<CommandGroup>(&c);
      const std::span<const Command> each = group ? std::span<const Command>(group->commands) : std::span(&c, 1);
      auto fetch = [](const Command& x) { return std::holds_alternative<FetchValue>(x); };
      auto ask = [](const Command& x) { return std::holds_alternative<RequestStatus>(x); };
      if (std::any_of(each.begin(), each.end(), fetch)) fetch_values += dests.size();
      if (std::all_of(each.begin(), each.end(), ask)) asks += dests.size();
    }
    inner_->send(dests, tag, std::move(bytes));
  }
  bool do_try_receive(int source, Tag tag, control::Bytes& out, int* from) override {
    if (!inner_->try_receive(source, tag, out, from)) return false;
    if (tag == Tag::Reply) {
      const Reply r = decode_reply(out);
      if (std::holds_alternative<FetchResult>(r)) ++fetch_results;
      if (std::holds_alternative<Status>(r)) ++statuses;
    }
    return true;
  }

 private:
  std::shared_ptr<control::Transport> inner_;
};

// A dedicated controller (rank 0) and `n` workers (ranks 1..n) in threads of this
// process, over one in-memory network. The workers report through the status tree when
// the settings put the job above the threshold, as Runtime configures them.
struct Job {
  explicit Job(int n, double status_interval = 1.0) : workers(static_cast<std::size_t>(n)) {
    std::vector<int> ranks;
    for (int r = 1; r <= n; ++r) ranks.push_back(r);
    const auto tree = control::StatusTree::for_job(ranks, static_cast<std::size_t>(settings::kFanout.get()),
                                                   static_cast<std::size_t>(settings::kFanoutThreshold.get()));
    for (int r = 1; r <= n; ++r) {
      endpoints.push_back(net->endpoint(r));
      WorkerOptions o;
      o.rank = r;
      o.world = MPI_COMM_WORLD;
      o.p2p = MPI_COMM_WORLD;
      o.transport = endpoints.back();
      o.status_interval_seconds = status_interval;
      if (tree) {
        o.status_parent = tree->is_top(r) ? kStatusToController : tree->parent(r);
        o.status_children = tree->children(r);
      }
      threads.emplace_back([o] { Worker::serve(o); });
    }
    ctl = std::make_shared<detail::ControllerState>(controller, n + 1, NDSlice(1, {n}, {1}));
  }
  ~Job() {
    ctl->shutdown(std::chrono::seconds(30));
    for (auto& t : threads) t.join();
  }
  std::vector<int> workers_list() const { return ctl->workers(); }

  std::shared_ptr<control::MemoryNetwork> net = control::MemoryNetwork::create();
  std::vector<int> workers;
  std::vector<std::shared_ptr<control::Transport>> endpoints;
  std::vector<std::thread> threads;
  std::shared_ptr<CountingTransport> controller = std::make_shared<CountingTransport>(net->endpoint(0));
  std::shared_ptr<detail::ControllerState> ctl;
};

TEST(FanOut, TheControllerSendsAtMostFanoutMessagesPerBatchAtAnySize) {
  ScopedEnv fanout("MESHRT_FANOUT", "3");
  ScopedEnv threshold("MESHRT_FANOUT_THRESHOLD", "4");
  for (int n : {2, 5, 16, 40}) {
    SCOPED_TRACE("ranks: " + std::to_string(n));
    Job job(n);
    const std::vector<int> all = job.ctl->workers();
    const ControlTraffic before = job.ctl->traffic();
    constexpr int kBatches = 5;
    Ident last = 0;
    for (int b = 0; b < kBatches; ++b) {
      last = job.ctl->new_ident();
      job.ctl->append(all, RequestStatus{last}, last);
      job.ctl->flush();
    }
    const ControlTraffic sent = job.ctl->traffic().since(before);
    // At most k per batch above the threshold; one per rank below it (flat).
    const std::uint64_t per_batch = n > 4 ? 3u : static_cast<std::uint64_t>(n);
    EXPECT_EQ(sent.sent_of(MessageKind::Command).messages, per_batch * kBatches);
    // Interleave a batch for two ranks (flat, from the controller): it must still run
    // after the tree batches before it on those ranks, and before the next ones.
    const Ident pair = job.ctl->new_ident();
    job.ctl->append({all.front(), all.back()}, RequestStatus{pair}, pair);
    last = job.ctl->new_ident();
    job.ctl->append(all, RequestStatus{last}, last);
    job.ctl->flush();
    // Completion from the Status each worker sends when it runs out of work (flat) or
    // from the status tree's answers to these RequestStatus batches (above the
    // threshold): wait_for would also ask laggards (more messages), and the counts below
    // are exact.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (job.ctl->frontier() < last && std::chrono::steady_clock::now() < deadline) {
      job.ctl->poll_replies();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ASSERT_GE(job.ctl->frontier(), last);
    // Every worker got each batch exactly once: kBatches + 1 through the tree or flat,
    // plus the pair's for two of them.
    std::uint64_t forwarded = 0;
    for (std::size_t i = 0; i < job.endpoints.size(); ++i) {
      const auto t = job.endpoints[i]->traffic();
      // At 2 ranks the pair is the whole mesh: its command joins the next batch.
      const bool in_pair = n > 2 && (i == 0 || i + 1 == job.endpoints.size());
      EXPECT_EQ(t.received_of(MessageKind::Command).messages, kBatches + 1u + (in_pair ? 1u : 0u)) << "rank " << i + 1;
      forwarded += t.sent_of(MessageKind::Command).messages;
    }
    // Workers forward to every rank the controller did not reach itself.
    EXPECT_EQ(forwarded, n > 4 ? static_cast<std::uint64_t>(n - 3) * (kBatches + 1) : 0u);
  }
}

// test.hold([gate]): blocks on world rank g_held_rank until g_release[gate] is set (gate
// 0 without an argument), with g_holding naming the gate it waits at; returns a scalar.
std::atomic<int> g_held_rank{-1};
std::array<std::atomic<bool>, 2> g_release{};
std::atomic<int> g_holding{-1};
Signature hold_shape(const ArgMetas& args) {
  args.expect_count(0, 1);
  return {{TensorMeta({}, DType::Float32, args.device())}, {}};
}
std::vector<Tensor> hold_kernel(CallContext& ctx, Args& args) {
  const auto gate = static_cast<std::size_t>(args.size() > 0 ? args.integer(0) : 0);
  if (ctx.rank() == g_held_rank.load()) {
    g_holding = static_cast<int>(gate);
    while (!g_release.at(gate).load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  Tensor t = Tensor::zeros(TensorMeta({}, DType::Float32));
  t.data<float>()[0] = static_cast<float>(ctx.rank());
  return {t};
}
MESHRT_REGISTER_FUNCTION("test.hold", hold_kernel, hold_shape);

CallFunction hold(Ident ident, Ref result) {
  return CallFunction{.ident = ident, .results = {result}, .function = "test.hold", .stream = Ref{1}, .mesh = Ref{0}};
}

// One step of the bench's loop, by hand: a call on every worker, then a fetch from one.
Ident call_and_fetch(Job& job, Ref result, int from_rank) {
  const Ident call = job.ctl->new_ident();
  job.ctl->append(job.ctl->workers(), hold(call, result), call);
  const Ident fetch = job.ctl->new_ident();
  job.ctl->append({from_rank}, FetchValue{.ident = fetch, .value = Value(result), .stream = Ref{1}}, fetch);
  return fetch;
}

TEST(FanIn, TheControllerHearsOneReportPerTopNodeAndTheFetchResultPerCompletedFetch) {
  ScopedEnv fanout("MESHRT_FANOUT", "3");
  ScopedEnv threshold("MESHRT_FANOUT_THRESHOLD", "4");
  for (int n : {4, 5, 16, 40}) {
    SCOPED_TRACE("ranks: " + std::to_string(n));
    // No timer reports during the test: every report answers a RequestStatus.
    Job job(n, 1000.0);
    const std::vector<int> all = job.ctl->workers();
    job.ctl->append(all, CreateStream{.result = Ref{1}, .is_default = true});
    const ControlTraffic before = job.ctl->traffic();
    constexpr int kSteps = 6;
    for (int s = 0; s < kSteps; ++s) {
      // From a top node, an inner node and a leaf in turn.
      const int from = all[static_cast<std::size_t>(s * 7) % all.size()];
      const Ident fetch = call_and_fetch(job, Ref{100 + static_cast<std::uint64_t>(s)}, from);
      job.ctl->wait_for(fetch, std::chrono::seconds(60), "fetch");
    }
    const ControlTraffic got = job.ctl->traffic().since(before);
    const std::uint64_t replies = got.received_of(MessageKind::Reply).messages;
    if (n > 4) {
      // Exactly one report from each of the k top nodes (the whole job passed the call,
      // so the fetch waits for all of them) and the FetchResult.
      EXPECT_EQ(replies, (3u + 1u) * kSteps);
      // The inner nodes heard their children's reports: one per child per step.
      std::uint64_t relayed = 0;
      for (const auto& e : job.endpoints) relayed += e->traffic().received_of(MessageKind::Reply).messages;
      EXPECT_EQ(relayed, static_cast<std::uint64_t>(n - 3) * kSteps);
    } else {
      // Flat: every worker reports to the controller itself, at least once a step (the
      // fetch's rank through its FetchResult, which counts as its report: the controller
      // asks no worker that reports by itself when it runs out of work).
      EXPECT_GE(replies, static_cast<std::uint64_t>(n) * kSteps);
    }
  }
}

TEST(FanIn, BelowTheTreeAFetchIsOneMessageEachWay) {
  // Flat: the controller asks no worker for its status when the awaited fetch is its
  // last command (it reports by itself when it runs out of work; the FetchResult is that
  // report), so a fetch is its FetchValue and its FetchResult, exactly.
  ScopedEnv fanout("MESHRT_FANOUT", "8");
  ScopedEnv threshold("MESHRT_FANOUT_THRESHOLD", "16");
  Job job(2, 1000.0);
  const std::vector<int> all = job.ctl->workers();
  job.ctl->append(all, CreateStream{.result = Ref{1}, .is_default = true});
  const Ident call = job.ctl->new_ident();
  job.ctl->append(all, hold(call, Ref{100}), call);
  job.ctl->wait_for(call, std::chrono::seconds(60), "call");
  // One fetch before counting: the worker's replies come in order, so once its FetchResult
  // is in, so is the Status it sent by itself after the call (which may come after the
  // controller has seen the call complete, and would count as an unasked Status below).
  const Ident warm = job.ctl->new_ident();
  job.ctl->append({all.back()}, FetchValue{.ident = warm, .value = Value(Ref{100}), .stream = Ref{1}}, warm);
  job.ctl->wait_for(warm, std::chrono::seconds(60), "fetch");
  const ControlTraffic before = job.ctl->traffic();
  const std::uint64_t asks_before = job.controller->asks, statuses_before = job.controller->statuses;
  const std::uint64_t fetches_before = job.controller->fetch_values, results_before = job.controller->fetch_results;
  constexpr std::uint64_t kFetches = 20;
  for (std::uint64_t i = 0; i < kFetches; ++i) {
    const Ident fetch = job.ctl->new_ident();
    job.ctl->append({all.back()}, FetchValue{.ident = fetch, .value = Value(Ref{100}), .stream = Ref{1}}, fetch);
    job.ctl->wait_for(fetch, std::chrono::seconds(60), "fetch");
  }
  const ControlTraffic got = job.ctl->traffic().since(before);
  // A fetch that outlasts kAskIdleAfter (a loaded machine) also gets the controller's
  // safety-net ask and its Status: those pairs are counted apart, not as the fetch's.
  const std::uint64_t asks = job.controller->asks - asks_before;
  const std::uint64_t statuses = job.controller->statuses - statuses_before;
  EXPECT_EQ(job.controller->fetch_values - fetches_before, kFetches);
  EXPECT_EQ(job.controller->fetch_results - results_before, kFetches);
  EXPECT_EQ(got.sent_of(MessageKind::Command).messages, kFetches + asks) << "every other command is an ask";
  EXPECT_EQ(statuses, asks) << "the worker sends a Status only when asked: its FetchResult is its report";
  EXPECT_EQ(got.received_of(MessageKind::Reply).messages, kFetches + statuses);
  ::testing::Test::RecordProperty("safety_net_asks", static_cast<int>(asks));
}

TEST(FanIn, AFetchWaitsForTheSlowestRankOfEverySubtree) {
  ScopedEnv fanout("MESHRT_FANOUT", "2");
  ScopedEnv threshold("MESHRT_FANOUT_THRESHOLD", "1");
  Job job(12, 1000.0);
  const std::vector<int> all = job.ctl->workers();
  job.ctl->append(all, CreateStream{.result = Ref{1}, .is_default = true});
  // The last rank is a leaf three levels down the second top node's subtree; the value
  // comes from the first top node, which finishes at once.
  g_release[0] = false;
  g_held_rank = all.back();
  const Ident fetch = call_and_fetch(job, Ref{100}, all.front());
  auto future = std::make_shared<detail::FutureState>();
  job.ctl->register_fetch(fetch, future);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
  while (std::chrono::steady_clock::now() < deadline) {
    job.ctl->poll_replies();
    job.ctl->request_status(fetch);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  // The value is in and its own subtree has reported, but the held rank has not passed
  // the call: the fetch must not complete.
  EXPECT_TRUE(future->value.has_value());
  EXPECT_LT(job.ctl->frontier(), fetch);
  EXPECT_EQ(job.ctl->frontier(), 0u) << "nothing before the held call is outstanding";
  g_release[0] = true;
  job.ctl->wait_for(fetch, std::chrono::seconds(60), "fetch");
  EXPECT_GE(job.ctl->frontier(), fetch);
  g_held_rank = -1;
}

TEST(FanIn, EachSessionStartsTheTreeAfresh) {
  ScopedEnv fanout("MESHRT_FANOUT", "2");
  ScopedEnv threshold("MESHRT_FANOUT_THRESHOLD", "1");
  Job job(9, 1000.0);
  const std::vector<int> all = job.ctl->workers();
  // Three sessions: the child-report tags alternate with the session's parity, so the
  // third reuses the first's. A report kept across a restart (a child's minimum, a direct
  // count, a held report) would complete the new session's fetch early or never.
  for (int session = 0; session < 3; ++session) {
    SCOPED_TRACE("session " + std::to_string(session));
    job.ctl->append(all, CreateStream{.result = Ref{1}, .is_default = true});
    const ControlTraffic before = job.ctl->traffic();
    const Ident fetch = call_and_fetch(job, Ref{100}, all.back());
    auto future = std::make_shared<detail::FutureState>();
    job.ctl->register_fetch(fetch, future);
    job.ctl->wait_for(fetch, std::chrono::seconds(60), "fetch");
    ASSERT_TRUE(future->value.has_value());
    EXPECT_EQ(future->value->as_tensor().item(), static_cast<double>(all.back()));
    // The two top nodes' reports and the FetchResult.
    EXPECT_EQ(job.ctl->traffic().since(before).received_of(MessageKind::Reply).messages, 3u);
    job.ctl->restart_workers();
  }
}

// The MPI transport's doorbells (rank 0 to itself, as the controller and worker 0 talk):
// a command rings the command bell only, a reply the reply bell only, and a wait on a
// bell returns the moment it rings, not after its time limit.
TEST(Doorbell, EachTagToThisRankRingsItsOwnBellAndWakesItsWaiter) {
  MPI_Comm comm = MPI_COMM_NULL;
  ASSERT_EQ(MPI_Comm_dup(MPI_COMM_WORLD, &comm), MPI_SUCCESS);
  {
    auto controller = control::mpi_transport(comm);
    auto worker0 = control::mpi_transport(comm);
    ASSERT_TRUE(controller->has_doorbells());
    const auto bytes = std::make_shared<control::Bytes>(control::Bytes(3, std::byte{1}));
    const std::uint64_t commands = worker0->rings(Tag::Command), replies = controller->rings(Tag::Reply);
    controller->send(0, Tag::Command, bytes);
    EXPECT_EQ(worker0->rings(Tag::Command), commands + 1);
    EXPECT_EQ(controller->rings(Tag::Reply), replies);
    worker0->send(0, Tag::Reply, bytes);
    EXPECT_EQ(controller->rings(Tag::Reply), replies + 1);
    EXPECT_EQ(worker0->rings(Tag::Command), commands + 1);
    EXPECT_EQ(controller->rings(Tag::Query), 0u);  // no bell for the other tags

    // Rung from another thread while the controller waits: it wakes well before 30 s.
    const std::uint64_t seen = controller->rings(Tag::Reply);
    std::thread ringer([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      worker0->send(0, Tag::Reply, bytes);
    });
    const auto start = std::chrono::steady_clock::now();
    controller->wait_ring(Tag::Reply, seen, std::chrono::seconds(30));
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
    EXPECT_EQ(controller->rings(Tag::Reply), seen + 1);
    ringer.join();
    // Already rung: returns at once.
    controller->wait_ring(Tag::Reply, seen, std::chrono::seconds(30));

    control::Bytes got;
    int taken = 0;
    while (controller->try_receive(0, Tag::Reply, got)) ++taken;
    while (worker0->try_receive(0, Tag::Command, got)) ++taken;
    EXPECT_EQ(taken, 3);
    EXPECT_TRUE(controller->drain(std::chrono::seconds(30)));
    EXPECT_TRUE(worker0->drain(std::chrono::seconds(30)));
  }
  MPI_Comm_free(&comm);
}

// The worker loop's idle wait: worker 0 sleeps on the controller's doorbell; a worker with
// a core of its own keeps yielding it for 20 ms before it sleeps; on an oversubscribed node
// a worker sleeps after 2 ms, leaving the core to the ranks that share it.
TEST(WorkerIdle, WorkerZeroWaitsOnTheDoorbellAndOnlyAWorkerWithACoreOfItsOwnYieldsLonger) {
  using detail::worker_idle_policy;
  auto policy = [](int rank, bool own_core) {
    WorkerOptions o;
    o.rank = rank;
    o.block_in_mpi = own_core;
    return worker_idle_policy(o);
  };
  EXPECT_EQ(policy(0, true).yield, detail::kDoorbell.yield);
  EXPECT_EQ(policy(0, false).yield, detail::kDoorbell.yield);
  EXPECT_EQ(policy(1, true).yield, std::chrono::milliseconds(20));
  EXPECT_EQ(policy(1, false).yield, std::chrono::milliseconds(2));
  // Past the yield, both sleep alike: waited/32, at most 1 ms.
  EXPECT_EQ(policy(3, true).sleep_divisor, policy(3, false).sleep_divisor);
  EXPECT_EQ(policy(3, true).max_sleep, policy(3, false).max_sleep);
  EXPECT_EQ(policy(3, true).spin, std::chrono::nanoseconds(0)) << "never spin: it may share the core after all";
}

// MESHRT_WORKER_BLOCKING: auto blocks only with a core per rank on the node; a boolean
// forces the mode; anything else is refused with the setting's name and what it takes.
TEST(WorkerBlocking, AutoBlocksOnlyWithACorePerRankAndABadValueIsRefused) {
  EXPECT_TRUE(worker_blocks_in_mpi("auto", 2, 2));
  EXPECT_FALSE(worker_blocks_in_mpi("auto", 4, 2)) << "oversubscribed: a blocked rank polls its peer's core";
  EXPECT_TRUE(worker_blocks_in_mpi("AUTO", 1, 8));
  EXPECT_TRUE(worker_blocks_in_mpi("1", 4, 2));
  EXPECT_TRUE(worker_blocks_in_mpi("on", 4, 2));
  EXPECT_FALSE(worker_blocks_in_mpi("0", 1, 8));
  EXPECT_FALSE(worker_blocks_in_mpi("false", 1, 8));
  const std::string what = test::usage_error([] { (void)worker_blocks_in_mpi("maybe", 2, 2); });
  expect_contains(what, "MESHRT_WORKER_BLOCKING=maybe: expected auto, or 1/0");
  EXPECT_FALSE(worker_blocks_in_mpi("", 1, 8)) << "empty is false, as for every boolean setting";
}

// Polls `done` every millisecond for up to kWait.
template <class Done>
bool wait_until(Done done) {
  const auto deadline = std::chrono::steady_clock::now() + kWait;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

TEST(WorkerLoop, PastItsQueueLimitTheWorkerLeavesBatchesInTheTransportAndStillRunsThemAll) {
  // A controller far ahead must not set the worker's memory: with 4096 commands queued,
  // the worker takes no more batches until it has run them, and then takes the rest.
  ScriptedController ctl;
  g_held_rank = 0;
  g_holding = -1;
  g_release[0] = g_release[1] = false;
  auto held = [](Ident ident, Ref result, int gate) {
    CallFunction c = hold(ident, result);
    c.args = {Value(gate)};
    c.mesh = Ref{2};
    return c;
  };
  ctl.send(setup());
  ctl.send(held(1, Ref{20}, 0));
  ASSERT_TRUE(wait_until([] { return g_holding == 0; })) << "the first hold never started";
  // 40 batches of 256 while the worker is held: the first starts with a second hold.
  constexpr int kBatches = 40;
  for (int b = 0; b < kBatches; ++b) {
    std::vector<Command> batch;
    if (b == 0) batch.push_back(held(2, Ref{21}, 1));
    while (batch.size() < 256) batch.push_back(DeleteRefs{{Ref{9000}}});
    ctl.send(CommandGroup{std::move(batch)});
  }
  EXPECT_EQ(ctl.waiting_commands(), static_cast<std::size_t>(kBatches));
  g_release[0] = true;
  // The worker takes batches until 4096 commands wait (16 of 256), then runs them, and is
  // held again by the first: the other 24 stay in the transport meanwhile.
  ASSERT_TRUE(wait_until([] { return g_holding == 1; })) << "the second hold never started";
  EXPECT_EQ(ctl.waiting_commands(), static_cast<std::size_t>(kBatches - 16));
  g_release[1] = true;
  const Status s = ctl.status(3);
  EXPECT_EQ(s.first_uncompleted_ident, 4u) << "every command ran, in order, up to the status request";
  EXPECT_EQ(ctl.waiting_commands(), 0u);
  ctl.finish();
  g_held_rank = -1;
}

}  // namespace
}  // namespace meshrt
