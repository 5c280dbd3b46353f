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
  // A step calls one function with a few metas (or scalars) in turn: each answer is kept.
  EXPECT_EQ(calls.expected(fn, args_of(a), Device::cpu()).outputs.at(0), a.meta());
  EXPECT_EQ(calls.expected(fn, args_of(b), Device::cpu()).outputs.at(0), b.meta());
  EXPECT_EQ(g_shape_calls - before, 3) << "a and b alternate: their kept answers";
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
  const Args none("f", {});
  calls.check("f", declared, {Tensor::zeros(vector)}, none);
  expect_contains(error_of<UsageError>([&] { calls.check("f", declared, {}, none); }),
                  "f returned 0 tensors on rank 2; its shape function declared 1");
  expect_contains(
      error_of<UsageError>([&] { calls.check("f", declared, {Tensor::zeros(TensorMeta({3}, DType::Float32))}, none); }),
      "f returned on rank 2 as output 0: expected");
  expect_contains(error_of<UsageError>([&] { calls.check("f", declared, {Tensor()}, none); }),
                  "found an undefined tensor");
}

// A view of `t`'s memory from element `first` on, of `n` float32 elements, made the way a
// host library's view comes back (adopted memory, not meshrt's own handle).
Tensor view_of(const Tensor& t, std::int64_t first, std::int64_t n) {
  auto* p = static_cast<float*>(const_cast<void*>(t.raw_data())) + first;
  return Tensor::adopt_host(TensorMeta({n}, DType::Float32), std::shared_ptr<void>(p, [keep = t](void*) {}));
}

TEST(WorkerKernelCall, AnOutputInAnInputsMemoryOrAnotherOutputsIsRefused) {
  const KernelCall calls(1);
  const Tensor x = Tensor::zeros(TensorMeta({8}, DType::Float32));
  const Tensor y = Tensor::zeros(TensorMeta({4}, DType::Float32));
  const Args args("f", {Value("mode"), Value(x), Value::list({Value(3), Value::dict({{"w", Value(y)}})})});
  const Signature four{{TensorMeta({4}, DType::Float32)}, {}};
  const Signature eight{{TensorMeta({8}, DType::Float32)}, {}};
  // The input itself, a reshape of it, and part of it made elsewhere: the bytes overlap.
  expect_contains(error_of<UsageError>([&] { calls.check("f", eight, {x}, args); }),
                  "f returned on rank 1 as output 0 (float32[8] on cpu) the memory of its argument 1: an output must "
                  "be a new tensor, not an undeclared view of an input; return a new tensor (a clone");
  expect_contains(error_of<UsageError>([&] {
                    calls.check("f", Signature{{TensorMeta({2, 4}, DType::Float32)}, {}}, {x.reshape({2, 4})}, args);
                  }),
                  "the memory of its argument 1:");
  expect_contains(error_of<UsageError>([&] { calls.check("f", four, {view_of(x, 4, 4)}, args); }),
                  "the memory of its argument 1:");
  // Inside a list and a dict.
  expect_contains(error_of<UsageError>([&] { calls.check("f", four, {y}, args); }),
                  "the memory of its argument 2 item 1 item 'w':");
  // Two outputs in one memory.
  const Tensor fresh = Tensor::zeros(TensorMeta({4}, DType::Float32));
  expect_contains(error_of<UsageError>([&] {
                    calls.check("f", Signature{{fresh.meta(), fresh.meta()}, {}}, {fresh, fresh}, args);
                  }),
                  "f returned on rank 1 outputs 0 and 1 in the same memory");
  // Memory next to the input's, a copy, and empty tensors are new.
  const Tensor wide = Tensor::zeros(TensorMeta({8}, DType::Float32));
  const Args half("f", {Value(view_of(wide, 0, 4))});
  calls.check("f", four, {view_of(wide, 4, 4)}, half);
  calls.check("f", eight, {x.clone()}, args);
  const Tensor empty = Tensor::zeros(TensorMeta({0}, DType::Float32));
  calls.check("f", Signature{{empty.meta()}, {}}, {empty}, Args("f", {Value(empty)}));
}

// A declared view (Signature::views) is accepted inside its argument's bytes, even where
// it overlaps another view of it, and refused outside them; an output that is not a view
// still may not overlap one.
TEST(WorkerKernelCall, ADeclaredViewLiesInsideItsArgument) {
  const KernelCall calls(1);
  const Tensor x = Tensor::zeros(TensorMeta({4, 2}, DType::Float32));
  const Args args("f", {Value("mode"), Value(x)});
  const TensorMeta half({2, 2}, DType::Float32);
  const Signature halves{
      .outputs = {half, half}, .mutates = {}, .views = {{.output = 0, .input = 1}, {.output = 1, .input = 1}}};
  calls.check("f", halves, {x.rows(0, 2), x.rows(2, 4)}, args);
  calls.check("f", halves, {x.rows(1, 3), x.rows(2, 4)}, args);
  const Signature whole{
      .outputs = {TensorMeta({8}, DType::Float32)}, .mutates = {}, .views = {{.output = 0, .input = 1}}};
  calls.check("f", whole, {x.reshape({8})}, args);
  expect_contains(
      error_of<UsageError>([&] {
        calls.check("f", halves, {x.rows(0, 2), x.rows(0, 2).clone()}, args);
      }),
      "f returned on rank 1 as output 1 (float32[2, 2] on cpu) memory outside its argument 1 (float32[4, 2] "
      "on cpu), which its shape function declares it a view of");
  // Part inside, part past the end of the argument.
  const Tensor wide = Tensor::zeros(TensorMeta({8}, DType::Float32));
  const Args part("f", {Value("mode"), Value(view_of(wide, 0, 4))});
  const Signature four{
      .outputs = {TensorMeta({4}, DType::Float32)}, .mutates = {}, .views = {{.output = 0, .input = 1}}};
  expect_contains(error_of<UsageError>([&] { calls.check("f", four, {view_of(wide, 2, 4)}, part); }),
                  "memory outside its argument 1");
  // Output 1 is not declared: it may not be the memory of view 0.
  const Signature one_view{.outputs = {half, half}, .mutates = {}, .views = {{.output = 0, .input = 1}}};
  expect_contains(error_of<UsageError>([&] {
                    calls.check("f", one_view, {x.rows(0, 2), x.rows(0, 2)}, args);
                  }),
                  "the memory of its argument 1");
}

}  // namespace
}  // namespace meshrt::detail
