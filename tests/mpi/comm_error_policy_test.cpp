// The MPI error policy (src/common/checks.hpp): every communicator meshrt makes returns
// errors instead of aborting the job, so that a failing call raises SystemError through
// MESHRT_MPI_CHECK on the rank where it failed. The test's own World keeps MPI's default
// handler (errors are fatal), as a user's communicator would: before the policy, the
// mesh communicators inherited it and these calls aborted the whole job.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <climits>

#include "comm_test_util.hpp"
#include "common/checks.hpp"

namespace meshrt::test {
namespace {

using ::testing::HasSubstr;

// The SystemError text of a checked MPI call that must fail ("" and a failure otherwise).
constexpr auto* system_error_text = &test::error_of<SystemError>;

int errhandler_returns(MPI_Comm comm) {
  MPI_Errhandler h = MPI_ERRHANDLER_NULL;
  MESHRT_MPI_CHECK(MPI_Comm_get_errhandler(comm, &h));
  const int returns = h == MPI_ERRORS_RETURN ? 1 : 0;
  MESHRT_MPI_CHECK(MPI_Errhandler_free(&h));
  return returns;
}

TEST(CommErrorPolicy, MeshCommunicatorsReturnErrorsAndChecksRaise) {
  World world;
  EXPECT_EQ(errhandler_returns(world.comm()), 0) << "the test's own communicator keeps MPI's default handler";
  const int n = world_size();
  WorkerMesh mesh({"gpu"}, NDSlice::row_major({n}), world.comm());
  EXPECT_EQ(errhandler_returns(mesh.comm()), 1);
  EXPECT_EQ(errhandler_returns(mesh.dim_comm(0)), 1);

  // A destination rank past the communicator: refused locally by MPI, on every rank.
  int value = world_rank();
  const std::string bad_rank =
      system_error_text([&] { MESHRT_MPI_CHECK(MPI_Send(&value, 1, MPI_INT, n + 3, 0, mesh.dim_comm(0))); });
  EXPECT_THAT(bad_rank, HasSubstr(fmt::format("rank {}: MPI_Send(&value, 1, MPI_INT, n + 3, 0, mesh.dim_comm(0)) "
                                              "failed: ",
                                              world_rank())));
  EXPECT_THAT(bad_rank, HasSubstr("(MPI error "));
  EXPECT_THAT(bad_rank, HasSubstr("comm_error_policy_test.cpp:"));
  // A negative count on the mesh communicator.
  EXPECT_THAT(system_error_text([&] { MESHRT_MPI_CHECK(MPI_Bcast(&value, -1, MPI_INT, 0, mesh.comm())); }),
              HasSubstr("MPI_Bcast(&value, -1, MPI_INT, 0, mesh.comm()) failed: "));
  // The communicators still work after a refused call.
  int sum = 0;
  MESHRT_MPI_CHECK(MPI_Allreduce(&value, &sum, 1, MPI_INT, MPI_SUM, mesh.dim_comm(0)));
  EXPECT_EQ(sum, n * (n - 1) / 2);
}

TEST(CommErrorPolicy, SetErrorPolicyOnADuplicate) {
  MPI_Comm dup = MPI_COMM_NULL;
  MESHRT_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &dup));
  detail::set_error_policy(dup);
  EXPECT_EQ(errhandler_returns(dup), 1);
  int value = 0;
  EXPECT_THAT(system_error_text([&] { MESHRT_MPI_CHECK(MPI_Recv(&value, 1, MPI_INT, -7, 0, dup, MPI_STATUS_IGNORE)); }),
              HasSubstr("MPI_Recv(&value, 1, MPI_INT, -7, 0, dup, MPI_STATUS_IGNORE) failed: "));
  MESHRT_MPI_CHECK(MPI_Comm_free(&dup));
}

}  // namespace
}  // namespace meshrt::test
