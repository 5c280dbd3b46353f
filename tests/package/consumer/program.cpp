// A meshrt program built from the installed headers only: its own kernel, a mesh, a call,
// a reduction, a send between sub-meshes and fetches. Every installed header is included,
// so one that needs an uninstalled (internal) header fails to compile here.
#include <cstdio>
#include <vector>

#include "meshrt/controller.hpp"
#include "meshrt/device.hpp"
#include "meshrt/error.hpp"
#include "meshrt/functions.hpp"
#include "meshrt/group.hpp"
#include "meshrt/log.hpp"
#include "meshrt/meshrt.hpp"
#include "meshrt/ndslice.hpp"
#include "meshrt/reduction.hpp"
#include "meshrt/runtime.hpp"
#include "meshrt/tensor.hpp"
#include "meshrt/tensor_serialization.hpp"
#include "meshrt/traffic.hpp"
#include "meshrt/value.hpp"
#include "meshrt/version.hpp"

namespace {

using namespace meshrt;

// consumer.rank_times(n) -> float32[n]: every element is (this rank + 1) * 10.
Signature rank_times_shape(const ArgMetas& args) {
  args.expect_count(1, 1);
  return {.outputs = {TensorMeta({args.integer(0)}, DType::Float32, args.device())}, .mutates = {}};
}
std::vector<Tensor> rank_times_kernel(CallContext& ctx, Args& args) {
  std::vector<float> v(static_cast<std::size_t>(args.integer(0)), static_cast<float>((ctx.rank() + 1) * 10));
  return {Tensor::from<float>({args.integer(0)}, std::span<const float>(v))};
}
MESHRT_REGISTER_FUNCTION("consumer.rank_times", rank_times_kernel, rank_times_shape);

}  // namespace

int main(int argc, char** argv) {
  return run(argc, argv, [](Controller& ctl) {
    const std::int64_t n = ctl.worker_ranks().len();
    Mesh mesh = ctl.world_mesh({{"x", n}});
    DTensor t = mesh.call("consumer.rank_times", 4);
    DTensor sum = t.reduce("x", Reduction::Sum);
    DTensor moved = t.slice_mesh("x", 0).to_mesh(mesh.slice("x", n - 1));
    const Tensor s = ctl.fetch_shard(sum, {{"x", 0}}).get();
    const Tensor m = ctl.fetch_shard(moved, {}).get();
    float expected = 0;
    for (std::int64_t r = 0; r < n; ++r) expected += static_cast<float>((r + 1) * 10);
    if (s.span<float>()[3] != expected || m.span<float>()[0] != 10.0f) {
      throw Error("consumer: wrong values");
    }
    std::printf("consumer program: sum %.0f over %lld ranks, moved %.0f\n", static_cast<double>(s.span<float>()[3]),
                static_cast<long long>(n), static_cast<double>(m.span<float>()[0]));
  });
}
