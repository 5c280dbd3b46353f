// A device collective whose peer never joins in time (NP 4 as a 2x2 mesh, the emulated
// accelerator, MESHRT_DEVICE_TIMEOUT=2 and MESHRT_GROUP_TIMEOUT=2): rank 3's function stalls for 6 s before a
// reduction over live communicators, so rank 2 waits in its 'gpu' line's collective. After 2 s rank 2's worker
// aborts that communicator and fails the command with a TimeoutError that names the mesh
// dimension, the peers and the seconds; every fetch of the result raises it. The next
// reduction over that line fails at once on rank 2, which does not make a communicator
// alone, and on rank 3 at its own deadline; unrelated work on other communicators computes
// right, and nothing hangs (rank 3 joins late against the aborted member's posted request).
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "meshrt/device.hpp"
#include "runtime_support.hpp"

using namespace meshrt;
using meshrt::test::session;

MESHRT_RUNTIME_TEST_ENVIRONMENT();

namespace {

// test.stall(seconds, rank): that rank's worker sleeps (a function that hangs for a while).
Signature stall_shape(const ArgMetas& args) {
  args.expect_count(2, 2);
  (void)args.number(0);
  (void)args.integer(1);
  return {.outputs = {TensorMeta({}, DType::Float32)}, .mutates = {}};
}
std::vector<Tensor> stall_kernel(CallContext& ctx, Args& args) {
  if (ctx.rank() == args.integer(1)) std::this_thread::sleep_for(std::chrono::duration<double>(args.number(0)));
  return {Tensor::zeros(TensorMeta({}, DType::Float32))};
}

// test.on_device(shape, base): base + rank everywhere, on this rank's emulated device.
Signature on_device_shape(const ArgMetas& args) {
  args.expect_count(2, 2);
  (void)args.number(1);
  return {.outputs = {TensorMeta(args.shape(0), DType::Float32, Device::emulated(0))}, .mutates = {}};
}
std::vector<Tensor> on_device_kernel(CallContext& ctx, Args& args) {
  const Device here = device::rank_device(DeviceKind::Emulated);
  Tensor host = Tensor::zeros(TensorMeta(args.shape(0), DType::Float32));
  for (float& v : host.span<float>()) v = static_cast<float>(args.number(1) + ctx.rank());
  return {device::to_device(host, here, device::stream_for(ctx.stream_id(), here))};
}

MESHRT_REGISTER_FUNCTION("test.stall", stall_kernel, stall_shape);
MESHRT_REGISTER_FUNCTION("test.on_device", on_device_kernel, on_device_shape);

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

TEST(DeviceTimeout, APeerThatNeverJoinsInTimeFailsTheCollectiveWithTheDimensionPeersAndSeconds) {
  session([](Controller& ctl) {
    Mesh mesh = ctl.world_mesh({{"host", 2}, {"gpu", 2}});
    Stream side = ctl.stream("side");
    DTensor x = mesh.call("test.on_device", {4}, 1.0);  // rank r holds 1 + r
    // Both dimensions' communicators exist first (their creation has its own timeout,
    // MESHRT_GROUP_TIMEOUT): what times out below is the collective itself.
    EXPECT_EQ(ctl.fetch_shard(x.reduce("gpu", Reduction::Sum), {{"host", 1}, {"gpu", 0}}).get().span<float>()[0], 7.0f);
    EXPECT_EQ(ctl.fetch_shard(x.reduce("host", Reduction::Sum), {{"host", 0}, {"gpu", 0}}).get().span<float>()[0],
              4.0f);
    (void)mesh.call("test.stall", 6.0, 3);
    DTensor y = x.reduce("gpu", Reduction::Sum);
    for (std::int64_t h = 0; h < 2; ++h) {
      try {
        (void)ctl.fetch_shard(y, {{"host", h}, {"gpu", 0}}).get();
        ADD_FAILURE() << "expected a RemoteError for host " << h;
      } catch (const RemoteError& e) {
        const std::string text = e.what();
        EXPECT_TRUE(contains(text, "failed on rank 2: timed out")) << text;
        EXPECT_EQ(e.ranks(), std::vector<int>{2});
        EXPECT_TRUE(contains(text, "dimension 'gpu'")) << text;
        EXPECT_TRUE(contains(text, "peers world ranks 2,3")) << text;
        EXPECT_TRUE(contains(text, "within 2 s (MESHRT_DEVICE_TIMEOUT)")) << text;
        EXPECT_TRUE(contains(text, "aborted emulated communicator")) << text;
      }
    }
    // That line's communicator is not made again by rank 2 alone (rank 3 still holds its
    // own): rank 2 refuses at once, rank 3 waits in its communicator until its own deadline.
    DTensor again = x.reduce("gpu", Reduction::Sum);
    try {
      (void)ctl.fetch_shard(again, {{"host", 1}, {"gpu", 1}}).get();
      ADD_FAILURE() << "expected a RemoteError";
    } catch (const RemoteError& e) {
      const std::string text = e.what();
      // Both ranks failed it, each for its own reason; the error carries one of them.
      EXPECT_EQ(e.ranks(), (std::vector<int>{2, 3})) << text;
      const bool refused = contains(text,
                                    "device communicator over world ranks 2,3: expected a live one, found the one "
                                    "this rank had failed (timed out after 2 s)");
      const bool timed_out = contains(text, "failed on rank 3: timed out");
      EXPECT_TRUE(refused || timed_out) << text;
    }
    // Unrelated work over the other dimension's communicators computes right.
    DTensor a = mesh.call_on(side, "test.on_device", {{4}, 5.0}).at(0);  // rank r holds 5 + r
    DTensor b = a.reduce("host", Reduction::Sum);
    EXPECT_EQ(ctl.fetch_shard(b, {{"host", 0}, {"gpu", 0}}).get().span<float>()[0], 12.0f);  // ranks 0, 2
    EXPECT_EQ(ctl.fetch_shard(b, {{"host", 1}, {"gpu", 1}}).get().span<float>()[0], 14.0f);  // ranks 1, 3
    try {
      ctl.synchronize();
    } catch (const Error&) {
      // raising is as good as returning: the point is that it comes back
    }
  });
}

// A member late for its line's first use (the creation of the line's communicator, then
// the device's) is named, never waited for without end: rank 3 stalls 4 s before a
// reduction over a fresh mesh's 'gpu' lines, and rank 2, whose line it is, gives up after
// MESHRT_GROUP_TIMEOUT (2 s) naming world rank 3; rank 3, when it comes, finds that rank 2
// gave up when it had not joined. The next reduction, over the other dimension, computes
// right. The creation used to block in MPI_Comm_split for as long as the member was late.
TEST(DeviceTimeout, AMemberLateForALinesCreationIsNamedNotWaitedFor) {
  session([](Controller& ctl) {
    Mesh mesh = ctl.world_mesh({{"host", 2}, {"gpu", 2}});
    DTensor x = mesh.call("test.on_device", {4}, 1.0);  // rank r holds 1 + r
    (void)mesh.call("test.stall", 4.0, 3);
    DTensor y = x.reduce("gpu", Reduction::Sum);
    try {
      (void)ctl.fetch_shard(y, {{"host", 1}, {"gpu", 0}}).get();
      ADD_FAILURE() << "expected a RemoteError";
    } catch (const RemoteError& e) {
      // Rank 2's error or rank 3's: each names world rank 3 as the one that was late.
      const std::string text = e.what();
      EXPECT_TRUE(contains(text, "creating the communicator of dimension 'gpu' of device mesh [host=2, gpu=2]"))
          << text;
      const bool named = contains(text, "world rank 3 did not join it (world ranks 2, 3) within 2 s") ||
                         contains(text, "when world rank 3 had not joined within 2 s");
      EXPECT_TRUE(named) << text;
      EXPECT_TRUE(contains(text, "(MESHRT_GROUP_TIMEOUT)")) << text;
    }
    DTensor z = x.reduce("host", Reduction::Sum);
    EXPECT_EQ(ctl.fetch_shard(z, {{"host", 1}, {"gpu", 1}}).get().span<float>()[0], 6.0f);  // ranks 1, 3
    try {
      ctl.synchronize();
    } catch (const Error&) {
      // the failed reduction may be raised again here
    }
  });
}
