// 64 ranks (issue 15 item 4): a call + reduce + fetch loop through the fan-out tree
// (MESHRT_FANOUT=8 by default, threshold 16: every batch for the whole mesh goes down a
// tree of depth 2), and the timeout report of a hang on a rank inside the tree (rank 1
// forwards batches to ranks 16..23 and relays their status reports). Oversubscribed on a small machine: timeouts are
// generous and nothing here is timed.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>

#include "runtime_support.hpp"

using namespace meshrt;
using meshrt::test::session;

MESHRT_RUNTIME_TEST_ENVIRONMENT();

namespace {

TEST(Scale64, CallReduceFetchLoopThroughTheTree) {
  session([](Controller& ctl) {
    const int n = ctl.world_size();
    Mesh mesh = ctl.world_mesh({{"rank", n}});
    const ControlTraffic before = ctl.control_traffic();
    constexpr int kSteps = 5;
    for (int step = 1; step <= kSteps; ++step) {
      DTensor x = mesh.call("meshrt.full", {2}, DType::Float32, static_cast<double>(step));
      DTensor y = x.reduce("rank", Reduction::Sum);
      const Tensor got = ctl.fetch_shard(y, {{"rank", n - 1}}).get(std::chrono::seconds(120));
      for (float v : got.span<float>()) EXPECT_EQ(v, static_cast<float>(step * n)) << "step " << step;
    }
    ctl.synchronize(std::chrono::seconds(120));
    const ControlTraffic d = ctl.control_traffic().since(before);
    // Flat fan-out sends every batch for the mesh to all n ranks (at least 2n + 1
    // messages a step: call + reduce, and the fetch); the tree sends each to 8.
    const double per_step = static_cast<double>(d.sent_of(MessageKind::Command).messages) / kSteps;
    EXPECT_LT(per_step, n) << d.to_json();
  });
}

TEST(Scale64, TimeoutReportNamesARankHungInsideTheTree) {
  session([](Controller& ctl) {
    const int n = ctl.world_size();
    Mesh mesh = ctl.world_mesh({{"rank", n}});
    const int hung = 1;  // an inner node of the tree: it forwards to ranks 16..23
    DTensor s = mesh.call("test.sleep", 8.0, {hung});
    DTensor r = s.reduce("rank", Reduction::Sum);
    auto fut = ctl.fetch_shard(r, {{"rank", 0}});
    try {
      fut.get(std::chrono::seconds(3));
      ADD_FAILURE() << "expected a TimeoutError";
    } catch (const TimeoutError& e) {
      const std::string what = e.what();
      // Only the hung rank is behind: the ranks below it in the trees, cut off, are not.
      EXPECT_EQ(e.missing_ranks(), std::vector<int>{hung}) << what;
      EXPECT_NE(what.find(fmt::format("rank {} is behind: running test.sleep (invocation", hung)), std::string::npos)
          << what;
      EXPECT_NE(what.find("desync report"), std::string::npos) << what;
      // The others wait for it, and for its subtree too when the reduce's batch reached rank 1
      // after it had started sleeping: it relays batches to ranks 16..23 (both happen).
      EXPECT_TRUE(what.find(fmt::format("waiting for rank {} to join", hung)) != std::string::npos ||
                  what.find(fmt::format("waiting for ranks {}, 16, 17, 18, 19, 20, 21, 22, 23 to join", hung)) !=
                      std::string::npos)
          << what;
      // Its status reports and batches travel through it (fan-in and fan-out trees).
      EXPECT_NE(what.find(fmt::format("status tree: rank {} is busy or silent; its subtree (ranks 16, 17, 18, 19, 20, "
                                      "21, 22, 23) is unreachable through it",
                                      hung)),
                std::string::npos)
          << what;
    }
    EXPECT_EQ(fut.get(std::chrono::seconds(120)).item(), 0.0);  // it completes once the sleeper wakes
  });
}

}  // namespace
