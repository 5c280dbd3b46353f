// The MPI test harness itself: every rank runs every test, collectives work, and the
// communicators the harness uses do not interfere with a test's own.
#include <gtest/gtest.h>
#include <mpi.h>

#include <numeric>
#include <vector>

#include "meshrt/ndslice.hpp"

TEST(Harness, AllRanksTakePart) {
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  ASSERT_EQ(size, 4);
  int sum = 0;
  MPI_Allreduce(&rank, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  EXPECT_EQ(sum, size * (size - 1) / 2);
}

TEST(Harness, ThreadLevelIsMultiple) {
  int provided = 0;
  MPI_Query_thread(&provided);
  EXPECT_EQ(provided, MPI_THREAD_MULTIPLE);
}

TEST(Harness, NDSliceRanksAgreeAcrossRanks) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const meshrt::NDSlice world = meshrt::NDSlice::row_major({2, 2});
  const auto coords = world.coordinates(rank);
  std::vector<long long> all(8);
  long long mine[2] = {coords[0], coords[1]};
  MPI_Allgather(mine, 2, MPI_LONG_LONG, all.data(), 2, MPI_LONG_LONG, MPI_COMM_WORLD);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(world.location(std::vector<meshrt::NDSlice::Int>{all[2 * r], all[2 * r + 1]}), r);
  }
}
