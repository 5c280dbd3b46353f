// The device layer's CUDA kernels (kernels_cuda.cu): the elementwise built-ins, sum and
// matmul, the division of avg and the NaN mask of max and min. Plain types only, so the .cu file
// needs no C++20 meshrt header. `dtype` is static_cast<int>(DType); `stream` is a
// cudaStream_t (nullptr: the default stream). Errors raise SystemError.
#pragma once

#include <cstddef>
#include <cstdint>

namespace meshrt::cuda_kernels {

// The elementwise operations of meshrt.add, meshrt.sub and meshrt.mul, on the host
// (functions/builtins.cpp) and on a CUDA device alike.
enum class BinaryOp : int { Add = 0, Sub = 1, Mul = 2 };

void binary(BinaryOp op, int dtype, const void* a, const void* b, void* out, std::int64_t n, void* stream);
void scale(int dtype, const void* x, double factor, void* out, std::int64_t n, void* stream);
// x[i] = x[i] / divisor in place (avg's division; integers truncate toward zero).
void divide(int dtype, void* x, std::int64_t divisor, std::int64_t n, void* stream);
// Floating dtypes take `fvalue`, the others `ivalue`.
void fill(int dtype, void* out, double fvalue, std::int64_t ivalue, std::int64_t n, void* stream);
// The NaN rule of max and min (device/nan_rule.hpp), on a floating dtype: mask (n uint8)
// is 1 where x is NaN; apply_nan_mask writes NaN into x where mask is set.
void nan_mask(int dtype, const void* x, void* mask, std::int64_t n, void* stream);
void apply_nan_mask(int dtype, void* x, const void* mask, std::int64_t n, void* stream);
// meshrt.sum on the device: out (one element: int64 for bool, else x's dtype) is the sum
// of x's n elements as the CPU's sum_into computes it (floating dtypes accumulate in
// double, integers wrap, bool counts); `scratch` holds sum_scratch_bytes() of device
// memory for the partial sums, on the same stream.
std::size_t sum_scratch_bytes();
void sum(int dtype, const void* x, void* out, void* scratch, std::int64_t n, void* stream);
// meshrt.matmul on the device: c[m, n] = a[m, k] b[k, n], row-major, float32 or float64
// (one accumulation per element in k order; not OpenBLAS's bits).
void matmul(int dtype, const void* a, const void* b, void* c, std::int64_t m, std::int64_t k, std::int64_t n,
            void* stream);

}  // namespace meshrt::cuda_kernels
