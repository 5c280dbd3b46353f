// A library of remote functions loaded with functions::load_library() by functions_test.
#include "meshrt/functions.hpp"

namespace {

std::vector<meshrt::Tensor> triple(meshrt::CallContext&, meshrt::Args& args) {
  meshrt::Tensor out = args.tensor(0).clone();
  for (float& v : out.span<float>()) v *= 3;
  return {out};
}

meshrt::Signature triple_shape(const meshrt::ArgMetas& args) {
  return {.outputs = {args.tensor(0)}, .mutates = {}};
}

}  // namespace

MESHRT_REGISTER_FUNCTION("plugin.triple", triple, triple_shape);
