// With duplicate_b.cpp: one name registered by two translation units of one program.
#include "meshrt/functions.hpp"

namespace {
std::vector<meshrt::Tensor> kernel(meshrt::CallContext&, meshrt::Args&) { return {}; }
meshrt::Signature shape(const meshrt::ArgMetas&) { return {}; }
}  // namespace

MESHRT_REGISTER_FUNCTION("test.same_name", kernel, shape);
