// Pipeline parallelism: two stages on two slices of one mesh, several micro-batches in
// flight, checked against the same computation in one process.
//
//   mpiexec -n 4 pipeline [--micro-batches 4] [--rows 8] [--in 16] [--hidden 32] [--out 8]
//
// The mesh is {stage: 2, dp: N/2}. Stage 0 (mesh.slice("stage", 0), a {dp} mesh) makes
// each micro-batch's input and runs layer 1; DTensor::to_mesh moves the activations to
// stage 1 (mesh.slice("stage", 1)), positionally: dp rank d of stage 0 sends to dp rank d
// of stage 1; stage 1 runs layer 2. The controller issues all stage-0 work, then all the
// sends, then all stage-1 work, and only then fetches: each worker runs its commands in
// order, so stage 1 starts on micro-batch 0 while stage 0 is still on later ones.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "meshrt/meshrt.hpp"

namespace {

using namespace meshrt;

// ---------------------------------------------------------------- the math, shared by the
// kernels and the one-process reference so that both run the very same code.

float value(std::int64_t seed, std::int64_t stream, std::int64_t i, std::int64_t j) {
  // A small deterministic pattern in [-1, 1): enough to tell every element apart.
  // Unsigned: wraps instead of overflowing for any seed.
  const auto u = [](std::int64_t v) { return static_cast<std::uint64_t>(v); };
  const std::uint64_t h = ((u(seed) * 7919 + u(stream)) * 104729 + u(i)) * 1299709 + u(j);
  return static_cast<float>((h * 0x9e3779b97f4a7c15ULL) >> 40) * 0x1.0p-23f - 1.0f;
}

// y = x w + b, optionally relu'd; x [rows, in], w [in, out], b [out].
void linear(std::int64_t rows, std::int64_t in, std::int64_t out, const float* x, const float* w, const float* b,
            bool relu, float* y) {
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t o = 0; o < out; ++o) {
      float acc = b[o];
      for (std::int64_t k = 0; k < in; ++k) acc += x[r * in + k] * w[k * out + o];
      y[r * out + o] = relu ? std::max(acc, 0.0f) : acc;
    }
  }
}

void make_layer(std::int64_t seed, std::int64_t layer, std::int64_t in, std::int64_t out, float* w, float* b) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(in));
  for (std::int64_t k = 0; k < in; ++k) {
    for (std::int64_t o = 0; o < out; ++o) w[k * out + o] = scale * value(seed, 2 * layer, k, o);
  }
  for (std::int64_t o = 0; o < out; ++o) b[o] = 0.1f * value(seed, 2 * layer + 1, 0, o);
}

// Rows [row0, row0 + rows) of micro-batch `micro`.
void make_input(std::int64_t seed, std::int64_t micro, std::int64_t row0, std::int64_t rows, std::int64_t in,
                float* x) {
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t k = 0; k < in; ++k) x[r * in + k] = value(seed, 100 + micro, row0 + r, k);
  }
}

// ---------------------------------------------------------------- remote functions

TensorMeta f32(const ArgMetas& args, std::vector<std::int64_t> shape) {
  return TensorMeta(std::move(shape), DType::Float32, args.device());
}

// pipeline.init_layer(seed, layer, in, out) -> w [in, out], b [out] (the same on every rank)
Signature init_layer_shape(const ArgMetas& args) {
  args.expect_count(4, 4);
  (void)args.integer(0);
  (void)args.integer(1);
  return {.outputs = {f32(args, {args.integer(2), args.integer(3)}), f32(args, {args.integer(3)})}, .mutates = {}};
}
std::vector<Tensor> init_layer_kernel(CallContext&, Args& args) {
  const std::int64_t in = args.integer(2), out = args.integer(3);
  Tensor w = Tensor::empty(TensorMeta({in, out}, DType::Float32)), b = Tensor::empty(TensorMeta({out}, DType::Float32));
  make_layer(args.integer(0), args.integer(1), in, out, w.data<float>(), b.data<float>());
  return {w, b};
}

// pipeline.make_input(seed, micro, rows, in) -> x [rows, in]: dp rank d's rows of the
// micro-batch, [d * rows, (d + 1) * rows).
Signature make_input_shape(const ArgMetas& args) {
  args.expect_count(4, 4);
  (void)args.integer(0);
  (void)args.integer(1);
  return {.outputs = {f32(args, {args.integer(2), args.integer(3)})}, .mutates = {}};
}
std::vector<Tensor> make_input_kernel(CallContext& ctx, Args& args) {
  const std::int64_t rows = args.integer(2), in = args.integer(3);
  Tensor x = Tensor::empty(TensorMeta({rows, in}, DType::Float32));
  make_input(args.integer(0), args.integer(1), ctx.coordinate("dp") * rows, rows, in, x.data<float>());
  return {x};
}

// pipeline.linear(x, w, b, relu) -> x w + b (relu'd if asked)
Signature linear_shape(const ArgMetas& args) {
  args.expect_count(4, 4);
  const TensorMeta x = args.tensor(0), w = args.tensor(1), b = args.tensor(2);
  (void)args.boolean(3);
  if (x.ndim() != 2 || w.ndim() != 2 || b.ndim() != 1 || x.shape()[1] != w.shape()[0] || b.shape()[0] != w.shape()[1] ||
      x.dtype() != DType::Float32 || w.dtype() != DType::Float32 || b.dtype() != DType::Float32) {
    args.fail(fmt::format("expected float32 x [rows, in], w [in, out], b [out], found {}, {}, {}", x.to_string(),
                          w.to_string(), b.to_string()));
  }
  return {.outputs = {f32(args, {x.shape()[0], w.shape()[1]})}, .mutates = {}};
}
std::vector<Tensor> linear_kernel(CallContext&, Args& args) {
  const Tensor &x = args.tensor(0), &w = args.tensor(1), &b = args.tensor(2);
  Tensor y = Tensor::empty(TensorMeta({x.shape()[0], w.shape()[1]}, DType::Float32));
  linear(x.shape()[0], x.shape()[1], w.shape()[1], x.data<float>(), w.data<float>(), b.data<float>(), args.boolean(3),
         y.data<float>());
  return {y};
}

MESHRT_REGISTER_FUNCTION("pipeline.init_layer", init_layer_kernel, init_layer_shape);
MESHRT_REGISTER_FUNCTION("pipeline.make_input", make_input_kernel, make_input_shape);
MESHRT_REGISTER_FUNCTION("pipeline.linear", linear_kernel, linear_shape);

// ---------------------------------------------------------------- the controller

struct Options {
  std::int64_t micro_batches = 4, rows = 8, in = 16, hidden = 32, out = 8, seed = 3;
};

void pipeline(Controller& ctl, const Options& o) {
  const std::int64_t n = ctl.worker_ranks().len();
  if (n % 2 != 0) throw UsageError(fmt::format("expected an even number of workers (two stages), found {}", n));
  const std::int64_t dp = n / 2;
  Mesh mesh = ctl.world_mesh({{"stage", 2}, {"dp", dp}});
  const Mesh stage0 = mesh.slice("stage", 0), stage1 = mesh.slice("stage", 1);
  fmt::print("pipeline: 2 stages x dp {} ({} ranks), {} micro-batches of {} rows ({} per dp rank), {} -> {} -> {}\n",
             dp, n, o.micro_batches, o.rows * dp, o.rows, o.in, o.hidden, o.out);

  // Each stage holds only its own layer.
  const auto layer1 = stage0.call_n("pipeline.init_layer", {o.seed, 1, o.in, o.hidden});
  const auto layer2 = stage1.call_n("pipeline.init_layer", {o.seed, 2, o.hidden, o.out});

  std::vector<DTensor> activations, received, outputs;
  for (std::int64_t m = 0; m < o.micro_batches; ++m) {
    const DTensor x = stage0.call("pipeline.make_input", o.seed, m, o.rows, o.in);
    activations.push_back(stage0.call("pipeline.linear", x, layer1[0], layer1[1], true));
  }
  for (const DTensor& h : activations) received.push_back(h.to_mesh(stage1));
  for (const DTensor& h : received) outputs.push_back(stage1.call("pipeline.linear", h, layer2[0], layer2[1], false));

  // The same in one process: every micro-batch's full rows through both layers.
  std::vector<float> w1(static_cast<std::size_t>(o.in * o.hidden)), b1(static_cast<std::size_t>(o.hidden));
  std::vector<float> w2(static_cast<std::size_t>(o.hidden * o.out)), b2(static_cast<std::size_t>(o.out));
  make_layer(o.seed, 1, o.in, o.hidden, w1.data(), b1.data());
  make_layer(o.seed, 2, o.hidden, o.out, w2.data(), b2.data());
  const std::int64_t rows = o.rows * dp;
  std::vector<float> x(static_cast<std::size_t>(rows * o.in)), h(static_cast<std::size_t>(rows * o.hidden));
  std::vector<float> y(static_cast<std::size_t>(rows * o.out));

  // The kernels and the reference run the same code on the same inputs: expect equality,
  // with a margin of a few float32 ulps in case a compiler vectorises one call site.
  double worst = 0, scale = 0;
  for (std::int64_t m = 0; m < o.micro_batches; ++m) {
    make_input(o.seed, m, 0, rows, o.in, x.data());
    linear(rows, o.in, o.hidden, x.data(), w1.data(), b1.data(), true, h.data());
    linear(rows, o.hidden, o.out, h.data(), w2.data(), b2.data(), false, y.data());
    for (std::int64_t d = 0; d < dp; ++d) {
      const Tensor got = ctl.fetch_shard(outputs[static_cast<std::size_t>(m)], {{"dp", d}}).get();
      const std::span<const float> g = got.span<float>();
      for (std::size_t i = 0; i < g.size(); ++i) {
        const double want = y[static_cast<std::size_t>(d * o.rows * o.out) + i];
        worst = std::max(worst, std::abs(g[i] - want));
        scale = std::max(scale, std::abs(want));
      }
    }
  }
  const double tolerance = 1e-6 * std::max(scale, 1.0);
  fmt::print("max |pipeline - one process| = {:.3g} over {} micro-batches (tolerance {:.3g}): {}\n", worst,
             o.micro_batches, tolerance, worst <= tolerance ? "PASS" : "FAIL");
  if (!(worst <= tolerance)) {
    throw Error(fmt::format("pipeline: expected the outputs within {:.3g} of the one-process run, found {:.3g}",
                            tolerance, worst));
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"Two pipeline stages on slices of one mesh, several micro-batches in flight"};
  app.add_option("--micro-batches", o.micro_batches)->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--rows", o.rows, "rows per dp rank and micro-batch")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--in", o.in)->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--hidden", o.hidden)->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--out", o.out)->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--seed", o.seed)->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  return run(argc, argv, [&](Controller& ctl) { pipeline(ctl, o); });
}
