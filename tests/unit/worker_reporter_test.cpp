// The worker's reporter (src/worker/reporter.hpp) over the in-memory transport: replies
// held behind a fetch still copying, a Status that never claims past it, and the status
// tree's subtree minimum.
#include <gtest/gtest.h>

#include <future>
#include <variant>

#include "common/backoff.hpp"
#include "meshrt/internal/control.hpp"
#include "meshrt/internal/device.hpp"
#include "worker/env.hpp"
#include "worker/monitor.hpp"
#include "worker/reporter.hpp"

namespace meshrt::detail {
namespace {

using namespace protocol;
using control::Tag;

struct Rig {
  explicit Rig(WorkerOptions o) : options(std::move(o)) {}
  std::shared_ptr<control::MemoryNetwork> net = control::MemoryNetwork::create();
  std::shared_ptr<control::Transport> controller = net->endpoint(0);
  WorkerOptions options;
  std::shared_ptr<control::Transport> worker = net->endpoint(options.rank);
  Monitor monitor{options.rank, 16};
  Env env{options.rank};
  Reporter reporter{*worker, monitor, options};

  // The replies the controller has received so far.
  std::vector<Reply> replies() {
    std::vector<Reply> out;
    control::Bytes bytes;
    while (controller->try_receive(control::kAnySource, Tag::Reply, bytes)) out.push_back(decode_reply(bytes));
    return out;
  }
};

WorkerOptions flat(int rank) {
  WorkerOptions o;
  o.rank = rank;
  o.status_interval_seconds = 1000;  // no timer reports
  return o;
}

TEST(WorkerReporter, StatusNeverClaimsPastAPendingWorkAndRepliesWaitBehindIt) {
  Rig rig(flat(1));
  rig.reporter.passed(4);
  // A fetch (ident 3) whose copy waits at a gate on an emulated stream.
  device::Backend& emulated = device::backend(Device::Kind::Emulated);
  const device::Stream stream = emulated.create_stream(0);
  std::promise<void> go;
  stream.enqueue([gate = go.get_future().share()] { gate.wait(); });
  device::Event copied = emulated.create_event(0);
  copied.record(stream);
  PendingWork fetch{.ident = 3, .function = "fetch", .mutates = {}, .value = Value(1), .copies = {}};
  fetch.copies.emplace_back(copied, stream);
  rig.reporter.fetched(std::move(fetch));
  rig.reporter.reply(RemoteFunctionFailed{.ident = 6, .error = "no luck", .rank = 1, .function = "f"});
  EXPECT_TRUE(rig.reporter.holding());
  EXPECT_EQ(rig.reporter.reportable(), 3u);

  // Asked past both: the Status claims only what precedes the fetch; the failure waits.
  rig.reporter.asked(7, 0);
  std::vector<Reply> got = rig.replies();
  ASSERT_EQ(got.size(), 1u);
  ASSERT_TRUE(std::holds_alternative<Status>(got[0]));
  EXPECT_EQ(std::get<Status>(got[0]).first_uncompleted_ident, 3u);
  EXPECT_FALSE(rig.reporter.poll(rig.env));
  EXPECT_TRUE(rig.replies().empty());

  // The copy done: the fetch's result, then the failure, in that order.
  go.set_value();
  stream.synchronize();
  EXPECT_TRUE(rig.reporter.poll(rig.env));
  got = rig.replies();
  ASSERT_EQ(got.size(), 2u);
  ASSERT_TRUE(std::holds_alternative<FetchResult>(got[0]));
  EXPECT_EQ(std::get<FetchResult>(got[0]).ident, 3u);
  ASSERT_TRUE(std::holds_alternative<RemoteFunctionFailed>(got[1]));
  EXPECT_EQ(std::get<RemoteFunctionFailed>(got[1]).ident, 6u);
  EXPECT_FALSE(rig.reporter.holding());
  EXPECT_EQ(rig.reporter.reportable(), 8u);
}

TEST(WorkerReporter, AFetchResultIsTheReportUpToItsIdent) {
  Rig rig(flat(1));
  rig.reporter.passed(2);
  rig.reporter.fetched(PendingWork{.ident = 3, .function = "fetch", .mutates = {}, .value = Value(1), .copies = {}});
  rig.reporter.passed(3);
  rig.reporter.report(/*moved_and_idle=*/true, 0);  // nothing new past the FetchResult
  const std::vector<Reply> got = rig.replies();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_TRUE(std::holds_alternative<FetchResult>(got[0]));
}

// A report to rank 1 from `from`, as a child sends it.
void tree_report(Rig& rig, int from, Ident min, std::uint32_t epoch, std::vector<std::int32_t> ranks = {},
                 std::vector<std::uint64_t> counts = {}) {
  auto child = rig.net->endpoint(from);
  child->send(1, control::tree_status_tag(epoch),
              std::make_shared<control::Bytes>(encode(Reply{TreeStatus{.first_uncompleted_ident = min,
                                                                       .epoch = epoch,
                                                                       .direct_ranks = std::move(ranks),
                                                                       .direct_counts = std::move(counts)}})));
}

TEST(WorkerReporter, TheTreeReportsItsSubtreesMinimumOnceTheSubtreePassedTheAsk) {
  WorkerOptions o = flat(1);
  o.epoch = 2;
  o.status_parent = kStatusToController;
  o.status_children = {2, 3};
  Rig rig(o);
  rig.reporter.passed(9);
  rig.reporter.asked(4, 0);  // no Status of its own with the tree
  rig.reporter.report(true, 0);
  EXPECT_TRUE(rig.replies().empty()) << "a silent child counts as having passed nothing";

  tree_report(rig, 2, 7, 2);
  tree_report(rig, 4, 100, 2);  // not a child: dropped
  tree_report(rig, 3, 100, 1);  // an earlier session: stale
  EXPECT_TRUE(rig.reporter.receive_tree());
  rig.reporter.report(false, 0);
  EXPECT_TRUE(rig.replies().empty()) << "child 3 has not passed the ask";

  tree_report(rig, 3, 5, 2, {3}, {2});
  EXPECT_TRUE(rig.reporter.receive_tree());
  rig.reporter.report(false, 0);
  std::vector<Reply> got = rig.replies();
  ASSERT_EQ(got.size(), 1u);
  ASSERT_TRUE(std::holds_alternative<TreeStatus>(got[0]));
  const auto& first = std::get<TreeStatus>(got[0]);
  EXPECT_EQ(first.first_uncompleted_ident, 5u);  // min(own 10, 7, 5)
  EXPECT_EQ(first.epoch, 2u);
  EXPECT_EQ(first.direct_ranks, (std::vector<std::int32_t>{3}));
  EXPECT_EQ(first.direct_counts, (std::vector<std::uint64_t>{2}));

  // A reply straight to the controller is counted in the next report.
  rig.reporter.reply(RemoteFunctionFailed{.ident = 10, .error = "no luck", .rank = 1, .function = "f"});
  rig.reporter.passed(10);
  rig.reporter.asked(8, 0);
  tree_report(rig, 2, 11, 2);
  tree_report(rig, 3, 9, 2);
  EXPECT_TRUE(rig.reporter.receive_tree());
  rig.reporter.report(false, 0);
  got = rig.replies();
  ASSERT_EQ(got.size(), 2u);
  EXPECT_TRUE(std::holds_alternative<RemoteFunctionFailed>(got[0]));
  ASSERT_TRUE(std::holds_alternative<TreeStatus>(got[1]));
  const auto& second = std::get<TreeStatus>(got[1]);
  EXPECT_EQ(second.first_uncompleted_ident, 9u);
  EXPECT_EQ(second.direct_ranks, (std::vector<std::int32_t>{1}));
  EXPECT_EQ(second.direct_counts, (std::vector<std::uint64_t>{1}));
  // Answered: nothing more until the next ask (the timer is off).
  rig.reporter.report(false, 0);
  EXPECT_TRUE(rig.replies().empty());
  Backoff backoff;
  rig.reporter.finish(rig.env, backoff);  // owes nothing: returns
}

}  // namespace
}  // namespace meshrt::detail
