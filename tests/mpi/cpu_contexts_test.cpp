// A CPU-only program creates no accelerator context (docs/ARCHITECTURE.md section 7): run
// under MESHRT_ACCELERATOR=emulated (NP 2), streams, borrows, reductions, a send and
// fetches on CPU meshes leave every rank's emulated backend with no device context; the
// first tensor of a mesh placed on the accelerator then creates exactly one per rank (its
// own device), so the count is a real one.
#include <gtest/gtest.h>

#include "meshrt/internal/device.hpp"
#include "runtime_support.hpp"

using namespace meshrt;
using meshrt::test::session;

MESHRT_RUNTIME_TEST_ENVIRONMENT();

namespace {

// test.contexts(): this rank's emulated device contexts, counted on its worker thread.
Signature contexts_shape(const ArgMetas& args) {
  args.expect_count(0, 0);
  return {.outputs = {TensorMeta({}, DType::Int64)}, .mutates = {}};
}
std::vector<Tensor> contexts_kernel(CallContext&, Args&) {
  const auto n = static_cast<std::int64_t>(device::backend(device::Accelerator::Emulated).contexts());
  return {Tensor::from<std::int64_t>({}, {n})};
}
MESHRT_REGISTER_FUNCTION("test.contexts", contexts_kernel, contexts_shape);

std::int64_t contexts_on(Controller& ctl, const Mesh& mesh, std::int64_t rank) {
  DTensor n = mesh.call("test.contexts");
  return ctl.fetch_shard(n, {{"r", rank}}).get().span<std::int64_t>()[0];
}

}  // namespace

TEST(CpuContexts, ACpuProgramCreatesNoDeviceContext) {
  session([](Controller& ctl) {
    ASSERT_EQ(ctl.accelerator(), DeviceKind::Emulated) << "run with MESHRT_ACCELERATOR=emulated";
    Mesh mesh = ctl.world_mesh({{"r", 2}});
    Stream side = ctl.stream("side");
    DTensor x = mesh.call("meshrt.full", {4}, DType::Float32, 2.0);
    DTensor b = side.borrow(x);
    DTensor y = mesh.call_on(side, "meshrt.scale", {b, 3.0}).at(0);
    b.drop();
    DTensor s = x.reduce("r", Reduction::Sum);
    Mesh grid = ctl.world_mesh({{"h", 2}, {"g", 1}});
    DTensor z = grid.slice("h", 0).call("meshrt.full", {4}, DType::Float32, 6.0);
    DTensor moved = z.to_mesh(grid.slice("h", 1));
    EXPECT_EQ(ctl.fetch_shard(s, {{"r", 0}}).get().span<float>()[0], 4.0f);
    EXPECT_EQ(ctl.fetch_shard(y, {{"r", 1}}).get().span<float>()[0], 6.0f);
    EXPECT_EQ(ctl.fetch_shard(moved, {{"g", 0}}).get().span<float>()[0], 6.0f);
    for (std::int64_t r = 0; r < 2; ++r) EXPECT_EQ(contexts_on(ctl, mesh, r), 0) << "rank " << r;

    // The first device tensor makes this rank's device current: one context per rank.
    Mesh on_device = ctl.world_mesh({{"r", 2}}, DeviceKind::Emulated);
    DTensor d = on_device.call("meshrt.full", {4}, DType::Float32, 1.0);
    EXPECT_EQ(ctl.fetch_shard(d, {{"r", 1}}).get().span<float>()[0], 1.0f);
    for (std::int64_t r = 0; r < 2; ++r) EXPECT_EQ(contexts_on(ctl, mesh, r), 1) << "rank " << r;
  });
}
