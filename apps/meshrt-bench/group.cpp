// group: StatelessGroup (typed object collectives, docs/ARCHITECTURE.md section 5) against the same
// transfer made with raw MPI on a communicator of its own, for std::vector<char> payloads
// of 8 B to 64 MiB:
//   - pingpong: group ranks 0 and 1 only; one operation is a round trip, send_obj +
//     recv_obj_into on rank 0 and the mirror on rank 1 (two transfers of `bytes`; half of
//     it is the one-way latency). Raw MPI: MPI_Send + MPI_Recv. Other ranks idle.
//   - broadcast: broadcast_obj from rank 0 against MPI_Bcast.
//   - all_gather: all_gather_obj_into against MPI_Allgather (bytes = the whole array,
//     n parts, as nccl-tests count it).
//   - barrier: barrier() against MPI_Barrier.
//
//   mpiexec -n 2 meshrt-bench group [--quick] [--json out.jsonl] [--benchmark_filter=pingpong]
#include <mpi.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "bench.hpp"
#include "meshrt/group.hpp"

namespace meshrt::bench {
namespace {

// Buffers shared by every size: pairs run one after another, so each side keeps one warm
// buffer that grows to the largest size (resizing down keeps the capacity).
struct Buffers {
  std::vector<char> mine;                // the StatelessGroup side's object
  std::vector<std::vector<char>> parts;  // all_gather_obj_into's output
  std::vector<char> raw;                 // the raw MPI side's buffer
  std::vector<char> raw_all;             // MPI_Allgather's output
};

void fit(std::vector<char>& v, std::size_t bytes) {
  if (v.size() != bytes) v.assign(bytes, 'x');
}

void register_group(Context& ctx) {
  auto g = std::make_shared<StatelessGroup>(StatelessGroup::from_comm(ctx.comm));
  MPI_Comm raw = MPI_COMM_NULL;  // never freed: the benchmarks hold it until exit
  MPI_Comm_dup(ctx.comm, &raw);
  auto b = std::make_shared<Buffers>();
  const int rank = ctx.rank;
  const int n = ctx.size;

  std::vector<std::size_t> sizes = sizes_up_to(std::size_t{64} << 20, ctx.quick);
  if (!ctx.quick && sizes.back() != (std::size_t{64} << 20)) sizes.push_back(std::size_t{64} << 20);

  // Fixed counts, the same on every rank: ~10 ms per timed iteration at the small end.
  auto inner_for = [](std::size_t bytes) {
    return static_cast<int>(std::clamp<std::size_t>((std::size_t{8} << 20) / std::max<std::size_t>(bytes, 1), 1, 200));
  };
  auto iterations_for = [](std::size_t bytes) { return bytes >= (std::size_t{16} << 20) ? 8 : 20; };

  for (std::size_t bytes : sizes) {
    if (n < 2) break;
    const int cnt = static_cast<int>(bytes);
    add_pair(ctx, {.suite = "group",
                   .op = "pingpong",
                   .bytes = bytes,
                   .bus = BusFactor::one,
                   .inner = inner_for(bytes),
                   .iterations = iterations_for(bytes),
                   .meshrt =
                       [=] {
                         fit(b->mine, bytes);
                         if (rank == 0) {
                           g->send_obj(b->mine, 1);
                           g->recv_obj_into(b->mine, 1);
                         } else if (rank == 1) {
                           g->recv_obj_into(b->mine, 0);
                           g->send_obj(b->mine, 0);
                         }
                       },
                   .mpi =
                       [=] {
                         fit(b->raw, bytes);
                         if (rank == 0) {
                           MPI_Send(b->raw.data(), cnt, MPI_BYTE, 1, 0, raw);
                           MPI_Recv(b->raw.data(), cnt, MPI_BYTE, 1, 0, raw, MPI_STATUS_IGNORE);
                         } else if (rank == 1) {
                           MPI_Recv(b->raw.data(), cnt, MPI_BYTE, 0, 0, raw, MPI_STATUS_IGNORE);
                           MPI_Send(b->raw.data(), cnt, MPI_BYTE, 0, 0, raw);
                         }
                       }});
  }
  for (std::size_t bytes : sizes) {
    const int cnt = static_cast<int>(bytes);
    add_pair(ctx, {.suite = "group",
                   .op = "broadcast",
                   .bytes = bytes,
                   .bus = BusFactor::one,
                   .inner = inner_for(bytes),
                   .iterations = iterations_for(bytes),
                   .meshrt =
                       [=] {
                         fit(b->mine, bytes);
                         b->mine = g->broadcast_obj(std::move(b->mine), 0);
                       },
                   .mpi =
                       [=] {
                         fit(b->raw, bytes);
                         MPI_Bcast(b->raw.data(), cnt, MPI_BYTE, 0, raw);
                       }});
  }
  for (std::size_t bytes : sizes) {
    // `bytes` is the whole gathered array; each rank contributes bytes / n.
    const std::size_t part = std::max<std::size_t>(bytes / static_cast<std::size_t>(n), 1);
    const int cnt = static_cast<int>(part);
    add_pair(ctx, {.suite = "group",
                   .op = "all_gather",
                   .bytes = part * static_cast<std::size_t>(n),
                   .bus = BusFactor::gather_like,
                   .inner = inner_for(bytes),
                   .iterations = iterations_for(bytes),
                   .meshrt =
                       [=] {
                         fit(b->mine, part);
                         g->all_gather_obj_into(b->mine, b->parts);
                       },
                   .mpi =
                       [=] {
                         fit(b->raw, part);
                         b->raw_all.resize(part * static_cast<std::size_t>(n));
                         MPI_Allgather(b->raw.data(), cnt, MPI_BYTE, b->raw_all.data(), cnt, MPI_BYTE, raw);
                       }});
  }
  add_pair(ctx, {.suite = "group",
                 .op = "barrier",
                 .bytes = 0,
                 .bus = BusFactor::one,
                 .inner = 200,
                 .iterations = 20,
                 .meshrt = [=] { g->barrier(); },
                 .mpi = [=] { MPI_Barrier(raw); }});
}

}  // namespace
MESHRT_BENCH_SUITE("group",
                   "StatelessGroup (pingpong = round trip, broadcast, all_gather, barrier) vs raw MPI, 8 B - 64 MiB",
                   register_group);
}  // namespace meshrt::bench
