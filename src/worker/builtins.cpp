// Built-in functions that need the worker's view of the mesh.
#include "meshrt/functions.hpp"

namespace meshrt {
namespace {

std::vector<Tensor> mesh_coordinate(CallContext& ctx, Args& args) {
  Tensor t = Tensor::empty(TensorMeta({}, DType::Int64));
  t.data<std::int64_t>()[0] = ctx.coordinate(args.string(0));
  return {t};
}

Signature mesh_coordinate_shape(const ArgMetas& args) {
  args.expect_count(1, 1);
  (void)args.string(0);
  return {{TensorMeta({}, DType::Int64, args.device())}, {}};
}

}  // namespace
}  // namespace meshrt

MESHRT_REGISTER_FUNCTION("meshrt.mesh_coordinate", meshrt::mesh_coordinate, meshrt::mesh_coordinate_shape,
                         meshrt::functions::Description{.params = {{"dim", "str"}},
                                                        .returns = "tensor",
                                                        .doc = "This rank's coordinate along `dim` as an int64 0-d "
                                                               "tensor (mesh.rank(dim))."});
