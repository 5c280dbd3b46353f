// StatelessGroup without meshrt::run (issue 24 item 6): groups never initialise MPI, so
// a create before MPI_Init_thread raises a UsageError saying how (instead of Open MPI's
// abort), and after the program's own MPI_Init_thread the same call works. Run under
// mpiexec with 2 ranks or more; the exit code is the verdict on every rank.
#include <fmt/format.h>
#include <mpi.h>

#include <chrono>
#include <cstdlib>
#include <string>

#include "meshrt/group.hpp"

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    fmt::print(stderr, "FAILED: {}\n", what);
  }
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

int main(int argc, char** argv) {
  // Before MPI_Init: a clear UsageError on every entry point, and MPI is left alone.
  try {
    (void)meshrt::StatelessGroup::create({0, 1});
    check(false, "create before MPI_Init returned a group");
  } catch (const meshrt::UsageError& e) {
    check(contains(e.what(), "StatelessGroup::create: expected MPI to be initialised"), e.what());
    check(contains(e.what(), "MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided)"), e.what());
  }
  try {
    (void)meshrt::StatelessGroup::from_comm(MPI_COMM_WORLD);
    check(false, "from_comm before MPI_Init returned a group");
  } catch (const meshrt::UsageError& e) {
    check(contains(e.what(), "StatelessGroup::from_comm: expected MPI to be initialised"), e.what());
  }
  int initialized = 1;
  MPI_Initialized(&initialized);
  check(initialized == 0, "a refused create initialised MPI");

  // The program owns MPI: the same call works once MPI is initialised.
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank < 2) {
    auto g = meshrt::StatelessGroup::create({0, 1});
    const auto got = g.all_gather_obj(std::string(rank == 0 ? "zero" : "one"), std::chrono::seconds(20));
    check(got.size() == 2 && got[0] == "zero" && got[1] == "one", "all_gather_obj over the pair");
  }
  int total = 0;
  MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0) fmt::print("{}\n", total == 0 ? "PASS" : "FAIL");
  MPI_Finalize();
  return total == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
