// The control plane without MPI: the out-of-band query frames, the in-memory transport,
// the completion tracker and the dependency graph (src/control, src/controller).
#include <gtest/gtest.h>

#include <thread>

#include "../support/expect_error.hpp"
#include "controller/completion.hpp"
#include "controller/graph.hpp"
#include "meshrt/controller.hpp"
#include "meshrt/internal/control.hpp"
#include "meshrt/internal/protocol.hpp"

namespace meshrt {
namespace {

using namespace protocol;
using control::Bytes;
using control::Tag;
using detail::CompletionTracker;
using detail::DependencyGraph;
using detail::Node;
using test::expect_contains;

constexpr auto* protocol_error = &test::error_of<ProtocolError>;

// ------------------------------------------------------------------ query frames

TEST(QueryProtocol, EveryOpRoundTripsCanonically) {
  for (int op = 0; op < kNumQueryOps; ++op) {
    const Query q{.id = 7u + static_cast<unsigned>(op), .op = static_cast<QueryOp>(op), .limit = 20, .reason = "why"};
    const auto bytes = encode(q);
    EXPECT_EQ(decode_query(bytes), q);
    EXPECT_EQ(encode(decode_query(bytes)), bytes);
    const QueryAnswer a{.query = q.id, .rank = 3, .op = q.op, .payload = R"({"current":null})", .error = ""};
    const auto abytes = encode(a);
    EXPECT_EQ(decode_query_answer(abytes), a);
    EXPECT_EQ(encode(decode_query_answer(abytes)), abytes);
  }
}

TEST(QueryProtocol, DecoderRejectsWhatIsNotAQuery) {
  auto bytes = encode(Query{.id = 1, .op = QueryOp::Dump});
  // The op byte follows the 4-byte header and the 8-byte id.
  auto bad_op = bytes;
  bad_op[12] = std::byte{9};
  const std::string op_error = protocol_error([&] { decode_query(bad_op); });
  expect_contains(op_error, "Query.op");
  expect_contains(op_error, "9");
  // A query is not an answer, nor a command: the frame kind says so.
  expect_contains(protocol_error([&] { decode_query_answer(bytes); }), "frame kind");
  expect_contains(protocol_error([&] { decode_command(bytes); }), "frame kind");
  auto truncated = bytes;
  truncated.pop_back();
  expect_contains(protocol_error([&] { decode_query(truncated); }), "Query.reason");
  auto longer = bytes;
  longer.push_back(std::byte{0});
  expect_contains(protocol_error([&] { decode_query(longer); }), "expected the frame to end");
  auto answer = encode(QueryAnswer{.query = 1, .rank = -7});
  expect_contains(protocol_error([&] { decode_query_answer(answer); }), "QueryAnswer.rank");
}

// ------------------------------------------------------------------ fan-out envelope

TEST(EnvelopeProtocol, RoundTripsCanonicallyAndNamesTheTree) {
  const Envelope e{
      .fanout = 2, .ranks = {4, 1, 7, 2, 9}, .seqs = {1, 5, 2, 2, 3}, .payload = encode(Command{RequestStatus{11}})};
  const auto bytes = encode(e);
  EXPECT_TRUE(is_envelope(bytes));
  EXPECT_FALSE(is_envelope(e.payload));
  EXPECT_EQ(decode_envelope(bytes), e);
  EXPECT_EQ(encode(decode_envelope(bytes)), bytes);
  // Controller -> positions 0,1; 0 -> 2,3; 1 -> 4; 2.. -> none.
  EXPECT_EQ(tree_children(5, 2, -1), (std::pair<std::size_t, std::size_t>{0, 2}));
  EXPECT_EQ(tree_children(5, 2, 0), (std::pair<std::size_t, std::size_t>{2, 4}));
  EXPECT_EQ(tree_children(5, 2, 1), (std::pair<std::size_t, std::size_t>{4, 5}));
  EXPECT_EQ(tree_children(5, 2, 2).first, tree_children(5, 2, 2).second);
  // Flat: fanout = size, every rank is the controller's child.
  EXPECT_EQ(tree_children(5, 5, -1), (std::pair<std::size_t, std::size_t>{0, 5}));
  EXPECT_EQ(tree_children(5, 5, 0).first, 5u);
}

TEST(EnvelopeProtocol, DecoderRejectsABadTree) {
  auto with = [](Envelope e) { return encode(e); };
  const Envelope good{.fanout = 2, .ranks = {1, 2}, .seqs = {1, 1}, .payload = encode(Command{RequestStatus{1}})};
  Envelope e = good;
  e.fanout = 0;
  expect_contains(protocol_error([&] { decode_envelope(with(e)); }), "Envelope.fanout");
  e = good;
  e.ranks = {3, 3};
  expect_contains(protocol_error([&] { decode_envelope(with(e)); }), "found rank 3 twice");
  e = good;
  e.ranks = {1, -2};
  expect_contains(protocol_error([&] { decode_envelope(with(e)); }), "expected a rank >= 0, found -2");
  e = good;
  e.seqs = {1, 0};
  expect_contains(protocol_error([&] { decode_envelope(with(e)); }), "Envelope.seqs");
  e = good;
  e.ranks = {};
  e.seqs = {};
  expect_contains(protocol_error([&] { decode_envelope(with(e)); }), "at least one destination");
  auto cut = with(good);
  cut.pop_back();
  expect_contains(protocol_error([&] { decode_envelope(cut); }), "Envelope.payload");
  // A count of ranks the frame cannot hold is refused before anything is allocated.
  auto big = with(good);
  big[8] = std::byte{0xff};
  big[9] = std::byte{0xff};
  expect_contains(protocol_error([&] { decode_envelope(big); }), "Envelope.ranks");
  e = good;
  e.seqs = {1};
  EXPECT_THROW(encode(e), ProtocolError);
}

// ------------------------------------------------------------------ in-memory transport

std::shared_ptr<const Bytes> bytes_of(std::initializer_list<int> v) {
  auto b = std::make_shared<Bytes>();
  for (int x : v) b->push_back(static_cast<std::byte>(x));
  return b;
}

TEST(MemoryTransport, SendsToASetAndKeepsTagsAndSendersApart) {
  auto net = control::MemoryNetwork::create();
  auto controller = net->endpoint(0);
  auto w1 = net->endpoint(1);
  auto w2 = net->endpoint(2);
  controller->send({1, 2}, Tag::Command, bytes_of({1}));
  controller->send(1, Tag::Command, bytes_of({2}));
  controller->send(1, Tag::Query, bytes_of({3}));
  Bytes out;
  int from = -1;
  EXPECT_FALSE(w1->try_receive(0, Tag::Reply, out));
  ASSERT_TRUE(w1->try_receive(0, Tag::Command, out, &from));
  EXPECT_EQ(out, *bytes_of({1}));
  EXPECT_EQ(from, 0);
  ASSERT_TRUE(w1->try_receive(0, Tag::Command, out));
  EXPECT_EQ(out, *bytes_of({2}));  // in the order sent
  EXPECT_FALSE(w1->try_receive(0, Tag::Command, out));
  ASSERT_TRUE(w1->try_receive(control::kAnySource, Tag::Query, out));
  EXPECT_EQ(out, *bytes_of({3}));
  ASSERT_TRUE(w2->try_receive(0, Tag::Command, out));
  EXPECT_EQ(out, *bytes_of({1}));

  w2->send(0, Tag::Reply, bytes_of({20}));
  w1->send(0, Tag::Reply, bytes_of({10}));
  EXPECT_FALSE(controller->try_receive(3, Tag::Reply, out));  // from a rank that sent nothing
  ASSERT_TRUE(controller->try_receive(1, Tag::Reply, out, &from));
  EXPECT_EQ(from, 1);
  EXPECT_EQ(out, *bytes_of({10}));
  ASSERT_TRUE(controller->try_receive(control::kAnySource, Tag::Reply, out, &from));
  EXPECT_EQ(from, 2);
  EXPECT_TRUE(controller->drain(std::chrono::seconds(0)));
}

TEST(MemoryTransport, CountsEveryMessageAndByteByKindOncePerDestination) {
  auto net = control::MemoryNetwork::create();
  auto controller = net->endpoint(0);
  auto w1 = net->endpoint(1);
  const ControlTraffic process_before = control::process_traffic();
  controller->send({1, 2, 3}, Tag::Command, bytes_of({1, 2, 3, 4, 5}));
  controller->send(1, Tag::Query, bytes_of({1, 2}));
  Bytes out;
  ASSERT_TRUE(w1->try_receive(0, Tag::Command, out));
  EXPECT_FALSE(w1->try_receive(0, Tag::Command, out));  // nothing taken: nothing counted
  w1->send(0, Tag::Reply, bytes_of({9, 9, 9}));
  ASSERT_TRUE(controller->try_receive(control::kAnySource, Tag::Reply, out));

  const ControlTraffic c = controller->traffic();
  EXPECT_EQ(c.sent_of(MessageKind::Command), (MessageCount{3, 15}));
  EXPECT_EQ(c.sent_of(MessageKind::Query), (MessageCount{1, 2}));
  EXPECT_EQ(c.sent_of(MessageKind::Reply), (MessageCount{}));
  EXPECT_EQ(c.received_of(MessageKind::Reply), (MessageCount{1, 3}));
  EXPECT_EQ(c.sent_total(), (MessageCount{4, 17}));
  EXPECT_EQ(c.received_total(), (MessageCount{1, 3}));
  const ControlTraffic w = w1->traffic();
  EXPECT_EQ(w.received_of(MessageKind::Command), (MessageCount{1, 5}));
  EXPECT_EQ(w.sent_of(MessageKind::Reply), (MessageCount{1, 3}));
  EXPECT_EQ(w.received_of(MessageKind::Query), (MessageCount{}));  // still waiting

  // The process sums every transport of the process.
  const ControlTraffic p = control::process_traffic().since(process_before);
  EXPECT_EQ(p.sent_total(), (MessageCount{5, 20}));
  EXPECT_EQ(p.received_total(), (MessageCount{2, 8}));
  // The JSON form names each kind.
  expect_contains(c.to_json(), R"("sent":{"Command":{"messages":3,"bytes":15})");
  const ControlTraffic later = controller->traffic();
  EXPECT_EQ(later.since(c), ControlTraffic{});
}

TEST(MemoryTransport, WaitForSeesAMessageFromAnotherThread) {
  auto net = control::MemoryNetwork::create();
  std::thread sender([&] { net->endpoint(1)->send(0, Tag::Reply, bytes_of({5})); });
  int from = -1;
  const auto got = net->wait_for(0, Tag::Reply, std::chrono::seconds(10), &from);
  sender.join();
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(*got, *bytes_of({5}));
  EXPECT_EQ(from, 1);
  EXPECT_FALSE(net->wait_for(0, Tag::Reply, std::chrono::milliseconds(1)).has_value());
}

// ------------------------------------------------------------------ completion tracker

TEST(CompletionTracker, FrontierIsTheSmallestOutstandingIdentLessOne) {
  CompletionTracker t({1, 2});
  EXPECT_EQ(t.frontier(), 0u);
  const Ident a = t.new_ident(), b = t.new_ident(), c = t.new_ident();
  EXPECT_EQ(t.frontier(), c);  // nothing sent is outstanding
  t.sent({1, 2}, a);
  t.sent({1}, b);
  t.sent({2}, c);
  EXPECT_EQ(t.frontier(), a - 1);
  // Complete on one worker is not complete.
  t.completed(1, a + 1);
  EXPECT_EQ(t.frontier(), a - 1);
  t.status(2, Status{.first_uncompleted_ident = a + 1, .live_values = 4});
  EXPECT_EQ(t.frontier(), b - 1);
  EXPECT_EQ(t.live_values(2), 4u);
  // A worker that reports past an ident it never got does not complete it elsewhere.
  t.completed(2, c + 1);
  EXPECT_EQ(t.frontier(), b - 1);
  EXPECT_EQ(t.missing(b), std::vector<int>{1});
  t.completed(1, b + 1);
  EXPECT_EQ(t.frontier(), c);
  EXPECT_TRUE(t.missing(c).empty());
}

TEST(CompletionTracker, AsksEachLaggingWorkerOnceAndReportsWhatItRuns) {
  CompletionTracker t({1, 2, 3});
  const Ident a = t.new_ident();
  const Ident sync = t.new_ident("synchronize");
  t.describe(a, "meshrt.sleep", std::source_location::current());
  t.sent({1, 2}, a);
  t.sent({1, 2, 3}, sync);
  EXPECT_EQ(t.to_ask(sync), (std::vector<int>{1, 2, 3}));
  EXPECT_TRUE(t.to_ask(sync).empty());  // asked already
  t.completed(3, sync + 1);
  t.completed(2, sync + 1);
  const std::string report = t.lagging_report(sync);
  expect_contains(report, "rank 1: has not reported invocation " + std::to_string(a));
  expect_contains(report, "meshrt.sleep, issued at control_test.cpp:");
  EXPECT_EQ(report.find("rank 2"), std::string::npos);
  EXPECT_EQ(t.describe_ident(sync), "synchronize");
  EXPECT_EQ(t.describe_ident(999), "?");
  t.completed(1, sync + 1);
  t.forget_complete();
  EXPECT_FALSE(t.described(a));
  EXPECT_EQ(t.describe_ident(a), "?");
  expect_contains(test::usage_error([&] { t.live_values(7); }), "rank 7 runs no worker");
}

TEST(CompletionTracker, RestartForgetsEverythingOutstanding) {
  CompletionTracker t({1, 2});
  const Ident a = t.new_ident();
  t.sent({1, 2}, a);
  t.status(1, Status{.first_uncompleted_ident = 0, .live_values = 9});
  t.expect_restart();
  EXPECT_FALSE(t.all_restarted());
  t.worker_restarted();
  EXPECT_FALSE(t.all_restarted());
  t.worker_restarted();
  EXPECT_TRUE(t.all_restarted());
  t.restart();
  EXPECT_EQ(t.frontier(), a);
  EXPECT_EQ(t.live_values(1), 0u);
  EXPECT_EQ(t.outstanding(1), 0u);
  // Idents keep growing: an old reply can never complete a new invocation.
  EXPECT_GT(t.new_ident(), a);
}

TEST(CompletionTracker, ASubtreeReportCompletesEveryRankOfItOnlyAfterTheDirectRepliesItCounts) {
  // Top nodes 1 and 2 of a binary tree over 1..5: 1 relays 3 and 4, 2 relays 5.
  CompletionTracker t({1, 2, 3, 4, 5});
  t.use_tree({{1, {1, 3, 4}}, {2, {2, 5}}});
  EXPECT_TRUE(t.has_tree());
  const Ident a = t.new_ident(), b = t.new_ident();
  t.sent({1, 2, 3, 4, 5}, a);
  t.sent({4}, b);
  // Rank 4 sent one reply straight to the controller (b's failure) before the subtree
  // passed b: the report waits for it, so no Status past b is applied before b's failure.
  t.tree_status(1, TreeStatus{.first_uncompleted_ident = b + 1, .epoch = 0, .direct_ranks = {4}, .direct_counts = {1}});
  EXPECT_EQ(t.held_reports(), 1u);
  EXPECT_EQ(t.outstanding(3), 1u);
  t.tree_status(2, TreeStatus{.first_uncompleted_ident = a + 1, .epoch = 0, .direct_ranks = {}, .direct_counts = {}});
  EXPECT_EQ(t.outstanding(5), 0u);
  EXPECT_EQ(t.frontier(), a - 1);
  t.direct_reply(3);  // another rank's reply does not count for rank 4's
  EXPECT_EQ(t.held_reports(), 1u);
  t.direct_reply(4);
  EXPECT_EQ(t.held_reports(), 0u);
  EXPECT_EQ(t.frontier(), b);
  // Reports from one node apply in order: a later one waits behind a held one.
  const Ident c = t.new_ident();
  t.sent({1, 2, 3, 4, 5}, c);
  t.tree_status(1, TreeStatus{.first_uncompleted_ident = c, .epoch = 0, .direct_ranks = {3}, .direct_counts = {2}});
  t.tree_status(1, TreeStatus{.first_uncompleted_ident = c + 1, .epoch = 0, .direct_ranks = {}, .direct_counts = {}});
  t.tree_status(2, TreeStatus{.first_uncompleted_ident = c + 1, .epoch = 0, .direct_ranks = {}, .direct_counts = {}});
  EXPECT_EQ(t.held_reports(), 2u);
  EXPECT_EQ(t.frontier(), c - 1);
  t.direct_reply(3);
  EXPECT_EQ(t.frontier(), c);
  // Only a top node reports for a subtree.
  const auto e = test::error_of<ProtocolError>([&] { t.tree_status(3, TreeStatus{}); });
  expect_contains(e, "came from rank 3, which is not a top node");
  // A restart forgets what the old session's workers sent.
  t.restart();
  EXPECT_EQ(t.held_reports(), 0u);
}

TEST(StatusTree, IsTheFanOutShapeOverTheWorkers) {
  EXPECT_FALSE(control::StatusTree::for_job({1, 2, 3}, 2, 3).has_value());
  EXPECT_FALSE(control::StatusTree::for_job({1, 2, 3, 4}, 0, 0).has_value());
  const auto tree = control::StatusTree::for_job({0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, 2, 1);
  ASSERT_TRUE(tree.has_value());
  EXPECT_EQ(tree->top(), (std::vector<int>{0, 1}));
  EXPECT_TRUE(tree->is_top(1));
  EXPECT_EQ(tree->parent(1), control::kControllerRank);
  EXPECT_EQ(tree->children(0), (std::vector<int>{2, 3}));
  EXPECT_EQ(tree->children(1), (std::vector<int>{4, 5}));
  EXPECT_EQ(tree->parent(5), 1);
  EXPECT_EQ(tree->parent(9), 3);
  EXPECT_EQ(tree->subtree(0), (std::vector<int>{0, 2, 3, 6, 7, 8, 9}));
  EXPECT_EQ(tree->subtree(1), (std::vector<int>{1, 4, 5}));
  EXPECT_EQ(tree->ancestors(9), (std::vector<int>{0, 3}));
  EXPECT_TRUE(tree->children(9).empty());
  // Every rank is in exactly one top node's subtree.
  EXPECT_EQ(tree->subtree(0).size() + tree->subtree(1).size(), 10u);
  expect_contains(test::usage_error([&] { tree->parent(12); }), "rank 12 runs no worker of this job");
}

// ------------------------------------------------------------------ dependency graph

RemoteFunctionFailed failed(Ident ident, int rank, std::string function) {
  return RemoteFunctionFailed{
      .ident = ident, .error = "boom", .rank = rank, .function = std::move(function), .exception_type = "E"};
}

TEST(DependencyGraph, FailureOfNamesTheRootCauseAndTheChain) {
  DependencyGraph g;
  const auto here = std::source_location::current();
  auto a = g.make_node(1, "meshrt.ok", here, {});
  auto b = g.make_node(2, "meshrt.fail", here, {a});
  auto c = g.make_node(3, "meshrt.fail_later", here, {});
  auto r = g.make_node(0, "reduce sum over 'x'", here, {b, c});
  auto d = g.make_node(4, "meshrt.use", here, {r});
  // Nothing failed yet, and nothing is complete: no error, and nothing is settled (a
  // failure may still be reported).
  EXPECT_EQ(g.failure_of(d, "fetch", 0), nullptr);
  EXPECT_FALSE(d->clean);
  EXPECT_FALSE(a->clean);
  g.record_failure(failed(3, 1, "meshrt.fail_later"));
  g.record_failure(failed(2, 2, "meshrt.fail"));
  g.record_failure(failed(2, 1, "meshrt.fail"));
  const auto e = g.failure_of(d, "fetch (invocation 5)", 4);
  ASSERT_NE(e, nullptr);
  try {
    std::rethrow_exception(e);
  } catch (const RemoteError& err) {
    // The smallest failed ident is the root cause, on every rank that reported it.
    EXPECT_EQ(err.ident(), 2u);
    EXPECT_EQ(err.ranks(), (std::vector<int>{1, 2}));
    const std::string text = err.what();
    expect_contains(text, "fetch (invocation 5) depends on a failed invocation: meshrt.fail failed on ranks 1, 2");
    // From the value used back to the cause.
    expect_contains(text, "chain: meshrt.use (invocation 4, control_test.cpp:");
    expect_contains(text, "<- reduce sum over 'x' (control_test.cpp:");
    expect_contains(text, "<- meshrt.fail (invocation 2, control_test.cpp:");
  }
  // The failure of the node itself is said without a chain.
  try {
    std::rethrow_exception(g.failure_of(c, "fetch", 4));
  } catch (const RemoteError& err) {
    EXPECT_EQ(std::string(err.what()).find("chain"), std::string::npos);
    EXPECT_EQ(err.ident(), 3u);
  }
}

TEST(DependencyGraph, FailureOfPrunesWhatIsCompleteAndClean) {
  DependencyGraph g;
  const auto here = std::source_location::current();
  auto a = g.make_node(1, "a", here, {});
  auto r = g.make_node(0, "reduce", here, {a});
  auto b = g.make_node(2, "b", here, {r});
  EXPECT_EQ(g.failure_of(b, "fetch", 1), nullptr);
  EXPECT_TRUE(a->clean);
  EXPECT_TRUE(r->clean);
  EXPECT_FALSE(b->clean);  // beyond the frontier
  EXPECT_EQ(g.failure_of(b, "fetch", 2), nullptr);
  EXPECT_TRUE(b->clean);
  EXPECT_TRUE(b->inputs.empty());
}

TEST(DependencyGraph, PruneSettlesNodesBehindTheFrontier) {
  DependencyGraph g;
  const auto here = std::source_location::current();
  auto a = g.make_node(1, "a", here, {});
  auto b = g.make_node(2, "b", here, {a});
  auto bad = g.make_node(3, "bad", here, {});
  auto c = g.make_node(4, "c", here, {bad});
  auto late = g.make_node(5, "late", here, {b});
  EXPECT_EQ(g.unsettled(), 5u);
  g.record_failure(failed(3, 0, "bad"));
  g.prune(4);
  EXPECT_TRUE(a->clean);
  EXPECT_TRUE(b->clean);
  EXPECT_TRUE(b->inputs.empty());  // clean nodes drop their inputs
  EXPECT_TRUE(bad->poisoned);
  EXPECT_TRUE(c->poisoned);
  EXPECT_EQ(c->inputs.size(), 1u);  // poisoned nodes keep them, for the chain
  EXPECT_FALSE(late->clean);        // beyond the frontier
  EXPECT_EQ(g.unsettled(), 1u);
  // A node made from clean inputs does not keep them.
  auto d = g.make_node(6, "d", here, {a, b, c});
  EXPECT_EQ(d->inputs.size(), 1u);
  g.prune(6);
  EXPECT_TRUE(late->clean);
  EXPECT_TRUE(d->poisoned);
  EXPECT_EQ(g.unsettled(), 0u);
}

TEST(DependencyGraph, AResultDroppedBeforeTheNextCommandIsForgottenAtOnce) {
  DependencyGraph g;
  const auto here = std::source_location::current();
  auto x = g.make_node(1, "x", here, {});
  // A loop that discards its results: each node goes before the next is made, so the
  // graph holds x and the last one, not a thousand nodes until the next prune.
  for (Ident i = 2; i < 1000; ++i) (void)g.make_node(i, "reduce sum over 'x'", here, {x});
  EXPECT_EQ(g.unsettled(), 2u);
  // A result kept, with dropped ones after it, stays and settles as before.
  auto kept = g.make_node(1000, "reduce sum over 'x'", here, {x});
  for (Ident i = 1001; i < 1010; ++i) (void)g.make_node(i, "reduce sum over 'x'", here, {kept});
  EXPECT_EQ(g.unsettled(), 3u);  // x, kept and the last
  g.record_failure(failed(1000, 0, "reduce"));
  g.prune(1009);
  EXPECT_TRUE(x->clean);
  EXPECT_TRUE(kept->poisoned);
  EXPECT_EQ(g.unsettled(), 0u);
}

TEST(DependencyGraph, UnobservedFailuresAreRaisedOnce) {
  DependencyGraph g;
  int more = -1;
  EXPECT_EQ(g.take_unobserved(&more), nullptr);
  EXPECT_EQ(more, 0);
  g.record_failure(failed(0, 2, "CreateDeviceMesh"));
  g.record_failure(failed(7, 1, "meshrt.fail"));
  const auto first = g.take_unobserved(&more);
  ASSERT_NE(first, nullptr);
  EXPECT_EQ(more, 1);
  try {
    std::rethrow_exception(first);
  } catch (const RemoteError& e) {
    EXPECT_EQ(e.ident(), 0u);  // the smallest ident first
    expect_contains(e.what(), "CreateDeviceMesh failed on rank 2");
  }
  EXPECT_EQ(g.take_unobserved(&more), nullptr);
  // A second failure outside an invocation is an entry of its own, raised in turn.
  g.record_failure(failed(0, 1, "DeleteRefs"));
  const auto again = g.take_unobserved(&more);
  ASSERT_NE(again, nullptr);
  EXPECT_EQ(more, 0);
  expect_contains(test::error_of<RemoteError>([&] { std::rethrow_exception(again); }), "DeleteRefs failed on rank 1");
}

TEST(DependencyGraph, ALongChainIsSummarisedAndItsCauseFoundWithoutAWalk) {
  DependencyGraph g;
  const auto here = std::source_location::current();
  auto bad = g.make_node(1, "meshrt.fail", here, {});
  std::shared_ptr<Node> x = bad;
  constexpr Ident kSteps = 20000;
  for (Ident i = 2; i <= kSteps + 1; ++i) x = g.make_node(i, "meshrt.add", here, {x});
  g.record_failure(failed(1, 0, "meshrt.fail"));
  // Before the frontier passes it, the walk finds it, and the text is summarised.
  const auto walked = g.failure_of(x, "fetch", 0);
  ASSERT_NE(walked, nullptr);
  std::string text;
  try {
    std::rethrow_exception(walked);
  } catch (const RemoteError& e) {
    text = e.what();
    EXPECT_EQ(e.ident(), 1u);
  }
  EXPECT_LT(text.size(), 2000u) << text.size();
  expect_contains(text, "<- ... and 19,996 more");
  // Settled, every node knows its cause and how far it is.
  g.prune(kSteps + 1);
  EXPECT_TRUE(x->poisoned);
  EXPECT_EQ(x->cause, 1u);
  EXPECT_EQ(x->links, kSteps);
  const auto settled = g.failure_of(x, "fetch", kSteps + 1);
  try {
    std::rethrow_exception(settled);
  } catch (const RemoteError& e) {
    EXPECT_EQ(e.ident(), 1u);
    EXPECT_EQ(std::string(e.what()), text);  // the same text either way
  }
}

TEST(DependencyGraph, PruneIsDueEvery1024Nodes) {
  DependencyGraph g;
  int due = 0;
  for (int i = 0; i < 3000; ++i) due += g.prune_due() ? 1 : 0;
  EXPECT_EQ(due, 2);
}

}  // namespace
}  // namespace meshrt
