// A real object over 2 GiB (MPI counts are int): 2.1 GiB of std::vector<char> from rank 0
// to rank 1 and back by broadcast, in chunks of MESHRT_GROUP_CHUNK_BYTES (1 GiB by
// default). Labelled "large": excluded from the default run (MESHRT_TEST_LARGE=1).
// Memory: one 2.1 GiB vector per rank (raw types are sent and received in place).
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <numeric>
#include <vector>

#include "meshrt/group.hpp"

using namespace std::chrono_literals;

namespace {
constexpr std::size_t kBytes = (std::size_t{21} << 30) / 10;  // 2.1 GiB
char pattern(std::size_t i) {
  return static_cast<char>((i * 2654435761u) >> 13);
}
}  // namespace

TEST(GroupLarge, ObjectOverTwoGiBBothWays) {
  auto g = meshrt::StatelessGroup::from_comm(MPI_COMM_WORLD);
  ASSERT_EQ(g.world_size(), 2);
  std::vector<char> v;
  if (g.rank() == 0) {
    v.resize(kBytes);
    for (std::size_t i = 0; i < kBytes; i += 4096) v[i] = pattern(i);
    v.back() = 'Z';
  }
  const auto t0 = std::chrono::steady_clock::now();
  if (g.rank() == 0) {
    g.send_obj(v, 1, 120s);
  } else {
    g.recv_obj_into(v, 0, 120s);
    ASSERT_EQ(v.size(), kBytes);
    for (std::size_t i = 0; i < kBytes; i += 4096) ASSERT_EQ(v[i], pattern(i)) << "at byte " << i;
    ASSERT_EQ(v.back(), 'Z');
    v.back() = 'Y';  // changed before it goes back
  }
  const auto t1 = std::chrono::steady_clock::now();
  v = g.broadcast_obj(std::move(v), 1, 120s);
  const auto t2 = std::chrono::steady_clock::now();
  ASSERT_EQ(v.size(), kBytes);
  EXPECT_EQ(v.back(), 'Y');
  EXPECT_EQ(v[4096 * 1000], pattern(4096 * 1000));
  if (g.rank() == 0) {
    std::printf("[large] %.2f GiB: send/recv %.2f s, broadcast %.2f s (chunks of %zu bytes)\n",
                static_cast<double>(kBytes) / (1 << 30), std::chrono::duration<double>(t1 - t0).count(),
                std::chrono::duration<double>(t2 - t1).count(), g.chunk_bytes());
  }
}
