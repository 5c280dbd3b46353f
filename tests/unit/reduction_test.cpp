// The reduction rules (meshrt::reduction_rule) against the table of docs/ARCHITECTURE.md
// section 3.6, row by row, and the dtype and device rules beside it. The controller and
// every worker call this one function, so what is checked here is what both enforce.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "meshrt/reduction.hpp"

namespace meshrt::test {
namespace {

constexpr std::int64_t kN = 4;  // the size of the mesh dimension
constexpr Device::Kind kCpu = Device::Kind::Cpu;
constexpr Device::Kind kCuda = Device::Kind::Cuda;

const std::vector<Reduction> kElementwise{Reduction::Sum, Reduction::Avg,  Reduction::Product, Reduction::Min,
                                          Reduction::Max, Reduction::Band, Reduction::Bor,     Reduction::Bxor};

// An integer input [kN, 3]: every elementwise reduction but avg accepts it.
TensorMeta input(std::vector<std::int64_t> shape = {kN, 3}, DType dtype = DType::Int32) {
  return TensorMeta(std::move(shape), dtype);
}
// The dtype every rule accepts for `r`: avg needs a floating-point one, the bitwise
// reductions an integer one.
DType accepted_dtype(Reduction r) {
  return r == Reduction::Avg ? DType::Float32 : DType::Int32;
}

void expect_allowed(const ReductionRule& rule, const std::string& collective, const TensorMeta& in,
                    const TensorMeta& out) {
  EXPECT_TRUE(rule.allowed()) << rule.error;
  EXPECT_EQ(std::string(rule.collective), collective);
  EXPECT_EQ(rule.out_meta(in), out);
}

// Row 1: stack, no scatter -> all_gather, S -> [N, *S], not in place.
TEST(ReductionRule, StackIsAllGather) {
  for (const auto& shape : std::vector<std::vector<std::int64_t>>{{}, {5}, {2, 3}}) {
    const TensorMeta in = input(shape, DType::Float32);
    std::vector<std::int64_t> out = {kN};
    out.insert(out.end(), shape.begin(), shape.end());
    expect_allowed(reduction_rule(in, kN, Reduction::Stack, false, false, kCpu), "all_gather", in, in.with_shape(out));
    expect_allowed(reduction_rule(in, kN, Reduction::Stack, false, false, kCuda), "all_gather", in, in.with_shape(out));
    const ReductionRule inplace = reduction_rule(in, kN, Reduction::Stack, false, true, kCpu);
    EXPECT_FALSE(inplace.allowed());
    EXPECT_EQ(inplace.error,
              "stack (all_gather) cannot run in place: its output [4, ...] is larger than its input " + in.to_string());
  }
}

// Row 2: stack with scatter -> all_to_all, [N, ...] -> [N, ...], in place allowed.
TEST(ReductionRule, StackWithScatterIsAllToAll) {
  const TensorMeta in = input({kN, 2, 5}, DType::Float64);
  for (bool inplace : {false, true}) {
    for (Device::Kind device : {kCpu, kCuda}) {
      const ReductionRule rule = reduction_rule(in, kN, Reduction::Stack, true, inplace, device);
      expect_allowed(rule, "all_to_all", in, in);
      EXPECT_FALSE(rule.reshaped.has_value()) << "the output is the input's meta: no copy";
    }
  }
}

// Row 3: every other reduction, no scatter -> all_reduce, S -> S, in place allowed.
TEST(ReductionRule, ElementwiseIsAllReduce) {
  for (Reduction r : kElementwise) {
    for (const auto& shape : std::vector<std::vector<std::int64_t>>{{}, {7}, {kN, 3}}) {
      const TensorMeta in = input(shape, accepted_dtype(r));
      for (bool inplace : {false, true}) {
        const ReductionRule rule = reduction_rule(in, kN, r, false, inplace, kCpu);
        expect_allowed(rule, "all_reduce", in, in);
        EXPECT_FALSE(rule.reshaped.has_value());
      }
    }
  }
}

// Row 4: every other reduction with scatter -> reduce_scatter, [N, *R] -> R, not in place.
TEST(ReductionRule, ElementwiseWithScatterIsReduceScatter) {
  for (Reduction r : kElementwise) {
    const TensorMeta in = input({kN, 3, 2}, accepted_dtype(r));
    expect_allowed(reduction_rule(in, kN, r, true, false, kCpu), "reduce_scatter", in, in.with_shape({3, 2}));
    const TensorMeta vector = input({kN}, accepted_dtype(r));
    expect_allowed(reduction_rule(vector, kN, r, true, false, kCpu), "reduce_scatter", vector, vector.with_shape({}));
    const ReductionRule inplace = reduction_rule(in, kN, r, true, true, kCpu);
    EXPECT_FALSE(inplace.allowed());
    const std::string dtype(name(accepted_dtype(r)));
    EXPECT_EQ(inplace.error, std::string(name(r)) + " with scatter (reduce_scatter) cannot run in place: its output " +
                                 dtype + "[3, 2] on cpu is smaller than its input " + dtype + "[4, 3, 2] on cpu");
  }
}

// Scatter needs size(0) == N, for stack (all_to_all) and the others (reduce_scatter).
TEST(ReductionRule, ScatterNeedsDimZeroOfSizeN) {
  for (Reduction r : {Reduction::Stack, Reduction::Sum, Reduction::Bxor}) {
    for (const auto& shape : std::vector<std::vector<std::int64_t>>{{}, {kN + 1}, {kN - 1, 4}, {1, kN}}) {
      const TensorMeta in = input(shape);
      const ReductionRule rule = reduction_rule(in, kN, r, true, false, kCpu);
      EXPECT_FALSE(rule.allowed()) << in.to_string();
      EXPECT_EQ(rule.error, std::string(name(r)) +
                                " with scatter over a dimension of size 4 needs an input with size(0) == 4, found " +
                                in.to_string());
      EXPECT_STREQ(rule.collective, "");
    }
  }
  // A dimension of size 1 takes any size(0) == 1.
  EXPECT_TRUE(reduction_rule(input({1, 3}), 1, Reduction::Sum, true, false, kCpu).allowed());
}

// Bool: no sum, avg or product (their results are not bool); the rest are fine.
TEST(ReductionRule, BoolRefusesSumAvgProduct) {
  const TensorMeta in = input({kN}, DType::Bool);
  for (Reduction r : {Reduction::Sum, Reduction::Avg, Reduction::Product}) {
    for (bool scatter : {false, true}) {
      for (Device::Kind device : {kCpu, kCuda}) {
        const ReductionRule rule = reduction_rule(in, kN, r, scatter, false, device);
        EXPECT_EQ(rule.error, "reduction " + std::string(name(r)) +
                                  " needs a numeric dtype, found bool; on bool use max or bor (any), min or band "
                                  "(all), bxor (parity)");
      }
    }
  }
  for (Reduction r :
       {Reduction::Stack, Reduction::Min, Reduction::Max, Reduction::Band, Reduction::Bor, Reduction::Bxor}) {
    EXPECT_TRUE(reduction_rule(in, kN, r, false, false, kCpu).allowed()) << name(r);
  }
}

// Avg on an integer dtype would truncate (the average of 0..3 would be 1): refused on
// every device, scattered or not, in place or not, saying what to do instead.
TEST(ReductionRule, AvgRefusesIntegerDtypes) {
  for (DType dtype : {DType::UInt8, DType::Int32, DType::Int64}) {
    for (bool scatter : {false, true}) {
      for (Device::Kind device : {kCpu, kCuda, Device::Kind::Emulated}) {
        const ReductionRule rule = reduction_rule(input({kN}, dtype), kN, Reduction::Avg, scatter, false, device);
        EXPECT_EQ(rule.error, "reduction avg needs a floating-point dtype, found " + std::string(name(dtype)) +
                                  " (an integer average would truncate); use sum and divide, or cast to a float "
                                  "dtype first");
        EXPECT_STREQ(rule.collective, "");
      }
    }
    EXPECT_TRUE(reduction_rule(input({kN}, dtype), kN, Reduction::Sum, false, true, kCpu).allowed()) << name(dtype);
  }
  for (DType dtype : {DType::Float16, DType::BFloat16, DType::Float32, DType::Float64}) {
    EXPECT_TRUE(reduction_rule(input({kN}, dtype), kN, Reduction::Avg, true, false, kCpu).allowed()) << name(dtype);
    EXPECT_TRUE(reduction_rule(input({kN}, dtype), kN, Reduction::Avg, false, true, kCuda).allowed()) << name(dtype);
  }
}

// Bitwise reductions need an integer or bool dtype.
TEST(ReductionRule, BitwiseRefusesFloatingDtypes) {
  for (DType dtype : {DType::Float16, DType::BFloat16, DType::Float32, DType::Float64}) {
    for (Reduction r : {Reduction::Band, Reduction::Bor, Reduction::Bxor}) {
      const ReductionRule rule = reduction_rule(input({kN}, dtype), kN, r, false, false, kCpu);
      EXPECT_EQ(rule.error, "bitwise reduction " + std::string(name(r)) + " needs an integer or bool dtype, found " +
                                std::string(name(dtype)));
    }
    EXPECT_TRUE(reduction_rule(input({kN}, dtype), kN, Reduction::Sum, false, false, kCpu).allowed());
  }
  for (DType dtype : {DType::UInt8, DType::Int32, DType::Int64, DType::Bool}) {
    EXPECT_TRUE(reduction_rule(input({kN}, dtype), kN, Reduction::Bxor, false, false, kCpu).allowed()) << name(dtype);
  }
}

// NCCL has no bitwise operations: on a CUDA tensor they are refused, whatever the dtype,
// in place or not.
TEST(ReductionRule, BitwiseRefusedOnCuda) {
  const TensorMeta in = TensorMeta({kN}, DType::Int32, Device::cuda(0));
  for (Reduction r : {Reduction::Band, Reduction::Bor, Reduction::Bxor}) {
    for (bool inplace : {false, true}) {
      const ReductionRule rule = reduction_rule(in, kN, r, false, inplace, kCuda);
      EXPECT_EQ(rule.error, "bitwise reduction " + std::string(name(r)) +
                                " is not supported by NCCL, found a CUDA tensor int32[4] on cuda:0; move it to the "
                                "CPU or use another reduction");
    }
    EXPECT_TRUE(reduction_rule(in, kN, r, false, false, kCpu).allowed()) << "the same op over MPI is fine";
  }
  EXPECT_TRUE(reduction_rule(in, kN, Reduction::Max, false, true, kCuda).allowed());
}

}  // namespace
}  // namespace meshrt::test
