// Shared by the comm tests: every rank fills its inputs deterministically from (world
// rank, element index), so every rank can compute the expected result for all of them.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "../support/expect_error.hpp"
#include "../support/mpi_world.hpp"
#include "meshrt/internal/comm.hpp"
#include "meshrt/tensor.hpp"

namespace meshrt::test {

// The runtime hands the data plane its own duplicate of MPI_COMM_WORLD; so do the tests.
class World {
 public:
  World() { MPI_Comm_dup(MPI_COMM_WORLD, &comm_); }
  ~World() { MPI_Comm_free(&comm_); }
  World(const World&) = delete;
  World& operator=(const World&) = delete;
  MPI_Comm comm() const { return comm_; }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
};

template <class T>
T from_double(double v) {
  if constexpr (std::is_same_v<T, Half>)
    return float_to_half(static_cast<float>(v));
  else if constexpr (std::is_same_v<T, BFloat16>)
    return float_to_bfloat16(static_cast<float>(v));
  else if constexpr (std::is_same_v<T, bool>)
    return v != 0;
  else
    return static_cast<T>(v);
}
template <class T>
double to_double(T v) {
  if constexpr (std::is_same_v<T, Half>)
    return half_to_float(v);
  else if constexpr (std::is_same_v<T, BFloat16>)
    return bfloat16_to_float(v);
  else
    return static_cast<double>(v);
}

// Input values by reduction family, small enough that every sum, product and average is
// exact in every dtype (bfloat16 holds integers exactly up to 256).
inline double fill_value(Reduction red, DType dtype, int rank, std::int64_t i) {
  const bool is_unsigned = dtype == DType::UInt8;
  const auto r = static_cast<std::int64_t>(rank);
  if (dtype == DType::Bool) return ((r + i) % 3 == 0) ? 1 : 0;
  switch (red) {
    case Reduction::Product: {
      const double mag = static_cast<double>(1 + (r + i) % 2);
      return (!is_unsigned && (r * 3 + i) % 5 == 0) ? -mag : mag;
    }
    case Reduction::Min:
    case Reduction::Max:
      return static_cast<double>((r * 5 + i * 3) % 13 - (is_unsigned ? 0 : 6));
    case Reduction::Band:
    case Reduction::Bor:
    case Reduction::Bxor:
      return static_cast<double>((r * 37 + i * 11 + 5) % 128);
    default:
      return static_cast<double>((r * 7 + i * 3) % 11 - (is_unsigned ? 0 : 5));
  }
}

// A tensor of `meta` filled for `rank`.
inline Tensor make_input(const TensorMeta& meta, Reduction red, int rank) {
  Tensor t = meta.empty();
  dispatch_dtype(meta.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* p = static_cast<T*>(t.raw_data());
    for (std::int64_t i = 0; i < meta.numel(); ++i) p[i] = from_double<T>(fill_value(red, meta.dtype(), rank, i));
  });
  return t;
}

// Reduces `values` (one per rank of the line, in coordinate order) as the data plane
// should, in the element type T, including avg's final division.
template <class T>
T reduce_values(Reduction red, const std::vector<double>& values) {
  double acc = values[0];
  for (std::size_t k = 1; k < values.size(); ++k) {
    const double v = values[k];
    switch (red) {
      case Reduction::Sum:
      case Reduction::Avg:
        acc += v;
        break;
      case Reduction::Product:
        acc *= v;
        break;
      case Reduction::Min:
        acc = std::min(acc, v);
        break;
      case Reduction::Max:
        acc = std::max(acc, v);
        break;
      case Reduction::Band:
        acc = static_cast<double>(static_cast<std::int64_t>(acc) & static_cast<std::int64_t>(v));
        break;
      case Reduction::Bor:
        acc = static_cast<double>(static_cast<std::int64_t>(acc) | static_cast<std::int64_t>(v));
        break;
      case Reduction::Bxor:
        acc = static_cast<double>(static_cast<std::int64_t>(acc) ^ static_cast<std::int64_t>(v));
        break;
      case Reduction::Stack:
        break;
    }
  }
  T out = from_double<T>(acc);
  if (red == Reduction::Avg) {
    const auto n = static_cast<std::int64_t>(values.size());
    if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
      out = from_double<T>(static_cast<double>(static_cast<float>(to_double(out)) / static_cast<float>(n)));
    } else if constexpr (std::is_integral_v<T>) {
      out = static_cast<T>(out / static_cast<T>(n));  // truncating, like NCCL's ncclAvg
    } else {
      out = static_cast<T>(out / static_cast<T>(n));
    }
  }
  return out;
}

// Max and min propagate NaN (torch.maximum, numpy.maximum) whichever rank holds it: each
// rank of the line in turn holds a NaN at element 0 (of every block when scattered);
// element 1 holds rank + 1 everywhere.
inline Tensor nan_input(DType dtype, std::int64_t blocks, int holder) {
  const TensorMeta meta = blocks == 0 ? TensorMeta({2}, dtype) : TensorMeta({blocks, 2}, dtype);
  Tensor t = meta.empty();
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, bool>) {
      T* p = t.data<T>();
      for (std::int64_t i = 0; i < meta.numel(); i += 2) {
        p[i] = from_double<T>(world_rank() == holder ? std::nan("") : world_rank() + 1.0);
        p[i + 1] = from_double<T>(world_rank() + 1.0);
      }
    }
  });
  return t;
}

// "" when `out` (host) holds NaN at element 0 and `want` at element 1.
inline std::string nan_result(const Tensor& out, double want) {
  std::string problem;
  dispatch_dtype(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, bool>) {
      const double a = to_double<T>(out.data<T>()[0]);
      const double b = to_double<T>(out.data<T>()[1]);
      if (!std::isnan(a)) problem += fmt::format("element 0: expected nan, found {}; ", a);
      if (b != want) problem += fmt::format("element 1: expected {}, found {}", want, b);
    }
  });
  return problem;
}

// Runs every NaN case of max and min over a line of `ranks`: each float dtype, all_reduce
// and reduce_scatter, the NaN on each rank in turn. `reduce(reduction, scatter, input)`
// runs the collective and returns its output on the host.
template <class Reduce>
void expect_nan_propagates(int ranks, Reduce reduce) {
  for (DType dtype : {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16}) {
    for (Reduction red : {Reduction::Max, Reduction::Min}) {
      for (bool scatter : {false, true}) {
        for (int holder = 0; holder < ranks; ++holder) {
          SCOPED_TRACE(fmt::format("{} {} scatter={}: NaN on rank {}", name(red), name(dtype), scatter, holder));
          const Tensor out = reduce(red, scatter, nan_input(dtype, scatter ? ranks : 0, holder));
          EXPECT_EQ(nan_result(out, red == Reduction::Max ? ranks : 1), "");
        }
      }
    }
  }
}

// Compares `actual` with `expected` element by element; returns "" or the first mismatch.
inline std::string compare(const Tensor& actual, const Tensor& expected) {
  if (actual.meta() != expected.meta()) {
    return "meta: expected " + expected.meta().to_string() + ", found " + actual.meta().to_string();
  }
  std::string err;
  dispatch_dtype(actual.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* a = static_cast<const T*>(actual.raw_data());
    const T* e = static_cast<const T*>(expected.raw_data());
    for (std::int64_t i = 0; i < actual.numel() && err.empty(); ++i) {
      if (!(a[i] == e[i])) {
        err = "element " + std::to_string(i) + ": expected " + std::to_string(to_double(e[i])) + ", found " +
              std::to_string(to_double(a[i]));
      }
    }
  });
  return err;
}

}  // namespace meshrt::test
