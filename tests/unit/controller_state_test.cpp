// The controller's session (ControllerState) against scripted workers over the in-memory
// transport: what reaches which rank, the completion rule fed by replies, failures, the
// timeout's desync report built from the watch threads' answers, restart and shutdown.
// No MPI is started: the session only calls MPI to abort the job, which no test does.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>

#include "../support/expect_error.hpp"
#include "common/site.hpp"
#include "controller/diagnostics.hpp"
#include "controller/state.hpp"
#include "meshrt/internal/control.hpp"
#include "meshrt/internal/controller.hpp"

namespace meshrt {
namespace {

using namespace protocol;
using control::Tag;
using detail::ControllerState;
using test::expect_contains;

// Two workers, ranks 1 and 2 (rank 0 plays a dedicated controller).
struct Session {
  std::shared_ptr<control::MemoryNetwork> net = control::MemoryNetwork::create();
  std::shared_ptr<ControllerState> ctl = std::make_shared<ControllerState>(net->endpoint(0), 3, NDSlice(1, {2}, {1}));

  // Every command `rank` received so far, groups flattened, in order.
  std::vector<Command> received(int rank) {
    std::vector<Command> out;
    control::Bytes b;
    auto ep = net->endpoint(rank);
    while (ep->try_receive(0, Tag::Command, b)) {
      // Two ranks: below the fan-out threshold, each envelope comes from the controller.
      flatten(is_envelope(b) ? decode_command(decode_envelope(b).payload) : decode_command(b), out);
    }
    return out;
  }
  void reply(int rank, const Reply& r) {
    net->endpoint(rank)->send(0, Tag::Reply, std::make_shared<control::Bytes>(encode(r)));
  }
  static void flatten(Command c, std::vector<Command>& out) {
    if (auto* g = std::get_if<CommandGroup>(&c)) {
      for (auto& x : g->commands) flatten(std::move(x), out);
    } else {
      out.push_back(std::move(c));
    }
  }
};

CallFunction call(Ident ident) {
  return CallFunction{.ident = ident, .results = {Ref{50 + ident}}, .function = "meshrt.sleep"};
}

TEST(ControllerState, CommandsReachTheirRanksInOrderAndDeletesRideAhead) {
  Session s;
  s.ctl->append({1, 2}, CreateStream{.result = Ref{1}, .is_default = true});
  s.ctl->append({1, 2}, RequestStatus{5});
  s.ctl->defer_delete({1}, Ref{7});
  s.ctl->defer_delete({1}, Ref{8});
  s.ctl->append({1}, Exit{.restart = false});
  s.ctl->flush();
  EXPECT_EQ(s.received(1), (std::vector<Command>{CreateStream{.result = Ref{1}, .is_default = true}, RequestStatus{5},
                                                 DeleteRefs{{Ref{7}, Ref{8}}}, Exit{.restart = false}}));
  EXPECT_EQ(s.received(2),
            (std::vector<Command>{CreateStream{.result = Ref{1}, .is_default = true}, RequestStatus{5}}));
  // A delete for ranks no later command goes to waits for flush_deferred.
  s.ctl->defer_delete({2}, Ref{9});
  s.ctl->append({1}, RequestStatus{6});
  s.ctl->flush();
  EXPECT_TRUE(s.received(2).empty());
  s.ctl->flush_deferred();
  EXPECT_EQ(s.received(2), (std::vector<Command>{DeleteRefs{{Ref{9}}}}));
}

TEST(ControllerState, DeletesOfSomeRanksRideAheadOfACommandToMoreRanks) {
  // A loop of to_mesh sends goes to both meshes while its outputs die on the receiving
  // one: their deletes must not wait for the next synchronize (the receiver's pool would
  // hand out a fresh, cold buffer for every receive).
  Session s;
  s.ctl->defer_delete({2}, Ref{9});
  s.ctl->defer_delete({1, 2}, Ref{10});
  s.ctl->append({1, 2}, RequestStatus{6});
  s.ctl->flush();
  EXPECT_EQ(s.received(2), (std::vector<Command>{DeleteRefs{{Ref{10}}}, DeleteRefs{{Ref{9}}}, RequestStatus{6}}));
  // Rank 1 never held ref 9: its worker ignores that delete.
  EXPECT_EQ(s.received(1), (std::vector<Command>{DeleteRefs{{Ref{10}}}, DeleteRefs{{Ref{9}}}, RequestStatus{6}}));
  // Nothing is left for flush_deferred.
  s.ctl->flush_deferred();
  EXPECT_TRUE(s.received(1).empty());
  EXPECT_TRUE(s.received(2).empty());
}

TEST(ControllerState, EachDeleteRidesOnceAndAnEmptiedRankSetSendsNothing) {
  // The pending deletes of a rank set keep their entry once they rode (a loop's outputs
  // die under the same ranks every time): the next ride carries only the new refs, and
  // neither a ride nor flush_deferred sends an empty delete.
  Session s;
  for (std::uint64_t i = 0; i < 3; ++i) {
    s.ctl->defer_delete({1, 2}, Ref{10 + i});
    s.ctl->append({1, 2}, RequestStatus{6 + i});
  }
  s.ctl->defer_delete({2}, Ref{20});
  s.ctl->append({2}, RequestStatus{9});
  s.ctl->append({1}, RequestStatus{10});
  s.ctl->flush_deferred();
  EXPECT_EQ(s.received(1),
            (std::vector<Command>{DeleteRefs{{Ref{10}}}, RequestStatus{6}, DeleteRefs{{Ref{11}}}, RequestStatus{7},
                                  DeleteRefs{{Ref{12}}}, RequestStatus{8}, RequestStatus{10}}));
  EXPECT_EQ(s.received(2),
            (std::vector<Command>{DeleteRefs{{Ref{10}}}, RequestStatus{6}, DeleteRefs{{Ref{11}}}, RequestStatus{7},
                                  DeleteRefs{{Ref{12}}}, RequestStatus{8}, DeleteRefs{{Ref{20}}}, RequestStatus{9}}));
  // Refilled after the synchronize's flush: it rides again, once.
  s.ctl->defer_delete({1, 2}, Ref{30});
  s.ctl->flush_deferred();
  EXPECT_EQ(s.received(1), (std::vector<Command>{DeleteRefs{{Ref{30}}}}));
  EXPECT_EQ(s.received(2), (std::vector<Command>{DeleteRefs{{Ref{30}}}}));
  s.ctl->flush_deferred();
  EXPECT_TRUE(s.received(1).empty());
  EXPECT_TRUE(s.received(2).empty());
}

TEST(ControllerState, SmallDeletesWaitForManyOrTheSynchronizeAndALargeOneTakesThemAlong) {
  // A small value's delete does not ride on its own: it waits until kSmallDeletes are
  // pending for its ranks, then all ride together; a delete that is not small rides with
  // the next command and takes the small ones with it; flush_deferred sends what is left.
  Session s;
  constexpr std::size_t k = detail::Batcher::kSmallDeletes;
  std::vector<Ref> first;
  for (std::uint64_t i = 0; i < k; ++i) {
    s.ctl->append({1, 2}, RequestStatus{100 + i});
    s.ctl->defer_delete({1, 2}, Ref{1000 + i}, /*value_bytes=*/8);
    first.push_back(Ref{1000 + i});
  }
  s.ctl->append({1, 2}, RequestStatus{200});
  s.ctl->defer_delete({1, 2}, Ref{2000}, detail::Batcher::kSmallDeleteBytes);
  s.ctl->append({1, 2}, RequestStatus{201});
  s.ctl->defer_delete({1, 2}, Ref{2001}, detail::Batcher::kSmallDeleteBytes + 1);
  s.ctl->append({1, 2}, RequestStatus{202});
  s.ctl->defer_delete({1, 2}, Ref{2002}, /*value_bytes=*/8);
  s.ctl->flush_deferred();
  std::vector<Command> expected;
  for (std::uint64_t i = 0; i < k; ++i) expected.push_back(RequestStatus{100 + i});
  expected.push_back(DeleteRefs{first});  // the k-th small delete made them ride
  expected.push_back(RequestStatus{200});
  expected.push_back(RequestStatus{201});
  expected.push_back(DeleteRefs{{Ref{2000}, Ref{2001}}});  // a large one takes the small along
  expected.push_back(RequestStatus{202});
  expected.push_back(DeleteRefs{{Ref{2002}}});  // the synchronize's flush sends the rest
  EXPECT_EQ(s.received(1), expected);
  EXPECT_EQ(s.received(2), expected);
}

TEST(ControllerState, CountsOneCommandMessagePerDestinationOfEachBatch) {
  Session s;
  const ControlTraffic before = s.ctl->traffic();
  s.ctl->append({1, 2}, CreateStream{.result = Ref{1}, .is_default = true});
  s.ctl->append({1, 2}, RequestStatus{5});
  s.ctl->append({1}, RequestStatus{6});  // another rank set: the first batch leaves
  s.ctl->flush();
  const ControlTraffic d = s.ctl->traffic().since(before);
  EXPECT_EQ(d.sent_of(MessageKind::Command).messages, 3u);
  EXPECT_EQ(d.sent_total().messages, 3u);
  std::uint64_t bytes = 0;
  control::Bytes b;
  for (int rank : {1, 2}) {
    auto ep = s.net->endpoint(rank);
    while (ep->try_receive(0, Tag::Command, b)) bytes += b.size();
  }
  EXPECT_EQ(d.sent_of(MessageKind::Command).bytes, bytes);
  s.reply(1, Status{.first_uncompleted_ident = 7});
  s.ctl->poll_replies();
  EXPECT_EQ(s.ctl->traffic().since(before).received_of(MessageKind::Reply).messages, 1u);
}

TEST(ControllerState, ABatchLeftAloneLeavesOnItsOwnAndAnIdleFlusherNeverWakes) {
  Session s;
  // Idle: the flusher sleeps until a batch starts. It used to wake every millisecond, on
  // the core the controller shares with worker 0 (~50 times here).
  auto idle_wakeups = [&] {
    const std::uint64_t before = s.ctl->flusher_wakeups();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    return s.ctl->flusher_wakeups() - before;
  };
  EXPECT_LE(idle_wakeups(), 1u);  // one spurious wake-up allowed
  // A batch nobody flushes leaves after its time limit (2 ms), from the flusher alone.
  s.ctl->append({1, 2}, RequestStatus{5});
  std::vector<Command> got;
  for (int i = 0; i < 2000 && got.empty(); ++i) {
    got = s.received(1);
    if (got.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(got, (std::vector<Command>{RequestStatus{5}}));
  EXPECT_EQ(s.received(2), (std::vector<Command>{RequestStatus{5}}));
  // Then it sleeps again; a batch the program flushes itself does not wake it past its
  // deadline either.
  s.ctl->append({1, 2}, RequestStatus{6});
  s.ctl->flush();
  std::this_thread::sleep_for(std::chrono::milliseconds(10));  // past that batch's deadline
  EXPECT_LE(idle_wakeups(), 1u);
  EXPECT_EQ(s.received(1), (std::vector<Command>{RequestStatus{6}}));
}

// A transport whose sends fail while `down` is set (a broken network, a message MPI
// refuses), over the in-memory one.
struct FlakyTransport : control::Transport {
  std::shared_ptr<control::Transport> inner;
  std::atomic<bool> down{false};
  std::atomic<int> refused{0};
  explicit FlakyTransport(std::shared_ptr<control::Transport> t) : inner(std::move(t)) {}
  void reap() override { inner->reap(); }
  bool drain(std::chrono::duration<double> timeout) override { return inner->drain(timeout); }

 protected:
  void do_send(const std::vector<int>& dests, Tag tag, std::shared_ptr<const control::Bytes> bytes) override {
    if (down.load()) {
      ++refused;
      throw SystemError("the network is down (on purpose)");
    }
    inner->send(dests, tag, std::move(bytes));
  }
  bool do_try_receive(int source, Tag tag, control::Bytes& out, int* from) override {
    return inner->try_receive(source, tag, out, from);
  }
};

TEST(ControllerState, AFlusherThatCannotSendRaisesAtTheNextCallAndDropsNothing) {
  Session s;
  auto flaky = std::make_shared<FlakyTransport>(s.net->endpoint(0));
  auto ctl = std::make_shared<ControllerState>(flaky, 3, NDSlice(1, {2}, {1}));
  flaky->down = true;
  // A batch left alone: the flusher thread sends it, and its send throws there. That used
  // to reach std::terminate and end the process.
  ctl->append({1, 2}, RequestStatus{5});
  for (int i = 0; i < 5000 && flaky->refused.load() == 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_GE(flaky->refused.load(), 1) << "the flusher never tried to send the batch";
  flaky->down = false;
  // The next call raises it, on the controller's thread, and queues nothing itself.
  const std::string raised = test::error_of<Error>([&] { ctl->append({1}, RequestStatus{6}); });
  expect_contains(raised,
                  "the controller's flusher thread could not send a batch of 1 command to ranks [1, 2]: the network "
                  "is down (on purpose)");
  expect_contains(raised, "stays queued");
  EXPECT_TRUE(s.received(1).empty());
  // Raised once; the batch it could not send is sent with the next flush, before anything later.
  ctl->append({1}, RequestStatus{7});
  ctl->flush();
  EXPECT_EQ(s.received(1), (std::vector<Command>{RequestStatus{5}, RequestStatus{7}}));
  EXPECT_EQ(s.received(2), (std::vector<Command>{RequestStatus{5}}));
  // A flush that fails on the controller's thread raises there, and keeps the batch too.
  ctl->append({2}, RequestStatus{8});
  flaky->down = true;
  EXPECT_THROW(ctl->flush(), SystemError);
  flaky->down = false;
  ctl->flush();
  EXPECT_EQ(s.received(2), (std::vector<Command>{RequestStatus{8}}));
}

TEST(ControllerState, ABatchSplitsBeforeItsArgumentsPassTheLimit) {
  Session s;
  detail::set_payload_limit(1000);
  const ControlTraffic before = s.ctl->traffic();
  // 600 + 600 bytes of arguments: two messages; 300 more ride with the second.
  s.ctl->append({1, 2}, RequestStatus{5}, 0, 600);
  s.ctl->append({1, 2}, RequestStatus{6}, 0, 600);
  s.ctl->append({1, 2}, RequestStatus{7}, 0, 300);
  s.ctl->flush();
  detail::set_payload_limit(0);
  EXPECT_EQ(s.ctl->traffic().since(before).sent_of(MessageKind::Command).messages, 4u);  // 2 batches x 2 ranks
  EXPECT_EQ(s.received(1), (std::vector<Command>{RequestStatus{5}, RequestStatus{6}, RequestStatus{7}}));
  EXPECT_EQ(detail::payload_limit(), detail::kControlMessageLimit - detail::kCommandRoom);
}

TEST(MeshState, ToMeshWordsAndRanksFollowTheTarget) {
  // Made once per target and kept for the last one: switching targets remakes them.
  auto mesh = [](std::int64_t offset, std::vector<int> dests) {
    detail::MeshState m;
    m.names = {"x"};
    m.ranks = NDSlice::row_major({2}, offset);
    m.dests = std::move(dests);
    return m;
  };
  detail::MeshState a = mesh(0, {0, 1}), b = mesh(2, {2, 3}), c = mesh(1, {1, 2});
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(round);
    EXPECT_EQ(a.send_words(b).what.str(), "to_mesh [0,1] -> [2,3]");
    EXPECT_EQ(a.send_words(b).dests, (std::vector<int>{0, 1, 2, 3}));
    EXPECT_EQ(a.send_words(c).what.str(), "to_mesh [0,1] -> [1,2]");
    EXPECT_EQ(a.send_words(c).dests, (std::vector<int>{0, 1, 2}));
    EXPECT_EQ(b.send_words(a).what.str(), "to_mesh [2,3] -> [0,1]");
    EXPECT_EQ(b.send_words(a).dests, (std::vector<int>{0, 1, 2, 3}));
  }
}

TEST(ControllerState, CompletesWhenEveryWorkerReportedAndAsksOnlyTheLaggingOnes) {
  Session s;
  const Ident a = s.ctl->new_ident();
  s.ctl->append({1, 2}, call(a), a);
  s.ctl->flush();
  s.received(1);
  s.received(2);
  s.reply(1, Status{.first_uncompleted_ident = a + 1, .live_values = 3});
  s.ctl->poll_replies();
  EXPECT_LT(s.ctl->frontier(), a);
  EXPECT_EQ(s.ctl->live_values(1), 3u);
  s.ctl->request_status(a);
  EXPECT_TRUE(s.received(1).empty());
  EXPECT_EQ(s.received(2), (std::vector<Command>{RequestStatus{a}}));
  s.ctl->request_status(a);  // asked already
  EXPECT_TRUE(s.received(2).empty());
  // A fetch's value completes the invocation on its rank.
  s.reply(2, FetchResult{.ident = a, .value = Value(1)});
  s.ctl->wait_for(a, std::chrono::seconds(30), "test");
  EXPECT_GE(s.ctl->frontier(), a);
}

TEST(ControllerState, AFailureReachesWhatDependsOnItOnce) {
  Session s;
  const auto here = std::source_location::current();
  const Ident a = s.ctl->new_ident();
  auto failing = s.ctl->make_node(a, "meshrt.fail", here, {});
  s.ctl->append({1, 2}, call(a), a);
  const Ident b = s.ctl->new_ident();
  auto fetch = s.ctl->make_node(b, "fetch from rank 1", here, {failing});
  s.ctl->append({1}, call(b), b);
  s.reply(2, RemoteFunctionFailed{.ident = a, .error = "boom", .rank = 2, .function = "meshrt.fail"});
  s.reply(1, Status{.first_uncompleted_ident = b + 1});
  s.ctl->wait_for(b, std::chrono::seconds(30), "test");
  const auto e = s.ctl->failure_of(fetch, "fetch (invocation 2)");
  ASSERT_NE(e, nullptr);
  try {
    std::rethrow_exception(e);
  } catch (const RemoteError& err) {
    EXPECT_EQ(err.ident(), a);
    EXPECT_EQ(err.ranks(), std::vector<int>{2});
    expect_contains(err.what(), "fetch (invocation 2) depends on a failed invocation: meshrt.fail failed on rank 2");
  }
  // Raised once: synchronize does not raise it again, but does raise one nobody saw.
  EXPECT_NO_THROW(s.ctl->raise_unobserved_failures());
  s.reply(1, RemoteFunctionFailed{.ident = 0, .error = "CreateDeviceMesh failed: x", .rank = 1});
  s.ctl->poll_replies();
  EXPECT_THROW(s.ctl->raise_unobserved_failures(), RemoteError);
  EXPECT_NO_THROW(s.ctl->raise_unobserved_failures());
}

TEST(ControllerState, EveryFailureIsAnEntryOfItsOwnAndSynchronizeNamesThemAll) {
  Session s;
  const auto here = std::source_location::current();
  // A reduce carries an ident: its failure in flight names the call and its site.
  const Ident r = s.ctl->new_ident();
  auto reduce = s.ctl->make_node(r, "reduce sum over 'x'", here, {});
  s.ctl->append({1, 2}, Reduce{.result = Ref{5}, .ident = r}, r);
  s.ctl->flush();
  s.reply(1, RemoteFunctionFailed{.ident = r, .error = "MPI broke", .rank = 1, .function = "Reduce"});
  s.reply(2, RemoteFunctionFailed{
                 .ident = 0, .error = "CreateDeviceMesh failed: a", .rank = 2, .function = "CreateDeviceMesh"});
  s.reply(1,
          RemoteFunctionFailed{.ident = 0, .error = "BorrowCreate failed: b", .rank = 1, .function = "BorrowCreate"});
  s.ctl->poll_replies();
  std::string text;
  try {
    s.ctl->raise_unobserved_failures();
    ADD_FAILURE() << "expected a RemoteError";
  } catch (const RemoteError& e) {
    text = e.what();
    EXPECT_EQ(e.ident(), 0u);  // outside an invocation first, in arrival order
    EXPECT_EQ(e.function(), "CreateDeviceMesh");
  }
  expect_contains(text, "CreateDeviceMesh failed on rank 2 (outside any invocation): CreateDeviceMesh failed: a");
  expect_contains(text, "and 2 more unobserved failures:");
  expect_contains(text, "- BorrowCreate failed on rank 1 (outside any invocation): BorrowCreate failed: b");
  expect_contains(text, "- reduce sum over 'x' failed on rank 1 (invocation " + std::to_string(r) +
                            ", issued at controller_state_test.cpp:");
  expect_contains(text, "MPI broke");
  // All marked observed; a later failure outside an invocation is raised again, not lost.
  EXPECT_NO_THROW(s.ctl->raise_unobserved_failures());
  s.reply(2, RemoteFunctionFailed{.ident = 0, .error = "second one", .rank = 2, .function = "DeleteRefs"});
  s.ctl->poll_replies();
  expect_contains(test::error_of<RemoteError>([&] { s.ctl->raise_unobserved_failures(); }), "second one");
  // A new session starts with none.
  s.reply(1, RemoteFunctionFailed{.ident = 0, .error = "old session", .rank = 1, .function = "DeleteRefs"});
  s.reply(1, Restarted{});
  s.reply(2, Restarted{});
  s.ctl->restart_workers();
  EXPECT_NO_THROW(s.ctl->raise_unobserved_failures());
  (void)reduce;
}

TEST(ControllerState, AnImplicitDropIsDrop) {
  Session s;
  const auto here = std::source_location::current();
  auto mesh = std::make_shared<detail::MeshState>();
  mesh->controller = s.ctl;
  mesh->epoch = s.ctl->epoch();
  mesh->dests = {1, 2};
  auto origin_stream = s.ctl->stream("default");
  auto comms = s.ctl->stream("comms");
  auto origin = std::make_shared<detail::TensorState>();
  origin->controller = s.ctl;
  origin->epoch = s.ctl->epoch();
  origin->ref = Ref{20};
  origin->home = mesh;
  origin->stream = origin_stream;
  origin->node() = s.ctl->make_node(0, "origin", here, {});
  // A mutable borrow whose write (invocation w) fails on rank 1.
  const Ident w = s.ctl->new_ident();
  auto borrow = std::make_shared<detail::TensorState>();
  borrow->controller = s.ctl;
  borrow->epoch = s.ctl->epoch();
  borrow->ref = Ref{21};
  borrow->home = mesh;
  borrow->stream = comms;
  borrow->borrow.origin = origin;
  borrow->borrow.is_mutable = true;
  borrow->node() = s.ctl->make_node(w, "meshrt.fill_", here, {origin->node()});
  origin->lent().active = 1;
  origin->lent().mutably = true;
  s.ctl->append({1, 2}, call(w), w);
  s.ctl->flush();
  s.received(1);
  borrow.reset();  // destroyed without drop()
  EXPECT_FALSE(origin->lent().mutably);
  // The origin's next use: the drop reaches the workers first, as drop()'s does.
  const Ident next = s.ctl->new_ident();
  s.ctl->append({1, 2}, call(next), next);
  s.ctl->flush();
  const auto got = s.received(1);
  const auto drop = std::find(got.begin(), got.end(), Command{BorrowDrop{Ref{21}}});
  const auto use = std::find(got.begin(), got.end(), Command{call(next)});
  ASSERT_NE(drop, got.end());
  ASSERT_NE(use, got.end());
  EXPECT_LT(drop - got.begin(), use - got.begin());
  // The failed write reaches the origin.
  s.reply(1, RemoteFunctionFailed{.ident = w, .error = "write failed", .rank = 1, .function = "meshrt.fill_"});
  s.reply(1, Status{.first_uncompleted_ident = next + 1});
  s.reply(2, Status{.first_uncompleted_ident = next + 1});
  s.ctl->wait_for(next, std::chrono::seconds(30), "test");
  const auto e = s.ctl->failure_of(origin->node(), "fetch");
  ASSERT_NE(e, nullptr);
  expect_contains(test::error_of<RemoteError>([&] { std::rethrow_exception(e); }), "write failed");
}

// Plays the watch threads of ranks 1 and 2: rank 1 is idle, rank 2 runs `ident`.
class ScriptedWatches {
 public:
  ScriptedWatches(std::shared_ptr<control::MemoryNetwork> net, Ident ident) {
    thread_ = std::thread([this, net, ident] {
      auto w1 = net->endpoint(1), w2 = net->endpoint(2);
      control::Bytes b;
      while (!stop_.load()) {
        bool any = false;
        for (auto& [rank, ep] : {std::pair{1, w1}, std::pair{2, w2}}) {
          if (!ep->try_receive(0, Tag::Query, b)) continue;
          any = true;
          const Query q = decode_query(b);
          QueryAnswer a{.query = q.id, .rank = rank, .op = q.op};
          if (q.op == QueryOp::State) {
            a.payload = rank == 1 ? R"({"rank":1,"first_uncompleted":9,"queued":0,"current":null})"
                                  : R"({"rank":2,"first_uncompleted":1,"queued":2,"current":{"kind":"CallFunction",)"
                                    R"("ident":)" +
                                        std::to_string(ident) + R"(,"seconds":1.5,"name":"meshrt.sleep"}})";
          } else if (q.op == QueryOp::Dump) {
            a.payload = "flight recorder of rank " + std::to_string(rank) + "\n";
          }
          ep->send(0, Tag::Answer, std::make_shared<control::Bytes>(encode(a)));
          ++answered_;
        }
        if (!any) std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    });
  }
  ~ScriptedWatches() {
    stop_.store(true);
    thread_.join();
  }
  int answered() const { return answered_.load(); }

 private:
  std::atomic<bool> stop_{false};
  std::atomic<int> answered_{0};
  std::thread thread_;
};

TEST(ControllerState, ATimeoutSaysWhoLagsAndWhatEveryWorkerRuns) {
  Session s;
  const Ident a = s.ctl->new_ident();
  s.ctl->make_node(a, "meshrt.sleep", std::source_location::current(), {});
  s.ctl->append({1, 2}, call(a), a);
  s.reply(1, Status{.first_uncompleted_ident = a + 1});
  ScriptedWatches watches(s.net, a);
  try {
    s.ctl->wait_for(a, std::chrono::milliseconds(1), "synchronize");
    FAIL() << "expected a TimeoutError";
  } catch (const TimeoutError& e) {
    const std::string text = e.what();
    // Rank 2 answers that it runs the invocation; rank 1 that it is idle past it.
    expect_contains(
        text,
        "synchronize did not complete within 0.001 s: rank 2 is behind: running meshrt.sleep (invocation 1) "
        "for 1.5 s\n");
    EXPECT_EQ(e.missing_ranks(), std::vector<int>{2}) << text;
    expect_contains(text, "desync report: what every worker is doing now");
    expect_contains(text, "idle (0 queued)");
    expect_contains(text, "1.500 s  CallFunction meshrt.sleep, issued at controller_state_test.cpp:");
    EXPECT_EQ(text.find("no answer within"), std::string::npos) << text;
  }
  EXPECT_GE(watches.answered(), 4);  // a dump and a state query, each to both ranks
  const std::string dump = s.ctl->dump_flight_recorder();
  expect_contains(dump, "flight recorder of rank 1\nflight recorder of rank 2\n");
}

// The desync table names a reduce once ("reduce sum over 'x'", not "Reduce reduce ...").
TEST(ControllerState, DesyncCommandWordsDoNotRepeatTheKind) {
  EXPECT_EQ(detail::command_words("Reduce", "reduce sum over 'x', issued at a.cpp:3 (f)"),
            "reduce sum over 'x', issued at a.cpp:3 (f)");
  EXPECT_EQ(detail::command_words("Reduce", "reduce_ sum over 'x'"), "reduce_ sum over 'x'");
  EXPECT_EQ(detail::command_words("CallFunction", "meshrt.sleep, issued at a.cpp:3 (f)"),
            "CallFunction meshrt.sleep, issued at a.cpp:3 (f)");
}

namespace {
CallSite site_in_a_lambda() {
  return [] { return std::source_location::current(); }();
}
}  // namespace

// Call sites read "file:line (function)": no return type, namespace, parameters or lambda.
TEST(ControllerState, CallSitesNameTheFunctionPlainly) {
  EXPECT_EQ(detail::short_function_name("void {anonymous}::train(meshrt::Controller&)::<lambda()>"), "train");
  EXPECT_EQ(detail::short_function_name("int main(int, char**)::<lambda(meshrt::Controller&)>"), "main");
  EXPECT_EQ(detail::short_function_name("void {anonymous}::errors(meshrt::Controller&)"), "errors");
  EXPECT_EQ(detail::short_function_name("T ns::Trainer<T>::step(std::vector<int>) [with T = float]"), "step");
  EXPECT_EQ(detail::short_function_name("std::map<int, int> ns::load<std::map<int, int> >(const char*)"), "load");
  EXPECT_EQ(detail::short_function_name("void ns::S::operator()(int) const"), "operator()");
  const std::string site = detail::describe(site_in_a_lambda());
  EXPECT_TRUE(site.starts_with("controller_state_test.cpp:")) << site;
  EXPECT_TRUE(site.ends_with(" (site_in_a_lambda)")) << site;
}

TEST(ControllerState, RestartWaitsForEveryWorkerAndForgetsTheOldSession) {
  Session s;
  const Ident a = s.ctl->new_ident();
  s.ctl->append({1, 2}, call(a), a);
  s.ctl->defer_delete({1, 2}, Ref{4});
  s.reply(1, Restarted{});
  s.reply(2, Restarted{});
  s.ctl->restart_workers();
  EXPECT_EQ(s.ctl->epoch(), 2u);
  EXPECT_GE(s.ctl->frontier(), a);  // nothing from before is outstanding
  const auto got = s.received(1);
  ASSERT_FALSE(got.empty());
  EXPECT_EQ(got.back(), Command{Exit{.restart = true}});
  expect_contains(test::usage_error([&] { s.ctl->check_epoch(1, "tensor"); }),
                  "this tensor was made before restart_workers()");
  // The deletes of the old session are not sent to the new one.
  s.ctl->flush_deferred();
  EXPECT_TRUE(s.received(1).empty());
}

TEST(ControllerState, ShutdownWaitsForEverythingThenEndsTheLoops) {
  Session s;
  s.reply(1, Status{.first_uncompleted_ident = 100});
  s.reply(2, Status{.first_uncompleted_ident = 100});
  s.ctl->shutdown(std::chrono::seconds(30));
  for (int rank : {1, 2}) {
    const auto got = s.received(rank);
    ASSERT_EQ(got.size(), 2u);
    EXPECT_TRUE(std::holds_alternative<RequestStatus>(got[0]));
    EXPECT_EQ(got[1], Command{Exit{.restart = false}});
  }
}

}  // namespace
}  // namespace meshrt
