// Remote functions the runtime tests use.
#include <chrono>
#include <csignal>
#include <stdexcept>
#include <string>
#include <thread>

#include "meshrt/device.hpp"
#include "meshrt/functions.hpp"
#include "meshrt/internal/comm.hpp"

namespace {

using namespace meshrt;

// A kernel's output on this rank's device: a mesh placed on an accelerator expects its
// outputs there (a CPU mesh keeps them on the host).
Tensor on_device(Tensor t, const CallContext& ctx) {
  return ctx.device().is_cpu() ? t : t.to(ctx.device());
}

// test.pattern(shape, dtype): element i on world rank r is r * 100 + i + 1.
Signature pattern_shape(const ArgMetas& args) {
  args.expect_count(2, 2);
  return {{TensorMeta(args.shape(0), args.dtype(1), args.device())}, {}};
}
std::vector<Tensor> pattern_kernel(CallContext& ctx, Args& args) {
  Tensor t = Tensor::empty(TensorMeta(args.shape(0), args.dtype(1)));
  dispatch_dtype(t.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* p = t.data<T>();
    for (std::int64_t i = 0; i < t.numel(); ++i) {
      const double v = ctx.rank() * 100 + static_cast<double>(i) + 1;
      if constexpr (std::is_same_v<T, Half>)
        p[i] = float_to_half(static_cast<float>(v));
      else if constexpr (std::is_same_v<T, BFloat16>)
        p[i] = float_to_bfloat16(static_cast<float>(v));
      else
        p[i] = static_cast<T>(v);
    }
  });
  return {on_device(std::move(t), ctx)};
}

// test.bump_and_copy_(x): adds 1 to x in place (float64) and returns a copy of the result;
// a fetch preprocess that mutates its argument.
Signature bump_shape(const ArgMetas& args) {
  args.expect_count(1, 1);
  return {{args.tensor(0)}, {0}};
}
std::vector<Tensor> bump_kernel(CallContext&, Args& args) {
  Tensor& x = args.tensor(0);
  for (double& v : x.span<double>()) v += 1;
  return {x.clone()};
}

// test.mesh_sizes(ndim): the mesh's size along each of its `ndim` dimensions, as the
// kernel sees them (CallContext::sizes and size(dim)), int64 [ndim].
Signature mesh_sizes_shape(const ArgMetas& args) {
  args.expect_count(1, 1);
  return {{TensorMeta({args.integer(0)}, DType::Int64, args.device())}, {}};
}
std::vector<Tensor> mesh_sizes_kernel(CallContext& ctx, Args&) {
  Tensor t = Tensor::empty(TensorMeta({static_cast<std::int64_t>(ctx.sizes().size())}, DType::Int64));
  for (std::size_t d = 0; d < ctx.sizes().size(); ++d) {
    if (ctx.size(ctx.dim_names()[d]) != ctx.sizes()[d]) throw std::logic_error("size(dim) disagrees with sizes()");
    t.data<std::int64_t>()[d] = ctx.size(ctx.dim_names()[d]);
  }
  return {on_device(std::move(t), ctx)};
}

// test.weighted_sum(a0, a1, ...): sum of (i + 1) * a_i over any number of numbers, float64
// 0-d: a call with many arguments, in order.
Signature weighted_sum_shape(const ArgMetas& args) {
  args.expect_count(1, 64);
  for (std::size_t i = 0; i < args.size(); ++i) (void)args.number(i);
  return {{TensorMeta({}, DType::Float64, args.device())}, {}};
}
std::vector<Tensor> weighted_sum_kernel(CallContext& ctx, Args& args) {
  double sum = 0;
  for (std::size_t i = 0; i < args.size(); ++i) sum += static_cast<double>(i + 1) * args.number(i);
  return {on_device(Tensor::from<double>({}, {sum}), ctx)};
}

// test.output_pool_cached(): the bytes this rank's CPU output pool holds for reuse, int64
// 0-d.
Signature pool_cached_shape(const ArgMetas& args) {
  args.expect_count(0, 0);
  return {{TensorMeta({}, DType::Int64, args.device())}, {}};
}
std::vector<Tensor> pool_cached_kernel(CallContext& ctx, Args&) {
  const auto cached = static_cast<std::int64_t>(output_pool_stats().cached_bytes);
  return {on_device(Tensor::from<std::int64_t>({}, {cached}), ctx)};
}

// test.sleep(seconds, ranks): sleeps on the listed ranks; returns a float32 scalar.
Signature sleep_shape(const ArgMetas& args) {
  args.expect_count(2, 2);
  return {{TensorMeta({}, DType::Float32, args.device())}, {}};
}
std::vector<Tensor> sleep_kernel(CallContext& ctx, Args& args) {
  for (const Value& r : args.value(1).as_list()) {
    if (r.as_int() == ctx.rank()) std::this_thread::sleep_for(std::chrono::duration<double>(args.number(0)));
  }
  return {Tensor::zeros(TensorMeta({}, DType::Float32))};
}

// test.crash(ranks): a kernel that gets SIGSEGV on the listed ranks, as one that
// dereferences a bad pointer would (raised, so that UBSan builds do not stop it first).
std::vector<Tensor> crash_kernel(CallContext& ctx, Args& args) {
  for (const Value& r : args.value(0).as_list()) {
    if (r.as_int() == ctx.rank()) std::raise(SIGSEGV);
  }
  return {Tensor::zeros(TensorMeta({}, DType::Float32))};
}
// test.device_fault(ranks): on the listed ranks a stream task that is no host task throws on
// the emulated accelerator: the emulator's model of an illegal address in a GPU kernel.
std::vector<Tensor> device_fault_kernel(CallContext& ctx, Args& args) {
  for (const Value& r : args.value(0).as_list()) {
    if (r.as_int() != ctx.rank()) continue;
    device::stream_for(ctx.stream_id(), device::rank_device(Device::Kind::Emulated)).enqueue([] {
      throw std::runtime_error("an illegal address (the emulator's model of one)");
    });
  }
  return {Tensor::zeros(TensorMeta({}, DType::Float32))};
}
// test.stop(ranks): the listed ranks stop themselves (SIGSTOP), as a process on a node
// that lost power goes silent without closing anything.
std::vector<Tensor> stop_kernel(CallContext& ctx, Args& args) {
  for (const Value& r : args.value(0).as_list()) {
    if (r.as_int() == ctx.rank()) std::raise(SIGSTOP);
  }
  return {Tensor::zeros(TensorMeta({}, DType::Float32))};
}
Signature one_scalar_shape(const ArgMetas& args) {
  return {{TensorMeta({}, DType::Float32, args.device())}, {}};
}

// test.usr1(ranks): sends SIGUSR1 to itself on the listed ranks.
std::vector<Tensor> usr1_kernel(CallContext& ctx, Args& args) {
  for (const Value& r : args.value(0).as_list()) {
    if (r.as_int() == ctx.rank()) std::raise(SIGUSR1);
  }
  return {Tensor::zeros(TensorMeta({}, DType::Float32))};
}

// test.misbehave(mode, ranks): float32[4] holding test.pattern's values, except on the
// listed ranks, where the kernel breaks its shape function's promise the way `mode` says:
// "shape" (float32[3]), "dtype" (int32[4]), "count" (two tensors), or throws: "throw42"
// (`throw 42`), "runtime" (std::runtime_error).
Signature misbehave_shape(const ArgMetas& args) {
  args.expect_count(2, 2);
  return {{TensorMeta({4}, DType::Float32, args.device())}, {}};
}
std::vector<Tensor> misbehave_kernel(CallContext& ctx, Args& args) {
  const std::string mode = args.value(0).as_string();
  bool bad = false;
  for (const Value& r : args.value(1).as_list()) bad = bad || r.as_int() == ctx.rank();
  auto pattern = [&](std::int64_t n) {
    Tensor t = Tensor::empty(TensorMeta({n}, DType::Float32));
    for (std::int64_t i = 0; i < n; ++i) t.data<float>()[i] = static_cast<float>(ctx.rank() * 100 + i + 1);
    return t;
  };
  if (!bad) return {on_device(pattern(4), ctx)};
  if (mode == "shape") return {on_device(pattern(3), ctx)};
  if (mode == "dtype") return {on_device(Tensor::zeros(TensorMeta({4}, DType::Int32)), ctx)};
  if (mode == "count") return {on_device(pattern(4), ctx), on_device(pattern(4), ctx)};
  if (mode == "throw42") throw 42;
  if (mode == "runtime") throw std::runtime_error("misbehave: a plain runtime_error");
  throw std::invalid_argument("test.misbehave: unknown mode " + mode);
}

// test.alias(mode, x, items): returns x's memory as its output, the way `mode` says:
// "same" (x itself), "reshape" (x reshaped to its numel), "item" (items[1], a tensor of
// the list `items`), "mutated" (x, which the call declares mutated), "twice" (one new
// tensor as both outputs: two outputs that are one memory), or "clone" (a copy: correct).
// Its outputs: one like x, two for "twice".
Signature alias_shape(const ArgMetas& args) {
  args.expect_count(3, 3);
  const std::string mode = args.string(0);
  const TensorMeta x = args.tensor(1);
  if (mode == "reshape") return {{x.with_shape({x.numel()})}, {}};
  if (mode == "twice") return {{x, x}, {}};
  return {{x}, mode == "mutated" ? std::vector<std::size_t>{1} : std::vector<std::size_t>{}};
}
std::vector<Tensor> alias_kernel(CallContext&, Args& args) {
  const std::string mode = args.value(0).as_string();
  const Tensor& x = args.tensor(1);
  if (mode == "same" || mode == "mutated") return {x};
  if (mode == "reshape") return {x.reshape({x.numel()})};
  if (mode == "item") return {args.value(2).as_list()[1].as_tensor()};
  if (mode == "twice") {
    Tensor t = x.clone();
    return {t, t};
  }
  if (mode == "clone") return {x.clone()};
  throw std::invalid_argument("test.alias: unknown mode " + mode);
}

// test.view(mode, x): outputs declared views of x (rows of dimension 0), the way `mode`
// says: "chunks" (two outputs, the first and second half of x's rows), "reshape" (x as
// one dimension), or "outside" (one output declared a view of x's first half but returned
// as a copy, outside x's storage: refused on the worker).
Signature view_shape(const ArgMetas& args) {
  args.expect_count(2, 2);
  const std::string mode = args.string(0);
  const TensorMeta x = args.tensor(1);
  if (x.shape().empty() || x.shape()[0] % 2 != 0) args.fail("expected an even number of rows, found " + x.to_string());
  std::vector<std::int64_t> half = x.shape();
  half[0] /= 2;
  if (mode == "chunks") {
    return {.outputs = {x.with_shape(half), x.with_shape(half)},
            .mutates = {},
            .views = {{.output = 0, .input = 1}, {.output = 1, .input = 1}}};
  }
  if (mode == "reshape") return {.outputs = {x.with_shape({x.numel()})}, .mutates = {}, .views = {{.input = 1}}};
  return {.outputs = {x.with_shape(half)}, .mutates = {}, .views = {{.output = 0, .input = 1}}};
}
std::vector<Tensor> view_kernel(CallContext&, Args& args) {
  const std::string mode = args.value(0).as_string();
  const Tensor& x = args.tensor(1);
  const std::int64_t h = x.shape()[0] / 2;
  if (mode == "chunks") return {x.rows(0, h), x.rows(h, 2 * h)};
  if (mode == "reshape") return {x.reshape({x.numel()})};
  if (mode == "outside") return {x.rows(0, h).clone()};
  throw std::invalid_argument("test.view: unknown mode " + mode);
}

}  // namespace

MESHRT_REGISTER_FUNCTION("test.view", view_kernel, view_shape);
MESHRT_REGISTER_FUNCTION("test.alias", alias_kernel, alias_shape);
MESHRT_REGISTER_FUNCTION("test.misbehave", misbehave_kernel, misbehave_shape);
MESHRT_REGISTER_FUNCTION("test.crash", crash_kernel, one_scalar_shape);
MESHRT_REGISTER_FUNCTION("test.stop", stop_kernel, one_scalar_shape);
MESHRT_REGISTER_FUNCTION("test.device_fault", device_fault_kernel, one_scalar_shape);
MESHRT_REGISTER_FUNCTION("test.usr1", usr1_kernel, one_scalar_shape);
MESHRT_REGISTER_FUNCTION("test.pattern", pattern_kernel, pattern_shape);
MESHRT_REGISTER_FUNCTION("test.bump_and_copy_", bump_kernel, bump_shape);
MESHRT_REGISTER_FUNCTION("test.sleep", sleep_kernel, sleep_shape);
MESHRT_REGISTER_FUNCTION("test.mesh_sizes", mesh_sizes_kernel, mesh_sizes_shape);
MESHRT_REGISTER_FUNCTION("test.weighted_sum", weighted_sum_kernel, weighted_sum_shape);
MESHRT_REGISTER_FUNCTION("test.output_pool_cached", pool_cached_kernel, pool_cached_shape);
