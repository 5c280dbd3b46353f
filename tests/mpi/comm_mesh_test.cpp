// WorkerMesh: membership, coordinates and per-dimension communicators of 1-, 2- and 3-D
// meshes, sliced and strided, built by some ranks while others do something else.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "comm_test_util.hpp"

namespace meshrt::test {
namespace {

using ::testing::HasSubstr;

// Checks every dimension's communicator against lines computed here from the NDSlice.
void check_mesh(WorkerMesh& mesh) {
  const NDSlice& ranks = mesh.ranks();
  const int me = world_rank();
  ASSERT_EQ(mesh.world_rank(), me);
  const std::vector<std::int64_t> coords = ranks.coordinates(me);
  EXPECT_EQ(mesh.coordinates(), coords);
  int mesh_rank = -1, mesh_size = 0;
  MPI_Comm_rank(mesh.comm(), &mesh_rank);
  MPI_Comm_size(mesh.comm(), &mesh_size);
  EXPECT_EQ(mesh_rank, ranks.index(me));
  EXPECT_EQ(mesh_size, ranks.len());
  for (std::size_t d = 0; d < mesh.ndim(); ++d) {
    MPI_Comm c = mesh.dim_comm(d);
    EXPECT_EQ(mesh.dim_comm(d), c) << "dim_comm must be created once";
    int r = -1, s = 0;
    MPI_Comm_rank(c, &r);
    MPI_Comm_size(c, &s);
    EXPECT_EQ(s, ranks.sizes()[d]) << "dimension " << mesh.names()[d];
    EXPECT_EQ(r, coords[d]) << "dimension " << mesh.names()[d];
    std::vector<int> members(static_cast<std::size_t>(s));
    MPI_Allgather(&me, 1, MPI_INT, members.data(), 1, MPI_INT, c);
    std::vector<int> expected;
    std::vector<std::int64_t> at = coords;
    for (std::int64_t k = 0; k < ranks.sizes()[d]; ++k) {
      at[d] = k;
      expected.push_back(static_cast<int>(ranks.location(at)));
    }
    EXPECT_EQ(members, expected) << "dimension " << mesh.names()[d];
    EXPECT_EQ(mesh.line_world_ranks(d), expected);
    EXPECT_EQ(mesh.size(mesh.names()[d]), ranks.sizes()[d]);
    EXPECT_EQ(mesh.dim_index(mesh.names()[d]), d);
  }
}

TEST(CommMesh, WorldOneDimension) {
  World world;
  WorkerMesh mesh({"x"}, NDSlice::row_major({world_size()}), world.comm());
  check_mesh(mesh);
  EXPECT_EQ(mesh.to_string(), "[x=" + std::to_string(world_size()) + "]");
}

TEST(CommMesh, TwoDimensions) {
  if (world_size() % 2 != 0) GTEST_SKIP() << "needs an even world";
  World world;
  WorkerMesh mesh({"host", "gpu"}, NDSlice::row_major({2, world_size() / 2}), world.comm());
  check_mesh(mesh);
  EXPECT_EQ(mesh.to_string(), "[host=2, gpu=" + std::to_string(world_size() / 2) + "]");
}

// The two halves of a 2xK mesh build their own sub-meshes at the same time: only members
// take part in a mesh's creation.
TEST(CommMesh, SlicedMeshesBuiltConcurrently) {
  if (world_size() % 2 != 0) GTEST_SKIP() << "needs an even world";
  World world;
  const NDSlice full = NDSlice::row_major({2, world_size() / 2});
  const std::int64_t host = full.coordinates(world_rank())[0];
  WorkerMesh mesh({"gpu"}, full.at(0, host), world.comm());
  check_mesh(mesh);
  // Each half sums its own world ranks over its mesh while the other does the same.
  int sum = 0;
  const int me = world_rank();
  MPI_Allreduce(&me, &sum, 1, MPI_INT, MPI_SUM, mesh.dim_comm(0));
  int expected = 0;
  for (auto r : full.at(0, host)) expected += static_cast<int>(r);
  EXPECT_EQ(sum, expected);
}

TEST(CommMesh, StridedAndThreeDimensions) {
  if (world_size() != 6) GTEST_SKIP() << "written for 6 ranks";
  World world;
  const int me = world_rank();
  {
    // Odd ranks form NDSlice(1, [3], [2]) while even ranks form NDSlice(0, [3], [2]).
    WorkerMesh mesh({"x"}, NDSlice(me % 2, {3}, {2}), world.comm());
    check_mesh(mesh);
  }
  {
    WorkerMesh mesh({"a", "b", "c"}, NDSlice::row_major({1, 2, 3}), world.comm());
    check_mesh(mesh);
    EXPECT_EQ(mesh.coordinates(), (std::vector<std::int64_t>{0, me / 3, me % 3}));
  }
  {
    // Transposed strides: a 3x2 mesh whose rows are not contiguous.
    WorkerMesh mesh({"row", "col"}, NDSlice(0, {3, 2}, {1, 3}), world.comm());
    check_mesh(mesh);
  }
  if (me >= 3) {
    // Only host=1 of a 2x3 mesh; ranks 0..2 meanwhile do their own collective.
    WorkerMesh mesh({"gpu"}, NDSlice::row_major({2, 3}).at(0, 1), world.comm());
    check_mesh(mesh);
  } else {
    WorkerMesh mesh({"gpu"}, NDSlice::row_major({3}), world.comm());
    int one = 1, sum = 0;
    MPI_Allreduce(&one, &sum, 1, MPI_INT, MPI_SUM, mesh.comm());
    EXPECT_EQ(sum, 3);
  }
  MPI_Barrier(world.comm());
}

TEST(CommMesh, UsageErrors) {
  World world;
  const int me = world_rank();
  const std::string rank = "world rank " + std::to_string(me);
  const NDSlice all = NDSlice::row_major({world_size()});
  EXPECT_THAT(usage_error([&] {
                WorkerMesh m({"x", "y"}, all, world.comm());
              }),
              HasSubstr("expected one name per dimension of the ranks"));
  EXPECT_THAT(usage_error([&] { WorkerMesh m({"x", "y"}, all, world.comm()); }), HasSubstr("found 2 names"));
  EXPECT_THAT(usage_error([&] {
                WorkerMesh m({"x", "x"}, NDSlice::row_major({1, world_size()}), world.comm());
              }),
              HasSubstr("expected unique dimension names, found 'x' twice in ['x', 'x'] (" + rank + ")"));
  EXPECT_THAT(usage_error([&] { WorkerMesh m({""}, all, world.comm()); }),
              HasSubstr("expected non-empty dimension names"));
  EXPECT_THAT(usage_error([&] { WorkerMesh m({"x"}, NDSlice::row_major({world_size() + 1}), world.comm()); }),
              HasSubstr("expected ranks below the world size " + std::to_string(world_size()) + ", found rank " +
                        std::to_string(world_size())));
  // A non-member constructing the mesh is a bug in the caller; it must not hang.
  const NDSlice others(me == 0 ? 1 : 0, {1}, {1});
  EXPECT_THAT(usage_error([&] { WorkerMesh m({"x"}, others, world.comm()); }), HasSubstr(rank + " is not a member of"));
  WorkerMesh mesh({"host"}, all, world.comm());
  EXPECT_EQ(usage_error([&] { (void)mesh.dim_index("gpu"); }),
            "device mesh [host=" + std::to_string(world_size()) +
                "]: unknown dimension 'gpu', expected one of 'host' (" + rank + ")");
  EXPECT_THAT(usage_error([&] { (void)mesh.size(std::size_t{3}); }),
              HasSubstr("expected a dimension index below 1, found 3"));
}

}  // namespace
}  // namespace meshrt::test
