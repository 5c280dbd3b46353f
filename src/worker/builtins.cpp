// Built-in functions that need the worker's view of the mesh.
#include "meshrt/device.hpp"
#include "meshrt/functions.hpp"
#include "meshrt/internal/comm.hpp"
#include "meshrt/internal/device.hpp"

namespace meshrt {
namespace {

std::vector<Tensor> mesh_coordinate(CallContext& ctx, Args& args) {
  Tensor t = Tensor::from<std::int64_t>({}, {ctx.coordinate(args.string(0))});
  // On an accelerator mesh the output is on the rank's device, as the shape function says.
  if (ctx.device().is_cpu()) return {t};
  return {device::to_device(t, ctx.device(), device::stream_for(ctx.stream_id(), ctx.device()))};
}

Signature mesh_coordinate_shape(const ArgMetas& args) {
  args.expect_count(1, 1);
  (void)args.string(0);
  return {{TensorMeta({}, DType::Int64, args.device())}, {}};
}

// meshrt.release_cached_memory(): frees this rank's cached memory, the CPU data plane's
// output pool and its accelerator's pool, and returns the bytes freed (int64 0-d, on the
// host). Controller::release_cached_memory calls it on every worker.
std::vector<Tensor> release_cached_memory(CallContext&, Args&) {
  std::size_t freed = release_output_pool();
  // Only a backend already in use: asking for one would create it (and, on CUDA, a context).
  const device::Placement where = device::placement();
  if (where.accelerator != device::Accelerator::None) {
    device::release_completed();  // what completed work no longer needs goes back first
    device::Backend& backend = device::backend(where.accelerator);
    const std::size_t cached = backend.pool_stats().cached_bytes;
    backend.empty_cache();
    freed += cached;
  }
  return {Tensor::from<std::int64_t>({}, {static_cast<std::int64_t>(freed)})};
}

Signature release_cached_memory_shape(const ArgMetas& args) {
  args.expect_count(0, 0);
  return {{TensorMeta({}, DType::Int64)}, {}};
}

}  // namespace
}  // namespace meshrt

MESHRT_REGISTER_FUNCTION("meshrt.mesh_coordinate", meshrt::mesh_coordinate, meshrt::mesh_coordinate_shape,
                         meshrt::functions::Description{.params = {{"dim", "str"}},
                                                        .returns = "tensor",
                                                        .doc = "This rank's coordinate along `dim` as an int64 0-d "
                                                               "tensor (mesh.rank(dim))."});
MESHRT_REGISTER_FUNCTION("meshrt.release_cached_memory", meshrt::release_cached_memory,
                         meshrt::release_cached_memory_shape,
                         meshrt::functions::Description{
                             .params = {},
                             .returns = "tensor",
                             .doc = "Empties this rank's cache of CPU collective outputs "
                                    "and its device pool; returns the bytes freed as an "
                                    "int64 0-d tensor (Controller::release_cached_memory)."});
