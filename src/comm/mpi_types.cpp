#include "comm/mpi_types.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <type_traits>

#include "common/assert.hpp"
#include "common/checks.hpp"

namespace meshrt::detail {
namespace {

// float16/bfloat16 reductions: MPI has no 16-bit float type, so the op converts each
// element through float, computes, and rounds back (round to nearest even). Summing N
// values this way rounds N-1 times, as an fp16 ring all-reduce on NCCL does.
template <class H, float (*ToFloat)(H), H (*FromFloat)(float), class F>
void combine16(void* in, void* inout, int* len, F&& f) {
  const auto n = static_cast<std::size_t>(*len);
  const H* a = static_cast<const H*>(in);
  H* b = static_cast<H*>(inout);
  for (std::size_t i = 0; i < n; ++i) b[i] = FromFloat(f(ToFloat(a[i]), ToFloat(b[i])));
}

struct Sum {
  float operator()(float a, float b) const { return a + b; }
};
struct Prod {
  float operator()(float a, float b) const { return a * b; }
};
// Comparisons propagate NaN, like torch.maximum and torch.minimum: a NaN on either side
// wins, so the result does not depend on which rank holds it.
struct Min {
  template <class F>
  F operator()(F a, F b) const {
    return (a != a || a < b) ? a : b;
  }
};
struct Max {
  template <class F>
  F operator()(F a, F b) const {
    return (a != a || a > b) ? a : b;
  }
};

template <class Op>
void half_op(void* in, void* inout, int* len, MPI_Datatype*) {
  combine16<Half, half_to_float, float_to_half>(in, inout, len, Op{});
}
template <class Op>
void bf16_op(void* in, void* inout, int* len, MPI_Datatype*) {
  combine16<BFloat16, bfloat16_to_float, float_to_bfloat16>(in, inout, len, Op{});
}

// float32/float64 min and max: MPI_MIN and MPI_MAX compare with < and >, so a NaN
// survives only where the reduction order happens to start from it (the first rank of
// the line). These ops propagate it from any rank.
template <class F, class Op>
void float_op(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto n = static_cast<std::size_t>(*len);
  const F* a = static_cast<const F*>(in);
  F* b = static_cast<F*>(inout);
  for (std::size_t i = 0; i < n; ++i) b[i] = Op{}(a[i], b[i]);
}

// uint8 sums wrap (mod 256), as NCCL's, torch's and numpy's do. MPI_SUM is not relied on
// for them: Open MPI's vectorised reductions (its op/avx component) saturate 8-bit sums
// at 255 on the elements their vector loop covers, and wrap on the rest.
void uint8_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto n = static_cast<std::size_t>(*len);
  const auto* a = static_cast<const std::uint8_t*>(in);
  auto* b = static_cast<std::uint8_t*>(inout);
  for (std::size_t i = 0; i < n; ++i) b[i] = static_cast<std::uint8_t>(a[i] + b[i]);
}

// uint8 min and max: MPICH 4.0's MPI_MIN on MPI_UINT8_T picked 132 over 118 (a signed
// comparison), so meshrt takes both itself, as it does the sum.
template <bool kMin>
void uint8_extreme(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto n = static_cast<std::size_t>(*len);
  const auto* a = static_cast<const std::uint8_t*>(in);
  auto* b = static_cast<std::uint8_t*>(inout);
  for (std::size_t i = 0; i < n; ++i) b[i] = kMin ? std::min(a[i], b[i]) : std::max(a[i], b[i]);
}

struct OwnOps {
  std::array<MPI_Op, 2> f32{};  // min, max
  std::array<MPI_Op, 2> f64{};
  std::array<MPI_Op, 2> u8{};
  MPI_Op u8_sum = MPI_OP_NULL;
};

// Created once, on first use after MPI_Init, and kept for the life of the process, like
// types16().
const OwnOps& own_ops() {
  static OwnOps t;
  static std::once_flag once;
  std::call_once(once, [] {
    MESHRT_MPI_CHECK(MPI_Op_create(float_op<float, Min>, 1, &t.f32[0]));
    MESHRT_MPI_CHECK(MPI_Op_create(float_op<float, Max>, 1, &t.f32[1]));
    MESHRT_MPI_CHECK(MPI_Op_create(float_op<double, Min>, 1, &t.f64[0]));
    MESHRT_MPI_CHECK(MPI_Op_create(float_op<double, Max>, 1, &t.f64[1]));
    MESHRT_MPI_CHECK(MPI_Op_create(uint8_extreme<true>, 1, &t.u8[0]));
    MESHRT_MPI_CHECK(MPI_Op_create(uint8_extreme<false>, 1, &t.u8[1]));
    MESHRT_MPI_CHECK(MPI_Op_create(uint8_sum, 1, &t.u8_sum));
  });
  return t;
}

struct Types16 {
  MPI_Datatype type = MPI_DATATYPE_NULL;
  std::array<MPI_Op, 4> half{};  // sum, product, min, max
  std::array<MPI_Op, 4> bf16{};
};

// Created once, on first use after MPI_Init, and kept for the life of the process:
// datatypes and ops are tiny, and freeing them would race with ops still in flight.
const Types16& types16() {
  static Types16 t;
  static std::once_flag once;
  std::call_once(once, [] {
    MESHRT_MPI_CHECK(MPI_Type_contiguous(2, MPI_BYTE, &t.type));
    MESHRT_MPI_CHECK(MPI_Type_commit(&t.type));
    MPI_User_function* half_fns[] = {half_op<Sum>, half_op<Prod>, half_op<Min>, half_op<Max>};
    MPI_User_function* bf16_fns[] = {bf16_op<Sum>, bf16_op<Prod>, bf16_op<Min>, bf16_op<Max>};
    for (std::size_t i = 0; i < 4; ++i) {
      MESHRT_MPI_CHECK(MPI_Op_create(half_fns[i], 1, &t.half[i]));
      MESHRT_MPI_CHECK(MPI_Op_create(bf16_fns[i], 1, &t.bf16[i]));
    }
  });
  return t;
}

std::size_t op16_index(Reduction r) {
  switch (r) {
    case Reduction::Sum:
    case Reduction::Avg:
      return 0;
    case Reduction::Product:
      return 1;
    case Reduction::Min:
      return 2;
    case Reduction::Max:
      return 3;
    default:
      break;
  }
  throw UsageError(fmt::format("reduction {} is not defined on float16/bfloat16", name(r)));
}

}  // namespace

MPI_Datatype mpi_datatype(DType dtype) {
  switch (dtype) {
    case DType::Bool:
    case DType::UInt8:
      return MPI_UINT8_T;
    case DType::Int32:
      return MPI_INT32_T;
    case DType::Int64:
      return MPI_INT64_T;
    case DType::Float16:
    case DType::BFloat16:
      return types16().type;
    case DType::Float32:
      return MPI_FLOAT;
    case DType::Float64:
      return MPI_DOUBLE;
  }
  throw UsageError(fmt::format("expected a valid dtype, found code {}", static_cast<int>(dtype)));
}

MPI_Op mpi_op(Reduction reduction, DType dtype) {
  if (dtype == DType::Float16) return types16().half[op16_index(reduction)];
  if (dtype == DType::BFloat16) return types16().bf16[op16_index(reduction)];
  if ((dtype == DType::Float32 || dtype == DType::Float64) &&
      (reduction == Reduction::Min || reduction == Reduction::Max)) {
    const auto& ops = dtype == DType::Float32 ? own_ops().f32 : own_ops().f64;
    return ops[reduction == Reduction::Min ? 0 : 1];
  }
  if (dtype == DType::UInt8 && reduction == Reduction::Sum) return own_ops().u8_sum;
  if (dtype == DType::UInt8 && (reduction == Reduction::Min || reduction == Reduction::Max)) {
    return own_ops().u8[reduction == Reduction::Min ? 0 : 1];
  }
  switch (reduction) {
    case Reduction::Sum:
    case Reduction::Avg:
      return MPI_SUM;
    case Reduction::Product:
      return MPI_PROD;
    case Reduction::Min:
      return MPI_MIN;
    case Reduction::Max:
      return MPI_MAX;
    case Reduction::Band:
      return MPI_BAND;
    case Reduction::Bor:
      return MPI_BOR;
    case Reduction::Bxor:
      return MPI_BXOR;
    case Reduction::Stack:
      break;
  }
  // plan_reduce turns stack into all_gather or all_to_all, which take no operator.
  MESHRT_INTERNAL("mpi_op: expected an elementwise reduction, found stack (an all_gather or all_to_all)");
}

void divide_in_place(void* data, std::int64_t numel, DType dtype, std::int64_t n) {
  const auto count = static_cast<std::size_t>(numel);
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    T* p = static_cast<T*>(data);
    if constexpr (std::is_same_v<T, Half>) {
      for (std::size_t i = 0; i < count; ++i) p[i] = float_to_half(half_to_float(p[i]) / static_cast<float>(n));
    } else if constexpr (std::is_same_v<T, BFloat16>) {
      for (std::size_t i = 0; i < count; ++i) {
        p[i] = float_to_bfloat16(bfloat16_to_float(p[i]) / static_cast<float>(n));
      }
    } else if constexpr (std::is_same_v<T, bool>) {
      throw UsageError("avg is not defined on bool");
    } else {
      const T divisor = static_cast<T>(n);
      for (std::size_t i = 0; i < count; ++i) p[i] = static_cast<T>(p[i] / divisor);
    }
  });
}

}  // namespace meshrt::detail
