// meshrt's MPI data plane against the same MPI call made by hand: all_reduce, all_gather,
// reduce_scatter, all_to_all and send, 8 B to 256 MiB, over a 1-D mesh of every rank.
//
// The meshrt side works as the worker will: it starts the operation with a tensor and the
// factory, waits, and drops the outcome (so outputs are allocated per operation). The MPI
// side reuses its buffers. Each op is measured twice:
//   <op>      Completion::Blocking: the blocking MPI call inside start_*
//   <op>_th   Completion::Thread: the blocking MPI call on meshrt's comm thread, wait()
//             on the caller's thread (what a worker loop that must keep answering its
//             control channel can use)
//   <op>_nb   Completion::NonBlocking: MPI_I* completed by wait()'s test-and-back-off loop
//   <op>_auto Completion::Auto: _nb below kThreadMinBytes, _th from there on (the worker)
// so the table shows what each way of not blocking the caller costs.
#include <mpi.h>

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bench.hpp"
#include "meshrt/internal/comm.hpp"

namespace meshrt::bench {
namespace {

// The buffers of one message size, allocated when the first benchmark of that size runs
// and released when a benchmark of another size starts: holding every size at once would
// take several GiB per rank at 256 MiB.
struct Buffers {
  std::size_t bytes = 0;
  std::vector<char> in, out;  // raw MPI side
  Tensor input;               // meshrt side (the factory's shape, filled)
};

Buffers& buffers(std::size_t bytes, std::size_t in_bytes, std::size_t out_bytes, const TensorMeta& meta) {
  static Buffers b;
  if (b.bytes != bytes || b.in.size() != in_bytes || b.out.size() != out_bytes || b.input.meta() != meta) {
    b = Buffers{};
    b.bytes = bytes;
    b.in.assign(in_bytes, 1);
    b.out.assign(out_bytes, 0);
    b.input = meta.zeros();
  }
  return b;
}

struct Shared {
  std::unique_ptr<WorkerMesh> mesh;
  MPI_Comm p2p = MPI_COMM_NULL;
};

void register_collectives(Context& ctx) {
  // The mesh is built here, collectively, on every rank, before any benchmark runs; it
  // lives until the process ends (the suite has no teardown hook).
  // Never destroyed: its destructor would free communicators after MPI_Finalize.
  static Shared* shared = new Shared;
  shared->mesh = std::make_unique<WorkerMesh>(std::vector<std::string>{"x"}, NDSlice::row_major({ctx.size}), ctx.comm);
  MPI_Comm_dup(ctx.comm, &shared->p2p);
  WorkerMesh* mesh = shared->mesh.get();
  const MPI_Comm dim_comm = mesh->dim_comm(0);
  const MPI_Comm p2p = shared->p2p;
  const int n = ctx.size;
  const int rank = ctx.rank;

  std::vector<std::size_t> sizes = sizes_up_to(std::size_t{256} << 20, ctx.quick);
  if (!ctx.quick) sizes.push_back(std::size_t{256} << 20);
  // Registered op by op, then size by size, so the ratio table prints one block per op.
  std::map<std::string, std::vector<Pair>> by_op;
  for (int op_index = 0; op_index < 5; ++op_index) {
    for (std::size_t bytes : sizes) {
      // float32 elements; sizes below one element per rank keep one element per rank.
      const std::int64_t total = std::max<std::int64_t>(static_cast<std::int64_t>(bytes / 4), n);
      const std::int64_t per_rank = std::max<std::int64_t>(total / n, 1);
      const std::int64_t whole = per_rank * n;  // divisible by n for the scatter ops
      // Small messages take a microsecond: many of them per timed iteration, or the
      // timer and the slowest-rank reduction dominate.
      const int inner = bytes >= (std::size_t{16} << 20)   ? 1
                        : bytes >= (std::size_t{1} << 20)  ? 3
                        : bytes >= (std::size_t{64} << 10) ? 10
                                                           : 100;
      const int iterations = bytes >= (std::size_t{16} << 20) ? 3 : bytes >= (std::size_t{1} << 20) ? 10 : 30;
      const int cw = static_cast<int>(whole), cp = static_cast<int>(per_rank);

      struct Op {
        const char* name;
        BusFactor bus;
        TensorMeta meta;  // the meshrt input (= factory)
        std::size_t in_b, out_b;
        Reduction red;
        bool scatter;
        bool send;
      };
      const std::size_t wb = static_cast<std::size_t>(whole) * 4, pb = static_cast<std::size_t>(per_rank) * 4;
      const Op ops[] = {
          {"all_reduce", BusFactor::all_reduce, TensorMeta({whole}, DType::Float32), wb, wb, Reduction::Sum, false,
           false},
          {"all_gather", BusFactor::gather_like, TensorMeta({per_rank}, DType::Float32), pb, wb, Reduction::Stack,
           false, false},
          {"reduce_scatter", BusFactor::gather_like, TensorMeta({n, per_rank}, DType::Float32), wb, pb, Reduction::Sum,
           true, false},
          {"all_to_all", BusFactor::gather_like, TensorMeta({n, per_rank}, DType::Float32), wb, wb, Reduction::Stack,
           true, false},
          {"send", BusFactor::one, TensorMeta({whole}, DType::Float32), wb, wb, Reduction::Sum, false, true},
      };
      {
        const Op& op = ops[op_index];
        if (op.send && n < 2) continue;
        // send: the first half of the ranks sends to the second half (rank i -> i + n/2).
        const int h = std::max(n / 2, 1);
        const NDSlice from(0, {n / 2 > 0 ? h : 1}, {1});
        const NDSlice to(n >= 2 ? h : 0, {n / 2 > 0 ? h : 1}, {1});
        auto mpi = [=] {
          Buffers& b = buffers(bytes, op.in_b, op.out_b, op.meta);
          const std::string_view name = op.name;
          if (name == "all_reduce")
            MPI_Allreduce(b.in.data(), b.out.data(), cw, MPI_FLOAT, MPI_SUM, dim_comm);
          else if (name == "all_gather")
            MPI_Allgather(b.in.data(), cp, MPI_FLOAT, b.out.data(), cp, MPI_FLOAT, dim_comm);
          else if (name == "reduce_scatter")
            MPI_Reduce_scatter_block(b.in.data(), b.out.data(), cp, MPI_FLOAT, MPI_SUM, dim_comm);
          else if (name == "all_to_all")
            MPI_Alltoall(b.in.data(), cp, MPI_FLOAT, b.out.data(), cp, MPI_FLOAT, dim_comm);
          else if (n >= 2 && rank < h)
            MPI_Send(b.in.data(), cw, MPI_FLOAT, rank + h, 0, p2p);
          else if (n >= 2 && rank < 2 * h)
            MPI_Recv(b.out.data(), cw, MPI_FLOAT, rank - h, 0, p2p, MPI_STATUS_IGNORE);
        };
        for (Completion completion :
             {Completion::Blocking, Completion::Auto, Completion::Thread, Completion::NonBlocking}) {
          auto meshrt_side = [=] {
            Buffers& b = buffers(bytes, op.in_b, op.out_b, op.meta);
            std::unique_ptr<Pending> p =
                op.send ? start_send_tensor(p2p, rank, from, to, b.input, op.meta, completion)
                        : start_reduce(*mesh, "x", op.red, op.scatter, false, b.input, op.meta, completion);
            (void)wait(*p);
          };
          // The non-blocking path stalls between MPI_Test calls (see comm.hpp): at 16 MiB
          // and up it runs minutes, so it is measured up to 16 MiB only.
          if (completion == Completion::NonBlocking && bytes > (std::size_t{16} << 20)) continue;
          const char* suffix = completion == Completion::Blocking ? ""
                               : completion == Completion::Auto   ? "_auto"
                               : completion == Completion::Thread ? "_th"
                                                                  : "_nb";
          by_op[std::string(op.name) + suffix].push_back({.suite = "collectives",
                                                          .op = std::string(op.name) + suffix,
                                                          .bytes = bytes,
                                                          .bus = op.bus,
                                                          .inner = inner,
                                                          .iterations = iterations,
                                                          .meshrt = meshrt_side,
                                                          .mpi = mpi});
        }
      }
    }
  }
  for (const char* op : {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send"}) {
    for (const char* suffix : {"", "_auto", "_th", "_nb"}) {
      for (Pair& p : by_op[std::string(op) + suffix]) add_pair(ctx, std::move(p));
    }
  }
}

}  // namespace
MESHRT_BENCH_SUITE("collectives", "meshrt's MPI data plane (Reduce, SendTensor) against the same MPI calls by hand",
                   register_collectives);
}  // namespace meshrt::bench
