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

}  // namespace
}  // namespace meshrt::detail
