// With duplicate_b.cpp: one name registered by two translation units of one program.
#include "meshrt/functions.hpp"

namespace {
std::vector<meshrt::Tensor> kernel(meshrt::CallContext&, meshrt::Args&) {
  return {};
}
meshrt::Signature shape(const meshrt::ArgMetas&) {
  return {};
}
}  // namespace

// The test checks that the error names this line.
extern const int duplicate_a_line = __LINE__ + 1;
MESHRT_REGISTER_FUNCTION("test.same_name", kernel, shape);
