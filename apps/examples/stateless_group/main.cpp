// StatelessGroup: typed object collectives over any subset of ranks, without global state.
// The scenario of the first source document, over MPI:
//
//   mpiexec -n 6 stateless_group      (4 ranks at least; ranks 4 and 5 are optional)
//
// 1. Ranks 0 and 1 form a group and exchange objects: strings, a vector, a user struct.
// 2. Later ranks 0..3 form another group, while ranks 4 and 5 form their own and do
//    something else. Ranks 0 and 1 then use both of their groups, interleaved.
// 3. The NCCL bootstrap: a group of the ranks that have a GPU of their own broadcasts an
//    ncclUniqueId and makes an NCCL communicator (skipped, with a message, without NCCL
//    or a GPU).
// This program does not use meshrt::run: it initialises MPI itself, like any MPI program
// that wants groups beside its own communicators (groups never initialise MPI: a create
// before MPI_Init_thread raises a UsageError saying so). Every rank checks what it received;
// the exit code is non-zero if any check failed on any rank.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <mpi.h>

#include <array>
#include <boost/serialization/map.hpp>
#include <boost/serialization/string.hpp>
#include <boost/serialization/vector.hpp>
#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "meshrt/config.hpp"
#include "meshrt/group.hpp"

#if MESHRT_HAVE_NCCL
#include <cuda_runtime_api.h>
#include <nccl.h>
#endif

namespace {

using meshrt::StatelessGroup;
using namespace std::chrono_literals;

// Any type Boost.Serialization can save travels; a user struct needs serialize().
struct Checkpoint {
  std::string name;
  int step = 0;
  std::vector<float> weights;
  std::map<std::string, double> metrics;
  template <class Archive>
  void serialize(Archive& ar, unsigned /*version*/) {
    ar& name& step& weights& metrics;
  }
  bool operator==(const Checkpoint&) const = default;
};

Checkpoint sample_checkpoint(int step) {
  return {.name = "mlp", .step = step, .weights = {0.5f, -1.25f, 2.0f}, .metrics = {{"loss", 0.125 * step}}};
}

int failures = 0;

void check(bool ok, int rank, const std::string& what) {
  if (!ok) {
    ++failures;
    fmt::print(stderr, "rank {}: FAILED: {}\n", rank, what);
  }
}

void say(int rank, const std::string& text) {
  fmt::print("rank {}: {}\n", rank, text);
  std::fflush(stdout);
}

// 1. Ranks 0 and 1.
void pair_exchange(StatelessGroup& g01, int w) {
  if (w == 0) {
    g01.send_obj(std::string("hello from rank 0"), 1);
    g01.send_obj(std::vector<double>{1.0, 2.5, -3.0}, 1);
    g01.send_obj(sample_checkpoint(7), 1);
    const auto reply = g01.recv_obj<std::string>(1, 10s);
    say(w, fmt::format("got '{}' from rank 1", reply));
    check(reply == "hello back from rank 1", w, "the reply string");
  } else {
    const auto text = g01.recv_obj<std::string>(0, 10s);
    const auto vec = g01.recv_obj<std::vector<double>>(0, 10s);
    const auto ckpt = g01.recv_obj<Checkpoint>(0, 10s);
    say(w, fmt::format("got '{}', [{}], Checkpoint{{{}, step {}, {} weights}} from rank 0", text, fmt::join(vec, ", "),
                       ckpt.name, ckpt.step, ckpt.weights.size()));
    check(text == "hello from rank 0", w, "the string");
    check(vec == std::vector<double>{1.0, 2.5, -3.0}, w, "the vector");
    check(ckpt == sample_checkpoint(7), w, "the user struct");
    g01.send_obj(std::string("hello back from rank 1"), 0);
  }
  // Receiving a different type than was sent is a clear error, not undefined behaviour.
  if (w == 0) g01.send_obj(42, 1);
  if (w == 1) {
    try {
      (void)g01.recv_obj<std::string>(0, 10s);
      check(false, w, "receiving an int as a string raises UsageError");
    } catch (const meshrt::UsageError& e) {
      say(w, fmt::format("receiving an int as a string: UsageError: {}", e.what()));
    }
    check(g01.usable(), w, "the group stays usable after a type mismatch");
  }
}

// 2. Ranks 0..3, with {0, 1} still in use on ranks 0 and 1.
void four_ranks(StatelessGroup& g4, std::optional<StatelessGroup>& g01, int w) {
  for (int round = 0; round < 3; ++round) {
    const int root = round % 4;
    const Checkpoint c = g4.broadcast_obj(w == root ? sample_checkpoint(round) : Checkpoint{}, root, 10s);
    check(c == sample_checkpoint(round), w, fmt::format("round {}: broadcast from group rank {}", round, root));
    if (g01) {
      // Interleaved with the other group: a message on {0, 1} between collectives of {0..3}.
      if (w == 1) g01->send_obj(fmt::format("round {} on the pair", round), 0);
      if (w == 0)
        check(g01->recv_obj<std::string>(1, 10s) == fmt::format("round {} on the pair", round), w, "pair msg");
    }
    const auto all = g4.all_gather_obj(std::vector<int>{w, round}, 10s);
    for (int r = 0; r < 4; ++r) check(all[static_cast<std::size_t>(r)] == std::vector<int>{r, round}, w, "all_gather");
    g4.barrier(10s);
  }
  if (w == 0) say(w, "3 rounds of broadcast + all_gather + barrier on {0,1,2,3}, interleaved with {0,1}: ok");
}

// Ranks 4 and 5 meanwhile: their own group, in their own order (group rank 0 is world 5).
void the_others(int w) {
  auto g = StatelessGroup::create({5, 4});
  const auto names = g.all_gather_obj(fmt::format("rank {} (group rank {})", w, g.rank()), 10s);
  check(names.size() == 2 && names[0] == "rank 5 (group rank 0)", w, "the {5, 4} group's all_gather");
  if (w == 4) say(w, fmt::format("meanwhile in group {{5, 4}}: {}", fmt::join(names, ", ")));
  g.barrier(10s);
}

// 3. The NCCL bootstrap on a group of the ranks that have a GPU of their own.
void nccl_bootstrap(int w, int world) {
#if MESHRT_HAVE_NCCL
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
  MPI_Comm node = MPI_COMM_NULL;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, w, MPI_INFO_NULL, &node);
  int local = 0;
  MPI_Comm_rank(node, &local);
  MPI_Comm_free(&node);
  // NCCL refuses two ranks of one communicator on one GPU of one host. Local rank i takes
  // visible GPU i modulo the count (one visible GPU per rank, as Slurm's GPU binding
  // gives, is every rank's device 0); a rank joins if no lower rank has the same GPU,
  // told apart as NCCL does: by host and PCI bus id, not by index.
  const int device = devices > 0 ? local % devices : -1;
  std::array<char, 256> place{};
  if (device >= 0) {
    char host[MPI_MAX_PROCESSOR_NAME] = {};
    int length = 0;
    MPI_Get_processor_name(host, &length);
    char bus[32] = {};
    if (cudaDeviceGetPCIBusId(bus, static_cast<int>(sizeof bus), device) != cudaSuccess) (void)cudaGetLastError();
    fmt::format_to_n(place.data(), place.size() - 1, "{} {}", host, bus);
  }
  std::vector<std::array<char, 256>> places(static_cast<std::size_t>(world));
  MPI_Allgather(place.data(), static_cast<int>(place.size()), MPI_CHAR, places.data(), static_cast<int>(place.size()),
                MPI_CHAR, MPI_COMM_WORLD);
  std::vector<int> has(static_cast<std::size_t>(world), 0);
  for (int r = 0; r < world; ++r) {
    const auto& p = places[static_cast<std::size_t>(r)];
    if (p[0] == '\0') continue;  // no GPU
    bool first = true;
    for (int q = 0; q < r && first; ++q) first = places[static_cast<std::size_t>(q)] != p;
    has[static_cast<std::size_t>(r)] = first ? 1 : 0;
  }
  const int mine = has[static_cast<std::size_t>(w)];
  std::vector<int> members;
  for (int r = 0; r < world; ++r) {
    if (has[static_cast<std::size_t>(r)] != 0) members.push_back(r);
  }
  if (members.empty()) {
    if (w == 0) say(w, "NCCL bootstrap: skipped (built with NCCL, but no rank sees a CUDA device)");
    return;
  }
  if (!mine) return;
  auto g = StatelessGroup::create(members);
  ncclComm_t comm = meshrt::make_nccl_comm(g, device, 30s);
  float* buf = nullptr;
  const float value = static_cast<float>(g.rank() + 1);
  float sum = 0;
  const bool ok = cudaMalloc(&buf, sizeof(float)) == cudaSuccess &&
                  cudaMemcpy(buf, &value, sizeof value, cudaMemcpyHostToDevice) == cudaSuccess &&
                  ncclAllReduce(buf, buf, 1, ncclFloat, ncclSum, comm, nullptr) == ncclSuccess &&
                  cudaMemcpy(&sum, buf, sizeof sum, cudaMemcpyDeviceToHost) == cudaSuccess;
  const int n = g.world_size();
  check(ok && sum == static_cast<float>(n * (n + 1) / 2), w, "ncclAllReduce over the group's communicator");
  if (g.rank() == 0) {
    say(w, fmt::format("NCCL bootstrap: communicator over ranks [{}] (one GPU each), all_reduce of 1..{} = {}",
                       fmt::join(members, ", "), n, sum));
  }
  cudaFree(buf);
  ncclCommDestroy(comm);
#else
  (void)world;
  if (w == 0) say(w, "NCCL bootstrap: skipped (meshrt was built without NCCL)");
#endif
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int w = 0, world = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &w);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (world < 4) {
    if (w == 0) fmt::print(stderr, "stateless_group: expected at least 4 ranks, found {}\n", world);
    MPI_Finalize();
    return 2;
  }
  try {
    std::optional<StatelessGroup> g01;
    if (w < 2) {
      // Only ranks 0 and 1 call create: the others are not involved at all.
      g01.emplace(StatelessGroup::create({0, 1}));
      pair_exchange(*g01, w);
    }
    if (w < 4) {
      // Later 0..3 form another group; 0 and 1 keep theirs.
      auto g4 = StatelessGroup::create({0, 1, 2, 3});
      four_ranks(g4, g01, w);
    } else if (w < 6 && world >= 6) {
      the_others(w);
    }
    nccl_bootstrap(w, world);
  } catch (const std::exception& e) {
    // A timeout or a protocol error: say where, and take the job down rather than hang.
    fmt::print(stderr, "rank {}: stateless_group failed: {}\n", w, e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  int total = 0;
  MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (w == 0)
    fmt::print("stateless_group: {}\n", total == 0 ? "every check passed" : fmt::format("{} checks FAILED", total));
  MPI_Finalize();
  return total == 0 ? 0 : 1;
}
