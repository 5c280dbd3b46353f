// Overlap (issue 29, item 2): while a collective or send is in flight on one stream, a
// worker runs the later commands on other streams that do not touch its values, and holds
// back those that do. CTest runs it on the CPU (the non-blocking worker: a blocking MPI call
// holds the thread) and on the emulated accelerator (MESHRT_ACCELERATOR=emulated), NP 2.
//
// The proof is an order no timing can fake: rank 1 posts its part of a collective only
// after a signal that rank 0 gives from a kernel it runs after posting its own part. A
// worker that waited for its collective before the next command would never give the
// signal while rank 1 waits for it; rank 1 gives up after kWait and says so in its value.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <thread>

#include "../support/devices.hpp"
#include "meshrt/internal/device.hpp"
#include "runtime_support.hpp"

using namespace meshrt;
using meshrt::test::session;

MESHRT_RUNTIME_TEST_ENVIRONMENT();

namespace {

constexpr auto kWait = std::chrono::seconds(20);

// The job's accelerator kind, or the cpu.
DeviceKind test_kind() {
  return meshrt::test::job_kind(DeviceKind::Cpu);
}

Signature scalar_shape(const ArgMetas& args) {
  args.expect_count(2, 2);
  (void)args.string(0);
  (void)args.integer(1);
  return {.outputs = {TensorMeta({}, DType::Float32)}, .mutates = {}};
}

// test.signal(path, rank): on `rank`, creates the file `path`, in the order of the call's
// stream (a task on it on an accelerator, at once on the cpu). Gives 0.
std::vector<Tensor> signal_kernel(CallContext& ctx, Args& args) {
  if (ctx.rank() == args.integer(1)) {
    device::host_task(ctx.stream_id(), ctx.device(),
                      [path = std::string(args.string(0))] { std::ofstream(path) << "signal\n"; });
  }
  return {Tensor::zeros(TensorMeta({}, DType::Float32))};
}

// test.await_signal(path, rank): on `rank`, waits on the worker's thread for the file
// `path` (kWait at most). Gives 1 where it came (or was not awaited), 0 where it did not.
std::vector<Tensor> await_kernel(CallContext& ctx, Args& args) {
  bool came = true;
  if (ctx.rank() == args.integer(1)) {
    const auto until = std::chrono::steady_clock::now() + kWait;
    while (!(came = std::filesystem::exists(std::string(args.string(0)))) && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return {Tensor::from<float>({}, {came ? 1.0f : 0.0f})};
}

MESHRT_REGISTER_FUNCTION("test.signal", signal_kernel, scalar_shape);
MESHRT_REGISTER_FUNCTION("test.await_signal", await_kernel, scalar_shape);

// On an accelerator, a device per rank (NCCL refuses two ranks of a line on one device):
// every rank skips alike, before the session.
#define SKIP_WITHOUT_A_DEVICE_PER_RANK()                                                                 \
  do {                                                                                                   \
    if (test_kind() != DeviceKind::Cpu) MESHRT_SKIP_UNLESS_DEVICES(device::configured_accelerator(), 2); \
  } while (false)

float first(const Tensor& t) {
  EXPECT_TRUE(t.device().is_cpu());
  return t.span<float>()[0];
}

// A fresh path for this test's signal, the same on every rank (rank 0's pid).
std::string signal_path(const char* name) {
  const auto path = std::filesystem::temp_directory_path() / ("meshrt-overlap-" + std::to_string(getpid()) + name);
  std::filesystem::remove(path);
  return path.string();
}

}  // namespace

// Rank 0 posts an all_reduce on stream "comm" and, while it is in flight, runs a kernel on
// stream "compute" that signals rank 1, which joins the all_reduce only after the signal.
TEST(Overlap, AKernelOnAnotherStreamRunsWhileACollectiveIsInFlight) {
  SKIP_WITHOUT_A_DEVICE_PER_RANK();
  session([](Controller& ctl) {
    const std::string path = signal_path("-reduce");
    Mesh mesh = ctl.world_mesh({{"rank", 2}}, test_kind());
    Stream comm = ctl.stream("comm");
    Stream compute = ctl.stream("compute");
    DTensor x = mesh.call_on(comm, "meshrt.full", {{4}, DType::Float32, 1.0}).at(0);
    // The dimension's communicator first: its creation (MPI_Comm_split, the device's
    // communicator) is a blocking collective of its own.
    EXPECT_EQ(first(ctl.fetch_shard(x.reduce("rank", Reduction::Sum), {{"rank", 0}}).get()), 2.0f);
    DTensor waited = mesh.call_on(comm, "test.await_signal", {path, 1}).at(0);  // rank 1 waits
    DTensor y = x.reduce("rank", Reduction::Sum);                               // on comm
    (void)mesh.call_on(compute, "test.signal", {path, 0});                      // rank 0 signals
    EXPECT_EQ(first(ctl.fetch_shard(waited, {{"rank", 1}}).get()), 1.0f)
        << "rank 1 waited " << kWait.count() << " s for a signal rank 0 gives after posting its all_reduce";
    EXPECT_EQ(first(ctl.fetch_shard(y, {{"rank", 0}}).get()), 2.0f);
    EXPECT_EQ(first(ctl.fetch_shard(y, {{"rank", 1}}).get()), 2.0f);
    std::filesystem::remove(path);
  });
}

// The same inside a replay: the replay runs on past its collective in flight (the kernel on
// the other stream), and ends once the collective completes.
TEST(Overlap, AReplayRunsAKernelOnAnotherStreamWhileItsCollectiveIsInFlight) {
  SKIP_WITHOUT_A_DEVICE_PER_RANK();
  session([](Controller& ctl) {
    const std::string path = signal_path("-replay");
    Mesh mesh = ctl.world_mesh({{"rank", 2}}, test_kind());
    Stream comm = ctl.stream("comm");
    Stream compute = ctl.stream("compute");
    DTensor x = mesh.call_on(comm, "meshrt.full", {{4}, DType::Float32, 1.0}).at(0);
    EXPECT_EQ(first(ctl.fetch_shard(x.reduce("rank", Reduction::Sum), {{"rank", 0}}).get()), 2.0f);
    Recording step = ctl.record({x}, [&](const std::vector<DTensor>& in) {
      DTensor waited = mesh.call_on(comm, "test.await_signal", {path, 1}).at(0);  // rank 1 waits
      DTensor y = in[0].reduce("rank", Reduction::Sum);                           // on comm
      (void)mesh.call_on(compute, "test.signal", {path, 0});                      // rank 0 signals
      return std::vector<DTensor>{waited, y};
    });
    const std::vector<DTensor> out = step({x});
    EXPECT_EQ(first(ctl.fetch_shard(out[0], {{"rank", 1}}).get()), 1.0f)
        << "rank 1 waited " << kWait.count()
        << " s for a signal rank 0 gives in the replay after posting its all_reduce";
    EXPECT_EQ(first(ctl.fetch_shard(out[1], {{"rank", 0}}).get()), 2.0f);
    EXPECT_EQ(first(ctl.fetch_shard(out[1], {{"rank", 1}}).get()), 2.0f);
    std::filesystem::remove(path);
  });
}

// The same with an allocation on the other stream after a block was given up: CTest runs
// the emulated case with MESHRT_DEVICE_POOL_BYTES=0, so the dropped tensor's block is
// freed, not cached. The free is in its stream's order (a task on it, cudaFreeAsync on
// CUDA), so the allocation never waits for the collective's stream, which waits for rank
// 1, which waits for the signal. The free used to wait for every stream first.
TEST(Overlap, AnAllocationAfterAFreeRunsWhileACollectiveIsInFlight) {
  SKIP_WITHOUT_A_DEVICE_PER_RANK();
  session([](Controller& ctl) {
    const std::string path = signal_path("-allocate");
    Mesh mesh = ctl.world_mesh({{"rank", 2}}, test_kind());
    Stream comm = ctl.stream("comm");
    Stream compute = ctl.stream("compute");
    DTensor x = mesh.call_on(comm, "meshrt.full", {{4}, DType::Float32, 1.0}).at(0);
    EXPECT_EQ(first(ctl.fetch_shard(x.reduce("rank", Reduction::Sum), {{"rank", 0}}).get()), 2.0f);
    std::optional<DTensor> dropped = mesh.call_on(compute, "meshrt.full", {{65536}, DType::Float32, 0.0}).at(0);
    DTensor waited = mesh.call_on(comm, "test.await_signal", {path, 1}).at(0);  // rank 1 waits
    DTensor y = x.reduce("rank", Reduction::Sum);                               // in flight on rank 0
    dropped.reset();  // its block is freed (the delete goes ahead of the next command)
    DTensor z = mesh.call_on(compute, "meshrt.full", {{4}, DType::Float32, 3.0}).at(0);  // an allocation
    (void)mesh.call_on(compute, "test.signal", {path, 0});                               // rank 0 signals
    EXPECT_EQ(first(ctl.fetch_shard(waited, {{"rank", 1}}).get()), 1.0f)
        << "rank 1 waited " << kWait.count() << " s for a signal rank 0 gives after an allocation";
    EXPECT_EQ(first(ctl.fetch_shard(y, {{"rank", 0}}).get()), 2.0f);
    EXPECT_EQ(first(ctl.fetch_shard(z, {{"rank", 1}}).get()), 3.0f);
    std::filesystem::remove(path);
  });
}

// The same with a send (to_mesh with a permutation) in flight.
TEST(Overlap, AKernelOnAnotherStreamRunsWhileASendIsInFlight) {
  SKIP_WITHOUT_A_DEVICE_PER_RANK();
  session([](Controller& ctl) {
    const std::string path = signal_path("-send");
    Mesh mesh = ctl.world_mesh({{"rank", 2}}, test_kind());
    Stream comm = ctl.stream("comm");
    Stream compute = ctl.stream("compute");
    DTensor x = mesh.call_on(comm, "meshrt.arange", {3, DType::Int64}).at(0);
    DTensor waited = mesh.call_on(comm, "test.await_signal", {path, 1}).at(0);
    DTensor moved = x.rotate("rank", 1);
    (void)mesh.call_on(compute, "test.signal", {path, 0});
    EXPECT_EQ(first(ctl.fetch_shard(waited, {{"rank", 1}}).get()), 1.0f);
    EXPECT_TRUE(ctl.fetch_shard(moved, {{"rank", 0}}).get().equals(Tensor::from<std::int64_t>({3}, {0, 1, 2})));
    std::filesystem::remove(path);
  });
}

// What depends on the collective waits for it: a borrow of what it writes, the drop of the
// borrow it reduces (on the cpu the origin stream uses the tensor again after it), and
// commands on its stream. Each sees the collective's values, never the values before it.
TEST(Overlap, WhatDependsOnACollectiveWaitsForIt) {
  SKIP_WITHOUT_A_DEVICE_PER_RANK();
  session([](Controller& ctl) {
    Mesh mesh = ctl.world_mesh({{"rank", 2}}, test_kind());
    Stream comm = ctl.stream("comm");
    Stream compute = ctl.stream("compute");
    // A borrow of the tensor an in-place all_reduce writes.
    DTensor x = mesh.call_on(comm, "meshrt.full", {{4}, DType::Float32, 1.0}).at(0);
    x.reduce_("rank", Reduction::Sum);  // x is 2
    DTensor bx = compute.borrow(x);
    DTensor twice = mesh.call_on(compute, "meshrt.add", {bx, bx}).at(0);  // 4
    bx.drop();
    // The drop of a mutable borrow reduced in place on another stream, then the origin.
    DTensor g = mesh.call_on(compute, "meshrt.full", {{4}, DType::Float32, 3.0}).at(0);
    DTensor bg = comm.borrow(g, /*mutable_borrow=*/true);
    bg.reduce_("rank", Reduction::Sum);  // 6
    bg.drop();
    DTensor g2 = mesh.call_on(compute, "meshrt.add", {g, g}).at(0);  // 12
    // The same stream, reading the result.
    DTensor y = x.reduce("rank", Reduction::Sum);                    // 4
    DTensor after = mesh.call_on(comm, "meshrt.add", {y, x}).at(0);  // 4 + 2
    for (std::int64_t r = 0; r < 2; ++r) {
      EXPECT_EQ(first(ctl.fetch_shard(twice, {{"rank", r}}).get()), 4.0f);
      EXPECT_EQ(first(ctl.fetch_shard(g2, {{"rank", r}}).get()), 12.0f);
      EXPECT_EQ(first(ctl.fetch_shard(after, {{"rank", r}}).get()), 6.0f);
    }
  });
}

// A collective with a failed input poisons exactly its dependents while independent work on
// another stream runs.
TEST(Overlap, AFailedCollectiveInFlightPoisonsItsDependentsOnly) {
  SKIP_WITHOUT_A_DEVICE_PER_RANK();
  session([](Controller& ctl) {
    Mesh mesh = ctl.world_mesh({{"rank", 2}}, test_kind());
    Stream comm = ctl.stream("comm");
    Stream compute = ctl.stream("compute");
    DTensor bad = mesh.call_on(comm, "meshrt.fail", {"an input that failed on rank 1", Value::list({Value(1)})}).at(0);
    DTensor x = mesh.call_on(comm, "meshrt.full", {{4}, DType::Float32, 1.0}).at(0);
    DTensor sum = bad.reduce("rank", Reduction::Sum);
    DTensor other = mesh.call_on(compute, "meshrt.full", {{2}, DType::Float32, 7.0}).at(0);
    DTensor dependent = mesh.call_on(comm, "meshrt.add", {sum, sum}).at(0);
    EXPECT_EQ(first(ctl.fetch_shard(other, {{"rank", 0}}).get()), 7.0f);
    EXPECT_THROW((void)ctl.fetch_shard(dependent, {{"rank", 0}}).get(), RemoteError);
    EXPECT_EQ(first(ctl.fetch_shard(x.reduce("rank", Reduction::Sum), {{"rank", 1}}).get()), 2.0f);
    try {
      ctl.synchronize();
    } catch (const RemoteError&) {
      // the failure may be raised again here
    }
  });
}
