#include "meshrt/functions.hpp"
#include "../support/expect_error.hpp"
#include "../support/gpu.hpp"
#include "meshrt/device.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

namespace meshrt {
namespace {

using test::expect_contains;
using test::usage_error;

// Runs a registered function as a worker would: shape function on metas, then the kernel.
std::vector<Tensor> call(const std::string& name, std::vector<Value> args, int rank = 0) {
  const functions::Function& f = functions::lookup(name);
  std::vector<Value> metas;
  for (const Value& a : args)
    metas.push_back(a.map([](const Value& v) { return v.is_tensor() ? Value(v.as_tensor().meta()) : v; }));
  const Signature sig = functions::infer(f, ArgMetas(name, std::move(metas)));
  CallContext ctx(rank, {"x"}, {rank}, {rank + 1});
  Args a(name, std::move(args));
  std::vector<Tensor> out = f.kernel(ctx, a);
  EXPECT_EQ(out.size(), sig.outputs.size()) << name;
  for (std::size_t i = 0; i < out.size() && i < sig.outputs.size(); ++i)
    EXPECT_EQ(out[i].meta(), sig.outputs[i]) << name;
  return out;
}

std::string shape_error(const std::string& name, std::vector<Value> metas) {
  return usage_error([&] { (void)functions::infer(functions::lookup(name), ArgMetas(name, std::move(metas))); });
}

std::vector<Tensor> my_kernel(CallContext&, Args&) {
  return {};
}
Signature my_shape(const ArgMetas&) {
  return {};
}
MESHRT_REGISTER_FUNCTION("test.registered_by_macro", my_kernel, my_shape);
MESHRT_REGISTER_FUNCTION("test.described_by_macro", my_kernel, my_shape,
                         {.params = {{"x", "tensor"}, {"n", "int"}},
                          .returns = "tensor",
                          .doc = "A test function with a description."});

TEST(Registry, BuiltinsAndMacroRegistrations) {
  const auto names = functions::names();
  for (const char* n : {"meshrt.full", "meshrt.zeros", "meshrt.arange", "meshrt.rand", "meshrt.add", "meshrt.sub",
                        "meshrt.mul", "meshrt.scale", "meshrt.matmul", "meshrt.copy", "meshrt.sum", "meshrt.fill_",
                        "meshrt.add_", "meshrt.fail", "test.registered_by_macro"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), n), names.end()) << n;
  }
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  const auto& f = functions::lookup("test.registered_by_macro");
  expect_contains(f.where(), "functions_test.cpp:");
  EXPECT_TRUE(f.library.empty());
  // Relative to the source root, not the build machine's absolute path (meshrt's build
  // maps __FILE__'s prefix away; a ccache hit from before that flag may keep "../").
  EXPECT_FALSE(f.where().starts_with("/")) << f.where();
  expect_contains(f.where(), "tests/unit/functions_test.cpp:");
  EXPECT_FALSE(functions::lookup("meshrt.add").where().starts_with("/"));
  expect_contains(functions::lookup("meshrt.add").where(), "src/functions/builtins.cpp:");
}

TEST(Registry, UnknownNamesSuggestOrList) {
  expect_contains(usage_error([] { functions::lookup("meshrt.ad"); }),
                  "unknown function 'meshrt.ad'; did you mean meshrt.add");
  const std::string far = usage_error([] { functions::lookup("zzzzzzzzzzzzzzzzzzzzzzzzzz"); });
  expect_contains(far, "unknown function 'zzzzzzzzzzzzzzzzzzzzzzzzzz'; registered: ");
  expect_contains(far, "meshrt.matmul");
  EXPECT_EQ(functions::find("nope"), nullptr);
}

TEST(Registry, DuplicatesAreRefusedNamingBothPlaces) {
  functions::register_function("test.dup", my_kernel, my_shape, "first.cpp", 10);
  const std::string e =
      usage_error([] { functions::register_function("test.dup", my_kernel, my_shape, "second.cpp", 20); });
  expect_contains(e, "remote function 'test.dup' registered twice: first at first.cpp:10, again at second.cpp:20");
  expect_contains(usage_error([] { functions::register_function("", my_kernel, my_shape, "x.cpp", 1); }),
                  "expected a non-empty name");
  expect_contains(usage_error([] { functions::register_function("test.nokernel", nullptr, my_shape, "x.cpp", 1); }),
                  "no kernel");
  EXPECT_NO_THROW(functions::check_table());
}

TEST(Registry, TableHashIsStableAndSensitive) {
  const std::uint64_t h = functions::table_hash();
  EXPECT_EQ(functions::table_hash(), h);
  functions::register_function("test.hash_changer", my_kernel, my_shape, __FILE__, __LINE__);
  EXPECT_NE(functions::table_hash(), h);
}

TEST(Registry, ShapeFunctionMutatesAreChecked) {
  functions::register_function(
      "test.bad_mutates", my_kernel,
      [](const ArgMetas&) {
        return Signature{{}, {3}};
      },
      __FILE__, __LINE__);
  expect_contains(shape_error("test.bad_mutates", {Value(TensorMeta())}),
                  "declares argument 3 mutated; expected the index of a tensor argument among 1 arguments");
}

TEST(Registry, LoadLibraryAddsItsFunctions) {
  const std::vector<std::string> added = functions::load_library(MESHRT_TEST_PLUGIN);
  EXPECT_EQ(added, std::vector<std::string>{"plugin.triple"});
  const auto& f = functions::lookup("plugin.triple");
  EXPECT_EQ(f.library, MESHRT_TEST_PLUGIN);
  expect_contains(f.where(), "test_plugin.cpp:");
  const auto out = call("plugin.triple", {Value(Tensor::from<float>({2}, {1, 2}))});
  EXPECT_TRUE(out.at(0).equals(Tensor::from<float>({2}, {3, 6})));

  // A library that re-registers a built-in is refused, and the table stays usable.
  const std::string e = usage_error([] { functions::load_library(MESHRT_TEST_PLUGIN_DUP); });
  expect_contains(e, "remote function 'meshrt.add' registered twice: first at ");
  expect_contains(e, "builtins.cpp:");
  expect_contains(e, "test_plugin_dup.cpp:");
  EXPECT_NO_THROW(functions::check_table());
  EXPECT_NO_THROW(functions::lookup("meshrt.add"));

  expect_contains(usage_error([] { functions::load_library("/nonexistent/libx.so"); }),
                  "load_library: expected a loadable shared library at '/nonexistent/libx.so', found: ");
}

TEST(Args, AccessorsNameTheFunctionAndPosition) {
  Args a("my.fn", {Value(1), Value("float32"), Value{2, 3}, Value(2.5), Value(Ref{1})});
  EXPECT_EQ(a.integer(0), 1);
  EXPECT_EQ(a.dtype(1), DType::Float32);
  EXPECT_EQ(a.shape(2), (std::vector<std::int64_t>{2, 3}));
  EXPECT_EQ(a.number(3), 2.5);
  EXPECT_EQ(usage_error([&] { (void)a.integer(3); }), "my.fn: argument 3: expected int, found double 2.5");
  EXPECT_EQ(usage_error([&] { (void)a.tensor(4); }), "my.fn: argument 4: expected a tensor, found ref ref(1)");
  EXPECT_EQ(usage_error([&] { (void)a.value(9); }), "my.fn: expected an argument 9, found only 5 arguments");
  EXPECT_EQ(usage_error([&] { (void)a.dtype(0); }),
            "my.fn: argument 0: expected a dtype such as \"float32\", found int 1");
  EXPECT_EQ(usage_error([&] { a.expect_count(2, 2); }), "my.fn: expected 2 arguments, found 5");
  CallContext ctx(3, {"host", "gpu"}, {1, 0}, {2, 4});
  EXPECT_EQ(ctx.coordinate("gpu"), 0);
  EXPECT_EQ(usage_error([&] { (void)ctx.coordinate("x"); }),
            "rank 3: expected a mesh dimension in [host, gpu], found 'x'");
}

TEST(CallContext, SizesAlongEachDimension) {
  CallContext ctx(3, {"host", "gpu"}, {1, 0}, {2, 4});
  EXPECT_EQ(ctx.size("host"), 2);
  EXPECT_EQ(ctx.size("gpu"), 4);
  EXPECT_EQ(ctx.sizes(), (std::vector<std::int64_t>{2, 4}));
  EXPECT_EQ(usage_error([&] { (void)ctx.size("x"); }), "rank 3: expected a mesh dimension in [host, gpu], found 'x'");
  // A CPU context of no mesh (a fetch's preprocess) has no dimensions.
  EXPECT_EQ(usage_error([] { (void)CallContext(0, {}, {}, {}).size("x"); }),
            "rank 0: expected a mesh dimension in [], found 'x'");
  expect_contains(usage_error([] { CallContext(0, {"x"}, {0}, {}); }),
                  "expected one coordinate and one size per dimension [x], found 1 coordinates and 0 sizes");
  EXPECT_EQ(usage_error([] { CallContext(0, {"x"}, {2}, {2}); }),
            "CallContext: expected a coordinate in [0, 2) along 'x', found 2");
}

// A kernel on a CUDA device launches on the CUDA stream its context names: a context with
// none is refused, since its kernels would run on the legacy default stream (issue 29, N3).
// The CPU and the emulated accelerator have no native stream.
TEST(CallContext, RefusesACudaDeviceWithoutItsNativeStream) {
  EXPECT_EQ(usage_error([] { CallContext(0, {}, {}, {}, 5, Device::cuda(1)); }),
            "CallContext on cuda:1: expected the CUDA stream of meshrt stream 5 (device::stream_for(...).native()), "
            "found none (its kernels would run on the legacy default stream)");
  EXPECT_EQ(CallContext(0, {}, {}, {}, 5, Device::emulated(0)).native_stream(), nullptr);
  EXPECT_EQ(CallContext(0, {}, {}, {}, 5).native_stream(), nullptr);
}

// The registry's descriptions: every built-in has one, errors print its parameters, and
// a function registered without one still gets the argument's position.
TEST(Args, ErrorsPrintTheSignature) {
  for (const std::string& n : functions::names()) {
    if (!n.starts_with("meshrt.")) continue;
    const functions::Function& f = functions::lookup(n);
    EXPECT_FALSE(f.description.empty()) << n << " has no description";
    EXPECT_FALSE(f.description.doc.empty()) << n;
  }
  EXPECT_EQ(functions::lookup("meshrt.rand").signature(),
            "meshrt.rand(shape: list[int], dtype: dtype, seed: int) -> tensor");
  EXPECT_EQ(functions::lookup("meshrt.rand").short_signature(), "meshrt.rand(shape, dtype, seed)");
  EXPECT_EQ(functions::lookup("test.registered_by_macro").signature(), "test.registered_by_macro");
  EXPECT_EQ(shape_error("meshrt.rand", {Value{2}, Value("float32")}),
            "meshrt.rand(shape, dtype, seed): expected 3 arguments, found 2");
  EXPECT_EQ(shape_error("meshrt.full", {Value{2}, Value(2.0), Value(1)}),
            "meshrt.full(shape, dtype, value): argument 1 (dtype): expected a dtype such as \"float32\", found "
            "double 2");
  EXPECT_EQ(shape_error("meshrt.copy", {Value(1)}), "meshrt.copy(x): argument 0 (x): expected a tensor, found int 1");
  ArgMetas plain("test.registered_by_macro", {Value(1)});
  EXPECT_EQ(usage_error([&] { (void)plain.dtype(0); }),
            "test.registered_by_macro: argument 0: expected a dtype such as \"float32\", found int 1");
}

std::vector<Tensor> reads_float_kernel(CallContext&, Args& args) {
  (void)args.tensor(0).data<float>();
  (void)args.tensor(1).data<float>();
  return {};
}
MESHRT_REGISTER_FUNCTION("test.reads_float", reads_float_kernel, my_shape,
                         {.params = {{"x", "tensor"}, {"y", "tensor"}}, .returns = "none", .doc = "Reads floats."});

// A kernel's typed read of the wrong element type names the argument, and reads forwards.
TEST(Args, WrongElementTypeNamesTheArgument) {
  const auto& f = functions::lookup("test.reads_float");
  CallContext ctx(0, {"x"}, {0}, {1});
  Args args("test.reads_float", {Value(Tensor::zeros(TensorMeta({2}, DType::Float32))),
                                 Value(Tensor::zeros(TensorMeta({2}, DType::Float64)))});
  EXPECT_EQ(usage_error([&] { (void)f.kernel(ctx, args); }),
            "test.reads_float(x, y): argument 1 (y): tensor data: expected data<double>() for a float64[2] on cpu "
            "tensor, found data<float>()");
}

TEST(Registry, DescriptionByMacro) {
  const auto& f = functions::lookup("test.described_by_macro");
  EXPECT_EQ(f.signature(), "test.described_by_macro(x: tensor, n: int) -> tensor");
  EXPECT_EQ(f.description.doc, "A test function with a description.");
  EXPECT_EQ(usage_error([] {
              ArgMetas a("test.described_by_macro", {Value(1), Value("two")});
              (void)a.integer(1);
            }),
            "test.described_by_macro(x, n): argument 1 (n): expected int, found string 'two'");
}

// ------------------------------------------------------------------ built-ins

TEST(Builtins, Creation) {
  auto t = call("meshrt.full", {Value{2, 3}, Value("int32"), Value(7)}).at(0);
  EXPECT_EQ(t.shape(), (std::vector<std::int64_t>{2, 3}));
  for (auto v : t.span<std::int32_t>()) EXPECT_EQ(v, 7);
  t = call("meshrt.full", {Value{2}, Value("bfloat16"), Value(1.5)}).at(0);
  EXPECT_EQ(t.data<BFloat16>()[1], float_to_bfloat16(1.5f));
  t = call("meshrt.full", {Value{2}, Value("bool"), Value(true)}).at(0);
  EXPECT_TRUE(t.data<bool>()[0]);
  t = call("meshrt.zeros", {Value{4}, Value("float64")}).at(0);
  for (auto v : t.span<double>()) EXPECT_EQ(v, 0.0);
  t = call("meshrt.arange", {Value(5), Value("int64")}).at(0);
  EXPECT_TRUE(t.equals(Tensor::from<std::int64_t>({5}, {0, 1, 2, 3, 4})));
  t = call("meshrt.arange", {Value(3), Value("float16")}).at(0);
  EXPECT_EQ(half_to_float(t.data<Half>()[2]), 2.0f);

  const auto r0 = call("meshrt.rand", {Value{100}, Value("float32"), Value(42)}, 0).at(0);
  const auto r0_again = call("meshrt.rand", {Value{100}, Value("float32"), Value(42)}, 0).at(0);
  const auto r1 = call("meshrt.rand", {Value{100}, Value("float32"), Value(42)}, 1).at(0);
  const auto r0_seed = call("meshrt.rand", {Value{100}, Value("float32"), Value(43)}, 0).at(0);
  EXPECT_TRUE(r0.equals(r0_again));
  EXPECT_FALSE(r0.equals(r1));  // one stream per rank
  EXPECT_FALSE(r0.equals(r0_seed));
  double mean = 0;
  for (float v : r0.span<float>()) {
    EXPECT_GE(v, 0.0f);
    EXPECT_LT(v, 1.0f);
    mean += v / 100.0;
  }
  EXPECT_NEAR(mean, 0.5, 0.15);
}

TEST(Builtins, CreationErrors) {
  expect_contains(shape_error("meshrt.full", {Value{2, -1}, Value("float32"), Value(1)}),
                  "meshrt.full(shape, dtype, value): argument 0 (shape): expected a shape of sizes >= 0, found -1 at "
                  "dimension 1");
  expect_contains(
      shape_error("meshrt.full", {Value{2}, Value("float"), Value(1)}),
      "meshrt.full(shape, dtype, value): argument 1 (dtype): expected a dtype, one of bool, uint8, int32, int64, "
      "float16, bfloat16, float32, float64, found 'float'");
  expect_contains(
      shape_error("meshrt.full", {Value{2}, Value("uint8"), Value(300)}),
      "meshrt.full(shape, dtype, value): argument 2 (value): expected an int in [0, 255] for dtype uint8, found 300");
  expect_contains(shape_error("meshrt.full", {Value{2}, Value("int32"), Value(1.5)}),
                  "expected an integral value in [-2147483648, 2147483647] for dtype int32 (an int, or a float with no "
                  "fractional part), found the float 1.5");
  expect_contains(shape_error("meshrt.full", {Value{2}, Value("bool"), Value(2)}),
                  "expected a bool (or 0/1) for dtype bool, found 2");
  expect_contains(shape_error("meshrt.full", {Value{2}}),
                  "meshrt.full(shape, dtype, value): expected 3 arguments, found 1");
  expect_contains(shape_error("meshrt.arange", {Value(-1), Value("int32")}), "expected a length >= 0, found -1");
  expect_contains(shape_error("meshrt.arange", {Value(3), Value("bool")}), "expected a numeric dtype, found bool");
  expect_contains(shape_error("meshrt.rand", {Value{2}, Value("int32"), Value(1)}), "expected a floating dtype");
}

template <class T>
Tensor filled(std::vector<std::int64_t> shape, std::initializer_list<double> values) {
  std::vector<T> v;
  for (double x : values) {
    if constexpr (std::is_same_v<T, Half>)
      v.push_back(float_to_half(static_cast<float>(x)));
    else if constexpr (std::is_same_v<T, BFloat16>)
      v.push_back(float_to_bfloat16(static_cast<float>(x)));
    else
      v.push_back(static_cast<T>(x));
  }
  return Tensor::from<T>(std::move(shape), std::span<const T>(v));
}

template <class T>
class Elementwise : public ::testing::Test {};
using NumericTypes = ::testing::Types<std::uint8_t, std::int32_t, std::int64_t, Half, BFloat16, float, double>;
TYPED_TEST_SUITE(Elementwise, NumericTypes);

TYPED_TEST(Elementwise, AddSubMulCopySum) {
  using T = TypeParam;
  const Tensor a = filled<T>({2, 2}, {1, 2, 3, 4});
  const Tensor b = filled<T>({2, 2}, {5, 6, 7, 8});
  EXPECT_TRUE(call("meshrt.add", {Value(a), Value(b)}).at(0).equals(filled<T>({2, 2}, {6, 8, 10, 12})));
  EXPECT_TRUE(call("meshrt.sub", {Value(b), Value(a)}).at(0).equals(filled<T>({2, 2}, {4, 4, 4, 4})));
  EXPECT_TRUE(call("meshrt.mul", {Value(a), Value(b)}).at(0).equals(filled<T>({2, 2}, {5, 12, 21, 32})));
  const Tensor c = call("meshrt.copy", {Value(a)}).at(0);
  EXPECT_TRUE(c.equals(a));
  EXPECT_FALSE(c.same_storage(a));
  EXPECT_TRUE(call("meshrt.sum", {Value(b)}).at(0).equals(filled<T>({}, {26})));
  // In place: the argument itself changes and nothing is returned.
  Tensor x = a.clone();
  Args args("meshrt.add_", {Value(x), Value(b)});
  CallContext ctx;
  EXPECT_TRUE(functions::lookup("meshrt.add_").kernel(ctx, args).empty());
  EXPECT_TRUE(x.equals(filled<T>({2, 2}, {6, 8, 10, 12})));
  Args fill_args("meshrt.fill_", {Value(x), Value(3)});
  EXPECT_TRUE(functions::lookup("meshrt.fill_").kernel(ctx, fill_args).empty());
  EXPECT_TRUE(x.equals(filled<T>({2, 2}, {3, 3, 3, 3})));
  const Signature sig =
      functions::infer(functions::lookup("meshrt.add_"), ArgMetas("meshrt.add_", {Value(x.meta()), Value(b.meta())}));
  EXPECT_EQ(sig.mutates, std::vector<std::size_t>{0});
  EXPECT_TRUE(sig.outputs.empty());
}

TEST(Builtins, IntegersWrapAndBoolsAreLogical) {
  const auto i32 = [](std::int32_t v) { return Tensor::from<std::int32_t>({1}, {v}); };
  EXPECT_EQ(call("meshrt.add", {Value(i32(INT32_MAX)), Value(i32(1))}).at(0).item(), INT32_MIN);
  EXPECT_EQ(call("meshrt.mul", {Value(i32(INT32_MIN)), Value(i32(-1))}).at(0).item(), INT32_MIN);
  const auto u8 = Tensor::from<std::uint8_t>({1}, {250});
  EXPECT_EQ(call("meshrt.add", {Value(u8), Value(u8)}).at(0).item(), 244);
  const Tensor p = Tensor::from<bool>({4}, {false, false, true, true});
  const Tensor q = Tensor::from<bool>({4}, {false, true, false, true});
  EXPECT_TRUE(
      call("meshrt.add", {Value(p), Value(q)}).at(0).equals(Tensor::from<bool>({4}, {false, true, true, true})));
  EXPECT_TRUE(
      call("meshrt.mul", {Value(p), Value(q)}).at(0).equals(Tensor::from<bool>({4}, {false, false, false, true})));
  const Tensor s = call("meshrt.sum", {Value(q)}).at(0);
  EXPECT_EQ(s.dtype(), DType::Int64);
  EXPECT_EQ(s.item(), 2.0);
  expect_contains(shape_error("meshrt.sub", {Value(p.meta()), Value(q.meta())}),
                  "meshrt.sub(a, b): expected a numeric dtype, found bool");
}

TEST(Builtins, ElementwiseErrors) {
  expect_contains(
      shape_error("meshrt.add", {Value(TensorMeta({2, 3}, DType::Float32)), Value(TensorMeta({3}, DType::Float32))}),
      "meshrt.add(a, b): expected arguments 0 and 1 of one shape, dtype and device, found float32[2, 3] on cpu and "
      "float32[3] on cpu");
  expect_contains(
      shape_error("meshrt.mul", {Value(TensorMeta({2}, DType::Float32)), Value(TensorMeta({2}, DType::Float64))}),
      "found float32[2] on cpu and float64[2] on cpu");
  expect_contains(shape_error("meshrt.add", {Value(TensorMeta({2}, DType::Float32)), Value(1)}),
                  "meshrt.add(a, b): argument 1 (b): expected a tensor, found int 1");
  expect_contains(shape_error("meshrt.scale", {Value(TensorMeta({2}, DType::Int32)), Value(2)}),
                  "meshrt.scale(x, factor): argument 0 (x): expected a floating dtype (float16, bfloat16, float32, "
                  "float64), found "
                  "int32[2] on cpu");
  expect_contains(shape_error("meshrt.fill_", {Value(TensorMeta({2}, DType::UInt8)), Value(-1)}),
                  "expected an int in [0, 255]");
}

// A float with no fractional part fills an integer dtype, as numpy and torch take it
// (issue 29: full({8}, int64, 3.0) was refused as "expected an int ..., found 3"); any
// other float is refused saying so.
TEST(Builtins, FullTakesAnIntegralFloatForAnIntegerDtype) {
  EXPECT_TRUE(call("meshrt.full", {Value{4}, Value("int64"), Value(3.0)})
                  .at(0)
                  .equals(Tensor::from<std::int64_t>({4}, {3, 3, 3, 3})));
  EXPECT_TRUE(call("meshrt.full", {Value{2}, Value("uint8"), Value(255.0)})
                  .at(0)
                  .equals(Tensor::from<std::uint8_t>({2}, {255, 255})));
  EXPECT_TRUE(
      call("meshrt.full", {Value{1}, Value("int32"), Value(-2.0)}).at(0).equals(Tensor::from<std::int32_t>({1}, {-2})));
  const auto refused = [](const char* dtype, double v) {
    return shape_error("meshrt.full", {Value{4}, Value(dtype), Value(v)});
  };
  expect_contains(refused("int64", 3.5),
                  "argument 2 (value): expected an integral value in [-9223372036854775808, 9223372036854775807] for "
                  "dtype int64 (an int, or a float with no fractional part), found the float 3.5");
  expect_contains(refused("uint8", 256.0), "expected an integral value in [0, 255] for dtype uint8");
  expect_contains(refused("int64", 9223372036854775808.0), "found the float 9.223372036854776e+18");
  expect_contains(refused("int32", std::nan("")), "found the float nan");
  // An int out of range still says so as before.
  expect_contains(shape_error("meshrt.full", {Value{4}, Value("uint8"), Value(-1)}), "expected an int in [0, 255]");
}

TEST(Builtins, Scale) {
  const Tensor x = Tensor::from<float>({3}, {1, -2, 4});
  EXPECT_TRUE(call("meshrt.scale", {Value(x), Value(0.5)}).at(0).equals(Tensor::from<float>({3}, {0.5f, -1, 2})));
  const Tensor h = filled<Half>({2}, {3, 5});
  EXPECT_TRUE(call("meshrt.scale", {Value(h), Value(2)}).at(0).equals(filled<Half>({2}, {6, 10})));
}

template <class T>
void check_matmul(std::int64_t m, std::int64_t k, std::int64_t n, std::mt19937& rng) {
  std::uniform_real_distribution<T> dist(-1, 1);
  std::vector<T> av(static_cast<std::size_t>(m * k)), bv(static_cast<std::size_t>(k * n));
  for (auto& v : av) v = dist(rng);
  for (auto& v : bv) v = dist(rng);
  const Tensor a = Tensor::from<T>({m, k}, std::span<const T>(av));
  const Tensor b = Tensor::from<T>({k, n}, std::span<const T>(bv));
  const Tensor c = call("meshrt.matmul", {Value(a), Value(b)}).at(0);
  const double tolerance = std::is_same_v<T, float> ? 1e-4 : 1e-12;
  ASSERT_EQ(c.shape(), (std::vector<std::int64_t>{m, n}));
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j) {
      double ref = 0;
      for (std::int64_t l = 0; l < k; ++l) ref += static_cast<double>(av[i * k + l]) * bv[l * n + j];
      EXPECT_NEAR(c.data<T>()[i * n + j], ref, tolerance) << i << "," << j;
    }
  }
}

TEST(Builtins, MatmulMatchesANaiveLoop) {
  std::mt19937 rng(7);
  check_matmul<float>(3, 5, 4, rng);
  check_matmul<float>(1, 1, 1, rng);
  check_matmul<double>(7, 2, 9, rng);
  check_matmul<double>(16, 16, 16, rng);
  const Tensor z = call("meshrt.matmul", {Value(Tensor::zeros(TensorMeta({2, 0}, DType::Float32))),
                                          Value(Tensor::zeros(TensorMeta({0, 3}, DType::Float32)))})
                       .at(0);
  for (float v : z.span<float>()) EXPECT_EQ(v, 0.0f);
  expect_contains(shape_error("meshrt.matmul",
                              {Value(TensorMeta({2, 3}, DType::Float32)), Value(TensorMeta({2, 3}, DType::Float32))}),
                  "meshrt.matmul(a, b): expected [m, k] and [k, n] matrices, found float32[2, 3] on cpu and "
                  "float32[2, 3] on cpu");
  expect_contains(
      shape_error("meshrt.matmul", {Value(TensorMeta({2, 2}, DType::Int32)), Value(TensorMeta({2, 2}, DType::Int32))}),
      "expected two float32 or two float64 matrices");
}

TEST(Builtins, FailThrowsOnTheChosenRanks) {
  const auto run = [](int rank) { return call("meshrt.fail", {Value("boom"), Value{1, 3}}, rank); };
  EXPECT_EQ(run(0).at(0).item(), 0.0);
  try {
    run(3);
    ADD_FAILURE() << "expected std::runtime_error";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "boom");
  }
  EXPECT_THROW(call("meshrt.fail", {Value("all"), Value::list()}, 5), std::runtime_error);
}

TEST(Builtins, CudaKernelsMatchTheCpu) {
  if (!cuda_available()) MESHRT_SKIP_WITHOUT_GPU("no CUDA device visible");
  const Tensor a = Tensor::from<float>({3}, {1, 2, 3});
  const Tensor b = Tensor::from<float>({3}, {4, 5, 6});
  constexpr std::uint64_t kStream = 31;
  CallContext ctx(0, {}, {}, {}, kStream, Device::cuda(0), device::stream_for(kStream, Device::cuda(0)).native());
  Args args("meshrt.add", {Value(a.to(Device::cuda(0))), Value(b.to(Device::cuda(0)))});
  const auto out = functions::lookup("meshrt.add").kernel(ctx, args);
  EXPECT_TRUE(out.at(0).to(Device::cpu()).equals(Tensor::from<float>({3}, {5, 7, 9})));
  Args full("meshrt.full", {Value{2}, Value("float16"), Value(2.5)});
  const auto f = functions::lookup("meshrt.full").kernel(ctx, full).at(0);
  EXPECT_TRUE(f.device().is_cuda());
  EXPECT_TRUE(f.to(Device::cpu()).equals(filled<Half>({2}, {2.5, 2.5})));
  // sum and matmul run on the device (no copy to the host and back); small integers, so
  // the sums' orders give the CPU's bits.
  const Device gpu = Device::cuda(0);
  const auto on_gpu = [&](const std::string& fn, std::vector<Value> cpu_args) {
    std::vector<Value> gpu_args;
    for (const Value& v : cpu_args) gpu_args.push_back(v.is_tensor() ? Value(v.as_tensor().to(gpu)) : v);
    Args device_args(fn, std::move(gpu_args));
    const Tensor got = functions::lookup(fn).kernel(ctx, device_args).at(0);
    EXPECT_TRUE(got.device().is_cuda()) << fn;
    const Tensor want = call(fn, std::move(cpu_args)).at(0);
    EXPECT_TRUE(got.to(Device::cpu()).equals(want)) << fn << " " << want.to_string();
  };
  std::vector<float> many(5000);
  for (std::size_t i = 0; i < many.size(); ++i) many[i] = static_cast<float>(i % 7) - 3.0f;
  on_gpu("meshrt.sum", {Value(Tensor::from<float>({5000}, std::span<const float>(many)))});
  on_gpu("meshrt.sum", {Value(Tensor::from<std::int32_t>({4}, {-7, 3, 2147483647, 5}))});  // wraps
  on_gpu("meshrt.sum", {Value(Tensor::from<bool>({5}, {true, false, true, true, false}))});
  on_gpu("meshrt.sum", {Value(filled<Half>({3}, {1.5, 2.5, -1}))});
  on_gpu("meshrt.sum", {Value(Tensor::zeros(TensorMeta({0}, DType::Float64)))});
  on_gpu("meshrt.matmul", {Value(Tensor::from<float>({2, 3}, {1, 2, 3, 4, 5, 6})),
                           Value(Tensor::from<float>({3, 2}, {1, 0, 0, 1, 1, 1}))});
  std::vector<double> left(37 * 19), right(19 * 21);
  for (std::size_t i = 0; i < left.size(); ++i) left[i] = static_cast<double>(i % 5);
  for (std::size_t i = 0; i < right.size(); ++i) right[i] = static_cast<double>(i % 3) - 1.0;
  on_gpu("meshrt.matmul", {Value(Tensor::from<double>({37, 19}, std::span<const double>(left))),
                           Value(Tensor::from<double>({19, 21}, std::span<const double>(right)))});
}

}  // namespace
}  // namespace meshrt
