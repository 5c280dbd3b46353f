// CUDA tensors through the runtime: NCCL reductions on a CUDA stream, borrows ordered by
// CUDA events. Skips without a GPU (this is how it runs in CI here).
#include <gtest/gtest.h>

#include "../support/gpu.hpp"
#include "runtime_support.hpp"

using namespace meshrt;
using meshrt::testing::session;

MESHRT_RUNTIME_TEST_ENVIRONMENT();

namespace {

// test.to_cuda(x): x on the rank's GPU.
Signature to_cuda_shape(const ArgMetas& a) {
  return {{a.tensor(0).with_device(Device::cuda(0))}, {}};
}
std::vector<Tensor> to_cuda_kernel(CallContext&, Args& a) {
  return {a.tensor(0).to(Device::cuda(0))};
}

}  // namespace

MESHRT_REGISTER_FUNCTION("test.to_cuda", to_cuda_kernel, to_cuda_shape);

TEST(RuntimeCuda, NcclReductionsAndBorrows) {
  int usable = cuda_available() ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &usable, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!usable) MESHRT_SKIP_WITHOUT_GPU("no CUDA device on every rank");
  session([](Controller& ctl) {
    Mesh mesh = ctl.world_mesh({{"gpu", ctl.world_size()}});
    DTensor x = mesh.call("test.to_cuda", mesh.call("meshrt.full", {4}, DType::Float32, 2.0));
    EXPECT_THROW(x.reduce("gpu", Reduction::Bxor), UsageError);
    DTensor y = x.reduce("gpu", Reduction::Sum);
    EXPECT_EQ(ctl.fetch_shard(y, {{"gpu", 0}}).get().span<float>()[3], 2.0f * ctl.world_size());
    Stream comms = ctl.stream("comms");
    DTensor b = comms.borrow(y, true);
    b.reduce_("gpu", Reduction::Max);
    b.drop();
    EXPECT_EQ(ctl.fetch_shard(y, {{"gpu", 0}}).get().span<float>()[0], 2.0f * ctl.world_size());
  });
}
