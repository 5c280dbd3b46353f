// runtime-collectives: collectives the way a user issues them (issue 16). The controller
// issues a loop of reductions (or to_mesh sends) on a mesh of every rank and then
// synchronizes; the time per operation includes the command's dispatch, the worker's
// completion mode (Completion::Auto) and the controller's synchronize, spread over the
// loop. The same job then runs the same MPI calls by hand on the same ranks, timed as the
// slowest rank's loop. Every repetition runs one meshrt session (all ops, all sizes) and
// then the MPI loops, so drifting load hits both sides alike; the table shows medians
// over the repetitions.
//
//   mpiexec -n 2 meshrt-bench runtime-collectives [--quick] [--json FILE] [--reps=N]
//                                                 [--max-bytes=N] [--ops=all_reduce,...]
//
// Ops: all_reduce (x.reduce(dim, Sum), out of place), all_reduce_ (x.reduce_(dim, Sum),
// in place: MPI_IN_PLACE by hand), all_gather (Stack), reduce_scatter (Sum, scatter),
// all_to_all (Stack, scatter), to_mesh (rank i of the first half to rank i + n/2).
#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "bench.hpp"
#include "meshrt/meshrt.hpp"

namespace meshrt::bench {
namespace {

using Clock = std::chrono::steady_clock;

enum class Kind { AllReduce, AllReduceInPlace, AllGather, ReduceScatter, AllToAll, ToMesh };

struct OpInfo {
  const char* name;
  Kind kind;
  BusFactor bus;
};
constexpr OpInfo kOps[] = {
    {"all_reduce", Kind::AllReduce, BusFactor::all_reduce},
    {"all_reduce_", Kind::AllReduceInPlace, BusFactor::all_reduce},
    {"all_gather", Kind::AllGather, BusFactor::gather_like},
    {"reduce_scatter", Kind::ReduceScatter, BusFactor::gather_like},
    {"all_to_all", Kind::AllToAll, BusFactor::gather_like},
    {"to_mesh", Kind::ToMesh, BusFactor::one},
};

// One measured point: an op at a size, with the element counts both sides use.
struct Point {
  OpInfo op;
  std::size_t bytes;                // the whole array, as nccl-tests count it
  std::int64_t per_rank;            // float32 elements per rank's chunk
  std::int64_t whole;               // per_rank * n
  int inner;                        // operations per sample
  std::vector<double> meshrt, mpi;  // seconds per operation, one per repetition
};

// Operations per sample: enough that the controller's synchronize (a round trip, ~10-20
// us here) and the timer stay below 1% of the sample.
int inner_for(std::size_t bytes) {
  if (bytes >= (std::size_t{64} << 20)) return 2;
  if (bytes >= (std::size_t{8} << 20)) return 5;
  if (bytes >= (std::size_t{1} << 20)) return 20;
  if (bytes >= (std::size_t{64} << 10)) return 100;
  return 1000;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  if (v.empty()) return 0;
  const std::size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
}

// The input each op starts from, per rank (zeros: in-place sums stay finite).
std::vector<std::int64_t> input_shape(const Point& p, int n) {
  switch (p.op.kind) {
    case Kind::AllGather:
      return {p.per_rank};
    case Kind::ReduceScatter:
    case Kind::AllToAll:
      return {n, p.per_rank};
    default:
      return {p.whole};
  }
}

// The meshrt side of one repetition, on the controller: a warm-up operation (first use
// of the communicator, first touch of the outputs), then `inner` operations and one
// synchronize, timed.
void run_meshrt(Controller& ctl, std::vector<Point>& points) {
  const std::int64_t n = ctl.world_size();
  Mesh mesh = ctl.world_mesh({{"x", n}});
  const std::int64_t h = std::max<std::int64_t>(n / 2, 1);
  Mesh lo = mesh.slice("x", 0, h);
  Mesh hi = mesh.slice("x", n >= 2 ? h : 0, n >= 2 ? 2 * h : 1);
  for (Point& p : points) {
    const std::vector<std::int64_t> shape = input_shape(p, static_cast<int>(n));
    DTensor x = (p.op.kind == Kind::ToMesh ? lo : mesh).call("meshrt.zeros", shape, DType::Float32);
    auto one = [&] {
      switch (p.op.kind) {
        case Kind::AllReduce:
          (void)x.reduce("x", Reduction::Sum);
          break;
        case Kind::AllReduceInPlace:
          x.reduce_("x", Reduction::Sum);
          break;
        case Kind::AllGather:
          (void)x.reduce("x", Reduction::Stack);
          break;
        case Kind::ReduceScatter:
          (void)x.reduce("x", Reduction::Sum, true);
          break;
        case Kind::AllToAll:
          (void)x.reduce("x", Reduction::Stack, true);
          break;
        case Kind::ToMesh:
          (void)x.to_mesh(hi);
          break;
      }
    };
    one();
    ctl.synchronize();
    const auto t0 = Clock::now();
    for (int i = 0; i < p.inner; ++i) one();
    ctl.synchronize();
    p.meshrt.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / p.inner);
  }
}

// The same MPI calls by hand, on every rank, with buffers kept across the loop.
void run_mpi(const Context& ctx, MPI_Comm comm, std::vector<Point>& points) {
  const int n = ctx.size;
  const int h = std::max(n / 2, 1);
  std::vector<char> in, out;
  for (Point& p : points) {
    const int cw = static_cast<int>(p.whole), cp = static_cast<int>(p.per_rank);
    const std::size_t wb = static_cast<std::size_t>(p.whole) * 4, pb = static_cast<std::size_t>(p.per_rank) * 4;
    const bool gather = p.op.kind == Kind::AllGather;
    const bool scatter = p.op.kind == Kind::ReduceScatter;
    in.assign(gather ? pb : wb, 0);
    out.assign(scatter ? pb : wb, 0);
    auto one = [&] {
      switch (p.op.kind) {
        case Kind::AllReduce:
          MPI_Allreduce(in.data(), out.data(), cw, MPI_FLOAT, MPI_SUM, comm);
          break;
        case Kind::AllReduceInPlace:
          MPI_Allreduce(MPI_IN_PLACE, in.data(), cw, MPI_FLOAT, MPI_SUM, comm);
          break;
        case Kind::AllGather:
          MPI_Allgather(in.data(), cp, MPI_FLOAT, out.data(), cp, MPI_FLOAT, comm);
          break;
        case Kind::ReduceScatter:
          MPI_Reduce_scatter_block(in.data(), out.data(), cp, MPI_FLOAT, MPI_SUM, comm);
          break;
        case Kind::AllToAll:
          MPI_Alltoall(in.data(), cp, MPI_FLOAT, out.data(), cp, MPI_FLOAT, comm);
          break;
        case Kind::ToMesh:
          if (ctx.rank < h)
            MPI_Send(in.data(), cw, MPI_FLOAT, ctx.rank + h, 0, comm);
          else if (ctx.rank < 2 * h)
            MPI_Recv(out.data(), cw, MPI_FLOAT, ctx.rank - h, 0, comm, MPI_STATUS_IGNORE);
          break;
      }
    };
    one();
    MPI_Barrier(comm);
    const auto t0 = Clock::now();
    for (int i = 0; i < p.inner; ++i) one();
    const double t = std::chrono::duration<double>(Clock::now() - t0).count();
    double slowest = 0;
    MPI_Allreduce(&t, &slowest, 1, MPI_DOUBLE, MPI_MAX, comm);
    p.mpi.push_back(slowest / p.inner);
  }
  in = {};
  out = {};
}

int run_runtime_collectives(Context& ctx, int argc, char** argv, const std::string& json_path) {
  const int n = ctx.size;
  const std::string reps_flag = flag(argc, argv, "reps");
  const std::string max_flag = flag(argc, argv, "max-bytes");
  const std::string ops_flag = flag(argc, argv, "ops");
  const int reps = reps_flag.empty() ? (ctx.quick ? 1 : 5) : std::max(1, std::stoi(reps_flag));
  const std::size_t max_bytes = max_flag.empty() ? (ctx.quick ? std::size_t{1} << 20 : std::size_t{256} << 20)
                                                 : static_cast<std::size_t>(std::stoull(max_flag));
  std::vector<std::size_t> sizes = sizes_up_to(max_bytes, ctx.quick);
  if (max_bytes >= (std::size_t{256} << 20) && sizes.back() != max_bytes) sizes.push_back(max_bytes);

  std::vector<Point> points;
  for (const OpInfo& op : kOps) {
    if (op.kind == Kind::ToMesh && n < 2) continue;
    if (!ops_flag.empty() && ("," + ops_flag + ",").find("," + std::string(op.name) + ",") == std::string::npos)
      continue;
    for (std::size_t bytes : sizes) {
      // float32 elements, at least one per rank; the whole array divisible by n.
      const std::int64_t total = std::max<std::int64_t>(static_cast<std::int64_t>(bytes / 4), n);
      const std::int64_t per_rank = std::max<std::int64_t>(total / n, 1);
      Point p{op, bytes, per_rank, per_rank * n, inner_for(bytes), {}, {}};
      if (op.kind == Kind::ToMesh) {
        // nccl-tests' send counts the bytes one rank sends: the whole tensor.
        p.per_rank = p.whole = std::max<std::int64_t>(static_cast<std::int64_t>(bytes / 4), 1);
      }
      points.push_back(std::move(p));
    }
  }

  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Comm_dup(ctx.comm, &comm);
  Runtime runtime(argc, argv);
  for (int rep = 0; rep < reps; ++rep) {
    runtime.session([&](Controller& ctl) { run_meshrt(ctl, points); });
    run_mpi(ctx, comm, points);
  }
  MPI_Comm_free(&comm);

  if (ctx.rank == 0) {
    std::vector<CollectiveRow> rows;
    for (const Point& p : points) {
      rows.push_back({"runtime-collectives", p.op.name, p.bytes, p.op.bus, median(p.meshrt), median(p.mpi)});
    }
    fmt::print("(medians of {} repetition{}; each a meshrt session, then the MPI calls by hand)\n", reps,
               reps == 1 ? "" : "s");
    print_collective_rows(rows, n, json_path);
  }
  return 0;
}

}  // namespace

MESHRT_BENCH_SUITE_RUN("runtime-collectives",
                       "collectives issued by the controller (dispatch, worker, synchronize) against MPI by hand",
                       run_runtime_collectives);

}  // namespace meshrt::bench
