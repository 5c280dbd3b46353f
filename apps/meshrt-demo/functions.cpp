// The demo's remote functions. Each kernel runs on every rank of the dp x tp mesh and
// only wraps model.cpp; each shape function runs on the controller at the call site and
// refuses mismatched shapes there, before anything is sent to the workers. The numerics
// run through device::host_task: at once on the CPU, as a task on the call's device stream
// on the emulated accelerator (whose memory the host may read only there).
//
//   demo.init_params(seed, in, hidden, out, tp) -> W1 [in, hidden/tp], b1 [hidden/tp],
//                                                 W2 [hidden/tp, out], b2 [out]
//   demo.make_batch(seed, step, rows, in, out)  -> x [rows, in], t [rows, out]
//     (step: an int, or an int64 0-d tensor counting the steps, advanced in place: the
//     form a recorded step uses, as its commands are the same every step)
//   demo.forward(x, W1, b1, W2)                 -> z [rows, hidden/tp], y_part [rows, out]
//   demo.loss_grad(y, b2, t)                    -> dy [rows, out], loss []
//   demo.backward(x, z, W2, dy)                 -> grads [packed, see model.hpp]
//   demo.sgd_step(W1, b1, W2, b2, grads, lr)    -> (W1, b1, W2, b2 updated in place)
#include <fmt/format.h>

#include <string>
#include <vector>

#include "meshrt/device.hpp"
#include "meshrt/functions.hpp"
#include "model.hpp"

namespace {

using meshrt::ArgMetas;
using meshrt::Args;
using meshrt::CallContext;
using meshrt::DType;
using meshrt::Signature;
using meshrt::Tensor;
using meshrt::TensorMeta;

TensorMeta f32(const ArgMetas& args, std::vector<std::int64_t> shape) {
  return TensorMeta(std::move(shape), DType::Float32, args.device());
}
Tensor empty_f32(const CallContext& ctx, std::vector<std::int64_t> shape) {
  return meshrt::device::empty_on(ctx.stream_id(), TensorMeta(std::move(shape), DType::Float32, ctx.device()));
}
template <class F>
void host_task(const CallContext& ctx, F&& work) {
  meshrt::device::host_task(ctx.stream_id(), ctx.device(), std::forward<F>(work));
}

// Argument i is a float32 tensor of exactly `shape` on the mesh's device; `what` names it.
void expect_tensor(const ArgMetas& args, std::size_t i, const char* what, const std::vector<std::int64_t>& shape) {
  const TensorMeta m = args.tensor(i);
  const TensorMeta want(shape, DType::Float32, args.device());
  if (!(m == want)) {
    args.fail(fmt::format("argument {} ({}): expected {}, found {}", i, what, want.to_string(), m.to_string()));
  }
}

std::int64_t positive(const ArgMetas& args, std::size_t i, const char* what) {
  const std::int64_t v = args.integer(i);
  if (v <= 0) args.fail(fmt::format("argument {} ({}): expected a positive size, found {}", i, what, v));
  return v;
}

// ---------------------------------------------------------------- init_params

Signature init_params_shape(const ArgMetas& args) {
  args.expect_count(5, 5);
  (void)args.integer(0);
  const std::int64_t in = positive(args, 1, "in"), hidden = positive(args, 2, "hidden");
  const std::int64_t out = positive(args, 3, "out"), tp = positive(args, 4, "tp");
  if (hidden % tp != 0) {
    args.fail(fmt::format("expected hidden ({}) divisible by the tensor-parallel degree ({})", hidden, tp));
  }
  const std::int64_t cols = hidden / tp;
  return {.outputs = {f32(args, {in, cols}), f32(args, {cols}), f32(args, {cols, out}), f32(args, {out})},
          .mutates = {}};
}

std::vector<Tensor> init_params_kernel(CallContext& ctx, Args& args) {
  const demo::Sizes s{.in = args.integer(1), .hidden = args.integer(2), .out = args.integer(3)};
  const std::int64_t cols = s.hidden / args.integer(4);
  // This rank's column block of the first layer and row block of the second.
  const std::int64_t col0 = ctx.coordinate("tp") * cols;
  Tensor w1 = empty_f32(ctx, {s.in, cols}), b1 = empty_f32(ctx, {cols});
  Tensor w2 = empty_f32(ctx, {cols, s.out}), b2 = empty_f32(ctx, {s.out});
  host_task(ctx, [seed = static_cast<std::uint64_t>(args.integer(0)), s, col0, cols, w1, b1, w2, b2]() mutable {
    demo::init_params(seed, s, col0, cols, w1.data<float>(), b1.data<float>(), w2.data<float>(), b2.data<float>());
  });
  return {w1, b1, w2, b2};
}

// ---------------------------------------------------------------- make_batch

Signature make_batch_shape(const ArgMetas& args) {
  args.expect_count(5, 5);
  (void)args.integer(0);
  bool counter = false;
  if (args.value(1).is_meta()) {
    const TensorMeta c = args.tensor(1);
    if (c.dtype() != DType::Int64 || c.ndim() != 0)
      args.fail(fmt::format("argument 1 (step): expected an int or an int64 0-d tensor, found {}", c.to_string()));
    counter = true;
  } else {
    (void)args.integer(1);
  }
  const std::int64_t rows = positive(args, 2, "rows"), in = positive(args, 3, "in"), out = positive(args, 4, "out");
  return {.outputs = {f32(args, {rows, in}), f32(args, {rows, out})},
          .mutates = counter ? std::vector<std::size_t>{1} : std::vector<std::size_t>{}};
}

std::vector<Tensor> make_batch_kernel(CallContext& ctx, Args& args) {
  const std::int64_t rows = args.integer(2);
  const demo::Sizes s{.in = args.integer(3), .hidden = 0, .out = args.integer(4)};
  Tensor x = empty_f32(ctx, {rows, s.in}), t = empty_f32(ctx, {rows, s.out});
  const bool counter = args.value(1).is_tensor();
  Tensor step_counter = counter ? args.tensor(1) : Tensor();
  // Data parallelism: dp rank d gets rows [d * rows, (d + 1) * rows) of the global batch.
  host_task(ctx, [seed = static_cast<std::uint64_t>(args.integer(0)), step = counter ? 0 : args.integer(1),
                  step_counter, row0 = ctx.coordinate("dp") * rows, rows, s, x, t]() mutable {
    std::int64_t at = step;
    if (step_counter.defined()) at = step_counter.data<std::int64_t>()[0]++;
    demo::make_batch(seed, at, row0, rows, s, x.data<float>(), t.data<float>());
  });
  return {x, t};
}

// ---------------------------------------------------------------- forward

Signature forward_shape(const ArgMetas& args) {
  args.expect_count(4, 4);
  const TensorMeta x = args.tensor(0), w1 = args.tensor(1), w2 = args.tensor(3);
  if (x.ndim() != 2 || w1.ndim() != 2 || w2.ndim() != 2) {
    args.fail(
        fmt::format("expected matrices x, W1, W2, found {}, {}, {}", x.to_string(), w1.to_string(), w2.to_string()));
  }
  const std::int64_t rows = x.shape()[0], in = x.shape()[1], cols = w1.shape()[1], out = w2.shape()[1];
  expect_tensor(args, 0, "x", {rows, in});
  expect_tensor(args, 1, "W1", {in, cols});
  expect_tensor(args, 2, "b1", {cols});
  expect_tensor(args, 3, "W2", {cols, out});
  return {.outputs = {f32(args, {rows, cols}), f32(args, {rows, out})}, .mutates = {}};
}

std::vector<Tensor> forward_kernel(CallContext& ctx, Args& args) {
  const Tensor &x = args.tensor(0), &w1 = args.tensor(1), &b1 = args.tensor(2), &w2 = args.tensor(3);
  const std::int64_t rows = x.shape()[0], in = x.shape()[1], cols = w1.shape()[1], out = w2.shape()[1];
  Tensor z = empty_f32(ctx, {rows, cols}), y_part = empty_f32(ctx, {rows, out});
  host_task(ctx, [=]() mutable {
    demo::forward(rows, in, cols, out, x.data<float>(), w1.data<float>(), b1.data<float>(), w2.data<float>(),
                  z.data<float>(), y_part.data<float>());
  });
  return {z, y_part};
}

// ---------------------------------------------------------------- loss_grad

Signature loss_grad_shape(const ArgMetas& args) {
  args.expect_count(3, 3);
  const TensorMeta y = args.tensor(0);
  if (y.ndim() != 2) args.fail(fmt::format("argument 0 (y): expected a [rows, out] matrix, found {}", y.to_string()));
  expect_tensor(args, 0, "y", y.shape());
  expect_tensor(args, 1, "b2", {y.shape()[1]});
  expect_tensor(args, 2, "t", y.shape());
  return {.outputs = {f32(args, y.shape()), f32(args, {})}, .mutates = {}};
}

std::vector<Tensor> loss_grad_kernel(CallContext& ctx, Args& args) {
  const Tensor &y = args.tensor(0), &b2 = args.tensor(1), &t = args.tensor(2);
  Tensor dy = empty_f32(ctx, y.shape()), loss = empty_f32(ctx, {});
  host_task(ctx, [=]() mutable {
    loss.data<float>()[0] = static_cast<float>(demo::loss_grad(y.shape()[0], y.shape()[1], y.data<float>(),
                                                               b2.data<float>(), t.data<float>(), dy.data<float>()));
  });
  return {dy, loss};
}

// ---------------------------------------------------------------- backward

Signature backward_shape(const ArgMetas& args) {
  args.expect_count(4, 4);
  const TensorMeta x = args.tensor(0), z = args.tensor(1), w2 = args.tensor(2);
  if (x.ndim() != 2 || z.ndim() != 2 || w2.ndim() != 2) {
    args.fail(
        fmt::format("expected matrices x, z, W2, found {}, {}, {}", x.to_string(), z.to_string(), w2.to_string()));
  }
  const std::int64_t rows = x.shape()[0], in = x.shape()[1], cols = z.shape()[1], out = w2.shape()[1];
  expect_tensor(args, 0, "x", {rows, in});
  expect_tensor(args, 1, "z", {rows, cols});
  expect_tensor(args, 2, "W2", {cols, out});
  expect_tensor(args, 3, "dy", {rows, out});
  return {.outputs = {f32(args, {demo::grad_size(in, cols, out)})}, .mutates = {}};
}

std::vector<Tensor> backward_kernel(CallContext& ctx, Args& args) {
  const Tensor &x = args.tensor(0), &z = args.tensor(1), &w2 = args.tensor(2), &dy = args.tensor(3);
  const std::int64_t rows = x.shape()[0], in = x.shape()[1], cols = z.shape()[1], out = w2.shape()[1];
  Tensor grads = empty_f32(ctx, {demo::grad_size(in, cols, out)});
  host_task(ctx, [=]() mutable {
    demo::backward(rows, in, cols, out, x.data<float>(), z.data<float>(), w2.data<float>(), dy.data<float>(),
                   grads.data<float>());
  });
  return {grads};
}

// ---------------------------------------------------------------- sgd_step

Signature sgd_step_shape(const ArgMetas& args) {
  args.expect_count(6, 6);
  const TensorMeta w1 = args.tensor(0);
  if (w1.ndim() != 2) args.fail(fmt::format("argument 0 (W1): expected a matrix, found {}", w1.to_string()));
  const std::int64_t in = w1.shape()[0], cols = w1.shape()[1];
  const TensorMeta b2 = args.tensor(3);
  if (b2.ndim() != 1) args.fail(fmt::format("argument 3 (b2): expected a vector, found {}", b2.to_string()));
  const std::int64_t out = b2.shape()[0];
  expect_tensor(args, 1, "b1", {cols});
  expect_tensor(args, 2, "W2", {cols, out});
  expect_tensor(args, 4, "grads", {demo::grad_size(in, cols, out)});
  (void)args.number(5);
  // No outputs: the four parameters are updated in place. Declaring them lets the
  // controller track the update: a later read of W1 depends on this call, and if the
  // step failed on a worker the parameters would be marked as failed, not silently stale.
  return {.outputs = {}, .mutates = {0, 1, 2, 3}};
}

std::vector<Tensor> sgd_step_kernel(CallContext& ctx, Args& args) {
  Tensor &w1 = args.tensor(0), &b1 = args.tensor(1), &w2 = args.tensor(2), &b2 = args.tensor(3);
  host_task(ctx, [w1, b1, w2, b2, grads = args.tensor(4), lr = static_cast<float>(args.number(5))]() mutable {
    demo::sgd_step(w1.shape()[0], w1.shape()[1], b2.shape()[0], lr, grads.data<float>(), w1.data<float>(),
                   b1.data<float>(), w2.data<float>(), b2.data<float>());
  });
  return {};
}

}  // namespace

MESHRT_REGISTER_FUNCTION("demo.init_params", init_params_kernel, init_params_shape);
MESHRT_REGISTER_FUNCTION("demo.make_batch", make_batch_kernel, make_batch_shape);
MESHRT_REGISTER_FUNCTION("demo.forward", forward_kernel, forward_shape);
MESHRT_REGISTER_FUNCTION("demo.loss_grad", loss_grad_kernel, loss_grad_shape);
MESHRT_REGISTER_FUNCTION("demo.backward", backward_kernel, backward_shape);
MESHRT_REGISTER_FUNCTION("demo.sgd_step", sgd_step_kernel, sgd_step_shape);
