// The NCCL data plane for CUDA tensors. The GPU tests skip without a GPU (cuda_available);
// the refusals are checked before anything touches a device, so they run everywhere.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>

#include "meshrt/config.hpp"
#if MESHRT_HAVE_NCCL
#include <cuda_runtime_api.h>
#endif

#include "../support/gpu.hpp"
#include "comm_test_util.hpp"

namespace meshrt::test {
namespace {

using ::testing::HasSubstr;

#if MESHRT_HAVE_NCCL

TEST(CommNccl, BitwiseRefusedBeforeAnyDeviceWork) {
  World world;
  WorkerMesh mesh({"gpu"}, NDSlice::row_major({world_size()}), world.comm());
  const TensorMeta meta({4}, DType::Int32, Device::cuda(0));
  for (Reduction red : {Reduction::Band, Reduction::Bor, Reduction::Bxor}) {
    EXPECT_EQ(usage_error_text(
                  [&] { (void)start_reduce_nccl(mesh, "gpu", red, false, false, DependentOnError{1}, meta, nullptr); }),
              fmt::format("bitwise reduction {} is not supported by NCCL, found a CUDA tensor int32[4] on cuda:0; "
                          "move it to the CPU or use another reduction (dimension 'gpu' of mesh [gpu={}], world "
                          "rank {})",
                          name(red), world_size(), world_rank()));
  }
  EXPECT_THAT(usage_error_text([&] {
                (void)start_reduce_nccl(mesh, "gpu", Reduction::Sum, false, false, DependentOnError{1},
                                        TensorMeta({4}, DType::Int32), nullptr);
              }),
              HasSubstr("sum over NCCL: expected a CUDA tensor, found int32[4] on cpu"));
}

// One GPU per rank when there are enough; otherwise ranks share device 0 (NCCL refuses
// two ranks of one communicator on one device, so those tests skip).
bool one_gpu_per_rank() {
  if (!cuda_available()) return false;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) return false;
  return count >= world_size();
}

Device my_device() {
  return Device::cuda(world_rank());
}

TEST(CommNccl, AllReduceGatherScatterAllToAll) {
  if (!one_gpu_per_rank()) MESHRT_SKIP_WITHOUT_GPU("needs one CUDA device per rank");
  World world;
  cudaSetDevice(world_rank());
  WorkerMesh mesh({"gpu"}, NDSlice::row_major({world_size()}), world.comm());
  const auto n = static_cast<std::int64_t>(world_size());
  const std::vector<int> line = mesh.line_world_ranks(0);
  for (DType dtype : {DType::Float32, DType::Float16, DType::BFloat16, DType::Int64}) {
    for (Reduction red : {Reduction::Sum, Reduction::Avg, Reduction::Max, Reduction::Stack}) {
      for (bool scatter : {false, true}) {
        for (bool inplace : {false, true}) {
          if (inplace && ((red == Reduction::Stack) != scatter)) continue;  // no in-place form
          SCOPED_TRACE(fmt::format("{} {} scatter={} inplace={}", name(red), name(dtype), scatter, inplace));
          const TensorMeta host({n, 3}, dtype);
          const Tensor input = make_input(host, red, world_rank()).to(my_device());
          auto p = start_reduce_nccl(mesh, "gpu", red, scatter, inplace, input, host.with_device(my_device()), nullptr);
          const Outcome out = wait(*p);
          const Tensor got = out.tensor.to(Device::cpu());
          // Same reference as the MPI tests, computed on the host.
          std::vector<std::int64_t> shape = host.shape();
          if (red == Reduction::Stack && !scatter) shape.insert(shape.begin(), n);
          if (red != Reduction::Stack && scatter) shape.erase(shape.begin());
          Tensor expected = host.with_shape(shape).empty();
          dispatch_dtype(dtype, [&](auto tag) {
            using T = decltype(tag);
            T* e = static_cast<T*>(expected.raw_data());
            const std::int64_t numel = host.numel();
            const std::int64_t me = world_rank();
            if (red == Reduction::Stack && !scatter) {
              for (std::int64_t k = 0; k < n; ++k)
                for (std::int64_t i = 0; i < numel; ++i)
                  e[k * numel + i] = from_double<T>(fill_value(red, dtype, line[static_cast<std::size_t>(k)], i));
            } else if (red == Reduction::Stack) {
              for (std::int64_t k = 0; k < n; ++k)
                for (std::int64_t j = 0; j < 3; ++j)
                  e[k * 3 + j] = from_double<T>(fill_value(red, dtype, line[static_cast<std::size_t>(k)], me * 3 + j));
            } else {
              const std::int64_t count = scatter ? 3 : numel;
              const std::int64_t base = scatter ? me * 3 : 0;
              for (std::int64_t j = 0; j < count; ++j) {
                std::vector<double> v;
                for (int r : line) v.push_back(fill_value(red, dtype, r, base + j));
                e[j] = reduce_values<T>(red, v);
              }
            }
          });
          EXPECT_EQ(compare(got, expected), "");
        }
      }
    }
  }
}

TEST(CommNccl, SendChainAndSelfPair) {
  if (!one_gpu_per_rank()) MESHRT_SKIP_WITHOUT_GPU("needs one CUDA device per rank");
  World world;
  cudaSetDevice(world_rank());
  const int n = world_size();
  WorkerMesh mesh({"gpu"}, NDSlice::row_major({n}), world.comm());
  (void)mesh.nccl_mesh_comm();  // collective over every member: made before a partial send
  const TensorMeta meta({1024}, DType::Float32, my_device());
  for (const auto& [from, to] : {std::pair{NDSlice(0, {n - 1}, {1}), NDSlice(1, {n - 1}, {1})},
                                 std::pair{NDSlice::row_major({n}), NDSlice::row_major({n})}}) {
    const Tensor input = make_input(meta.with_device(Device::cpu()), Reduction::Sum, world_rank()).to(my_device());
    const Outcome out = wait(*start_send_tensor_nccl(mesh, from, to, input, meta, nullptr));
    int src = -1;
    for (std::int64_t i = 0; i < from.len(); ++i)
      if (to[i] == world_rank()) src = static_cast<int>(from[i]);
    if (src < 0) {
      EXPECT_FALSE(out.tensor.defined());
    } else {
      EXPECT_EQ(compare(out.tensor.to(Device::cpu()), make_input(meta.with_device(Device::cpu()), Reduction::Sum, src)),
                "");
      EXPECT_FALSE(out.tensor.same_storage(input));
    }
  }
}

// Which way of making per-dimension NCCL communicators is faster: each rank's line by
// ncclCommInitRank (unique id broadcast over the MPI split) or ncclCommSplit of one
// per-mesh communicator. Prints both; it measures, it does not judge.
TEST(CommNccl, CreationTimeInitRankAgainstSplit) {
  if (!one_gpu_per_rank()) MESHRT_SKIP_WITHOUT_GPU("needs one CUDA device per rank");
  if (world_size() % 2 != 0) GTEST_SKIP() << "needs an even world";
  World world;
  cudaSetDevice(world_rank());
  double seconds[2] = {0, 0};
  for (NcclCreation how : {NcclCreation::InitRank, NcclCreation::Split}) {
    WorkerMesh mesh({"host", "gpu"}, NDSlice::row_major({2, world_size() / 2}), world.comm());
    mesh.set_nccl_creation(how);
    if (how == NcclCreation::Split) (void)mesh.nccl_mesh_comm();  // the parent exists in a running worker
    MPI_Barrier(world.comm());
    const auto t0 = std::chrono::steady_clock::now();
    (void)mesh.nccl_comm(0);
    (void)mesh.nccl_comm(1);
    MPI_Barrier(world.comm());
    seconds[how == NcclCreation::Split ? 1 : 0] =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  if (world_rank() == 0) {
    std::printf("NCCL communicator creation, 2 dimensions of [host=2, gpu=%d]: InitRank %.1f ms, Split %.1f ms\n",
                world_size() / 2, seconds[0] * 1e3, seconds[1] * 1e3);
  }
  EXPECT_GT(seconds[0], 0);
  EXPECT_GT(seconds[1], 0);
}

#else
TEST(CommNccl, BuiltWithoutNccl) {
  MESHRT_SKIP_WITHOUT_GPU("meshrt was built without NCCL");
}
#endif

}  // namespace
}  // namespace meshrt::test
