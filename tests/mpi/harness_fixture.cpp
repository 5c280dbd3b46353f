// A test binary that misbehaves on purpose, driven by harness_selftest.sh:
//   MESHRT_FIXTURE=fail  -> rank 2 fails an assertion, the others pass
//   MESHRT_FIXTURE=hang  -> rank 1 never reaches the barrier the others wait in
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

namespace {
std::string mode() {
  const char* m = std::getenv("MESHRT_FIXTURE");
  return m ? m : "";
}
int rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
}  // namespace

TEST(Fixture, FailsOnRankTwo) {
  if (mode() != "fail") GTEST_SKIP();
  EXPECT_EQ(rank() == 2 ? 41 : 42, 42) << "deliberate failure placed on rank " << rank();
}

TEST(Fixture, HangsOnRankOne) {
  if (mode() != "hang") GTEST_SKIP();
  if (rank() == 1) {
    for (;;) pause();
  }
  MPI_Barrier(MPI_COMM_WORLD);
}
