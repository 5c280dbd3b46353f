// common/backoff.hpp: the phases of a wait (hot polls, spin, yield, idle) and the idle
// durations (waited / divisor, clamped), checked with lower bounds on the clock only.
#include "common/backoff.hpp"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

namespace meshrt::detail {
namespace {

using std::chrono::microseconds;
using std::chrono::milliseconds;

TEST(Backoff, HotPollsReturnAtOnceThenIdle) {
  const BackoffPolicy p{.hot_polls = 5, .sleep_divisor = 8, .min_sleep = microseconds(7), .max_sleep = microseconds(9)};
  Backoff b(p);
  std::vector<microseconds> idles;
  auto idle = [&](microseconds d) { idles.push_back(d); };
  for (int i = 0; i < 5; ++i) b.pause(idle);
  EXPECT_TRUE(idles.empty()) << "a hot poll idled";
  b.pause(idle);  // no spin, no yield: straight to the idle step, at its minimum
  ASSERT_EQ(idles.size(), 1u);
  EXPECT_EQ(idles[0], microseconds(7));
}

TEST(Backoff, NeverIdlesBeforeTheYieldPhaseEnds) {
  const BackoffPolicy p{.spin = microseconds(500), .yield = milliseconds(5)};
  Backoff b(p);
  bool idled = false;
  const auto start = Backoff::Clock::now();  // before the first pause, which starts the wait
  while (!idled) b.pause([&](microseconds) { idled = true; });
  EXPECT_GE(Backoff::Clock::now() - start, milliseconds(5)) << "idled during the yield phase";
}

TEST(Backoff, IdleGrowsWithTheWaitUpToItsMaximumAndResetStartsOver) {
  const BackoffPolicy p{.sleep_divisor = 4, .min_sleep = microseconds(10), .max_sleep = microseconds(100)};
  Backoff b(p);
  std::vector<microseconds> idles;
  auto idle = [&](microseconds d) { idles.push_back(d); };
  b.pause(idle);
  std::this_thread::sleep_for(milliseconds(1));  // waited / 4 >= 250 us: clamped
  b.pause(idle);
  b.reset();
  b.pause(idle);
  ASSERT_EQ(idles.size(), 3u);
  EXPECT_EQ(idles[0], microseconds(10));
  EXPECT_EQ(idles[1], microseconds(100));
  EXPECT_EQ(idles[2], microseconds(10)) << "reset() did not start a new wait";
}

TEST(Backoff, ExpiresOnlyAfterTheHotPolls) {
  Backoff b(kGroup);
  const auto past = Backoff::Clock::now() - milliseconds(1);
  EXPECT_FALSE(b.expired(past));
  for (int i = 0; i < kGroup.hot_polls; ++i) b.pause();
  EXPECT_TRUE(b.expired(past));
  EXPECT_FALSE(b.expired(Backoff::Clock::now() + std::chrono::hours(1)));
}

TEST(Backoff, YieldingUntilChangesOnlyTheYieldPhase) {
  const BackoffPolicy p = kGroup.yielding_until(milliseconds(3));
  EXPECT_EQ(p.yield, milliseconds(3));
  EXPECT_EQ(p.hot_polls, kGroup.hot_polls);
  EXPECT_EQ(p.sleep_divisor, kGroup.sleep_divisor);
  EXPECT_EQ(p.min_sleep, kGroup.min_sleep);
  EXPECT_EQ(p.max_sleep, kGroup.max_sleep);
}

}  // namespace
}  // namespace meshrt::detail
