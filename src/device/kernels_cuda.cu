// CUDA kernels of the elementwise built-ins. Halves compute in float, signed integers wrap
// (through unsigned arithmetic, as on the CPU), so both devices give the same bits.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <string>
#include <type_traits>

#include "device/cuda_kernels.hpp"
#include "device/nan_rule.hpp"
#include "meshrt/error.hpp"

// Not common/checks.hpp: this file is compiled as C++17 by nvcc, apart from libmeshrt's
// C++20 sources, and needs neither MPI nor NCCL.
#define MESHRT_CUDA_CHECK(call)                                                                                \
  do {                                                                                                         \
    const cudaError_t meshrt_rc_ = (call);                                                                     \
    if (meshrt_rc_ != cudaSuccess) {                                                                           \
      throw ::meshrt::SystemError(std::string(#call) + " failed: " + cudaGetErrorString(meshrt_rc_) + " at " + \
                                  __FILE__ + ":" + std::to_string(__LINE__));                                  \
    }                                                                                                          \
  } while (0)

namespace meshrt::cuda_kernels {
namespace {

// DType order: Bool, UInt8, Int32, Int64, Float16, BFloat16, Float32, Float64.
template <class F>
void dispatch(int dtype, F&& f) {
  switch (dtype) {
    case 0:
      f(bool{});
      return;
    case 1:
      f(std::uint8_t{});
      return;
    case 2:
      f(std::int32_t{});
      return;
    case 3:
      f(std::int64_t{});
      return;
    case 4:
      f(__half{});
      return;
    case 5:
      f(__nv_bfloat16{});
      return;
    case 6:
      f(float{});
      return;
    case 7:
      f(double{});
      return;
    default:
      throw UsageError("CUDA kernel: expected a dtype in 0..7, found " + std::to_string(dtype));
  }
}

template <class T>
__device__ float widen(T v) {
  return static_cast<float>(v);
}

template <class T>
__device__ T apply(BinaryOp op, T a, T b) {
  if constexpr (std::is_same_v<T, bool>) {
    return op == BinaryOp::Add ? (a || b) : op == BinaryOp::Mul ? (a && b) : (a != b);
  } else if constexpr (std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>) {
    const float x = static_cast<float>(a), y = static_cast<float>(b);
    return T(op == BinaryOp::Add ? x + y : op == BinaryOp::Sub ? x - y : x * y);
  } else if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    const U x = static_cast<U>(a), y = static_cast<U>(b);
    return static_cast<T>(op == BinaryOp::Add   ? static_cast<U>(x + y)
                          : op == BinaryOp::Sub ? static_cast<U>(x - y)
                                                : static_cast<U>(x * y));
  } else {
    return op == BinaryOp::Add ? a + b : op == BinaryOp::Sub ? a - b : a * b;
  }
}

template <class T>
__global__ void binary_kernel(BinaryOp op, const T* a, const T* b, T* out, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    out[i] = apply(op, a[i], b[i]);
  }
}

template <class T>
__global__ void scale_kernel(const T* x, double factor, T* out, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    if constexpr (std::is_same_v<T, double>) {
      out[i] = x[i] * factor;
    } else {
      out[i] = T(static_cast<float>(x[i]) * static_cast<float>(factor));
    }
  }
}

template <class T>
__global__ void fill_kernel(T* out, T value, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    out[i] = value;
  }
}

// x[i] / n: the second half of avg (a sum, then a division, as on the CPU). Halves divide
// in float and round once; integers truncate toward zero.
template <class T>
__global__ void divide_kernel(T* x, std::int64_t divisor, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    if constexpr (std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>) {
      x[i] = T(static_cast<float>(x[i]) / static_cast<float>(divisor));
    } else {
      x[i] = static_cast<T>(x[i] / static_cast<T>(divisor));
    }
  }
}

// The NaN rule of max and min (device/nan_rule.hpp): the any-NaN mask of x, and NaN
// written back where the reduced mask is set.
template <int D>
__global__ void nan_mask_kernel(const typename nan_rule::Bits<D>::type* x, std::uint8_t* mask, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    mask[i] = nan_rule::is_nan<D>(x[i]);
  }
}

template <int D>
__global__ void apply_nan_mask_kernel(typename nan_rule::Bits<D>::type* x, const std::uint8_t* mask, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    x[i] = nan_rule::masked<D>(x[i], mask[i]);
  }
}

// meshrt.sum: each block's partial sum of a strided share of x, then one block sums the
// partials (in a fixed order for a fixed n: the same bits every run).
constexpr int kSumThreads = 256;
constexpr int kSumBlocks = 256;

// What a sum of T accumulates in, as the CPU's sum_into: double for floating dtypes, the
// unsigned 64-bit wrap of the integers, a count for bool.
template <class T>
using SumAcc = std::conditional_t<std::is_same_v<T, bool> || std::is_integral_v<T>, unsigned long long, double>;

template <class T>
__device__ SumAcc<T> sum_term(T v) {
  if constexpr (std::is_same_v<T, bool>) {
    return v ? 1ull : 0ull;
  } else if constexpr (std::is_integral_v<T>) {
    return static_cast<unsigned long long>(static_cast<long long>(v));
  } else if constexpr (std::is_same_v<T, double>) {
    return v;
  } else {
    return static_cast<double>(static_cast<float>(v));
  }
}

// Sums s[0, kSumThreads) into s[0]; every thread of the block calls it.
template <class A>
__device__ void block_sum(A* s) {
  for (int w = kSumThreads / 2; w > 0; w /= 2) {
    if (static_cast<int>(threadIdx.x) < w) s[threadIdx.x] += s[threadIdx.x + w];
    __syncthreads();
  }
}

template <class T>
__global__ void partial_sums_kernel(const T* x, std::int64_t n, SumAcc<T>* partial) {
  __shared__ SumAcc<T> s[kSumThreads];
  SumAcc<T> acc = 0;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    acc += sum_term(x[i]);
  }
  s[threadIdx.x] = acc;
  __syncthreads();
  block_sum(s);
  if (threadIdx.x == 0) partial[blockIdx.x] = s[0];
}

template <class T>
__global__ void final_sum_kernel(const SumAcc<T>* partial, int count, void* out) {
  __shared__ SumAcc<T> s[kSumThreads];
  SumAcc<T> acc = 0;
  for (int i = static_cast<int>(threadIdx.x); i < count; i += kSumThreads) acc += partial[i];
  s[threadIdx.x] = acc;
  __syncthreads();
  block_sum(s);
  if (threadIdx.x != 0) return;
  if constexpr (std::is_same_v<T, bool>) {
    *static_cast<long long*>(out) = static_cast<long long>(s[0]);
  } else if constexpr (std::is_integral_v<T> || std::is_same_v<T, double>) {
    *static_cast<T*>(out) = static_cast<T>(s[0]);
  } else {
    *static_cast<T*>(out) = T(static_cast<float>(s[0]));  // through float, as the CPU
  }
}

// c = a b, one thread per element of c, a and b through shared 16 x 16 tiles.
constexpr int kTile = 16;
template <class T>
__global__ void matmul_kernel(const T* a, const T* b, T* c, std::int64_t m, std::int64_t k, std::int64_t n) {
  __shared__ T ta[kTile][kTile];
  __shared__ T tb[kTile][kTile];
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.y) * kTile + threadIdx.y;
  const std::int64_t col = static_cast<std::int64_t>(blockIdx.x) * kTile + threadIdx.x;
  T acc = 0;
  for (std::int64_t t = 0; t < k; t += kTile) {
    ta[threadIdx.y][threadIdx.x] = row < m && t + threadIdx.x < k ? a[row * k + t + threadIdx.x] : T(0);
    tb[threadIdx.y][threadIdx.x] = t + threadIdx.y < k && col < n ? b[(t + threadIdx.y) * n + col] : T(0);
    __syncthreads();
    for (int i = 0; i < kTile; ++i) acc += ta[threadIdx.y][i] * tb[i][threadIdx.x];
    __syncthreads();
  }
  if (row < m && col < n) c[row * n + col] = acc;
}

constexpr int kThreads = 256;
unsigned blocks(std::int64_t n) {
  const std::int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 4096 ? (b < 1 ? 1 : b) : 4096);
}

}  // namespace

void binary(BinaryOp op, int dtype, const void* a, const void* b, void* out, std::int64_t n, void* stream) {
  if (n == 0) return;
  dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    binary_kernel<T><<<blocks(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        op, static_cast<const T*>(a), static_cast<const T*>(b), static_cast<T*>(out), n);
  });
  MESHRT_CUDA_CHECK(cudaGetLastError());
}

void scale(int dtype, const void* x, double factor, void* out, std::int64_t n, void* stream) {
  if (n == 0) return;
  dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, bool> || std::is_integral_v<T>) {
      throw UsageError("CUDA scale: expected a floating dtype, found an integer one");
    } else {
      scale_kernel<T><<<blocks(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(static_cast<const T*>(x), factor,
                                                                                     static_cast<T*>(out), n);
    }
  });
  MESHRT_CUDA_CHECK(cudaGetLastError());
}

void divide(int dtype, void* x, std::int64_t divisor, std::int64_t n, void* stream) {
  if (n == 0 || divisor == 1) return;
  dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, bool>) {
      throw UsageError("CUDA divide: expected a numeric dtype, found bool");
    } else {
      divide_kernel<T><<<blocks(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(static_cast<T*>(x), divisor, n);
    }
  });
  MESHRT_CUDA_CHECK(cudaGetLastError());
}

void fill(int dtype, void* out, double fvalue, std::int64_t ivalue, std::int64_t n, void* stream) {
  if (n == 0) return;
  dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    T value;
    if constexpr (std::is_same_v<T, bool>) {
      value = ivalue != 0;
    } else if constexpr (std::is_integral_v<T>) {
      value = static_cast<T>(ivalue);
    } else if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
      value = static_cast<T>(fvalue);
    } else {
      value = T(static_cast<float>(fvalue));
    }
    fill_kernel<T><<<blocks(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(static_cast<T*>(out), value, n);
  });
  MESHRT_CUDA_CHECK(cudaGetLastError());
}

void nan_mask(int dtype, const void* x, void* mask, std::int64_t n, void* stream) {
  if (n == 0) return;
  const bool floating = nan_rule::for_floating(dtype, [&](auto tag) {
    constexpr int D = decltype(tag)::value;
    using T = typename nan_rule::Bits<D>::type;
    nan_mask_kernel<D><<<blocks(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(x), static_cast<std::uint8_t*>(mask), n);
  });
  if (!floating) throw UsageError("CUDA nan_mask: expected a floating dtype, found code " + std::to_string(dtype));
  MESHRT_CUDA_CHECK(cudaGetLastError());
}

void apply_nan_mask(int dtype, void* x, const void* mask, std::int64_t n, void* stream) {
  if (n == 0) return;
  const bool floating = nan_rule::for_floating(dtype, [&](auto tag) {
    constexpr int D = decltype(tag)::value;
    using T = typename nan_rule::Bits<D>::type;
    apply_nan_mask_kernel<D><<<blocks(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<T*>(x), static_cast<const std::uint8_t*>(mask), n);
  });
  if (!floating)
    throw UsageError("CUDA apply_nan_mask: expected a floating dtype, found code " + std::to_string(dtype));
  MESHRT_CUDA_CHECK(cudaGetLastError());
}

std::size_t sum_scratch_bytes() {
  return kSumBlocks * sizeof(double);
}

void sum(int dtype, const void* x, void* out, void* scratch, std::int64_t n, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  const std::int64_t wanted = (n + kSumThreads - 1) / kSumThreads;
  const int grid = static_cast<int>(wanted < 1 ? 1 : wanted < kSumBlocks ? wanted : kSumBlocks);
  dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    auto* partial = static_cast<SumAcc<T>*>(scratch);
    partial_sums_kernel<T><<<grid, kSumThreads, 0, s>>>(static_cast<const T*>(x), n, partial);
    MESHRT_CUDA_CHECK(cudaGetLastError());
    final_sum_kernel<T><<<1, kSumThreads, 0, s>>>(partial, grid, out);
  });
  MESHRT_CUDA_CHECK(cudaGetLastError());
}

void matmul(int dtype, const void* a, const void* b, void* c, std::int64_t m, std::int64_t k, std::int64_t n,
            void* stream) {
  if (m == 0 || n == 0) return;
  const std::int64_t rows = (m + kTile - 1) / kTile;
  if (rows > 65535) {
    throw UsageError("CUDA matmul: expected at most " + std::to_string(65535 * kTile) + " rows, found " +
                     std::to_string(m));
  }
  const dim3 grid(static_cast<unsigned>((n + kTile - 1) / kTile), static_cast<unsigned>(rows));
  const dim3 block(kTile, kTile);
  const auto s = static_cast<cudaStream_t>(stream);
  if (dtype == 6) {
    matmul_kernel<float><<<grid, block, 0, s>>>(static_cast<const float*>(a), static_cast<const float*>(b),
                                                static_cast<float*>(c), m, k, n);
  } else if (dtype == 7) {
    matmul_kernel<double><<<grid, block, 0, s>>>(static_cast<const double*>(a), static_cast<const double*>(b),
                                                 static_cast<double*>(c), m, k, n);
  } else {
    throw UsageError("CUDA matmul: expected float32 or float64, found dtype code " + std::to_string(dtype));
  }
  MESHRT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace meshrt::cuda_kernels
