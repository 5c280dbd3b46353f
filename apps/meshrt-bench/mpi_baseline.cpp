// The floor every suite is compared with: raw MPI point-to-point and collectives, paired
// with themselves. It also checks the harness: its ratios should sit at 1.0 within noise.
#include <mpi.h>

#include <memory>
#include <vector>

#include "bench.hpp"

namespace meshrt::bench {
namespace {

void register_baseline(Context& ctx) {
  for (std::size_t bytes : sizes_up_to(std::size_t{1} << 22, ctx.quick)) {
    auto buf = std::make_shared<std::vector<char>>(bytes);
    auto out = std::make_shared<std::vector<char>>(bytes);
    const MPI_Comm comm = ctx.comm;
    const int count = static_cast<int>(bytes);
    auto all_reduce = [=] { MPI_Allreduce(buf->data(), out->data(), count, MPI_CHAR, MPI_BOR, comm); };
    add_pair(ctx, {.suite = "baseline",
                   .op = "all_reduce",
                   .bytes = bytes,
                   .bus = BusFactor::all_reduce,
                   .meshrt = all_reduce,
                   .mpi = all_reduce});
  }
}

}  // namespace
MESHRT_BENCH_SUITE("baseline", "raw MPI against itself: the harness's own noise", register_baseline);
}  // namespace meshrt::bench
