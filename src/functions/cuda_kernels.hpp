// The CUDA side of the elementwise built-ins (builtins_cuda.cu). Plain types only, so
// the .cu file does not need meshrt's C++20 headers. `dtype` is static_cast<int>(DType);
// `stream` is a cudaStream_t (nullptr: the default stream). Errors raise SystemError.
#pragma once

#include <cstdint>

namespace meshrt::cuda_kernels {

enum BinaryOp : int { kAdd = 0, kSub = 1, kMul = 2 };

void binary(int op, int dtype, const void* a, const void* b, void* out, std::int64_t n, void* stream);
void scale(int dtype, const void* x, double factor, void* out, std::int64_t n, void* stream);
// Floating dtypes take `fvalue`, the others `ivalue`.
void fill(int dtype, void* out, double fvalue, std::int64_t ivalue, std::int64_t n, void* stream);

}  // namespace meshrt::cuda_kernels
