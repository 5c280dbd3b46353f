// The worker's environment (src/worker/env.hpp): what a ref names on a rank, the lookups
// that give a failure's marker as a value, the errors for a wrong ref, and node reuse.
#include <gtest/gtest.h>

#include <variant>

#include "../support/expect_error.hpp"
#include "meshrt/error.hpp"
#include "worker/env.hpp"

namespace meshrt::detail {
namespace {

using test::error_of;
using test::expect_contains;

Tensor vector_of(float x) {
  Tensor t = Tensor::zeros(TensorMeta({2}, DType::Float32));
  t.data<float>()[0] = x;
  t.data<float>()[1] = x;
  return t;
}

TEST(WorkerEnv, DefinesReplacesAndForgetsValues) {
  Env env(3);
  env.define(Ref{1}, vector_of(1));
  env.define(Ref{1}, vector_of(2));
  EXPECT_EQ(env.size(), 1u);
  const Found<Tensor> t = env.find<Tensor>(Ref{1}, "tensor");
  ASSERT_TRUE(t);
  EXPECT_EQ(t->data<float>()[0], 2.0f);
  env.undefine(1);
  env.undefine(1);   // already gone: ignored
  env.undefine(42);  // never defined: ignored
  EXPECT_EQ(env.size(), 0u);
  expect_contains(error_of<ProtocolError>([&] { env.get(Ref{1}, "argument"); }),
                  "rank 3: argument ref 1 is not defined on this worker");
}

TEST(WorkerEnv, ReusedNodesHoldTheirNewValuesOnly) {
  Env env(0);
  for (std::uint64_t i = 1; i <= 300; ++i) env.define(Ref{i}, vector_of(static_cast<float>(i)));
  for (std::uint64_t i = 1; i <= 300; ++i) env.undefine(i);
  // The next definitions take the spare nodes: each holds its own value, none an old one.
  for (std::uint64_t i = 1000; i < 1300; ++i) env.define(Ref{i}, DependentOnError{i});
  EXPECT_EQ(env.size(), 300u);
  for (std::uint64_t i = 1000; i < 1300; ++i) {
    const Input in = env.input(Ref{i});
    ASSERT_TRUE(std::holds_alternative<DependentOnError>(in)) << i;
    EXPECT_EQ(std::get<DependentOnError>(in).ident, i);
  }
  for (std::uint64_t i = 1; i <= 300; ++i) EXPECT_THROW(env.get(Ref{i}, "tensor"), ProtocolError) << i;
}

TEST(WorkerEnv, ALookupGivesTheMarkerOfAFailedDependencyAsAValue) {
  Env env(0);
  env.define(Ref{1}, vector_of(1));
  env.define(Ref{2}, DependentOnError{7});
  env.define(Ref{3}, StreamValue{3, true, make_stream(true, 3)});
  EXPECT_TRUE(std::holds_alternative<Tensor>(env.input(Ref{1})));
  EXPECT_EQ(std::get<DependentOnError>(env.input(Ref{2})).ident, 7u);
  const Found<StreamValue> stream = env.find<StreamValue>(Ref{2}, "stream");
  EXPECT_FALSE(stream);
  EXPECT_EQ(stream.failed.ident, 7u);
  EXPECT_NE(env.stream_handle(Ref{3}), nullptr);
  EXPECT_EQ(env.stream_handle(Ref{1}), nullptr);
  EXPECT_EQ(env.stream_handle(Ref{99}), nullptr);

  // An argument tree resolves to tensors, or to the first marker in it.
  const auto ok = env.resolve(Value::list({Value(Ref{1}), Value(2), Value::list({Value(Ref{1})})}));
  ASSERT_TRUE(std::holds_alternative<Value>(ok));
  const Value& v = std::get<Value>(ok);
  EXPECT_TRUE(v.as_list()[0].is_tensor());
  EXPECT_TRUE(v.as_list()[2].as_list()[0].is_tensor());
  const auto poisoned = env.resolve(Value::list({Value(Ref{1}), Value(Ref{2})}));
  ASSERT_TRUE(std::holds_alternative<DependentOnError>(poisoned));
  EXPECT_EQ(std::get<DependentOnError>(poisoned).ident, 7u);
}

TEST(WorkerEnv, AValueOfAnotherKindNamesWhatWasExpectedAndFound) {
  Env env(5);
  env.define(Ref{1}, vector_of(1));
  env.define(Ref{2}, DependentOnError{7});
  env.define(Ref{3}, StreamValue{3, true, make_stream(true, 3)});
  expect_contains(error_of<UsageError>([&] { env.find<StreamValue>(Ref{1}, "stream"); }),
                  "rank 5: stream ref 1: expected a stream, found a tensor");
  expect_contains(error_of<UsageError>([&] { env.mesh(Ref{2}, "mesh"); }),
                  "rank 5: mesh ref 2: expected a mesh, found a failure marker");
  expect_contains(error_of<UsageError>([&] { env.mesh(Ref{3}, "mesh"); }), "expected a mesh, found a stream");
  expect_contains(error_of<UsageError>([&] { env.input(Ref{3}); }),
                  "rank 5: tensor ref 3: expected a tensor, found a stream");
  expect_contains(error_of<UsageError>([&] { env.resolve(Value(Ref{3})); }),
                  "rank 5: argument ref 3: expected a tensor, found a stream");
  expect_contains(error_of<ProtocolError>([&] { env.mesh(Ref{9}, "mesh"); }),
                  "rank 5: mesh ref 9 is not defined on this worker");
}

}  // namespace
}  // namespace meshrt::detail
