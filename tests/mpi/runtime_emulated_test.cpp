// The runtime on the emulated accelerator (MESHRT_ACCELERATOR=emulated, a delay on every
// stream operation; NP 4, a 2x2 mesh): device tensors made by a kernel on the call's
// device stream, reduced and sent over device communicators, computed on by the
// built-ins, and fetched in stream order from every rank. With the fetch's ordering
// removed (the test-only switch) the same program reads a wrong value.
//
// The accelerator is the job's (MESHRT_ACCELERATOR; CTest sets emulated), so the same
// tests run on cuda on a node with 4 GPUs (scripts/gpu-check.sh): the kernel below makes
// its device tensor from the host through pinned staging, which both backends do. The
// missing-ordering test is the emulator's own and runs on it only.
#include <gtest/gtest.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>

#include "../support/devices.hpp"
#include "meshrt/internal/device.hpp"
#include "runtime_support.hpp"

using namespace meshrt;
using meshrt::test::session;

MESHRT_RUNTIME_TEST_ENVIRONMENT();

namespace {

// The job's accelerator kind; emulated when the job has none.
DeviceKind test_kind() {
  return meshrt::test::job_kind(DeviceKind::Emulated);
}

// test.on_emulated(shape, base): base + rank everywhere, on this rank's device of the
// job's accelerator, copied from the host on the call's stream.
Signature on_emulated_shape(const ArgMetas& args) {
  args.expect_count(2, 2);
  (void)args.number(1);
  return {.outputs = {TensorMeta(args.shape(0), DType::Float32, Device::of(test_kind(), 0))}, .mutates = {}};
}
std::vector<Tensor> on_emulated_kernel(CallContext& ctx, Args& args) {
  const Device here = device::rank_device(test_kind());
  const device::Stream s = device::stream_for(ctx.stream_id(), here);
  Tensor host = Tensor::zeros(TensorMeta(args.shape(0), DType::Float32));
  const auto value = static_cast<float>(args.number(1) + ctx.rank());
  for (float& v : host.span<float>()) v = value;
  return {device::to_device(host, here, s)};
}

// test.unordered_fetch(on): flips the test-only switch on every rank, in command order.
Signature switch_shape(const ArgMetas& args) {
  args.expect_count(1, 1);
  (void)args.boolean(0);
  return {.outputs = {TensorMeta({}, DType::Float32)}, .mutates = {}};
}
std::vector<Tensor> switch_kernel(CallContext&, Args& args) {
  device::set_unordered_fetch_for_testing(args.boolean(0));
  return {Tensor::zeros(TensorMeta({}, DType::Float32))};
}

// test.task_fails(shape, base, rank): test.on_emulated, then on `rank` a host task on the
// call's stream throws (after the call returned): the call's own failure, found when the
// stream runs the task; rank -1: on every rank.
Signature task_fails_shape(const ArgMetas& args) {
  args.expect_count(3, 3);
  (void)args.number(1);
  (void)args.integer(2);
  return {.outputs = {TensorMeta(args.shape(0), DType::Float32, Device::of(test_kind(), 0))}, .mutates = {}};
}
std::vector<Tensor> task_fails_kernel(CallContext& ctx, Args& args) {
  std::vector<Tensor> out = on_emulated_kernel(ctx, args);
  if (args.integer(2) < 0 || ctx.rank() == args.integer(2)) {
    device::host_task(ctx.stream_id(), ctx.device(), [rank = ctx.rank()] {
      throw std::runtime_error("a host task failed on rank " + std::to_string(rank));
    });
  }
  return out;
}

// test.task_fails_quietly(): no outputs, a host task that throws on every rank.
Signature quiet_shape(const ArgMetas& args) {
  args.expect_count(0, 0);
  return {.outputs = {}, .mutates = {}};
}
std::vector<Tensor> quiet_kernel(CallContext& ctx, Args&) {
  device::host_task(ctx.stream_id(), ctx.device(), [] { throw std::runtime_error("a task with no outputs failed"); });
  return {};
}

// test.plus_one(x): x + 1 in a host task (x read there, where device memory is readable).
Signature plus_one_shape(const ArgMetas& args) {
  args.expect_count(1, 1);
  return {.outputs = {args.tensor(0)}, .mutates = {}};
}
std::vector<Tensor> plus_one_kernel(CallContext& ctx, Args& args) {
  const Tensor x = args.tensor(0);
  Tensor y = device::empty_on(ctx.stream_id(), x.meta());
  device::host_task(ctx.stream_id(), ctx.device(), [x, y]() mutable {
    for (std::int64_t i = 0; i < x.numel(); ++i) y.data<float>()[i] = x.data<float>()[i] + 1.0f;
  });
  return {y};
}

// test.task_sleeps(ms): a host task of `ms` milliseconds on every rank.
Signature sleeps_shape(const ArgMetas& args) {
  args.expect_count(1, 1);
  (void)args.integer(0);
  return {.outputs = {}, .mutates = {}};
}
std::vector<Tensor> sleeps_kernel(CallContext& ctx, Args& args) {
  device::host_task(ctx.stream_id(), ctx.device(),
                    [ms = args.integer(0)] { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); });
  return {};
}

// test.busy(tasks): `tasks` host tasks of 1 ms each on the call's device stream (on top of
// the emulator's delay), so that what follows on that stream waits behind them.
Signature busy_shape(const ArgMetas& args) {
  args.expect_count(1, 1);
  (void)args.integer(0);
  return {.outputs = {TensorMeta({}, DType::Float32)}, .mutates = {}};
}
std::vector<Tensor> busy_kernel(CallContext& ctx, Args& args) {
  const device::Stream s = device::stream_for(ctx.stream_id(), device::rank_device(test_kind()));
  for (std::int64_t i = 0; i < args.integer(0); ++i) {
    s.enqueue([] { std::this_thread::sleep_for(std::chrono::milliseconds(1)); });
  }
  return {Tensor::zeros(TensorMeta({}, DType::Float32))};
}

// test.stream_idle(): 1 when the call's device stream has run everything enqueued on it,
// else 0. A CPU kernel: it runs on the worker thread when the worker reaches it.
Signature idle_shape(const ArgMetas& args) {
  args.expect_count(0, 0);
  return {.outputs = {TensorMeta({}, DType::Float32)}, .mutates = {}};
}
std::vector<Tensor> idle_kernel(CallContext& ctx, Args&) {
  const device::Stream s = device::stream_for(ctx.stream_id(), device::rank_device(test_kind()));
  return {Tensor::from<float>({}, {s.query() ? 1.0f : 0.0f})};
}

// test.where_it_runs(x): a fetch's preprocess that fails unless its context is on x's
// device, with that device's stream of the fetch's meshrt stream (and, on cuda, its CUDA
// stream as the native one); gives x back.
Signature where_shape(const ArgMetas& args) {
  args.expect_count(1, 1);
  return {.outputs = {args.tensor(0)}, .mutates = {}};
}
std::vector<Tensor> where_kernel(CallContext& ctx, Args& args) {
  const Tensor& x = args.tensor(0);
  if (ctx.device() != x.device()) {
    throw std::runtime_error("the preprocess ran on " + ctx.device().to_string() + ", its value is on " +
                             x.device().to_string());
  }
  const device::Stream s = device::stream_for(ctx.stream_id(), x.device());
  if (ctx.native_stream() != s.native()) throw std::runtime_error("the preprocess was given another native stream");
  return {x};
}

// test.stamp(ms, rank) -> int64 0-d on the host: sleeps `ms` milliseconds on world rank
// `rank` only (in the kernel, not on a stream), then gives this rank's steady clock in ns.
Signature stamp_shape(const ArgMetas& args) {
  args.expect_count(2, 2);
  (void)args.integer(0);
  (void)args.integer(1);
  return {.outputs = {TensorMeta({}, DType::Int64)}, .mutates = {}};
}
std::vector<Tensor> stamp_kernel(CallContext& ctx, Args& args) {
  if (ctx.rank() == args.integer(1)) std::this_thread::sleep_for(std::chrono::milliseconds(args.integer(0)));
  const std::int64_t now = std::chrono::steady_clock::now().time_since_epoch().count();
  return {Tensor::from<std::int64_t>({}, {now})};
}

MESHRT_REGISTER_FUNCTION("test.stamp", stamp_kernel, stamp_shape);
MESHRT_REGISTER_FUNCTION("test.busy", busy_kernel, busy_shape);
MESHRT_REGISTER_FUNCTION("test.where_it_runs", where_kernel, where_shape);
MESHRT_REGISTER_FUNCTION("test.stream_idle", idle_kernel, idle_shape);
MESHRT_REGISTER_FUNCTION("test.on_emulated", on_emulated_kernel, on_emulated_shape);
MESHRT_REGISTER_FUNCTION("test.task_fails", task_fails_kernel, task_fails_shape);
MESHRT_REGISTER_FUNCTION("test.task_fails_quietly", quiet_kernel, quiet_shape);
MESHRT_REGISTER_FUNCTION("test.plus_one", plus_one_kernel, plus_one_shape);
MESHRT_REGISTER_FUNCTION("test.task_sleeps", sleeps_kernel, sleeps_shape);
MESHRT_REGISTER_FUNCTION("test.unordered_fetch", switch_kernel, switch_shape);

float first(const Tensor& t) {
  EXPECT_TRUE(t.device().is_cpu());
  return t.span<float>()[0];
}

}  // namespace

TEST(RuntimeEmulated, ReduceAndFetchFromEveryRank) {
  session([](Controller& ctl) {
    Mesh mesh = ctl.world_mesh({{"host", 2}, {"gpu", 2}});
    DTensor x = mesh.call("test.on_emulated", {3, 4}, 1.0);  // rank r holds r + 1
    DTensor y = x.reduce("gpu", Reduction::Sum);
    DTensor z = y.reduce("host", Reduction::Avg);
    for (std::int64_t h = 0; h < 2; ++h) {
      for (std::int64_t g = 0; g < 2; ++g) {
        // Ranks h*2 + g: the "gpu" line of host h sums (2h+1) + (2h+2).
        EXPECT_EQ(first(ctl.fetch_shard(y, {{"host", h}, {"gpu", g}}).get()), static_cast<float>(4 * h + 3));
        EXPECT_EQ(first(ctl.fetch_shard(z, {{"host", h}, {"gpu", g}}).get()), 5.0f);  // (3 + 7) / 2
      }
    }
    // The built-ins compute on device tensors through tasks on the stream.
    DTensor w = mesh.call("meshrt.add", x, x);
    EXPECT_EQ(first(ctl.fetch_shard(w, {{"host", 1}, {"gpu", 1}}).get()), 8.0f);
  });
}

// Rooted collectives and a reduction over several dimensions on device tensors (the
// emulator's reduce and broadcast, a gather and scatter as grouped sends).
// A barrier on a mesh placed on the accelerator runs over MPI like a CPU mesh's: the stamps
// after it on host 1 are later than world rank 3's before it, which slept.
TEST(RuntimeEmulated, ABarrierWaitsForTheRanksOfItsLine) {
  session([](Controller& ctl) {
    Mesh mesh = ctl.world_mesh({{"host", 2}, {"gpu", 2}}, test_kind());
    DTensor x = mesh.call("test.on_emulated", {2}, 1.0);
    mesh.barrier("gpu").get();  // makes the line's communicator, whose making waits for the line too
    DTensor before = mesh.call("test.stamp", 200, 3);
    Future<void> f = mesh.barrier({"gpu"});
    DTensor after = mesh.call("test.stamp", 0, -1);
    DTensor sum = x.reduce("gpu", Reduction::Sum);  // device work goes on after it
    f.get(std::chrono::seconds(60));
    const auto at = [&](const DTensor& t, std::int64_t g) {
      return ctl.fetch_shard(t, {{"host", 1}, {"gpu", g}}).get().span<std::int64_t>()[0];
    };
    const std::int64_t slept = at(before, 1);
    for (std::int64_t g = 0; g < 2; ++g) EXPECT_GE(at(after, g), slept) << g;
    EXPECT_FLOAT_EQ(first(ctl.fetch_shard(sum, {{"host", 1}, {"gpu", 0}}).get()), 7.0f);  // ranks 2, 3 hold 3, 4
    mesh.barrier().get(std::chrono::seconds(60));
    ctl.synchronize();
  });
}

TEST(RuntimeEmulated, RootedAndSeveralDimensionCollectives) {
  session([](Controller& ctl) {
    Mesh mesh = ctl.world_mesh({{"host", 2}, {"gpu", 2}});
    DTensor x = mesh.call("test.on_emulated", {4, 3}, 1.0);  // rank r = 2h + g holds r + 1
    DTensor to0 = x.reduce("gpu", Reduction::Sum, Dst{0});
    DTensor avg = x.reduce("host", Reduction::Avg, Dst{1});
    DTensor gathered = x.gather("gpu", 1);
    DTensor from1 = x.broadcast("host", 1);
    DTensor parts = x.scatter("gpu", 0);
    DTensor every = x.reduce({}, Reduction::Sum);
    DTensor stacked = x.reduce({"host", "gpu"}, Reduction::Stack);
    EXPECT_EQ(gathered.meta().shape(), (std::vector<std::int64_t>{2, 4, 3}));
    EXPECT_EQ(parts.meta().shape(), (std::vector<std::int64_t>{2, 3}));
    for (std::int64_t h = 0; h < 2; ++h) {
      EXPECT_EQ(first(ctl.fetch_shard(to0, {{"host", h}}).get()), static_cast<float>(4 * h + 3));
      const Tensor g = ctl.fetch_shard(gathered, {{"host", h}}).get();
      EXPECT_EQ(g.span<float>()[0], static_cast<float>(2 * h + 1));
      EXPECT_EQ(g.span<float>()[12], static_cast<float>(2 * h + 2));
      for (std::int64_t i = 0; i < 2; ++i) {
        const std::vector<std::pair<std::string, std::int64_t>> at = {{"host", h}, {"gpu", i}};
        EXPECT_EQ(first(ctl.fetch_shard(from1, at).get()), static_cast<float>(3 + i));
        EXPECT_EQ(first(ctl.fetch_shard(parts, at).get()), static_cast<float>(2 * h + 1));
        EXPECT_EQ(first(ctl.fetch_shard(every, at).get()), 10.0f);
        const Tensor s = ctl.fetch_shard(stacked, at).get();
        for (std::int64_t p = 0; p < 4; ++p) EXPECT_EQ(s.span<float>()[static_cast<std::size_t>(12 * p)], p + 1.0f);
      }
    }
    for (std::int64_t g = 0; g < 2; ++g)
      EXPECT_EQ(first(ctl.fetch_shard(avg, {{"gpu", g}}).get()), static_cast<float>(g + 2));  // ((g+1) + (g+3)) / 2
    x.reduce_({"gpu", "host"}, Reduction::Max);
    EXPECT_EQ(first(ctl.fetch_shard(x, {{"host", 0}, {"gpu", 0}}).get()), 4.0f);
  });
}

TEST(RuntimeEmulated, ToMeshBetweenSubMeshes) {
  session([](Controller& ctl) {
    Mesh mesh = ctl.world_mesh({{"host", 2}, {"gpu", 2}});
    Mesh left = mesh.slice("host", 0);
    Mesh right = mesh.slice("host", 1);
    DTensor x = left.call("test.on_emulated", {2}, 10.0);  // ranks 0, 1: 10, 11
    DTensor moved = x.to_mesh(right);
    EXPECT_EQ(first(ctl.fetch_shard(moved, {{"gpu", 0}}).get()), 10.0f);
    EXPECT_EQ(first(ctl.fetch_shard(moved, {{"gpu", 1}}).get()), 11.0f);
    DTensor back = moved.to_mesh(left);  // chained, over the same rank set
    EXPECT_EQ(first(ctl.fetch_shard(back, {{"gpu", 1}}).get()), 11.0f);
  });
}

// A broadcast to_mesh from a slice onto the mesh, over device communicators: a source
// that is also a target keeps a copy and sends to the others in one group.
TEST(RuntimeEmulated, ToMeshFromASliceBroadcasts) {
  session([](Controller& ctl) {
    Mesh mesh = ctl.world_mesh({{"host", 2}, {"gpu", 2}});
    DTensor x = mesh.call("test.on_emulated", {4, 3}, 1.0);                  // rank r = 2h + g holds r + 1
    DTensor rooted = x.reduce("gpu", Reduction::Sum, Dst{0}).to_mesh(mesh);  // x.reduce("gpu", Sum)
    DTensor host1 = x.slice_mesh("host", 1).to_mesh(mesh);
    DTensor one = x.slice_mesh("host", 0).slice_mesh("gpu", 1).to_mesh(mesh);
    DTensor total = one.reduce({}, Reduction::Sum);  // four copies of rank 1's 2
    EXPECT_EQ(rooted.meta().device(), Device::of(test_kind(), 0));
    for (std::int64_t h = 0; h < 2; ++h) {
      for (std::int64_t g = 0; g < 2; ++g) {
        const std::vector<std::pair<std::string, std::int64_t>> at = {{"host", h}, {"gpu", g}};
        const Tensor r = ctl.fetch_shard(rooted, at).get();
        EXPECT_EQ(r.shape(), (std::vector<std::int64_t>{4, 3}));
        for (float v : r.span<float>()) EXPECT_EQ(v, static_cast<float>(4 * h + 3)) << h << g;
        EXPECT_EQ(first(ctl.fetch_shard(host1, at).get()), static_cast<float>(3 + g)) << h << g;
        EXPECT_EQ(first(ctl.fetch_shard(one, at).get()), 2.0f) << h << g;
        EXPECT_EQ(first(ctl.fetch_shard(total, at).get()), 8.0f) << h << g;
      }
    }
  });
}

TEST(RuntimeEmulated, AFetchWithoutItsOrderingReadsAWrongValue) {
  if (test_kind() != DeviceKind::Emulated) GTEST_SKIP() << "the emulator's own check (the switch removes an ordering)";
  session([](Controller& ctl) {
    Mesh mesh = ctl.world_mesh({{"host", 2}, {"gpu", 2}});
    Stream side = ctl.stream("side");
    // Ordered: a kernel, then a scale, then the fetch, all on one device stream.
    DTensor a = mesh.call_on(side, "test.on_emulated", {{4}, 100.0}).at(0);
    DTensor b = mesh.call_on(side, "meshrt.scale", {a, 2.0}).at(0);
    EXPECT_EQ(first(ctl.fetch_shard(b, {{"host", 0}, {"gpu", 0}}).get()), 200.0f);
    // Unordered: the copy runs before the queued (delayed) work.
    (void)mesh.call("test.unordered_fetch", true);
    DTensor c = mesh.call_on(side, "test.on_emulated", {{4}, 300.0}).at(0);
    DTensor d = mesh.call_on(side, "meshrt.scale", {c, 3.0}).at(0);
    const float unordered = first(ctl.fetch_shard(d, {{"host", 0}, {"gpu", 0}}).get());
    (void)mesh.call("test.unordered_fetch", false);
    EXPECT_NE(unordered, 900.0f) << "the emulator did not catch the missing ordering";
    EXPECT_EQ(first(ctl.fetch_shard(d, {{"host", 0}, {"gpu", 0}}).get()), 900.0f);
  });
}

// A fetch's preprocess runs on the value's device and its stream (issue 29, N3: it ran
// with a CPU context, so a CUDA kernel there went to the legacy default stream).
TEST(RuntimeEmulated, AFetchsPreprocessRunsOnTheValuesDeviceAndStream) {
  session([](Controller& ctl) {
    Mesh mesh = ctl.world_mesh({{"host", 2}, {"gpu", 2}});
    Stream side = ctl.stream("side");
    DTensor x = mesh.call_on(side, "test.on_emulated", {{2}, 5.0}).at(0);  // rank r: 5 + r
    EXPECT_EQ(first(ctl.fetch_shard(x, {{"host", 1}, {"gpu", 0}}, "test.where_it_runs").get()), 7.0f);
    DTensor y = mesh.call_on(side, "meshrt.scale", {x, 2.0}).at(0);
    EXPECT_EQ(first(ctl.fetch_shard(y, {{"host", 0}, {"gpu", 1}}, "meshrt.sum").get()), 24.0f);  // 2 x 12
  });
}

TEST(RuntimeEmulated, AMeshPlacedOnTheAcceleratorRunsTheBuiltinsThere) {
  session([](Controller& ctl) {
    EXPECT_EQ(ctl.accelerator(), test_kind());
    Mesh mesh = ctl.world_mesh({{"host", 2}, {"gpu", 2}}, test_kind());
    DTensor x = mesh.call("meshrt.full", {2, 3}, DType::Float32, 1.5);
    EXPECT_EQ(x.meta().device(), Device::of(test_kind(), 0));  // the shape function saw the kind
    DTensor y = x.reduce("gpu", Reduction::Sum);
    EXPECT_EQ(first(ctl.fetch_shard(y, {{"host", 1}, {"gpu", 0}}).get()), 3.0f);
    // Slices keep the placement; a send between them goes over device communicators.
    Mesh row = mesh.slice("host", 1);
    DTensor r = row.call("meshrt.arange", 4, DType::Int64);
    EXPECT_EQ(r.meta().device(), Device::of(test_kind(), 0));
    DTensor moved = r.to_mesh(mesh.slice("host", 0));
    const Tensor got = ctl.fetch_shard(moved, {{"gpu", 1}}).get();
    EXPECT_TRUE(got.equals(Tensor::from<std::int64_t>({4}, {0, 1, 2, 3})));
    // Bitwise reductions are refused at the call site, as on cuda.
    DTensor i = mesh.call("meshrt.zeros", {4}, DType::Int32);
    try {
      (void)i.reduce("gpu", Reduction::Bor);
      ADD_FAILURE() << "expected a UsageError";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("is not supported by NCCL"), std::string::npos) << e.what();
    }
  });
}

// Host data onto an accelerator mesh: from_host and scatter give device tensors with the
// controller's values (issue 24).
TEST(RuntimeEmulated, HostDataOntoAnAcceleratorMesh) {
  session([](Controller& ctl) {
    Mesh mesh = ctl.world_mesh({{"host", 2}, {"gpu", 2}}, test_kind());
    const Tensor host = Tensor::from<float>({4}, {1, 2, 3, 4});
    DTensor all = mesh.from_host(host);
    DTensor halves = mesh.scatter("gpu", host);
    EXPECT_EQ(all.meta(), TensorMeta({4}, DType::Float32, Device::of(test_kind(), 0)));
    EXPECT_EQ(halves.meta(), TensorMeta({2}, DType::Float32, Device::of(test_kind(), 0)));
    DTensor summed = halves.reduce("host", Reduction::Sum);
    for (std::int64_t h = 0; h < 2; ++h) {
      for (std::int64_t g = 0; g < 2; ++g) {
        const std::vector<std::pair<std::string, std::int64_t>> at = {{"host", h}, {"gpu", g}};
        EXPECT_TRUE(ctl.fetch_shard(all, at).get().equals(host)) << h << g;
        const float v = static_cast<float>(2 * g + 1);
        EXPECT_TRUE(ctl.fetch_shard(halves, at).get().equals(Tensor::from<float>({2}, {v, v + 1}))) << h << g;
        EXPECT_TRUE(ctl.fetch_shard(summed, at).get().equals(Tensor::from<float>({2}, {2 * v, 2 * v + 2}))) << h << g;
      }
    }
  });
}

// A host task that fails on one rank of four fails its call (docs/ARCHITECTURE.md section
// 7): every value that depends on it raises RemoteError naming the task's error at its
// fetch, from every rank (the failed rank still takes part in the reduction, so no peer
// waits), and independent work, on the same stream too, computes right.
TEST(RuntimeEmulated, AHostTaskThatFailsFailsItsCallAndOnlyWhatDependsOnIt) {
  if (test_kind() != DeviceKind::Emulated) GTEST_SKIP() << "host tasks run on the emulated accelerator only";
  session([](Controller& ctl) {
    Mesh mesh = ctl.world_mesh({{"host", 2}, {"gpu", 2}}, test_kind());
    Stream side = ctl.stream("side");
    DTensor x = mesh.call("test.task_fails", {4}, 1.0, 1);
    DTensor y = x.reduce("gpu", Reduction::Sum);
    for (std::int64_t h = 0; h < 2; ++h) {
      for (std::int64_t g = 0; g < 2; ++g) {
        for (const DTensor* t : {&x, &y}) {
          try {
            (void)ctl.fetch_shard(*t, {{"host", h}, {"gpu", g}}).get();
            ADD_FAILURE() << "expected a RemoteError for host " << h << ", gpu " << g;
          } catch (const RemoteError& e) {
            EXPECT_NE(std::string(e.what()).find("a host task failed on rank 1"), std::string::npos) << e.what();
            EXPECT_EQ(e.function(), "test.task_fails") << e.what();
          }
        }
      }
    }
    // The same stream goes on: the failure was the call's, not the stream's.
    DTensor a = mesh.call("test.on_emulated", {4}, 5.0);  // rank r holds 5 + r
    DTensor b = a.reduce("host", Reduction::Sum);
    EXPECT_EQ(first(ctl.fetch_shard(b, {{"host", 0}, {"gpu", 1}}).get()), 14.0f);  // ranks 1 and 3: 6 + 8
    EXPECT_EQ(first(ctl.fetch_shard(a, {{"host", 0}, {"gpu", 1}}).get()), 6.0f);   // from the failed rank
    DTensor c = mesh.call_on(side, "test.on_emulated", {{4}, 1.0}).at(0);
    EXPECT_EQ(first(ctl.fetch_shard(c, {{"host", 1}, {"gpu", 1}}).get()), 4.0f);
    try {
      ctl.synchronize();
    } catch (const Error&) {
      // raising is as good as returning: the point is that it comes back
    }
  });
}

// A failed call with no outputs: nothing to fetch, so synchronize() raises it.
TEST(RuntimeEmulated, AFailedHostTaskOfACallWithoutOutputsIsRaisedBySynchronize) {
  if (test_kind() != DeviceKind::Emulated) GTEST_SKIP() << "host tasks run on the emulated accelerator only";
  session([](Controller& ctl) {
    Mesh mesh = ctl.world_mesh({{"host", 2}, {"gpu", 2}}, test_kind());
    mesh.call_n("test.task_fails_quietly", {});
    try {
      ctl.synchronize();
      ADD_FAILURE() << "expected synchronize() to raise the host task's error";
    } catch (const RemoteError& e) {
      EXPECT_NE(std::string(e.what()).find("a task with no outputs failed"), std::string::npos) << e.what();
    }
  });
}

// A failed value borrowed onto another stream: what uses it there fails with the root
// cause, never reading the failed call's never-written output.
TEST(RuntimeEmulated, AFailedValueBorrowedOntoAnotherStreamFailsWhatUsesIt) {
  if (test_kind() != DeviceKind::Emulated) GTEST_SKIP() << "host tasks run on the emulated accelerator only";
  session([](Controller& ctl) {
    Mesh mesh = ctl.world_mesh({{"host", 2}, {"gpu", 2}}, test_kind());
    Stream side = ctl.stream("side");
    DTensor failed = mesh.call("test.task_fails", {4}, 0.0, -1);
    DTensor borrowed = side.borrow(failed);
    DTensor used = mesh.call_on(side, "test.plus_one", {borrowed}).at(0);
    try {
      const Tensor v = ctl.fetch_shard(used, {{"host", 0}, {"gpu", 0}}).get();
      ADD_FAILURE() << "expected a RemoteError, found a value " << v.span<float>()[0];
    } catch (const RemoteError& e) {
      EXPECT_NE(std::string(e.what()).find("a host task failed on rank"), std::string::npos) << e.what();
    }
    borrowed.drop();
    try {
      ctl.synchronize();
    } catch (const Error&) {
    }
  });
}

// Ranks whose host tasks still run are behind in a timeout's report, each named running
// the call: not "finished, its report not arrived".
TEST(RuntimeEmulated, ATimeoutNamesEveryRankWhoseHostTasksStillRun) {
  if (test_kind() != DeviceKind::Emulated) GTEST_SKIP() << "host tasks run on the emulated accelerator only";
  session([](Controller& ctl) {
    Mesh mesh = ctl.world_mesh({{"host", 2}, {"gpu", 2}}, test_kind());
    mesh.call_n("test.task_sleeps", {3000});
    DTensor x = mesh.call("test.on_emulated", {4}, 1.0);
    try {
      (void)ctl.fetch_shard(x, {{"host", 0}, {"gpu", 0}}).get(std::chrono::milliseconds(1000));
      ADD_FAILURE() << "expected a TimeoutError";
    } catch (const TimeoutError& e) {
      const std::string text = e.what();
      EXPECT_EQ(e.missing_ranks(), (std::vector<int>{0, 1, 2, 3})) << text;
      EXPECT_NE(text.find("running test.task_sleeps"), std::string::npos) << text;
      EXPECT_EQ(text.find("has finished it"), std::string::npos) << text;
    }
    ctl.synchronize();
  });
}

// A device fetch does not hold the worker: its copy is enqueued on the value's stream and
// the loop polls its event. A later command on that stream runs (on the host) while the
// copy still waits behind the stream's work, and both fetches give their values.
TEST(RuntimeEmulated, AFetchLetsLaterCommandsRunWhileItsCopyIsPending) {
  session([](Controller& ctl) {
    Mesh mesh = ctl.world_mesh({{"host", 2}, {"gpu", 2}});
    Stream side = ctl.stream("side");
    DTensor x = mesh.call_on(side, "test.on_emulated", {{4}, 20.0}).at(0);  // rank r holds 20 + r
    (void)mesh.call_on(side, "test.busy", {300});                           // about a second of work ahead of the copy
    Future<Tensor> value = ctl.fetch_shard(x, {{"host", 1}, {"gpu", 0}});
    DTensor idle = mesh.call_on(side, "test.stream_idle", {}).at(0);
    Future<Tensor> probe = ctl.fetch_shard(idle, {{"host", 1}, {"gpu", 0}});
    // A function that fails on the same rank while the copy is pending: its failure names
    // a later ident, so it must not reach the controller before the fetch's value (it
    // would count the fetch complete without one).
    DTensor failed = mesh.call("meshrt.fail", "a failure behind a pending fetch", Value::list({Value(2)}));
    // A fetch that waited for its copy would have drained the stream before the probe ran.
    EXPECT_EQ(first(probe.get()), 0.0f) << "the probe ran only after the fetch's copy completed";
    EXPECT_EQ(first(value.get()), 22.0f);
    try {
      (void)ctl.fetch_shard(failed, {{"host", 1}, {"gpu", 0}}).get();
      ADD_FAILURE() << "expected a RemoteError";
    } catch (const RemoteError& e) {
      EXPECT_NE(std::string(e.what()).find("a failure behind a pending fetch"), std::string::npos) << e.what();
    }
    try {
      ctl.synchronize();
    } catch (const Error&) {
      // the failure may be raised again here
    }
  });
}
