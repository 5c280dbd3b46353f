// One side of a cross-job StatelessGroup: `group_cross_job accept <port_file>` (the
// "trainer", 2 ranks) and `group_cross_job connect <port_file>` (the "service", 1 rank),
// launched as two separate mpiexec jobs by group_cross_job.sh. The merged group has the
// accepting ranks first (group ranks 0, 1) and the connecting rank last (2). Every
// operation moves objects in both directions; any mismatch exits non-zero.
#include <mpi.h>

#include <boost/serialization/map.hpp>
#include <boost/serialization/string.hpp>
#include <boost/serialization/vector.hpp>
#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "meshrt/group.hpp"

using namespace std::chrono_literals;

namespace {

int failures = 0;

void check(bool ok, const std::string& what, int rank) {
  if (!ok) {
    std::fprintf(stderr, "group rank %d: FAILED: %s\n", rank, what.c_str());
    ++failures;
  }
}

void exercise(meshrt::StatelessGroup& g) {
  const int r = g.rank(), n = g.world_size();
  check(n == 3, "merged group size is 3", r);
  // Point to point both ways: trainer rank 0 -> service, service -> each trainer rank.
  if (r == 0) g.send_obj(std::map<std::string, int>{{"step", 7}}, 2, 20s);
  if (r == 2) check(g.recv_obj<std::map<std::string, int>>(0, 20s).at("step") == 7, "recv from trainer", r);
  if (r == 2) {
    for (int d = 0; d < 2; ++d) g.send_obj(std::string("weights for ") + std::to_string(d), d, 20s);
  } else {
    check(g.recv_obj<std::string>(2, 20s) == "weights for " + std::to_string(r), "recv from service", r);
  }
  // Broadcast from each side, one chunked (big) and one small.
  auto big = g.broadcast_obj(r == 0 ? std::vector<float>(300000, 1.5f) : std::vector<float>{}, 0, 20s);
  check(big.size() == 300000 && big.back() == 1.5f, "broadcast from trainer", r);
  auto cfg = g.broadcast_obj(r == 2 ? std::string("service config") : std::string(), 2, 20s);
  check(cfg == "service config", "broadcast from service", r);
  auto all = g.all_gather_obj(std::vector<int>(static_cast<std::size_t>(r + 1), r), 20s);
  for (int p = 0; p < n; ++p) {
    check(all[static_cast<std::size_t>(p)] == std::vector<int>(static_cast<std::size_t>(p + 1), p),
          "all_gather part " + std::to_string(p), r);
  }
  g.barrier(20s);
  std::printf("group rank %d (job rank %d) of %d: every operation worked\n", r, g.parent_rank(r), n);
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s accept|connect <port_file>\n", argv[0]);
    MPI_Finalize();
    return 2;
  }
  const std::string mode = argv[1];
  try {
    meshrt::GroupOptions opt;
    opt.chunk_bytes = 256 * 1024;  // the 1.2 MB broadcast goes in chunks
    opt.timeout = 30s;
    auto g = mode == "accept" ? meshrt::StatelessGroup::accept(argv[2], MPI_COMM_WORLD, opt)
                              : meshrt::StatelessGroup::connect(argv[2], MPI_COMM_WORLD, opt);
    const bool accepting = mode == "accept";
    int wr = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &wr);
    check(g.rank() == (accepting ? wr : 2 + wr), "accepting ranks come first", g.rank());
    exercise(g);
    g.disconnect();  // collective over both jobs; the destructor would do it too
    std::printf("%s: disconnected\n", mode.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", mode.c_str(), e.what());
    ++failures;
  }
  MPI_Finalize();
  return failures == 0 ? 0 : 1;
}
