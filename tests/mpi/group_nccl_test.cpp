// The NCCL bootstrap over a StatelessGroup. Skips (on every rank alike) without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <mpi.h>
#include <nccl.h>

#include <chrono>

#include "../support/gpu.hpp"
#include "meshrt/group.hpp"

TEST(GroupNccl, CommunicatorFromGroupAllReduces) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) MESHRT_SKIP_WITHOUT_GPU("no CUDA device");
  // One GPU per rank of a node: NCCL refuses two ranks of a communicator on one device.
  MPI_Comm node = MPI_COMM_NULL;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
  int local_rank = 0, local_size = 1;
  MPI_Comm_rank(node, &local_rank);
  MPI_Comm_size(node, &local_size);
  MPI_Comm_free(&node);
  if (devices < local_size)
    MESHRT_SKIP_WITHOUT_GPU(local_size << " ranks on this node but only " << devices << " GPUs");
  auto g = meshrt::StatelessGroup::from_comm(MPI_COMM_WORLD);
  const int device = local_rank;
  ncclComm_t comm = meshrt::make_nccl_comm(g, device, std::chrono::seconds(30));
  ASSERT_NE(comm, nullptr);
  int nranks = 0, rank = -1;
  EXPECT_EQ(ncclCommCount(comm, &nranks), ncclSuccess);
  EXPECT_EQ(ncclCommUserRank(comm, &rank), ncclSuccess);
  EXPECT_EQ(nranks, g.world_size());
  EXPECT_EQ(rank, g.rank());
  float* buf = nullptr;
  ASSERT_EQ(cudaMalloc(&buf, sizeof(float)), cudaSuccess);
  const float mine = static_cast<float>(g.rank() + 1);
  cudaMemcpy(buf, &mine, sizeof mine, cudaMemcpyHostToDevice);
  EXPECT_EQ(ncclAllReduce(buf, buf, 1, ncclFloat, ncclSum, comm, nullptr), ncclSuccess);
  float sum = 0;
  cudaMemcpy(&sum, buf, sizeof sum, cudaMemcpyDeviceToHost);
  const int n = g.world_size();
  EXPECT_EQ(sum, static_cast<float>(n * (n + 1) / 2));
  cudaFree(buf);
  ncclCommDestroy(comm);
}
