// Max and min propagate NaN on every backend (numpy and torch: any rank's NaN wins),
// whatever the collective library does with it: NCCL's max and min compare as fmax and
// fmin may, dropping a NaN. So a device max or min of a floating dtype reduces the data
// as the library does and, beside it, an any-NaN mask (1 where an element is NaN) with
// max over uint8, then writes NaN wherever the reduced mask is set.
//
// The element rules of that mask, on the dtype's bits so one definition serves the CUDA
// kernels (kernels_cuda.cu, __half) and the emulated accelerator (emulated_comm.cpp,
// meshrt::Half) alike. Plain C++17, no meshrt header: nvcc compiles it too.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__CUDACC__)
#define MESHRT_HOST_DEVICE __host__ __device__
#else
#define MESHRT_HOST_DEVICE
#endif

namespace meshrt::nan_rule {

// DType codes (static_cast<int>(DType)) of the floating dtypes.
inline constexpr int kFloat16 = 4;
inline constexpr int kBFloat16 = 5;
inline constexpr int kFloat32 = 6;
inline constexpr int kFloat64 = 7;
// Reduction codes (static_cast<int>(Reduction)) of min and max.
inline constexpr int kMin = 4;
inline constexpr int kMax = 5;

// Whether a reduction over a dtype needs the mask: min or max of a floating dtype.
constexpr bool applies(int dtype, int reduction) {
  return (reduction == kMin || reduction == kMax) && dtype >= kFloat16 && dtype <= kFloat64;
}

// The bits of one element of each floating dtype: the exponent's mask, the mantissa's,
// and the quiet NaN written where the mask is set.
template <int DType>
struct Bits;
template <>
struct Bits<kFloat16> {
  using type = std::uint16_t;
  static constexpr type exponent = 0x7c00;
  static constexpr type mantissa = 0x03ff;
  static constexpr type quiet_nan = 0x7e00;
};
template <>
struct Bits<kBFloat16> {
  using type = std::uint16_t;
  static constexpr type exponent = 0x7f80;
  static constexpr type mantissa = 0x007f;
  static constexpr type quiet_nan = 0x7fc0;
};
template <>
struct Bits<kFloat32> {
  using type = std::uint32_t;
  static constexpr type exponent = 0x7f800000u;
  static constexpr type mantissa = 0x007fffffu;
  static constexpr type quiet_nan = 0x7fc00000u;
};
template <>
struct Bits<kFloat64> {
  using type = std::uint64_t;
  static constexpr type exponent = 0x7ff0000000000000ull;
  static constexpr type mantissa = 0x000fffffffffffffull;
  static constexpr type quiet_nan = 0x7ff8000000000000ull;
};

template <int DType>
MESHRT_HOST_DEVICE inline std::uint8_t is_nan(typename Bits<DType>::type bits) {
  return (bits & Bits<DType>::exponent) == Bits<DType>::exponent && (bits & Bits<DType>::mantissa) != 0 ? 1 : 0;
}

template <int DType>
MESHRT_HOST_DEVICE inline typename Bits<DType>::type masked(typename Bits<DType>::type bits, std::uint8_t mask) {
  return mask != 0 ? Bits<DType>::quiet_nan : bits;
}

// Calls f(std::integral_constant<int, D>{}) for a floating dtype code D; returns false
// for any other dtype.
template <class F>
bool for_floating(int dtype, F&& f) {
  switch (dtype) {
    case kFloat16:
      f(std::integral_constant<int, kFloat16>{});
      return true;
    case kBFloat16:
      f(std::integral_constant<int, kBFloat16>{});
      return true;
    case kFloat32:
      f(std::integral_constant<int, kFloat32>{});
      return true;
    case kFloat64:
      f(std::integral_constant<int, kFloat64>{});
      return true;
    default:
      return false;
  }
}

// On the host: mask[i] = 1 where x[i] (n elements of `dtype`) is NaN, else 0.
template <int DType>
void mask_of(const void* x, std::uint8_t* mask, std::int64_t n) {
  using T = typename Bits<DType>::type;
  for (std::int64_t i = 0; i < n; ++i) {
    T bits;
    std::memcpy(&bits, static_cast<const char*>(x) + i * static_cast<std::int64_t>(sizeof(T)), sizeof(T));
    mask[i] = is_nan<DType>(bits);
  }
}

// On the host: x[i] = NaN where mask[i] != 0.
template <int DType>
void apply_mask(void* x, const std::uint8_t* mask, std::int64_t n) {
  using T = typename Bits<DType>::type;
  for (std::int64_t i = 0; i < n; ++i) {
    char* at = static_cast<char*>(x) + i * static_cast<std::int64_t>(sizeof(T));
    T bits;
    std::memcpy(&bits, at, sizeof(T));
    bits = masked<DType>(bits, mask[i]);
    std::memcpy(at, &bits, sizeof(T));
  }
}

}  // namespace meshrt::nan_rule
