// The CPU data plane's output pool (src/comm/output_pool.hpp): reuse of returned buffers,
// the cap, and which buffers a full cache gives up.
#include <gtest/gtest.h>

#include "comm/output_pool.hpp"

namespace meshrt::detail {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

TEST(OutputPool, AReturnedBufferIsHandedOutAgainForTheSameSize) {
  OutputPool pool(8 * kMiB);
  void* first = nullptr;
  {
    auto a = pool.get(kMiB);
    first = a.get();
  }
  auto b = pool.get(kMiB - 100);  // rounds to the same pages
  EXPECT_EQ(b.get(), first);
  auto c = pool.get(kMiB);  // b is held: a fresh one
  EXPECT_NE(c.get(), b.get());
  EXPECT_EQ(pool.stats().hits, 1u);
  EXPECT_EQ(pool.stats().misses, 2u);
}

TEST(OutputPool, AFullCacheEvictsTheLongestUnusedBuffersNotTheOneJustReturned) {
  OutputPool pool(3 * kMiB);
  {
    auto a = pool.get(kMiB);
    auto b = pool.get(kMiB);
  }  // two 1 MiB buffers cached: 2 MiB of 3
  EXPECT_EQ(pool.stats().cached_bytes, 2 * kMiB);
  void* big = nullptr;
  {
    auto c = pool.get(2 * kMiB);
    big = c.get();
  }  // 2 + 2 > 3: one 1 MiB buffer goes, the 2 MiB one stays
  EXPECT_EQ(pool.stats().cached_bytes, 3 * kMiB);
  auto again = pool.get(2 * kMiB);
  EXPECT_EQ(again.get(), big) << "the buffer the program uses now stays warm";
  auto small = pool.get(kMiB);  // the other 1 MiB buffer is still there
  EXPECT_EQ(pool.stats().hits, 2u);
  EXPECT_EQ(pool.stats().cached_bytes, 0u);
}

TEST(OutputPool, ABufferLargerThanTheCapIsNeverCached) {
  OutputPool pool(kMiB);
  { auto a = pool.get(kMiB / 2); }
  { auto b = pool.get(2 * kMiB); }
  EXPECT_EQ(pool.stats().cached_bytes, kMiB / 2) << "nothing was evicted for a buffer that cannot fit";
  OutputPool none(0);
  { auto c = none.get(kMiB); }
  EXPECT_EQ(none.stats().cached_bytes, 0u);
}

TEST(OutputPool, ReleaseFreesEveryCachedBufferAndLeavesHandedOutOnes) {
  OutputPool pool(16 * kMiB);
  auto held = pool.get(kMiB);
  for (std::size_t mib = 1; mib <= 4; ++mib) (void)pool.get(mib * kMiB);  // each returns at once
  EXPECT_EQ(pool.stats().cached_bytes, 10 * kMiB);
  EXPECT_EQ(pool.release(), 10 * kMiB);
  EXPECT_EQ(pool.stats().cached_bytes, 0u);
  held.reset();  // a buffer handed out before the release still returns
  EXPECT_EQ(pool.stats().cached_bytes, kMiB);
  EXPECT_EQ(pool.release(), kMiB);
  EXPECT_EQ(pool.release(), 0u);
}

TEST(OutputPool, TheDefaultCapIsAnEighthOfACoresShareOfMemoryAtMostOneGiB) {
  constexpr std::size_t kGiB = std::size_t{1} << 30;
  EXPECT_EQ(default_pool_cap(64 * kGiB, 2), kGiB);        // 4 GiB an eighth of a core's share
  EXPECT_EQ(default_pool_cap(16 * kGiB, 8), 256 * kMiB);  // 2 GiB per core
  EXPECT_EQ(default_pool_cap(8 * kGiB, 0), kGiB);         // cores unknown: one
  EXPECT_EQ(default_pool_cap(0, 8), kGiB);                // memory unknown: the old default
}

}  // namespace
}  // namespace meshrt::detail
