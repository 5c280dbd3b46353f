#include <gtest/gtest.h>
#include <mpi.h>

#include <meshrt/ndslice.hpp>
#include <meshrt/version.hpp>

TEST(Consumer, UsesMeshrtUnderMpi) {
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  EXPECT_EQ(size, 3);
  const auto world = meshrt::NDSlice::row_major({size});
  EXPECT_EQ(world.index(rank), rank);
  EXPECT_FALSE(meshrt::build_info().meshrt_version.empty());
}
