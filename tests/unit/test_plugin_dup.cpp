// A library that registers a name libmeshrt already has: load_library must refuse it.
#include "meshrt/functions.hpp"

namespace {
std::vector<meshrt::Tensor> kernel(meshrt::CallContext&, meshrt::Args&) {
  return {};
}
meshrt::Signature shape(const meshrt::ArgMetas&) {
  return {};
}
}  // namespace

MESHRT_REGISTER_FUNCTION("meshrt.add", kernel, shape);
