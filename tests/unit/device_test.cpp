// The device layer on the emulated accelerator: the stream-ordered pool, streams (FIFO,
// asynchronous, delayed), events, the host-read refusal, stream errors and the fetch.
#include "meshrt/internal/device.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <limits>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "../support/expect_error.hpp"
#include "device/emulated.hpp"
#include "device/nan_rule.hpp"
#include "device/pool.hpp"

namespace meshrt::test {
namespace {

using device::Backend;
using device::CachingPool;
using device::Event;
using device::Stream;

Backend& emulated() {
  return device::backend(device::Accelerator::Emulated);
}

// A backend of its own with a delay on every stream operation (the process-wide one was
// made with the environment's setting).
std::unique_ptr<device::EmulatedBackend> delayed_backend(int delay_us) {
  setenv("MESHRT_EMULATED_DELAY_US", std::to_string(delay_us).c_str(), 1);
  auto b = std::make_unique<device::EmulatedBackend>();
  unsetenv("MESHRT_EMULATED_DELAY_US");
  return b;
}

TEST(DeviceKind, ParsesAndPrintsEmulated) {
  EXPECT_EQ(Device::parse("emulated"), Device::emulated(0));
  EXPECT_EQ(Device::parse("emulated:3").index(), 3);
  EXPECT_TRUE(Device::parse("emulated:3").is_emulated());
  EXPECT_EQ(Device::emulated(2).to_string(), "emulated:2");
  EXPECT_EQ(Device::of(Device::Kind::Emulated, 1), Device::emulated(1));
  expect_contains(usage_error([] { (void)Device::parse("emulated:x"); }), "'emulated:N'");
  expect_contains(usage_error([] { (void)Device::of(Device::Kind::Cpu, 1); }), "expected index 0 for the cpu");
}

TEST(DeviceAccelerator, ParsesTheSetting) {
  EXPECT_EQ(device::parse_accelerator("emulated"), device::Accelerator::Emulated);
  EXPECT_EQ(device::parse_accelerator("none"), device::Accelerator::None);
  expect_contains(usage_error([] { (void)device::parse_accelerator("tpu"); }), "found \"tpu\"");
}

TEST(DevicePool, ReusesBlocksOnTheirOwnStreamOnly) {
  int allocations = 0;
  int frees = 0;
  CachingPool pool(
      [&](std::size_t n, std::uint64_t) {
        ++allocations;
        return ::operator new(n);
      },
      [&](void* p, std::uint64_t) {
        ++frees;
        ::operator delete(p);
      },
      4096);
  void* first = nullptr;
  {
    auto a = pool.allocate(100, 7);
    first = a.get();
    EXPECT_TRUE(pool.contains(first, 100));
    EXPECT_TRUE(pool.contains(static_cast<char*>(first) + 500, 12));
    EXPECT_FALSE(pool.contains(static_cast<char*>(first) + 500, 13));  // past the 512-byte block
  }
  EXPECT_FALSE(pool.contains(first, 1));  // freed: no longer live
  EXPECT_EQ(pool.stats().cached_bytes, 512u);
  {
    auto again = pool.allocate(200, 7);  // same stream, same size class: the cached block
    EXPECT_EQ(again.get(), first);
    auto other = pool.allocate(200, 8);  // another stream never takes it
    EXPECT_NE(other.get(), first);
  }
  EXPECT_EQ(pool.stats().hits, 1u);
  EXPECT_EQ(pool.stats().misses, 2u);
  EXPECT_EQ(allocations, 2);
  {
    auto unordered = pool.allocate(100, 0);  // no stream: not cached
  }
  (void)pool.allocate(1, 9);  // the allocation frees what waited to be freed
  EXPECT_EQ(frees, 1);
  // Over the limit, a freed block is freed rather than cached.
  { auto big = pool.allocate(8192, 7); }
  EXPECT_LE(pool.stats().cached_bytes, 4096u);
  pool.forget_stream(7);
  pool.empty_cache();
  EXPECT_EQ(pool.stats().cached_bytes, 0u);
  EXPECT_EQ(frees, allocations);
}

// Reuse is best fit: a cached block up to twice the request serves it, so varying sizes
// reuse each other's blocks; a larger one is left for a request of its size.
TEST(DevicePool, ReusesTheSmallestBlockLargeEnoughUpToTwiceTheRequest) {
  CachingPool pool([](std::size_t n, std::uint64_t) { return ::operator new(n); },
                   [](void* p, std::uint64_t) { ::operator delete(p); }, 1 << 20);
  void* big = nullptr;
  { big = pool.allocate(3000, 7).get(); }  // a 3072-byte block, cached
  {
    auto fits = pool.allocate(2000, 7);  // 2048 bytes: the 3072-byte block serves it
    EXPECT_EQ(fits.get(), big);
    EXPECT_TRUE(pool.contains(big, 3072));
  }
  {
    auto small = pool.allocate(1000, 7);  // 1024 bytes: 3072 is more than twice that
    EXPECT_NE(small.get(), big);
  }
  EXPECT_EQ(pool.stats().hits, 1u);
  EXPECT_EQ(pool.stats().misses, 2u);
}

// A block is freed in its stream's order, by the device, never by the host waiting for
// the device: with a stream held up (a task waiting for the test, as a collective waits
// for a peer), freeing its blocks and allocating on another stream return at once. The
// free used to synchronize every stream (cudaDeviceSynchronize on CUDA) and waited here.
// MESHRT_ACCELERATOR=cuda runs it on the GPU (scripts/gpu-check.sh).
TEST(DevicePool, AFreeNeverWaitsForTheDevice) {
  const bool cuda = device::configured_accelerator() == device::Accelerator::Cuda;
  Backend& b = device::backend(cuda ? device::Accelerator::Cuda : device::Accelerator::Emulated);
  b.make_current(0);
  Stream held = b.create_stream(0);
  Stream other = b.create_stream(0);
  const TensorMeta meta({1024}, DType::Float32, Device::of(b.kind(), 0));
  auto release = std::make_shared<std::atomic<bool>>(false);
  (void)b.empty(meta, held);  // used on `held`, then cached for it
  held.enqueue([release] {    // a host task that may make no CUDA call: it only waits
    while (!release->load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  auto next = std::async(std::launch::async, [&] {
    b.make_current(0);
    b.empty_cache();              // frees the block in `held`'s order
    return b.empty(meta, other);  // and allocates on another stream
  });
  const bool returned = next.wait_for(std::chrono::seconds(20)) == std::future_status::ready;
  EXPECT_FALSE(held.query()) << "the held stream ran before the test let it";
  release->store(true);
  EXPECT_TRUE(returned) << "freeing and allocating waited for a stream held up elsewhere (20 s)";
  EXPECT_TRUE(next.get().defined());
  held.synchronize();
  other.synchronize();
  EXPECT_FALSE(held.error());
}

TEST(DeviceStream, RunsInFifoOrderOffTheCallersThread) {
  Stream s = emulated().create_stream(0);
  std::vector<int> order;
  std::thread::id ran_on;
  for (int i = 0; i < 50; ++i) {
    s.enqueue([&order, &ran_on, i] {
      order.push_back(i);
      ran_on = std::this_thread::get_id();
    });
  }
  s.synchronize();
  ASSERT_EQ(order.size(), 50u);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(order[static_cast<std::size_t>(i)], i);
  EXPECT_NE(ran_on, std::this_thread::get_id());
  EXPECT_TRUE(s.query());
}

TEST(DeviceStream, IsAsynchronousToTheHost) {
  Stream s = emulated().create_stream(1);
  std::promise<void> go;
  auto gate = go.get_future().share();
  s.enqueue([gate] { gate.wait(); });
  EXPECT_FALSE(s.query());  // the host went on while the stream is held
  go.set_value();
  s.synchronize();
  EXPECT_TRUE(s.query());
}

TEST(DeviceStream, TheDelayMakesAnUnorderedReadWrongEveryTime) {
  auto b = delayed_backend(20000);
  Stream s = b->create_stream(0);
  Tensor t = b->empty(TensorMeta({4}, DType::Int32, Device::emulated(0)), s);
  {
    DeviceMemoryAccess access;
    for (auto& v : t.span<std::int32_t>()) v = 1;
  }
  s.enqueue([t]() mutable {
    for (auto& v : t.span<std::int32_t>()) v = 7;
  });
  // Read without the stream's ordering, as a missing wait would: the kernel has not run.
  int seen = -1;
  {
    DeviceMemoryAccess access;
    seen = t.data<std::int32_t>()[0];
  }
  EXPECT_EQ(seen, 1);
  s.synchronize();
  DeviceMemoryAccess access;
  EXPECT_EQ(t.data<std::int32_t>()[3], 7);
}

TEST(DeviceEvent, RecordsQueriesAndOrdersAnotherStream) {
  Stream a = emulated().create_stream(0);
  Stream b = emulated().create_stream(0);
  Event e = emulated().create_event(0);
  EXPECT_TRUE(e.query());  // never recorded: complete
  std::promise<void> go;
  auto gate = go.get_future().share();
  int value = 0;
  a.enqueue([gate, &value] {
    gate.wait();
    value = 1;
  });
  e.record(a);
  int seen_by_b = -1;
  e.wait(b);
  b.enqueue([&] { seen_by_b = value; });
  EXPECT_FALSE(e.query());
  EXPECT_FALSE(b.query());  // b waits on the device, the host does not
  go.set_value();
  e.synchronize();
  EXPECT_TRUE(e.query());
  b.synchronize();
  EXPECT_EQ(seen_by_b, 1);
}

TEST(DeviceMemory, HostReadsOfEmulatedTensorsAreRefusedOutsideStreamTasks) {
  Tensor t = Tensor::empty(TensorMeta({2, 3}, DType::Float32, Device::emulated(0)));
  const std::string text = usage_error([&] { (void)t.data<float>(); });
  expect_contains(text, "float32[2, 3] on emulated:0");
  expect_contains(text, "read it in a task on its stream");
  expect_contains(text, "or fetch it");
  expect_contains(usage_error([&] { (void)t.item(); }), "one element");
  // Inside a stream task it is the kernel's memory.
  Stream s = emulated().create_stream(0);
  s.enqueue([t]() mutable {
    for (float& v : t.span<float>()) v = 2.5f;
  });
  s.synchronize();
  EXPECT_FALSE(s.error()) << *s.error();
  device::Fetch f = device::fetch(t, s);
  f.done.synchronize();
  EXPECT_EQ(f.host.span<float>()[5], 2.5f);
}

TEST(DeviceMemory, ToDeviceZerosCopyAndFetchRoundTrip) {
  Stream s = emulated().create_stream(2);
  const Tensor host = Tensor::from<std::int64_t>({3}, {4, 5, 6});
  Tensor d = device::to_device(host, Device::emulated(2), s);
  EXPECT_EQ(d.device(), Device::emulated(2));
  Tensor z = device::zeros(TensorMeta({3}, DType::Int64, Device::emulated(2)), s);
  device::Fetch fz = device::fetch(z, s);
  device::copy(z, d, s);
  device::Fetch fd = device::fetch(z, s);
  fd.done.synchronize();
  EXPECT_TRUE(fz.done.query());
  EXPECT_EQ(fz.host.span<std::int64_t>()[1], 0);
  EXPECT_TRUE(fd.host.equals(host));
  const device::PoolStats stats = emulated().pool_stats();
  EXPECT_GE(stats.live_bytes, 2u * CachingPool::kGranule);
}

// The device layer's copies hold their source until an event after the copy completes,
// not with a host task on the stream (a CUDA host function may make no CUDA call, yet a
// release can free into the pool, and each one holds up the stream's later work).
TEST(DeviceMemory, ACopysSourceIsHeldUntilTheCopyRanNotByAHostTask) {
  Stream s = emulated().create_stream(1);
  auto& impl = static_cast<device::EmulatedStream&>(*s.impl());
  Tensor src = device::to_device(Tensor::from<std::int32_t>({2}, {3, 4}), Device::emulated(1), s);
  Tensor dst = emulated().empty(src.meta(), s);
  s.synchronize();
  const std::uint64_t before = impl.enqueued();
  s.enqueue([] { std::this_thread::sleep_for(std::chrono::milliseconds(50)); });  // a slow kernel
  device::copy(dst, src, s);
  EXPECT_EQ(impl.enqueued(), before + 2) << "a host task was enqueued beside the copy";
  src = Tensor();  // the last handle here: the device layer holds the block until the copy ran
  device::Fetch f = device::fetch(dst, s);
  f.done.synchronize();
  EXPECT_TRUE(f.host.equals(Tensor::from<std::int32_t>({2}, {3, 4})));
  EXPECT_EQ(impl.enqueued(), before + 3);  // and the fetch's copy, alone
  device::release_completed();
}

// Under memory pressure the pool frees what went over its limit at the next allocation,
// in stream order, while that stream's work can release a block into the pool (a task
// holding a tensor's last handle). The pool frees outside its lock, so this finishes
// (issue 29, N4: it deadlocked when the free waited for the streams).
TEST(DevicePool, FreesUnderPressureWhileAStreamTaskReleasesIntoIt) {
  setenv("MESHRT_DEVICE_POOL_BYTES", "0", 1);  // nothing cached: every release waits to be freed
  auto b = delayed_backend(1000);
  unsetenv("MESHRT_DEVICE_POOL_BYTES");
  Stream s = b->create_stream(0);
  const TensorMeta meta({256}, DType::Float32, Device::emulated(0));
  Tensor a = b->empty(meta, s);
  // Over the limit when it goes: freed by the next allocation.
  { Tensor spare = b->empty(meta, s); }
  s.enqueue([] { std::this_thread::sleep_for(std::chrono::milliseconds(100)); });  // a slow kernel
  s.enqueue([keep = a] {});  // the stream releases a's block when it gets here
  a = Tensor();
  auto next = std::async(std::launch::async, [&] { return b->empty(meta, s); });
  if (next.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
    std::fprintf(stderr,
                 "FAILED: the allocation did not return in 20 s (the pool's lock held across a free that "
                 "waits for a stream whose task waits for that lock)\n");
    std::_Exit(1);  // a thread is stuck in the pool for good: end the test here
  }
  EXPECT_TRUE(next.get().defined());
  s.synchronize();
  EXPECT_EQ(b->pool_stats().cached_bytes, 0u);
}

TEST(DeviceStream, AThrowingTaskPutsTheStreamInErrorAndLaterWorkIsSkipped) {
  Stream s = emulated().create_stream(3);
  bool later_ran = false;
  s.enqueue([] { throw SystemError("illegal memory access at 0x10"); });
  s.enqueue([&] { later_ran = true; });
  Event e = emulated().create_event(3);
  e.record(s);
  e.synchronize();  // events still complete: nobody waits forever
  ASSERT_TRUE(s.error());
  expect_contains(*s.error(), "emulated:3 stream");
  expect_contains(*s.error(), "illegal memory access at 0x10");
  EXPECT_FALSE(later_ran);
}

TEST(DeviceStream, TheLastHandleMayGoInsideItsOwnTask) {
  std::promise<void> ran;
  auto done = ran.get_future();
  {
    Stream s = emulated().create_stream(0);
    // The task holds the last handle: the stream is destroyed on its own thread, which
    // then ends by itself (under ASan a use after free would show here).
    s.enqueue([keep = s, &ran] { ran.set_value(); });
  }
  done.wait();
  Stream next = emulated().create_stream(0);
  next.synchronize();
}

TEST(DeviceBackend, RefusesDevicesOutOfRange) {
  const int n = emulated().device_count();
  expect_contains(usage_error([&] { (void)emulated().create_stream(n); }),
                  "expected an emulated device in 0.." + std::to_string(n - 1));
  expect_contains(usage_error([&] { emulated().make_current(-1); }), "found -1");
}

// DLPack's stream hand-off is CUDA's: another library's stream never waits on an emulated
// stream (its kernels get host views inside host tasks, ordered by the stream itself).
TEST(DeviceStream, TheNativeStreamHandOffIsRefusedOffCuda) {
  Stream s = emulated().create_stream(0);
  int not_a_stream = 0;
  expect_contains(usage_error([&] { device::make_native_wait(&not_a_stream, s); }),
                  "make_native_wait: expected a cuda stream (another library's streams are CUDA streams), found ");
}

// The NaN rule's element bits (device/nan_rule.hpp), shared by the CUDA kernels and the
// emulated communicator: NaNs of any sign and payload are found, infinities and numbers
// are not, and the NaN written reads as NaN in each floating dtype.
TEST(DeviceNanRule, MasksEveryFloatingDtypesNaNsAndWritesOne) {
  namespace nr = nan_rule;
  EXPECT_TRUE(nr::applies(static_cast<int>(DType::Float16), static_cast<int>(Reduction::Max)));
  EXPECT_TRUE(nr::applies(static_cast<int>(DType::Float64), static_cast<int>(Reduction::Min)));
  EXPECT_FALSE(nr::applies(static_cast<int>(DType::Float32), static_cast<int>(Reduction::Sum)));
  EXPECT_FALSE(nr::applies(static_cast<int>(DType::Int32), static_cast<int>(Reduction::Max)));
  for (DType dtype : {DType::Float16, DType::BFloat16, DType::Float32, DType::Float64}) {
    SCOPED_TRACE(name(dtype));
    const double inf = std::numeric_limits<double>::infinity();
    const std::vector<double> values{1.5, std::nan(""), -std::nan(""), inf, -inf, 0.0, -2.0};
    Tensor t = Tensor::empty(TensorMeta({static_cast<std::int64_t>(values.size())}, dtype));
    dispatch_dtype(dtype, [&](auto tag) {
      using T = decltype(tag);
      for (std::size_t i = 0; i < values.size(); ++i) {
        if constexpr (std::is_same_v<T, Half>) {
          t.data<T>()[i] = float_to_half(static_cast<float>(values[i]));
        } else if constexpr (std::is_same_v<T, BFloat16>) {
          t.data<T>()[i] = float_to_bfloat16(static_cast<float>(values[i]));
        } else {
          t.data<T>()[i] = static_cast<T>(values[i]);
        }
      }
    });
    std::vector<std::uint8_t> mask(values.size());
    ASSERT_TRUE(nr::for_floating(static_cast<int>(dtype), [&](auto tag) {
      nr::mask_of<decltype(tag)::value>(t.raw_data(), mask.data(), t.numel());
    }));
    EXPECT_EQ(mask, (std::vector<std::uint8_t>{0, 1, 1, 0, 0, 0, 0}));
    const std::vector<std::uint8_t> set{1, 0, 0, 0, 0, 0, 1};
    nr::for_floating(static_cast<int>(dtype),
                     [&](auto tag) { nr::apply_mask<decltype(tag)::value>(t.raw_data(), set.data(), t.numel()); });
    for (std::size_t i = 0; i < values.size(); ++i) {
      const double v = dispatch_dtype(dtype, [&](auto tag) -> double {
        using T = decltype(tag);
        if constexpr (std::is_same_v<T, Half>) {
          return half_to_float(t.data<T>()[i]);
        } else if constexpr (std::is_same_v<T, BFloat16>) {
          return bfloat16_to_float(t.data<T>()[i]);
        } else {
          return static_cast<double>(t.data<T>()[i]);
        }
      });
      if (set[i] || std::isnan(values[i])) {
        EXPECT_TRUE(std::isnan(v)) << i;
      } else {
        EXPECT_EQ(v, values[i]) << i;
      }
    }
  }
  EXPECT_FALSE(nr::for_floating(static_cast<int>(DType::Int64), [](auto) {}));
}

// MESHRT_EMULATED_VISIBLE_DEVICES picks and orders the node's devices this process sees,
// as CUDA_VISIBLE_DEVICES does GPUs: index i is the i-th listed, named by its place on the
// node (what tells two ranks on one node apart).
TEST(DeviceBackend, VisibleDevicesMapIndicesToTheNodesDevices) {
  const auto with_visible = [](const char* text) {
    setenv("MESHRT_EMULATED_VISIBLE_DEVICES", text, 1);
    auto b = std::make_unique<device::EmulatedBackend>();
    unsetenv("MESHRT_EMULATED_VISIBLE_DEVICES");
    return b;
  };
  auto b = with_visible("5,2");
  EXPECT_EQ(b->device_count(), 2);
  EXPECT_EQ(b->physical_device(0), "emulated device 5 of the node");
  EXPECT_EQ(b->physical_device(1), "emulated device 2 of the node");
  expect_contains(
      usage_error([&] { (void)b->create_stream(2); }),
      "expected an emulated device in 0..1 (MESHRT_EMULATED_DEVICES=8, MESHRT_EMULATED_VISIBLE_DEVICES=5,2)");
  EXPECT_EQ(emulated().physical_device(3), "emulated device 3 of the node");  // unset: all, in order
  for (const char* bad : {"8", "1,1", "0,,1", "-1", "x", "0,"}) {
    expect_contains(usage_error([&] { (void)with_visible(bad); }),
                    "setting MESHRT_EMULATED_VISIBLE_DEVICES: expected a comma-separated list of distinct emulated "
                    "devices in 0..7 (MESHRT_EMULATED_DEVICES=8), found \"" +
                        std::string(bad) + "\"");
  }
}

// Tensor's own copies of accelerator memory (to, clone, zeros, copy_from) name no stream:
// they run as tasks on the device layer's stream after the work already enqueued on the
// device's streams (a plain host read there is refused, so these are stream tasks), and
// read what that work wrote, never the memory before it.
TEST(DeviceMemory, TensorCopiesOfDeviceMemoryAreOrderedAfterTheStreamsWork) {
  Stream s = device::stream_for(7001, Device::emulated(1));
  Tensor t = device::zeros(TensorMeta({4}, DType::Float32, Device::emulated(1)), s);
  s.enqueue([t]() mutable {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // a slow kernel
    for (float& v : t.span<float>()) v = 7.0f;
  });
  const Tensor host = t.to(Device::cpu());  // queued behind the slow kernel
  EXPECT_TRUE(host.equals(Tensor::from<float>({4}, {7, 7, 7, 7})));
  EXPECT_TRUE(s.query()) << "the copy completed before the work it must follow";
  s.enqueue([t]() mutable { t.span<float>()[0] = 1.0f; });
  const Tensor copy = t.clone();
  EXPECT_EQ(copy.device(), Device::emulated(1));
  EXPECT_TRUE(copy.to(Device::cpu()).equals(Tensor::from<float>({4}, {1, 7, 7, 7})));
  const Tensor zeros = TensorMeta({3}, DType::Int32, Device::emulated(1)).zeros();
  EXPECT_TRUE(zeros.to(Device::cpu()).equals(Tensor::from<std::int32_t>({3}, {0, 0, 0})));
  Tensor back = Tensor::from<float>({4}, {1, 2, 3, 4}).to(Device::emulated(1));
  EXPECT_TRUE(back.to(Device::cpu()).equals(Tensor::from<float>({4}, {1, 2, 3, 4})));
  // The stream form does not block; its fetch reads it in order.
  const Tensor c2 = device::clone(back, s);
  device::Fetch f = device::fetch(c2, s);
  f.done.synchronize();
  EXPECT_TRUE(f.host.equals(Tensor::from<float>({4}, {1, 2, 3, 4})));
  device::release_stream(7001);
}

}  // namespace
}  // namespace meshrt::test
