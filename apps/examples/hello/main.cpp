// README.md's first program: a mesh, a call, two reductions, a send and two fetches.
//   mpiexec -n 4 example-hello
#include <cstdio>

#include "meshrt/meshrt.hpp"

using namespace meshrt;

int main(int argc, char** argv) {
  return run(argc, argv, [](Controller& ctl) {
    const std::int64_t n = ctl.worker_ranks().len();
    Mesh mesh = ctl.world_mesh({{"host", 2}, {"gpu", n / 2}});           // 4 ranks: 2 x 2
    DTensor x = mesh.call("meshrt.full", {3, 4}, DType::Float32, 1.0);   // on every rank
    DTensor y = x.reduce("gpu", Reduction::Sum);                         // all_reduce over gpu
    DTensor g = y.reduce("host", Reduction::Stack);                      // all_gather: [2, 3, 4]
    DTensor z = y.slice_mesh("host", 0).to_mesh(mesh.slice("host", 1));  // host 0 -> host 1
    Tensor a = ctl.fetch_shard(g, {{"host", 1}, {"gpu", 0}}).get();      // waits for the value
    Tensor b = ctl.fetch_shard(z, {{"gpu", 0}}).get();
    std::printf("g is %s, g[0][0][0] = %.1f; z on host 1 = %.1f\n", a.meta().to_string().c_str(), a.span<float>()[0],
                b.span<float>()[0]);
    if (a.span<float>()[0] != static_cast<float>(n / 2)) throw Error("expected the sum over gpu to be n / 2");
  });
}
