// Remote functions for the Python controller tests (test_controller.py), built into a
// library the tests load before meshrt starts (MESHRT_PYTHON_TEST_FUNCTIONS names it).
//
// test.block(path, ranks) -> float32 0-d 1: on the listed ranks, waits until `path`
// exists. A kernel that ends exactly when the controller says, so that a timeout or a
// Ctrl-C during a wait is certain to find it still running, with no timing in the test.
//
// test.sigint(ranks) -> float32 0-d 1: raises SIGINT on the listed ranks, as a Ctrl-C
// delivered while the session runs (Python's handler turns it into KeyboardInterrupt on
// the main thread).
#include <chrono>
#include <csignal>
#include <filesystem>
#include <thread>
#include <vector>

#include "meshrt/functions.hpp"

namespace {

using namespace meshrt;

Signature block_shape(const ArgMetas& args) {
  args.expect_count(2, 2);
  (void)args.string(0);
  return {.outputs = {TensorMeta({}, DType::Float32, args.device())}, .mutates = {}};
}

Tensor one(const CallContext& ctx) {
  Tensor t = Tensor::from<float>({}, {1.0f});
  return ctx.device().is_cpu() ? t : t.to(ctx.device());
}

std::vector<Tensor> block_kernel(CallContext& ctx, Args& args) {
  for (const Value& r : args.value(1).as_list()) {
    if (r.as_int() != ctx.rank()) continue;
    while (!std::filesystem::exists(args.string(0))) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return {one(ctx)};
}

Signature sigint_shape(const ArgMetas& args) {
  args.expect_count(1, 1);
  return {.outputs = {TensorMeta({}, DType::Float32, args.device())}, .mutates = {}};
}

std::vector<Tensor> sigint_kernel(CallContext& ctx, Args& args) {
  for (const Value& r : args.value(0).as_list()) {
    if (r.as_int() == ctx.rank()) std::raise(SIGINT);
  }
  return {one(ctx)};
}

}  // namespace

MESHRT_REGISTER_FUNCTION("test.block", block_kernel, block_shape);
MESHRT_REGISTER_FUNCTION("test.sigint", sigint_kernel, sigint_shape);
