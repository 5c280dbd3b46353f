// Remote functions the runtime tests use.
#include <chrono>
#include <csignal>
#include <thread>

#include "meshrt/functions.hpp"

namespace {

using namespace meshrt;

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
  return {t};
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

}  // namespace

MESHRT_REGISTER_FUNCTION("test.crash", crash_kernel, one_scalar_shape);
MESHRT_REGISTER_FUNCTION("test.usr1", usr1_kernel, one_scalar_shape);
MESHRT_REGISTER_FUNCTION("test.pattern", pattern_kernel, pattern_shape);
MESHRT_REGISTER_FUNCTION("test.sleep", sleep_kernel, sleep_shape);
