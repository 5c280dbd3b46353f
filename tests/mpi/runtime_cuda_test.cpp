// CUDA tensors through the runtime: a mesh placed on DeviceKind::Cuda, its built-ins on
// each rank's GPU, NCCL reductions on a CUDA stream, borrows ordered by CUDA events.
// NCCL refuses two ranks of one communicator on one device, so the "gpu" dimension (the
// one reduced over) has at most as many ranks as the node has GPUs: with one GPU its
// lines have one rank. Skips without a GPU (as in CI here), fails instead under
// MESHRT_REQUIRE_GPU=1.
#include <gtest/gtest.h>

#include "../support/gpu.hpp"
#include "runtime_support.hpp"

using namespace meshrt;
using meshrt::test::session;

MESHRT_RUNTIME_TEST_ENVIRONMENT();

namespace {

// MESHRT_ACCELERATOR=emulated runs the same test on the emulated accelerator (with
// MESHRT_EMULATED_DEVICES=1, the one-GPU case), so its logic is checked without a GPU.
bool on_emulated() {
  return settings::kAccelerator.get() == "emulated";
}

// The fewest devices any rank sees, and the most ranks any node runs.
std::pair<int, int> gpus_and_ranks_per_node() {
  int gpus = 0;
  if (on_emulated()) {
    gpus = static_cast<int>(settings::kEmulatedDevices.get());
  } else if (cuda_available()) {
    gpus = build_info().cuda_devices;
  }
  MPI_Allreduce(MPI_IN_PLACE, &gpus, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  MPI_Comm node = MPI_COMM_NULL;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
  int local = 1;
  MPI_Comm_size(node, &local);
  MPI_Comm_free(&node);
  MPI_Allreduce(MPI_IN_PLACE, &local, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  return {gpus, local};
}

// The size of the "gpu" dimension: the whole world when every rank of a node has its own
// GPU; otherwise the largest divisor of the world that is at most the GPU count, so that
// (ranks taking devices local rank modulo the count, row-major) no line has two ranks on
// one device.
std::int64_t gpu_line(int world, int gpus, int ranks_per_node) {
  if (gpus >= ranks_per_node) return world;
  if (world != ranks_per_node) return 1;  // several nodes short of GPUs: one rank per line
  for (int g = gpus; g > 1; --g) {
    if (world % g == 0) return g;
  }
  return 1;
}

}  // namespace

TEST(RuntimeCuda, NcclReductionsAndBorrows) {
  const auto [gpus, ranks_per_node] = gpus_and_ranks_per_node();
  if (gpus == 0) MESHRT_SKIP_WITHOUT_GPU("no CUDA device on every rank");
  session([gpus = gpus, ranks_per_node = ranks_per_node](Controller& ctl) {
    const std::int64_t g = gpu_line(ctl.world_size(), gpus, ranks_per_node);
    const DeviceKind kind = on_emulated() ? DeviceKind::Emulated : DeviceKind::Cuda;
    Mesh mesh = ctl.world_mesh({{"rest", ctl.world_size() / g}, {"gpu", g}}, kind);
    DTensor x = mesh.call("meshrt.full", {4}, DType::Float32, 2.0);
    EXPECT_EQ(x.meta().device(), Device::of(kind, 0));  // the shape function saw the kind
    EXPECT_THROW(x.reduce("gpu", Reduction::Bxor), UsageError);
    DTensor y = x.reduce("gpu", Reduction::Sum);
    const auto expected = 2.0f * static_cast<float>(g);
    EXPECT_EQ(ctl.fetch_shard(y, {{"rest", 0}, {"gpu", 0}}).get().span<float>()[3], expected);
    Stream comms = ctl.stream("comms");
    DTensor b = comms.borrow(y, true);
    b.reduce_("gpu", Reduction::Max);
    b.drop();
    EXPECT_EQ(ctl.fetch_shard(y, {{"rest", 0}, {"gpu", g - 1}}).get().span<float>()[0], expected);
    // Avg is sum-then-divide on every backend.
    DTensor a = mesh.call("meshrt.full", {3}, DType::Float32, 3.0).reduce("gpu", Reduction::Avg);
    EXPECT_EQ(ctl.fetch_shard(a, {{"rest", 0}, {"gpu", 0}}).get().span<float>()[0], 3.0f);
  });
}
