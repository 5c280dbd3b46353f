// The built-in remote functions (meshrt.*). Each is a kernel templated over the element
// type with one dtype switch, and a shape function that refuses what the kernel cannot
// do, so errors surface at the controller's call site rather than on a worker.
//
// Device policy: elementwise ops run on CUDA tensors with the kernels of
// src/device/kernels_cuda.cu; the others (arange, rand, matmul, sum) compute on the host
// and copy, which is correct everywhere and fast enough for what they are used for
// (tests, demos). On the emulated accelerator every built-in is the same host code run as
// a task on the call's device stream, with outputs from the stream-ordered pool.
#include <cblas.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <type_traits>

#include "meshrt/config.hpp"
#include "meshrt/device.hpp"
#include "meshrt/functions.hpp"

#include "device/cuda_kernels.hpp"  // plain declarations, in every build (BinaryOp)

namespace meshrt {
namespace {

// ------------------------------------------------------------------ stream order

// A kernel's host work in stream order: on the emulated accelerator a task on the call's
// device stream, the one place its memory is readable (docs/ARCHITECTURE.md section 7), so it runs
// after the stream's earlier work and before its later work; elsewhere at once.
template <class F>
void on_stream(const CallContext& ctx, const Device& where, F&& work) {
  if (!where.is_emulated()) {
    work();
    return;
  }
  device::host_task(ctx.stream_id(), where, std::forward<F>(work));
}

// An output: on an accelerator from the stream-ordered pool of the call's stream.
Tensor new_tensor(const CallContext& ctx, const TensorMeta& meta) {
  return device::empty_on(ctx.stream_id(), meta);
}

Tensor new_zeros(const CallContext& ctx, const TensorMeta& meta) {
  if (meta.device().is_cpu()) return Tensor::zeros(meta);
  return device::zeros(meta, device::stream_for(ctx.stream_id(), meta.device()));
}

// ------------------------------------------------------------------ element arithmetic

using cuda_kernels::BinaryOp;  // the one definition, shared with the CUDA kernels

template <class T>
constexpr bool kIsHalf = std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>;

template <class T>
float to_float(T v) {
  if constexpr (std::is_same_v<T, Half>)
    return half_to_float(v);
  else
    return bfloat16_to_float(v);
}
template <class T>
T from_float(float v) {
  if constexpr (std::is_same_v<T, Half>)
    return float_to_half(v);
  else
    return float_to_bfloat16(v);
}

// Bools: add is or, mul is and. Signed integers wrap (two's complement, as CUDA and
// torch do) instead of being undefined behaviour. Halves compute in float.
template <BinaryOp Op, class T>
T apply(T a, T b) {
  if constexpr (std::is_same_v<T, bool>) {
    return Op == BinaryOp::Add ? (a || b) : Op == BinaryOp::Mul ? (a && b) : (a != b);
  } else if constexpr (kIsHalf<T>) {
    const float x = to_float(a), y = to_float(b);
    return from_float<T>(Op == BinaryOp::Add ? x + y : Op == BinaryOp::Sub ? x - y : x * y);
  } else if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    const U x = static_cast<U>(a), y = static_cast<U>(b);
    // uint8 promotes to int; the cast back keeps the low bits either way.
    return static_cast<T>(static_cast<U>(Op == BinaryOp::Add ? x + y : Op == BinaryOp::Sub ? x - y : x * y));
  } else {
    return Op == BinaryOp::Add ? a + b : Op == BinaryOp::Sub ? a - b : a * b;
  }
}

template <BinaryOp Op>
void binary_host(const Tensor& a, const Tensor& b, Tensor& out) {
  dispatch_dtype(a.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* x = a.data<T>();
    const T* y = b.data<T>();
    T* z = out.data<T>();
    const std::int64_t n = a.numel();
    for (std::int64_t i = 0; i < n; ++i) z[i] = apply<Op, T>(x[i], y[i]);
  });
}

template <BinaryOp Op>
void binary(CallContext& ctx, const Tensor& a, const Tensor& b, Tensor& out) {
  if (a.device().is_cpu()) return binary_host<Op>(a, b, out);
  if (a.device().is_emulated()) {
    on_stream(ctx, a.device(), [a, b, out]() mutable { binary_host<Op>(a, b, out); });
    return;
  }
#if MESHRT_HAVE_CUDA
  cuda_kernels::binary(Op, static_cast<int>(a.dtype()), a.raw_data(), b.raw_data(), out.raw_data(), a.numel(),
                       ctx.native_stream());
#else
  (void)ctx;
#endif
}

// A fill value checked against the dtype, so that the conversion is defined.
struct Scalar {
  double f = 0;
  std::int64_t i = 0;
};

Scalar fill_value(const detail::ArgAccess& args, std::size_t index, DType dtype) {
  const Value& v = args.value(index);
  const auto refuse = [&](std::string_view expected) {
    args.fail_arg(index, fmt::format("expected {} for dtype {}, found {}", expected, name(dtype), v.to_string()));
  };
  if (dtype == DType::Bool) {
    if (v.is_bool()) return {v.as_bool() ? 1.0 : 0.0, v.as_bool() ? 1 : 0};
    if (v.is_int() && (v.as_int() == 0 || v.as_int() == 1)) return {static_cast<double>(v.as_int()), v.as_int()};
    refuse("a bool (or 0/1)");
  }
  if (is_floating(dtype)) {
    if (!v.is_number()) refuse("a number");
    return {v.as_number(), 0};
  }
  const auto [lo, hi] = dispatch_dtype(dtype, [](auto tag) -> std::pair<std::int64_t, std::int64_t> {
    using T = decltype(tag);
    if constexpr (std::is_integral_v<T>) {
      return {static_cast<std::int64_t>(std::numeric_limits<T>::min()),
              static_cast<std::int64_t>(std::numeric_limits<T>::max())};
    } else {
      return {0, 0};
    }
  });
  // A float with no fractional part is that integer, as numpy and torch take it
  // (full(..., 3.0) of int64); the range's top is hi + 1 exclusive, exact in a double.
  if (v.is_double()) {
    const double d = v.as_number();
    const double top = static_cast<double>(hi / 2 + 1) * 2.0;
    if (!(d == std::trunc(d) && d >= static_cast<double>(lo) && d < top)) {
      args.fail_arg(index, fmt::format("expected an integral value in [{}, {}] for dtype {} (an int, or a float "
                                       "with no fractional part), found the float {}",
                                       lo, hi, name(dtype), d));
    }
    return {d, static_cast<std::int64_t>(d)};
  }
  if (!v.is_int() || v.as_int() < lo || v.as_int() > hi) refuse(fmt::format("an int in [{}, {}]", lo, hi));
  return {static_cast<double>(v.as_int()), v.as_int()};
}

template <class T>
T convert(const Scalar& s) {
  if constexpr (std::is_same_v<T, bool>)
    return s.i != 0;
  else if constexpr (std::is_integral_v<T>)
    return static_cast<T>(s.i);
  else if constexpr (kIsHalf<T>)
    return from_float<T>(static_cast<float>(s.f));
  else
    return static_cast<T>(s.f);
}

void fill(CallContext& ctx, Tensor& t, const Scalar& s) {
  if (t.device().is_cuda()) {
#if MESHRT_HAVE_CUDA
    cuda_kernels::fill(static_cast<int>(t.dtype()), t.raw_data(), s.f, s.i, t.numel(), ctx.native_stream());
#endif
    return;
  }
  on_stream(ctx, t.device(), [t, s]() mutable {
    dispatch_dtype(t.dtype(), [&](auto tag) {
      using T = decltype(tag);
      std::fill_n(t.data<T>(), t.numel(), convert<T>(s));
    });
  });
}

// A result computed on the host, moved to `device` through pinned staging on the call's
// stream.
Tensor on_device(std::uint64_t stream_id, const Tensor& host_result, const Device& device) {
  if (device.is_cpu()) return host_result;
  return device::to_device(host_result, device, device::stream_for(stream_id, device));
}

// A host copy of CUDA tensor `x` made on the call's stream, after the work queued there
// (a copy on the legacy stream could read it before a kernel on a named stream wrote it).
Tensor on_host(std::uint64_t stream_id, const Tensor& x) {
  if (!x.device().is_cuda()) return x;
  device::Fetch f = device::fetch(x, device::stream_for(stream_id, x.device()));
  f.done.synchronize();
  return f.host;
}

// ------------------------------------------------------------------ shape helpers

void same_meta(const ArgMetas& args, const TensorMeta& a, const TensorMeta& b) {
  if (!(a == b)) {
    args.fail(fmt::format("expected arguments 0 and 1 of one shape, dtype and device, found {} and {}", a.to_string(),
                          b.to_string()));
  }
}

void require_floating(const ArgMetas& args, std::size_t i, const TensorMeta& m) {
  if (!is_floating(m.dtype())) {
    args.fail_arg(
        i, fmt::format("expected a floating dtype (float16, bfloat16, float32, float64), found {}", m.to_string()));
  }
}

// ------------------------------------------------------------------ creation

Signature full_shape(const ArgMetas& args) {
  args.expect_count(3, 3);
  const TensorMeta m(args.shape(0), args.dtype(1), args.device());
  (void)fill_value(args, 2, m.dtype());
  return {.outputs = {m}, .mutates = {}};
}
std::vector<Tensor> full_kernel(CallContext& ctx, Args& args) {
  Tensor t = new_tensor(ctx, TensorMeta(args.shape(0), args.dtype(1), ctx.device()));
  fill(ctx, t, fill_value(args, 2, t.dtype()));
  return {t};
}

Signature zeros_shape(const ArgMetas& args) {
  args.expect_count(2, 2);
  return {.outputs = {TensorMeta(args.shape(0), args.dtype(1), args.device())}, .mutates = {}};
}
std::vector<Tensor> zeros_kernel(CallContext& ctx, Args& args) {
  return {new_zeros(ctx, TensorMeta(args.shape(0), args.dtype(1), ctx.device()))};
}

Signature arange_shape(const ArgMetas& args) {
  args.expect_count(2, 2);
  const std::int64_t n = args.integer(0);
  const DType dtype = args.dtype(1);
  if (n < 0) args.fail_arg(0, fmt::format("expected a length >= 0, found {}", n));
  if (dtype == DType::Bool) args.fail_arg(1, "expected a numeric dtype, found bool");
  if (dtype == DType::UInt8 && n > 256) args.fail_arg(0, fmt::format("expected n <= 256 for uint8, found {}", n));
  if (dtype == DType::Int32 && n > std::int64_t{1} << 31)
    args.fail_arg(0, fmt::format("expected n <= 2^31 for int32, found {}", n));
  return {.outputs = {TensorMeta({n}, dtype, args.device())}, .mutates = {}};
}
// Host-computed creations: straight into the output on the CPU and on the emulated
// accelerator (as a stream task), through a host copy on CUDA.
template <class Compute>
Tensor create(CallContext& ctx, const TensorMeta& host_meta, Compute compute) {
  if (ctx.device().is_cuda()) {
    Tensor t = Tensor::empty(host_meta);
    compute(t);
    return on_device(ctx.stream_id(), t, ctx.device());
  }
  Tensor t = new_tensor(ctx, host_meta.with_device(ctx.device()));
  on_stream(ctx, t.device(), [t, compute]() mutable { compute(t); });
  return t;
}

std::vector<Tensor> arange_kernel(CallContext& ctx, Args& args) {
  return {create(ctx, TensorMeta({args.integer(0)}, args.dtype(1)), [](Tensor& t) {
    dispatch_dtype(t.dtype(), [&](auto tag) {
      using T = decltype(tag);
      T* p = t.data<T>();
      for (std::int64_t i = 0; i < t.numel(); ++i) {
        if constexpr (kIsHalf<T>)
          p[i] = from_float<T>(static_cast<float>(i));
        else
          p[i] = static_cast<T>(i);
      }
    });
  })};
}

// splitmix64: a counter-based generator, so element i of rank r's stream is a pure
// function of (seed, r, i): the same on CPU and GPU, independent of thread count.
std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

Signature rand_shape(const ArgMetas& args) {
  args.expect_count(3, 3);
  const TensorMeta m(args.shape(0), args.dtype(1), args.device());
  require_floating(args, 1, m);
  (void)args.integer(2);
  return {.outputs = {m}, .mutates = {}};
}
std::vector<Tensor> rand_kernel(CallContext& ctx, Args& args) {
  const std::uint64_t key =
      splitmix64(static_cast<std::uint64_t>(args.integer(2)) ^ splitmix64(static_cast<std::uint64_t>(ctx.rank()) + 1));
  return {create(ctx, TensorMeta(args.shape(0), args.dtype(1)), [key](Tensor& t) {
    dispatch_dtype(t.dtype(), [&](auto tag) {
      using T = decltype(tag);
      if constexpr (!std::is_integral_v<T>) {
        T* p = t.data<T>();
        for (std::int64_t i = 0; i < t.numel(); ++i) {
          // 53 random bits -> [0, 1)
          const double u = static_cast<double>(splitmix64(key + static_cast<std::uint64_t>(i)) >> 11) * 0x1.0p-53;
          if constexpr (kIsHalf<T>)
            p[i] = from_float<T>(static_cast<float>(u));
          else
            p[i] = static_cast<T>(u);
        }
      }
    });
  })};
}

// ------------------------------------------------------------------ elementwise

Signature binary_shape(const ArgMetas& args, bool allow_bool) {
  args.expect_count(2, 2);
  const TensorMeta a = args.tensor(0), b = args.tensor(1);
  same_meta(args, a, b);
  if (!allow_bool && a.dtype() == DType::Bool)
    args.fail("expected a numeric dtype, found bool (use add/mul for or/and)");
  return {.outputs = {a}, .mutates = {}};
}

template <BinaryOp Op>
std::vector<Tensor> binary_kernel(CallContext& ctx, Args& args) {
  const Tensor& a = args.tensor(0);
  Tensor out = new_tensor(ctx, a.meta());
  binary<Op>(ctx, a, args.tensor(1), out);
  return {out};
}

Signature scale_shape(const ArgMetas& args) {
  args.expect_count(2, 2);
  const TensorMeta x = args.tensor(0);
  require_floating(args, 0, x);
  (void)args.number(1);
  return {.outputs = {x}, .mutates = {}};
}
std::vector<Tensor> scale_kernel([[maybe_unused]] CallContext& ctx, Args& args) {  // ctx: CUDA builds only
  const Tensor& x = args.tensor(0);
  const double factor = args.number(1);
  Tensor out = new_tensor(ctx, x.meta());
  if (x.device().is_cuda()) {
#if MESHRT_HAVE_CUDA
    cuda_kernels::scale(static_cast<int>(x.dtype()), x.raw_data(), factor, out.raw_data(), x.numel(),
                        ctx.native_stream());
#endif
    return {out};
  }
  on_stream(ctx, x.device(), [x, out, factor]() mutable {
    dispatch_dtype(x.dtype(), [&](auto tag) {
      using T = decltype(tag);
      if constexpr (!std::is_integral_v<T>) {
        const T* p = x.data<T>();
        T* q = out.data<T>();
        for (std::int64_t i = 0; i < x.numel(); ++i) {
          if constexpr (kIsHalf<T>)
            q[i] = from_float<T>(to_float(p[i]) * static_cast<float>(factor));
          else
            q[i] = static_cast<T>(p[i] * static_cast<T>(factor));
        }
      }
    });
  });
  return {out};
}

Signature copy_shape(const ArgMetas& args) {
  args.expect_count(1, 1);
  return {.outputs = {args.tensor(0)}, .mutates = {}};
}
std::vector<Tensor> copy_kernel(CallContext& ctx, Args& args) {
  const Tensor& x = args.tensor(0);
  if (x.device().is_cpu()) return {x.clone()};
  Tensor out = new_tensor(ctx, x.meta());
  device::copy(out, x, device::stream_for(ctx.stream_id(), x.device()));
  return {out};
}

// meshrt.copy_(x, y): y's values into x in place (reduce's out=).
Signature copy__shape(const ArgMetas& args) {
  args.expect_count(2, 2);
  const TensorMeta x = args.tensor(0);
  const TensorMeta y = args.tensor(1);
  if (x.shape() != y.shape() || x.dtype() != y.dtype() || x.device() != y.device()) {
    args.fail_arg(0, fmt::format("expected a tensor of y's shape, dtype and device ({}), found {}", y.to_string(),
                                 x.to_string()));
  }
  return {.outputs = {}, .mutates = {0}};
}
std::vector<Tensor> copy__kernel(CallContext& ctx, Args& args) {
  Tensor& x = args.tensor(0);
  const Tensor& y = args.tensor(1);
  if (x.device().is_cpu()) {
    std::memcpy(x.raw_data(), y.raw_data(), y.nbytes());
  } else {
    device::copy(x, y, device::stream_for(ctx.stream_id(), x.device()));
  }
  return {};
}

// ------------------------------------------------------------------ host data

// The controller's host tensor (sent in the command) as this rank's own tensor on the
// mesh's device: a copy, so the command's bytes (shared with the controller on rank 0)
// are never the output.
Signature from_host_shape(const ArgMetas& args) {
  args.expect_count(1, 1);
  const TensorMeta x = args.tensor(0);
  if (!x.device().is_cpu()) args.fail_arg(0, fmt::format("expected a host (cpu) tensor, found {}", x.to_string()));
  return {.outputs = {x.with_device(args.device())}, .mutates = {}};
}
std::vector<Tensor> from_host_kernel(CallContext& ctx, Args& args) {
  const Tensor& x = args.tensor(0);
  if (ctx.device().is_cpu()) return {x.clone()};
  return {device::to_device(x, ctx.device(), device::stream_for(ctx.stream_id(), ctx.device()))};
}

// Shard coordinate(dim) of x split along its first axis into `parts` equal shards
// (Mesh::scatter passes the mesh's size of `dim`).
Signature shard_shape(const ArgMetas& args) {
  args.expect_count(3, 3);
  const TensorMeta x = args.tensor(0);
  (void)args.string(1);
  const std::int64_t parts = args.integer(2);
  if (parts < 1) args.fail_arg(2, fmt::format("expected a number of shards >= 1, found {}", parts));
  if (!x.device().is_cpu()) args.fail_arg(0, fmt::format("expected a host (cpu) tensor, found {}", x.to_string()));
  if (x.ndim() == 0 || x.shape()[0] % parts != 0) {
    args.fail_arg(
        0, fmt::format("expected a first axis that splits into {} equal shards, found {}", parts, x.to_string()));
  }
  std::vector<std::int64_t> shape = x.shape();
  shape[0] /= parts;
  return {.outputs = {TensorMeta(std::move(shape), x.dtype(), args.device())}, .mutates = {}};
}
std::vector<Tensor> shard_kernel(CallContext& ctx, Args& args) {
  const Tensor& x = args.tensor(0);
  const std::int64_t parts = args.integer(2);
  const std::int64_t index = ctx.coordinate(args.string(1));
  if (index >= parts) {
    args.fail(fmt::format("rank {}: expected a coordinate below the {} shards along '{}', found {}", ctx.rank(), parts,
                          args.string(1), index));
  }
  std::vector<std::int64_t> shape = x.shape();
  shape[0] /= parts;
  const std::size_t shard_bytes = x.nbytes() / static_cast<std::size_t>(parts);
  Tensor shard = Tensor::empty(TensorMeta(std::move(shape), x.dtype()));
  if (shard_bytes > 0) {
    std::memcpy(shard.raw_data(),
                static_cast<const std::byte*>(x.raw_data()) + static_cast<std::size_t>(index) * shard_bytes,
                shard_bytes);
  }
  return {on_device(ctx.stream_id(), shard, ctx.device())};
}

// ------------------------------------------------------------------ matmul, sum

void init_blas_threads() {
  // One BLAS thread per rank unless the user says otherwise: ranks already fill the
  // cores, and OpenBLAS's own pool would oversubscribe them.
  static std::once_flag once;
  std::call_once(once, [] {
    if (std::getenv("OPENBLAS_NUM_THREADS") == nullptr && std::getenv("OMP_NUM_THREADS") == nullptr) {
      openblas_set_num_threads(1);
    }
  });
}

Signature matmul_shape(const ArgMetas& args) {
  args.expect_count(2, 2);
  const TensorMeta a = args.tensor(0), b = args.tensor(1);
  if (a.ndim() != 2 || b.ndim() != 2 || a.shape()[1] != b.shape()[0]) {
    args.fail(fmt::format("expected [m, k] and [k, n] matrices, found {} and {}", a.to_string(), b.to_string()));
  }
  if (a.dtype() != b.dtype() || (a.dtype() != DType::Float32 && a.dtype() != DType::Float64)) {
    args.fail(
        fmt::format("expected two float32 or two float64 matrices, found {} and {}", a.to_string(), b.to_string()));
  }
  if (!(a.device() == b.device())) {
    args.fail(fmt::format("expected both matrices on one device, found {} and {}", a.to_string(), b.to_string()));
  }
  return {.outputs = {TensorMeta({a.shape()[0], b.shape()[1]}, a.dtype(), a.device())}, .mutates = {}};
}
// c = a b on host-readable memory; c is zeroed first.
void gemm(const Tensor& a, const Tensor& b, Tensor& c) {
  const auto m = static_cast<int>(a.shape()[0]), k = static_cast<int>(a.shape()[1]), n = static_cast<int>(b.shape()[1]);
  if (c.nbytes() > 0) std::memset(c.raw_data(), 0, c.nbytes());
  if (m > 0 && n > 0 && k > 0) {
    if (a.dtype() == DType::Float32) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, k, 1.0f, a.data<float>(), k, b.data<float>(), n,
                  0.0f, c.data<float>(), n);
    } else {
      cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, k, 1.0, a.data<double>(), k, b.data<double>(), n,
                  0.0, c.data<double>(), n);
    }
  }
}

std::vector<Tensor> matmul_kernel(CallContext& ctx, Args& args) {
  init_blas_threads();
  const Tensor& x = args.tensor(0);
  const TensorMeta out({x.shape()[0], args.tensor(1).shape()[1]}, x.dtype());
  if (x.device().is_emulated()) {
    Tensor c = new_tensor(ctx, out.with_device(x.device()));
    on_stream(ctx, x.device(), [a = x, b = args.tensor(1), c]() mutable { gemm(a, b, c); });
    return {c};
  }
  if (x.device().is_cuda()) {
    // On the device, on the call's stream: no copy to the host and back.
    Tensor c = new_tensor(ctx, out.with_device(x.device()));
#if MESHRT_HAVE_CUDA
    cuda_kernels::matmul(static_cast<int>(x.dtype()), x.raw_data(), args.tensor(1).raw_data(), c.raw_data(),
                         x.shape()[0], x.shape()[1], args.tensor(1).shape()[1], ctx.native_stream());
#endif
    return {c};
  }
  const Tensor a = on_host(ctx.stream_id(), x);
  const Tensor b = on_host(ctx.stream_id(), args.tensor(1));
  Tensor c = Tensor::empty(out);
  gemm(a, b, c);
  return {on_device(ctx.stream_id(), c, x.device())};
}

DType sum_dtype(DType in) {
  return in == DType::Bool ? DType::Int64 : in;
}

Signature sum_shape(const ArgMetas& args) {
  args.expect_count(1, 1);
  const TensorMeta x = args.tensor(0);
  return {.outputs = {TensorMeta({}, sum_dtype(x.dtype()), x.device())}, .mutates = {}};
}
void sum_into(const Tensor& x, Tensor& out) {
  dispatch_dtype(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* p = x.data<T>();
    if constexpr (std::is_same_v<T, bool>) {
      *out.data<std::int64_t>() = std::count(p, p + x.numel(), true);
    } else if constexpr (std::is_integral_v<T>) {
      // Wraps like the elementwise ops (the unsigned sum, truncated to T).
      std::uint64_t acc = 0;
      for (std::int64_t i = 0; i < x.numel(); ++i) acc += static_cast<std::uint64_t>(p[i]);
      *out.data<T>() = static_cast<T>(acc);
    } else {
      double acc = 0;  // double accumulation: float32 sums of large tensors stay accurate
      for (std::int64_t i = 0; i < x.numel(); ++i) {
        if constexpr (kIsHalf<T>)
          acc += to_float(p[i]);
        else
          acc += static_cast<double>(p[i]);
      }
      if constexpr (kIsHalf<T>)
        *out.data<T>() = from_float<T>(static_cast<float>(acc));
      else
        *out.data<T>() = static_cast<T>(acc);
    }
  });
}

std::vector<Tensor> sum_kernel(CallContext& ctx, Args& args) {
  const Tensor& in = args.tensor(0);
  const TensorMeta meta({}, sum_dtype(in.dtype()));
  if (in.device().is_emulated()) {
    Tensor out = new_tensor(ctx, meta.with_device(in.device()));
    on_stream(ctx, in.device(), [in, out]() mutable { sum_into(in, out); });
    return {out};
  }
  if (in.device().is_cuda()) {
    // On the device, on the call's stream; the partial sums' scratch goes back to the
    // stream's pool when this returns, after the kernels in its order.
    Tensor out = new_tensor(ctx, meta.with_device(in.device()));
#if MESHRT_HAVE_CUDA
    const Tensor scratch = new_tensor(
        ctx, TensorMeta({static_cast<std::int64_t>(cuda_kernels::sum_scratch_bytes())}, DType::UInt8, in.device()));
    cuda_kernels::sum(static_cast<int>(in.dtype()), in.raw_data(), out.raw_data(),
                      const_cast<void*>(scratch.raw_data()), in.numel(), ctx.native_stream());
#endif
    return {out};
  }
  const Tensor x = on_host(ctx.stream_id(), in);
  Tensor out = Tensor::empty(meta);
  sum_into(x, out);
  return {on_device(ctx.stream_id(), out, in.device())};
}

// ------------------------------------------------------------------ in place

Signature fill__shape(const ArgMetas& args) {
  args.expect_count(2, 2);
  (void)fill_value(args, 1, args.tensor(0).dtype());
  return {.outputs = {}, .mutates = {0}};
}
std::vector<Tensor> fill__kernel(CallContext& ctx, Args& args) {
  Tensor& x = args.tensor(0);
  fill(ctx, x, fill_value(args, 1, x.dtype()));
  return {};
}

Signature add__shape(const ArgMetas& args) {
  (void)binary_shape(args, true);  // the same checks as meshrt.add
  return {.outputs = {}, .mutates = {0}};
}
std::vector<Tensor> add__kernel(CallContext& ctx, Args& args) {
  Tensor& x = args.tensor(0);
  binary<BinaryOp::Add>(ctx, x, args.tensor(1), x);
  return {};
}

// ------------------------------------------------------------------ errors on purpose

Signature fail_shape(const ArgMetas& args) {
  args.expect_count(2, 2);
  (void)args.string(0);
  for (const Value& r : args.value(1).as_list()) {
    if (!r.is_int())
      args.fail_arg(1, fmt::format("expected a list of ranks (ints), found {}", args.value(1).to_string()));
  }
  return {.outputs = {TensorMeta({}, DType::Float32, args.device())}, .mutates = {}};
}
// Throws on the listed ranks (every rank when the list is empty); for error-path tests.
std::vector<Tensor> fail_kernel(CallContext& ctx, Args& args) {
  const auto& ranks = args.value(1).as_list();
  const bool mine = ranks.empty() ||
                    std::any_of(ranks.begin(), ranks.end(), [&](const Value& r) { return r.as_int() == ctx.rank(); });
  if (mine) throw std::runtime_error(args.string(0));
  return {new_zeros(ctx, TensorMeta({}, DType::Float32, ctx.device()))};
}

}  // namespace

// The descriptions below are the reference: docs/builtins.md is generated from them
// (meshrt-info --builtins-markdown; scripts/builtins-check.sh keeps the two equal).
using functions::Description;
MESHRT_REGISTER_FUNCTION("meshrt.full", full_kernel, full_shape,
                         Description{
                             .params = {{"shape", "list[int]"}, {"dtype", "dtype"}, {"value", "int | float | bool"}},
                             .returns = "tensor",
                             .doc = "A tensor of `shape` filled with `value` (checked against `dtype`'s range; a "
                                    "float with no fractional part fills an integer dtype, as in numpy)."});
MESHRT_REGISTER_FUNCTION("meshrt.zeros", zeros_kernel, zeros_shape,
                         Description{.params = {{"shape", "list[int]"}, {"dtype", "dtype"}},
                                     .returns = "tensor",
                                     .doc = "A tensor of `shape` filled with zeros."});
MESHRT_REGISTER_FUNCTION("meshrt.arange", arange_kernel, arange_shape,
                         Description{.params = {{"n", "int"}, {"dtype", "dtype"}},
                                     .returns = "tensor",
                                     .doc = "0, 1, ..., n-1 as a 1-D tensor of a numeric dtype."});
MESHRT_REGISTER_FUNCTION("meshrt.rand", rand_kernel, rand_shape,
                         Description{.params = {{"shape", "list[int]"}, {"dtype", "dtype"}, {"seed", "int"}},
                                     .returns = "tensor",
                                     .doc = "Uniform numbers in [0, 1) of a floating dtype; a function of (seed, rank, "
                                            "element), so each rank draws its own."});
MESHRT_REGISTER_FUNCTION(
    "meshrt.add", binary_kernel<BinaryOp::Add>, [](const ArgMetas& a) { return binary_shape(a, true); },
    Description{.params = {{"a", "tensor"}, {"b", "tensor"}},
                .returns = "tensor",
                .doc = "a + b elementwise (one shape, dtype and device; or for bool)."});
MESHRT_REGISTER_FUNCTION(
    "meshrt.sub", binary_kernel<BinaryOp::Sub>, [](const ArgMetas& a) { return binary_shape(a, false); },
    Description{.params = {{"a", "tensor"}, {"b", "tensor"}},
                .returns = "tensor",
                .doc = "a - b elementwise (one shape, dtype and device; not bool)."});
MESHRT_REGISTER_FUNCTION(
    "meshrt.mul", binary_kernel<BinaryOp::Mul>, [](const ArgMetas& a) { return binary_shape(a, true); },
    Description{.params = {{"a", "tensor"}, {"b", "tensor"}},
                .returns = "tensor",
                .doc = "a * b elementwise (one shape, dtype and device; and for bool)."});
MESHRT_REGISTER_FUNCTION("meshrt.scale", scale_kernel, scale_shape,
                         Description{.params = {{"x", "tensor"}, {"factor", "float"}},
                                     .returns = "tensor",
                                     .doc = "x * factor for a tensor of a floating dtype."});
MESHRT_REGISTER_FUNCTION("meshrt.matmul", matmul_kernel, matmul_shape,
                         Description{.params = {{"a", "tensor"}, {"b", "tensor"}},
                                     .returns = "tensor",
                                     .doc = "The matrix product of [m, k] and [k, n] float32 or float64 matrices "
                                            "(OpenBLAS on the host; on a CUDA device a kernel on the call's "
                                            "stream, whose rounding is not OpenBLAS's)."});
MESHRT_REGISTER_FUNCTION("meshrt.copy", copy_kernel, copy_shape,
                         Description{
                             .params = {{"x", "tensor"}}, .returns = "tensor", .doc = "A copy of x, on x's device."});
MESHRT_REGISTER_FUNCTION("meshrt.copy_", copy__kernel, copy__shape,
                         Description{.params = {{"x", "tensor"}, {"y", "tensor"}},
                                     .returns = "none (writes x in place)",
                                     .doc = "x = y elementwise (one shape, dtype and device): reduce's out=."});
MESHRT_REGISTER_FUNCTION("meshrt.from_host", from_host_kernel, from_host_shape,
                         Description{.params = {{"x", "host tensor"}},
                                     .returns = "tensor",
                                     .doc = "A copy of the controller's tensor x on every rank, on the mesh's device "
                                            "(mesh.from_host(x))."});
MESHRT_REGISTER_FUNCTION("meshrt.shard", shard_kernel, shard_shape,
                         Description{.params = {{"x", "host tensor"}, {"dim", "str"}, {"parts", "int"}},
                                     .returns = "tensor",
                                     .doc = "Shard coordinate(dim) of x split along its first axis into `parts` equal "
                                            "shards (mesh.scatter(dim, x))."});
MESHRT_REGISTER_FUNCTION("meshrt.sum", sum_kernel, sum_shape,
                         Description{.params = {{"x", "tensor"}},
                                     .returns = "tensor",
                                     .doc = "The sum of every element as a 0-d tensor (int64 for bool; integers wrap; "
                                            "floating dtypes add in double, on a CUDA device by a kernel on the call's "
                                            "stream)."});
MESHRT_REGISTER_FUNCTION("meshrt.fill_", fill__kernel, fill__shape,
                         Description{.params = {{"x", "tensor"}, {"value", "int | float | bool"}},
                                     .returns = "none (writes x in place)",
                                     .doc = "Sets every element of x to `value`."});
MESHRT_REGISTER_FUNCTION("meshrt.add_", add__kernel, add__shape,
                         Description{.params = {{"x", "tensor"}, {"y", "tensor"}},
                                     .returns = "none (writes x in place)",
                                     .doc = "x += y elementwise (one shape, dtype and device)."});
MESHRT_REGISTER_FUNCTION("meshrt.fail", fail_kernel, fail_shape,
                         Description{.params = {{"message", "str"}, {"ranks", "list[int]"}},
                                     .returns = "tensor",
                                     .doc = "Raises `message` on the listed ranks (every rank when empty); for tests "
                                            "of the error paths."});

}  // namespace meshrt
