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

}  // namespace meshrt::cuda_kernels
