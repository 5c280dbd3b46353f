// The worker's checks around a kernel call (src/worker/kernel_call.hpp): the shape
// function's answer is reused only for the same metas and device, and outputs that differ
// from it are refused with the function, rank and output named.
#include <gtest/gtest.h>

#include <atomic>

#include "../support/expect_error.hpp"
#include "meshrt/error.hpp"
#include "meshrt/functions.hpp"
#include "worker/kernel_call.hpp"

namespace meshrt::detail {
namespace {

using test::error_of;
using test::expect_contains;

std::atomic<int> g_shape_calls{0};
Signature counted_shape(const ArgMetas& args) {
  ++g_shape_calls;
  args.expect_count(1, 1);
  return {{args.tensor(0)}, {}};
}
std::vector<Tensor> counted_kernel(CallContext&, Args& args) {
  return {args.tensor(0)};
}
MESHRT_REGISTER_FUNCTION("test.kernel_call.counted", counted_kernel, counted_shape);

Args args_of(const Tensor& t) {
  return Args("test.kernel_call.counted", std::vector<Value>{Value(t)});
}

TEST(WorkerKernelCall, TheShapeFunctionRunsAgainOnlyForOtherMetasOrAnotherDevice) {
  KernelCall calls(2);
  const functions::Function& fn = functions::lookup("test.kernel_call.counted");
  const Tensor a = Tensor::zeros(TensorMeta({2}, DType::Float32));
  const Tensor b = Tensor::zeros(TensorMeta({3}, DType::Float32));
  const int before = g_shape_calls;
  EXPECT_EQ(calls.expected(fn, args_of(a), Device::cpu()).outputs.at(0), a.meta());
  EXPECT_EQ(calls.expected(fn, args_of(a), Device::cpu()).outputs.at(0), a.meta());
  EXPECT_EQ(g_shape_calls - before, 1) << "the same metas: the kept answer";
  EXPECT_EQ(calls.expected(fn, args_of(b), Device::cpu()).outputs.at(0), b.meta());
  EXPECT_EQ(g_shape_calls - before, 2);
  calls.expected(fn, args_of(b), Device::emulated(0));
  EXPECT_EQ(g_shape_calls - before, 3);
}

TEST(WorkerKernelCall, SameMetaComparesTensorsByMetaAndEverythingElseByValue) {
  const Tensor a = Tensor::zeros(TensorMeta({2}, DType::Float32));
  const Value meta = Value::list({Value(a.meta()), Value(3)});
  EXPECT_TRUE(KernelCall::same_meta(meta, Value::list({Value(a), Value(3)})));
  EXPECT_FALSE(KernelCall::same_meta(meta, Value::list({Value(a), Value(4)})));
  EXPECT_FALSE(KernelCall::same_meta(meta, Value::list({Value(a)})));
  EXPECT_FALSE(
      KernelCall::same_meta(meta, Value::list({Value(Tensor::zeros(TensorMeta({2}, DType::Float64))), Value(3)})));
}

TEST(WorkerKernelCall, OutputsThatDifferFromTheDeclarationAreRefused) {
  const KernelCall calls(2);
  const TensorMeta vector({2}, DType::Float32);
  const Signature declared{{vector}, {}};
  calls.check("f", declared, {Tensor::zeros(vector)});
  expect_contains(error_of<UsageError>([&] { calls.check("f", declared, {}); }),
                  "f returned 0 tensors on rank 2; its shape function declared 1");
  expect_contains(
      error_of<UsageError>([&] { calls.check("f", declared, {Tensor::zeros(TensorMeta({3}, DType::Float32))}); }),
      "f returned on rank 2 as output 0: expected");
  expect_contains(error_of<UsageError>([&] { calls.check("f", declared, {Tensor()}); }), "found an undefined tensor");
}

}  // namespace
}  // namespace meshrt::detail
