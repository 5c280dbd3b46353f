// StatelessGroups made on rank 0's controller thread inside a meshrt::run session, while
// rank 0's worker thread creates meshes' communicators (issue 24 item 14). Both threads
// used to meet inside Open MPI's communicator-id agreement and hang the whole job; now a
// rank makes one communicator at a time (src/common/comm_creation.hpp). The harness's
// watchdog ends the job (and fails the test) if it hangs.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>
#include <vector>

#include "meshrt/functions.hpp"
#include "meshrt/group.hpp"
#include "runtime_support.hpp"

using namespace meshrt;
using meshrt::test::session;
using namespace std::chrono_literals;

MESHRT_RUNTIME_TEST_ENVIRONMENT();

namespace {

constexpr int kPairTag = 0x6d40;

// test.pair_with_controller(): on its one rank r, creates the group {0, r} with rank 0's
// controller thread and returns the sum of the group's ranks' world ranks (r).
Signature pair_shape(const ArgMetas& args) {
  args.expect_count(0, 0);
  return {{TensorMeta({}, DType::Float32, args.device())}, {}};
}
std::vector<Tensor> pair_kernel(CallContext& ctx, Args&) {
  GroupOptions opt;
  opt.timeout = 60s;
  opt.create_tag = kPairTag;
  auto g = StatelessGroup::create({0, ctx.rank()}, MPI_COMM_WORLD, opt);
  const auto ranks = g.all_gather_obj(ctx.rank());
  Tensor t = Tensor::empty(TensorMeta({}, DType::Float32));
  t.data<float>()[0] = static_cast<float>(ranks[0] + ranks[1]);
  return {t};
}
MESHRT_REGISTER_FUNCTION("test.pair_with_controller", pair_kernel, pair_shape);

// test.nap_on_rank0(seconds): sleeps on world rank 0 only; returns a float32 scalar.
Signature nap_shape(const ArgMetas& args) {
  args.expect_count(1, 1);
  return {{TensorMeta({}, DType::Float32, args.device())}, {}};
}
std::vector<Tensor> nap_kernel(CallContext& ctx, Args& args) {
  if (ctx.rank() == 0) std::this_thread::sleep_for(std::chrono::duration<double>(args.number(0)));
  return {Tensor::zeros(TensorMeta({}, DType::Float32))};
}
MESHRT_REGISTER_FUNCTION("test.nap_on_rank0", nap_kernel, nap_shape);

}  // namespace

TEST(GroupInSession, ControllerMakesGroupsWhileWorkersMakeMeshes) {
  session([](Controller& ctl) {
    const std::int64_t n = ctl.world_size();
    GroupOptions opt;
    opt.timeout = 60s;  // a hang becomes a TimeoutError naming the call, not a stuck job
    for (int round = 0; round < 40; ++round) {
      // A fresh mesh each round: its workers create its communicator on first use, and
      // the reduction the communicator of its "gpu" dimension.
      Mesh mesh = ctl.world_mesh({{"host", 1}, {"gpu", n}});
      DTensor x = mesh.call("meshrt.full", {8}, DType::Float32, 1.0);
      DTensor y = x.reduce("gpu", Reduction::Sum);
      // Meanwhile this thread makes groups of its own on rank 0 until the result is there:
      // from MPI_COMM_WORLD (the lowest communicator id, ahead of the workers' in Open
      // MPI's agreement), from MPI_COMM_SELF, and a duplicate of MPI_COMM_SELF.
      auto fut = ctl.fetch_shard(y, {{"host", 0}, {"gpu", 0}});
      int made = 0;
      do {
        auto g = StatelessGroup::create({0}, MPI_COMM_WORLD, opt);
        EXPECT_EQ(g.all_gather_obj(round), std::vector<int>{round});
        auto s = StatelessGroup::create({0}, MPI_COMM_SELF, opt);
        auto d = StatelessGroup::from_comm(MPI_COMM_SELF, opt);
        EXPECT_EQ(s.world_size() + d.world_size(), 2);
        ++made;
      } while (!fut.done() || made < 2);
      const Tensor got = fut.get(60s);
      for (float v : got.span<float>()) ASSERT_EQ(v, static_cast<float>(n)) << "round " << round;
    }
  });
}

TEST(GroupInSession, ControllerAndAWorkerKernelMakeAGroupWhileMeshesAreMade) {
  // Rank 0's controller creates the group {0, 1} from MPI_COMM_WORLD right after sending
  // the commands that make rank 0's worker create a new mesh, which rank 1 must create
  // before it runs the kernel that joins the group. Open MPI serves the creation with the
  // lowest parent id first, so without the per-rank ordering rank 0's worker waited for
  // the controller's group, the group for rank 1, and rank 1 for rank 0's worker.
  session([](Controller& ctl) {
    const std::int64_t n = ctl.world_size();
    GroupOptions opt;
    opt.timeout = 60s;
    opt.create_tag = kPairTag;
    Mesh base = ctl.world_mesh({{"gpu", n}});
    for (int round = 0; round < 10; ++round) {
      // Rank 0's worker naps first, so the controller is inside its creation before that
      // worker starts the new mesh's (the order that hung).
      DTensor nap = base.call("test.nap_on_rank0", round % 2 == 0 ? 0.2 : 0.0);
      Mesh mesh = ctl.world_mesh({{"gpu", n}});
      Mesh one = mesh.slice("gpu", 1, 2);
      DTensor r = one.call("test.pair_with_controller");
      auto g = StatelessGroup::create({0, 1}, MPI_COMM_WORLD, opt);
      EXPECT_EQ(g.all_gather_obj(0), (std::vector<int>{0, 1})) << "round " << round;
      const Tensor got = ctl.fetch_shard(r, {{"gpu", 0}}).get(60s);
      ASSERT_EQ(got.data<float>()[0], 1.0f) << "round " << round;
    }
  });
}
