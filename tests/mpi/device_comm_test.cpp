// The emulated accelerator's communicator over MPI (NP 2 and 4, and NP 1 on one device):
// every collective and dtype, a communicator over only some ranks, and its refusals and
// asynchronous errors. A test that needs more ranks or devices than the job has skips,
// saying what it needs (support/devices.hpp).
// MESHRT_ACCELERATOR=cuda runs the same tests on the cuda backend (NCCL; one GPU per
// rank, scripts/gpu-check.sh); the emulator's own checks (a host pointer as an
// asynchronous error, its device count) run on emulated only.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../support/devices.hpp"
#include "../support/expect_error.hpp"
#include "../support/mpi_world.hpp"
#include "common/trace.hpp"
#include "meshrt/functions.hpp"
#include "meshrt/internal/device.hpp"
#include "meshrt/internal/settings.hpp"

namespace meshrt::test {
namespace {

using device::Accelerator;
using device::Communicator;
using device::Stream;

constexpr std::chrono::seconds kInitTimeout{60};

// The accelerator under test: cuda when MESHRT_ACCELERATOR=cuda, else emulated (CTest).
Accelerator under_test() {
  return settings::kAccelerator.get() == "cuda" ? Accelerator::Cuda : Accelerator::Emulated;
}
Device on_device(int index) {
  return Device::of(device::device_kind(under_test()), index);
}

device::Backend& emulated() {
  return device::backend(under_test());
}

struct OnEmulated {
  int device = device::select_device(under_test(), MPI_COMM_WORLD);
  Stream stream = [this] {
    emulated().make_current(device);
    return emulated().create_stream(device);
  }();
  std::unique_ptr<Communicator> comm = device::create_communicator(under_test(), MPI_COMM_WORLD, device, kInitTimeout);
  Device where() const { return on_device(device); }
};

// The value rank r holds at element i: small integers, exact in every dtype.
double value(int r, std::size_t i) {
  return static_cast<double>((r + static_cast<int>(i)) % 3 + 1);
}

// A host tensor of `dtype` from doubles (exact for the small values used here).
Tensor host_tensor(DType dtype, const std::vector<double>& values) {
  Tensor t = Tensor::empty(TensorMeta({static_cast<std::int64_t>(values.size())}, dtype));
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    T* p = t.data<T>();
    for (std::size_t i = 0; i < values.size(); ++i) {
      if constexpr (std::is_same_v<T, Half>) {
        p[i] = float_to_half(static_cast<float>(values[i]));
      } else if constexpr (std::is_same_v<T, BFloat16>) {
        p[i] = float_to_bfloat16(static_cast<float>(values[i]));
      } else {
        p[i] = static_cast<T>(values[i]);
      }
    }
  });
  return t;
}

Tensor fetched(const Tensor& t, const Stream& s) {
  device::Fetch f = device::fetch(t, s);
  f.done.synchronize();
  EXPECT_FALSE(s.error()) << *s.error();
  return f.host;
}

// What a reduction of value(r, i) over n ranks gives in `dtype`: a sum, then a division.
double expected(Reduction red, DType dtype, int n, std::size_t i) {
  double acc = value(0, i);
  for (int r = 1; r < n; ++r) {
    const double v = value(r, i);
    acc = red == Reduction::Product ? acc * v
          : red == Reduction::Min   ? std::min(acc, v)
          : red == Reduction::Max   ? std::max(acc, v)
                                    : acc + v;
  }
  if (red != Reduction::Avg) return acc;
  if (!is_floating(dtype)) return std::trunc(acc / n);
  if (dtype == DType::Float16) return half_to_float(float_to_half(static_cast<float>(acc) / static_cast<float>(n)));
  if (dtype == DType::BFloat16) {
    return bfloat16_to_float(float_to_bfloat16(static_cast<float>(acc) / static_cast<float>(n)));
  }
  if (dtype == DType::Float32) return static_cast<float>(acc) / static_cast<float>(n);
  return acc / n;
}

TEST(DeviceComm, AllReduceEveryDtypeAndReduction) {
  MESHRT_SKIP_UNLESS_DEVICES(under_test(), 1);
  OnEmulated s;
  const int n = world_size();
  const std::size_t count = 5;
  for (DType dtype : {DType::UInt8, DType::Int32, DType::Int64, DType::Float16, DType::BFloat16, DType::Float32,
                      DType::Float64, DType::Bool}) {
    for (Reduction red : {Reduction::Sum, Reduction::Avg, Reduction::Product, Reduction::Min, Reduction::Max}) {
      if (dtype == DType::Bool && red != Reduction::Min && red != Reduction::Max) continue;
      std::vector<double> mine(count);
      for (std::size_t i = 0; i < count; ++i)
        mine[i] = dtype == DType::Bool ? (value(world_rank(), i) > 1) : value(world_rank(), i);
      Tensor in = device::to_device(host_tensor(dtype, mine), s.where(), s.stream);
      Tensor out = emulated().empty(in.meta(), s.stream);
      s.comm->all_reduce(in.raw_data(), out.raw_data(), count, dtype, red, s.stream);
      // In place too: the same buffer as input and output.
      s.comm->all_reduce(in.raw_data(), in.raw_data(), count, dtype, red, s.stream);
      const Tensor got = fetched(out, s.stream);
      const Tensor got_inplace = fetched(in, s.stream);
      std::vector<double> want(count);
      for (std::size_t i = 0; i < count; ++i) {
        if (dtype == DType::Bool) {
          bool acc = value(0, i) > 1;
          for (int r = 1; r < n; ++r) acc = red == Reduction::Min ? (acc && value(r, i) > 1) : (acc || value(r, i) > 1);
          want[i] = acc;
        } else {
          want[i] = expected(red, dtype, n, i);
        }
      }
      EXPECT_TRUE(got.equals(host_tensor(dtype, want))) << name(red) << " on " << name(dtype);
      EXPECT_TRUE(got_inplace.equals(host_tensor(dtype, want))) << "in place " << name(red) << " on " << name(dtype);
    }
  }
  EXPECT_FALSE(s.comm->async_error());
}

TEST(DeviceComm, AllGatherReduceScatterAndAllToAll) {
  MESHRT_SKIP_UNLESS_DEVICES(under_test(), 1);
  OnEmulated s;
  const int n = world_size();
  const int me = world_rank();
  const std::size_t block = 3;
  for (DType dtype : {DType::Int32, DType::Float16, DType::Float64}) {
    // all_gather: block r holds rank r's values.
    std::vector<double> mine(block);
    for (std::size_t i = 0; i < block; ++i) mine[i] = value(me, i);
    const Tensor in = device::to_device(host_tensor(dtype, mine), s.where(), s.stream);
    Tensor gathered = emulated().empty(TensorMeta({static_cast<std::int64_t>(block) * n}, dtype, s.where()), s.stream);
    s.comm->all_gather(in.raw_data(), gathered.raw_data(), block, dtype, s.stream);
    std::vector<double> want_gather;
    for (int r = 0; r < n; ++r) {
      for (std::size_t i = 0; i < block; ++i) want_gather.push_back(value(r, i));
    }
    EXPECT_TRUE(fetched(gathered, s.stream).equals(host_tensor(dtype, want_gather))) << name(dtype);

    // reduce_scatter (sum, avg) of a send of n blocks: element k of everyone's send is
    // value(rank, k); rank me keeps block me.
    std::vector<double> send(block * static_cast<std::size_t>(n));
    for (std::size_t k = 0; k < send.size(); ++k) send[k] = value(me, k);
    const Tensor big = device::to_device(host_tensor(dtype, send), s.where(), s.stream);
    for (Reduction red : {Reduction::Sum, Reduction::Avg}) {
      Tensor part = emulated().empty(in.meta(), s.stream);
      s.comm->reduce_scatter(big.raw_data(), part.raw_data(), block, dtype, red, s.stream);
      std::vector<double> want(block);
      for (std::size_t i = 0; i < block; ++i)
        want[i] = expected(red, dtype, n, static_cast<std::size_t>(me) * block + i);
      EXPECT_TRUE(fetched(part, s.stream).equals(host_tensor(dtype, want))) << name(red) << " on " << name(dtype);
    }

    // all_to_all: block r of my send goes to rank r; I get block me of every rank's send.
    Tensor swapped = emulated().empty(big.meta(), s.stream);
    s.comm->all_to_all(big.raw_data(), swapped.raw_data(), block, dtype, s.stream);
    std::vector<double> want_swap;
    for (int r = 0; r < n; ++r) {
      for (std::size_t i = 0; i < block; ++i) want_swap.push_back(value(r, static_cast<std::size_t>(me) * block + i));
    }
    EXPECT_TRUE(fetched(swapped, s.stream).equals(host_tensor(dtype, want_swap))) << name(dtype);
  }
}

TEST(DeviceComm, GroupedSendRecvAroundARing) {
  MESHRT_SKIP_UNLESS_DEVICES(under_test(), 1);
  OnEmulated s;
  const int n = world_size();
  const int me = world_rank();
  const Tensor mine = device::to_device(Tensor::from<std::int64_t>({2}, {me, 100 + me}), s.where(), s.stream);
  Tensor got = emulated().empty(mine.meta(), s.stream);
  // Everyone sends before anyone receives: only a grouped call completes this.
  const Communicator::PeerOp ops[] = {{true, (me + 1) % n, const_cast<void*>(mine.raw_data()), 2},
                                      {false, (me + n - 1) % n, got.raw_data(), 2}};
  s.comm->send_recv(ops, DType::Int64, s.stream);
  const int from = (me + n - 1) % n;
  EXPECT_TRUE(fetched(got, s.stream).equals(Tensor::from<std::int64_t>({2}, {from, 100 + from})));
}

TEST(DeviceComm, ACommunicatorOverSomeRanksOnly) {
  MESHRT_SKIP_UNLESS_DEVICES(under_test(), 1);
  // Even and odd world ranks make one each; neither waits for the other.
  MPI_Comm half = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, world_rank() % 2, world_rank(), &half);
  int size = 0;
  MPI_Comm_size(half, &size);
  const int dev = device::select_device(under_test(), MPI_COMM_WORLD);
  emulated().make_current(dev);
  Stream stream = emulated().create_stream(dev);
  auto comm = device::create_communicator(under_test(), half, dev, kInitTimeout);
  EXPECT_EQ(comm->size(), size);
  const Tensor in = device::to_device(Tensor::from<std::int32_t>({1}, {world_rank()}), on_device(dev), stream);
  Tensor out = emulated().empty(in.meta(), stream);
  comm->all_reduce(in.raw_data(), out.raw_data(), 1, DType::Int32, Reduction::Sum, stream);
  int want = 0;
  for (int r = world_rank() % 2; r < world_size(); r += 2) want += r;
  EXPECT_TRUE(fetched(out, stream).equals(Tensor::from<std::int32_t>({1}, {want})));
  comm->destroy();
  MPI_Comm_free(&half);
}

TEST(DeviceComm, RefusesTwoRanksOnOneDeviceOnEveryRank) {
  if (world_size() < 2) GTEST_SKIP() << "needs 2 ranks (on one device), found 1";
  if (device::most_ranks_on_a_host(MPI_COMM_WORLD) < world_size()) {
    GTEST_SKIP() << "needs every rank on one host, found NCCL_HOSTID telling them apart";
  }
  // Every rank asks for device 0 of this node: each one is told, none waits.
  const std::string text =
      usage_error([] { (void)device::create_communicator(under_test(), MPI_COMM_WORLD, 0, kInitTimeout); });
  expect_contains(text, "expected one rank per device, found world ranks 0 and 1 (members 0 and 1) both on " +
                            on_device(0).to_string());
}

TEST(DeviceComm, RefusesBitwiseReductionsAsNcclDoes) {
  MESHRT_SKIP_UNLESS_DEVICES(under_test(), 1);
  OnEmulated s;
  Tensor t = emulated().empty(TensorMeta({4}, DType::Int32, s.where()), s.stream);
  for (Reduction red : {Reduction::Band, Reduction::Bor, Reduction::Bxor}) {
    const std::string text =
        usage_error([&] { s.comm->all_reduce(t.raw_data(), t.raw_data(), 4, DType::Int32, red, s.stream); });
    expect_contains(text, std::string("NCCL has no ") + std::string(name(red)) + " operator");
    expect_contains(text, "rank " + std::to_string(world_rank()));
  }
  EXPECT_FALSE(s.comm->async_error());
}

TEST(DeviceComm, AHostPointerIsAnAsynchronousErrorAndDestroyDoesNotHang) {
  if (under_test() != Accelerator::Emulated) GTEST_SKIP() << "the emulator's own check (a GPU would fault)";
  MESHRT_SKIP_UNLESS_DEVICES(under_test(), 1);
  OnEmulated s;
  std::vector<float> host(4, 1.0f);  // not device memory: a collective faults on it
  s.comm->all_reduce(host.data(), host.data(), 4, DType::Float32, Reduction::Sum, s.stream);  // no throw here
  s.stream.synchronize();
  // The fault is the stream's, as a sticky CUDA error is; the communicator stays usable.
  ASSERT_TRUE(s.stream.error());
  expect_contains(*s.stream.error(), "all_reduce on emulated communicator");
  expect_contains(*s.stream.error(), "illegal memory access: the all_reduce send buffer");
  EXPECT_FALSE(s.comm->async_error());
  s.comm->abort();
  s.comm->destroy();  // a failed communicator is aborted, not waited for
  s.comm->destroy();
  expect_contains(
      usage_error([&] { s.comm->all_reduce(host.data(), host.data(), 4, DType::Float32, Reduction::Sum, s.stream); }),
      "expected a live communicator, found it aborted");
}

// A member whose stream faulted, or whose buffer is not device memory, still takes part in
// its collectives (with zeros), so its peers finish instead of waiting forever; its own
// stream carries the error, and the communicator stays usable on a healthy stream.
TEST(DeviceComm, AFaultOnOneRankNeverLeavesItsPeersWaiting) {
  if (under_test() != Accelerator::Emulated) GTEST_SKIP() << "the emulator's own checks (a GPU would fault)";
  MESHRT_SKIP_UNLESS_DEVICES(under_test(), 2);
  OnEmulated s;
  const int me = world_rank();
  const int n = world_size();
  auto device_ones = [&](const Stream& on) {
    Tensor t = device::to_device(host_tensor(DType::Float32, std::vector<double>(4, 1.0)), s.where(), on);
    return t;
  };
  // 1. Rank 1's stream faults in a task of its own; every rank then reduces on it.
  Tensor a = device_ones(s.stream);
  if (me == 1) s.stream.enqueue([] { throw std::runtime_error("a kernel faulted"); });
  s.comm->all_reduce(a.raw_data(), a.raw_data(), 4, DType::Float32, Reduction::Sum, s.stream);
  s.stream.synchronize();  // returns on every rank: nobody waits for rank 1
  if (me == 1) {
    ASSERT_TRUE(s.stream.error());
    expect_contains(*s.stream.error(), "a kernel faulted");
  } else {
    ASSERT_FALSE(s.stream.error()) << *s.stream.error();
    const Tensor v = fetched(a, s.stream);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(v.data<float>()[i], static_cast<float>(n - 1));  // rank 1 gave zeros
  }
  EXPECT_FALSE(s.comm->async_error());
  // 2. On a fresh stream, rank 1 passes a host pointer: the others still finish.
  Stream fresh = emulated().create_stream(s.device);
  Tensor b = device_ones(fresh);
  std::vector<float> host(4, 1.0f);
  void* buffer = me == 1 ? static_cast<void*>(host.data()) : b.raw_data();
  s.comm->all_reduce(buffer, buffer, 4, DType::Float32, Reduction::Sum, fresh);
  fresh.synchronize();
  if (me == 1) {
    ASSERT_TRUE(fresh.error());
    expect_contains(*fresh.error(), "illegal memory access");
  } else {
    ASSERT_FALSE(fresh.error()) << *fresh.error();
    const Tensor v = fetched(b, fresh);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(v.data<float>()[i], static_cast<float>(n - 1));
  }
  // 3. The communicator still works for everyone on a healthy stream.
  Stream healthy = emulated().create_stream(s.device);
  Tensor c = device_ones(healthy);
  s.comm->all_reduce(c.raw_data(), c.raw_data(), 4, DType::Float32, Reduction::Sum, healthy);
  const Tensor v = fetched(c, healthy);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(v.data<float>()[i], static_cast<float>(n));
  EXPECT_FALSE(s.comm->async_error());
}

// destroy() of a communicator whose work never finishes (a peer that never joins) gives up
// after MESHRT_DEVICE_TIMEOUT and aborts it, instead of waiting forever at the runtime's
// end (issue 29, N8; NCCL's Finalize is polled against the same deadline).
TEST(DeviceComm, DestroyGivesUpOnWorkThatNeverFinishes) {
  if (under_test() != Accelerator::Emulated) GTEST_SKIP() << "the emulator's destroy (NCCL's needs a peer that hangs)";
  if (world_size() < 2) GTEST_SKIP() << "needs 2 ranks (a peer that has not joined), found 1";
  setenv("MESHRT_DEVICE_TIMEOUT", "1", 1);
  OnEmulated s;  // its communicator reads the deadline when it is made
  unsetenv("MESHRT_DEVICE_TIMEOUT");
  Tensor t = device::to_device(Tensor::from<float>({1}, {1.0f}), s.where(), s.stream);
  if (world_rank() == 0) {
    // Rank 0 alone posts a reduction: its peers join only after its destroy returned.
    s.comm->all_reduce(t.raw_data(), t.raw_data(), 1, DType::Float32, Reduction::Sum, s.stream);
    s.comm->destroy();
    ASSERT_TRUE(s.comm->async_error());
    expect_contains(*s.comm->async_error(), "was aborted");
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank() != 0) {
    // Rank 0's part is still posted in MPI (an abort cannot take it back): theirs complete.
    s.comm->all_reduce(t.raw_data(), t.raw_data(), 1, DType::Float32, Reduction::Sum, s.stream);
    s.stream.synchronize();
    s.comm->destroy();
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// The members' exchange of their devices is polled against the creation's deadline: a
// member that has not joined it in time gives a TimeoutError on the others, never a hang
// in a blocking MPI_Allgather (issue 29, N6).
TEST(DeviceComm, TheExchangeOfDevicesHasADeadline) {
  if (under_test() != Accelerator::Emulated) GTEST_SKIP() << "written for the emulated devices";
  if (world_size() < 2) GTEST_SKIP() << "needs 2 ranks (one that joins late), found 1";
  MPI_Comm members = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &members);
  const int dev = device::select_device(under_test(), MPI_COMM_WORLD);
  const auto soon = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
  if (world_rank() == 1) {
    MPI_Barrier(MPI_COMM_WORLD);  // until the others gave up
    device::check_distinct_devices(members, under_test(), dev, std::chrono::steady_clock::now() + kInitTimeout);
  } else {
    const std::string text =
        error_of<TimeoutError>([&] { device::check_distinct_devices(members, under_test(), dev, soon); });
    expect_contains(text, "device communicator: expected every member to join the exchange of their devices in time");
    MPI_Barrier(MPI_COMM_WORLD);  // rank 1 joins late: the exchange completes as MPI progresses here
  }
  MPI_Barrier(MPI_COMM_WORLD);
  MPI_Comm_free(&members);
}

TEST(DeviceComm, AnAbortedCommunicatorFailsLaterWork) {
  MESHRT_SKIP_UNLESS_DEVICES(under_test(), 1);
  OnEmulated s;
  Stream other = emulated().create_stream(s.device);
  Tensor t = emulated().empty(TensorMeta({1}, DType::Float32, s.where()), other);
  s.comm->abort();
  // NCCL frees an aborted communicator: later work is refused when it is enqueued (the
  // emulator as CUDA), and the stream it would have run on stays healthy.
  const std::string text = error_of<UsageError>(
      [&] { s.comm->all_reduce(t.raw_data(), t.raw_data(), 1, DType::Float32, Reduction::Sum, other); });
  expect_contains(text, "all_reduce on");
  expect_contains(text, "expected a live communicator, found it aborted");
  other.synchronize();
  EXPECT_FALSE(other.error());
  ASSERT_TRUE(s.comm->async_error());
  expect_contains(*s.comm->async_error(), "was aborted");
}

// A handled failed allocation (the device has not the memory) must not stay the thread's
// last error (cudaGetLastError): the next kernel launch would report it as its own, and in
// a collective that drops the line's communicator for good. After an impossible
// allocation (a tensor and a pool block), a kernel and a collective (max over floats
// launches the NaN mask's kernel) work. The emulated device keeps CUDA's last error alike;
// MESHRT_ACCELERATOR=cuda runs it on a GPU (scripts/gpu-check.sh).
TEST(DeviceComm, AHandledOutOfMemoryIsNotTheNextKernelsError) {
  MESHRT_SKIP_UNLESS_DEVICES(under_test(), 1);
  OnEmulated s;
  const TensorMeta huge({std::int64_t{1} << 44}, DType::Float32, s.where());  // 64 TiB
  const std::string from_pool = error_of<SystemError>([&] { (void)emulated().empty(huge, s.stream); });
  if (under_test() == Accelerator::Emulated) expect_contains(from_pool, "out of memory");  // CUDA's pool: its own words
  expect_contains(error_of<SystemError>([&] { (void)Tensor::empty(huge); }), "out of memory");
  // A kernel: meshrt.full through its context, on this rank's device.
  constexpr std::uint64_t kKernelStream = 41;
  const Stream k = device::stream_for(kKernelStream, s.where());
  CallContext ctx(world_rank(), {}, {}, {}, kKernelStream, s.where(), s.where().is_cuda() ? k.native() : nullptr);
  Args args("meshrt.full", {Value{3}, Value("float32"), Value(7.0)});
  std::vector<Tensor> out = functions::lookup("meshrt.full").kernel(ctx, args);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_TRUE(fetched(out[0], k).equals(Tensor::from<float>({3}, {7, 7, 7})));
  // A collective, and its own kernel.
  const int n = world_size();
  Tensor x =
      device::to_device(Tensor::from<float>({2}, {static_cast<float>(world_rank() + 1), 2.0f}), s.where(), s.stream);
  s.comm->all_reduce(x.raw_data(), x.raw_data(), 2, DType::Float32, Reduction::Max, s.stream);
  EXPECT_TRUE(fetched(x, s.stream).equals(Tensor::from<float>({2}, {static_cast<float>(n), 2.0f})));
  EXPECT_FALSE(s.comm->async_error());
}

// A call that fails inside an operation's group (ncclGroupStart ... ncclGroupEnd; here the
// test fault, right after the group's start) must still end the group: NCCL keeps it per
// thread, and a group left open queues every later call of the thread and launches none,
// so the next all_to_all would complete at once with its output never written. The
// emulated communicator keeps NCCL's group alike; at one rank all_to_all and send_recv go
// through NCCL's group on a GPU too (scripts/gpu-check.sh). Every rank fails alike here.
TEST(DeviceComm, ACallThatFailsInsideAGroupLeavesNoGroupOpen) {
  MESHRT_SKIP_UNLESS_DEVICES(under_test(), 1);
  OnEmulated s;
  const int n = world_size();
  const int me = world_rank();
  // Block r of rank me holds 1000 (me + 1) + r: never what memory held before.
  auto block_values = [](int from, int to) { return 1000.0 * (from + 1) + to; };
  std::vector<double> mine;
  for (int r = 0; r < n; ++r) mine.push_back(block_values(me, r));
  const Tensor send = device::to_device(host_tensor(DType::Float32, mine), s.where(), s.stream);
  Tensor first = emulated().empty(send.meta(), s.stream);
  device::set_enqueue_fault_for_testing("a call failed inside the group");
  expect_contains(error_of<SystemError>(
                      [&] { s.comm->all_to_all(send.raw_data(), first.raw_data(), 1, DType::Float32, s.stream); }),
                  "all_to_all on");
  device::set_enqueue_fault_for_testing("a call failed inside the group");
  Tensor got = emulated().empty(TensorMeta({1}, DType::Float32, s.where()), s.stream);
  // Each rank sends its first element (block 0) to the next.
  const Communicator::PeerOp ring[] = {{true, (me + 1) % n, const_cast<void*>(send.raw_data()), 1},
                                       {false, (me + n - 1) % n, got.raw_data(), 1}};
  expect_contains(error_of<SystemError>([&] { s.comm->send_recv(ring, DType::Float32, s.stream); }),
                  "a call failed inside the group");
  // Later calls are launched: their outputs are written.
  Tensor again = emulated().empty(send.meta(), s.stream);
  s.comm->all_to_all(send.raw_data(), again.raw_data(), 1, DType::Float32, s.stream);
  std::vector<double> want;
  for (int r = 0; r < n; ++r) want.push_back(block_values(r, me));
  EXPECT_TRUE(fetched(again, s.stream).equals(host_tensor(DType::Float32, want)));
  s.comm->send_recv(ring, DType::Float32, s.stream);
  const int from = (me + n - 1) % n;
  EXPECT_TRUE(fetched(got, s.stream).equals(host_tensor(DType::Float32, {block_values(from, 0)})));
}

// MESHRT_TRACE: a worker command's device work (trace_command_begin/end around it) is
// recorded on its stream's track with the command's ident, inside the host's window of the
// run: on cuda one span per command from two CUDA events on the GPU's clock (also for a
// stream the command itself makes), on emulated each task the stream ran. Nothing when off.
TEST(DeviceTrace, ACommandsDeviceWorkIsRecordedOnItsStreamWithItsIdent) {
  MESHRT_SKIP_UNLESS_DEVICES(under_test(), 1);
  OnEmulated s;
  const device::Placement before_test = device::placement();
  device::set_placement({under_test(), s.device});
  namespace trace = detail::trace;
  const std::size_t n = std::size_t{1} << 18;
  const std::int64_t start = trace::now_ns();
  trace::enable(1024);
  auto command = [&](std::uint64_t ident, std::uint64_t stream_id, Stream* made) {
    trace::current_ident = ident;
    device::trace_command_begin(stream_id);
    const Stream st = device::stream_for(stream_id, s.where());
    if (made) *made = st;
    Tensor t = device::zeros(TensorMeta({static_cast<std::int64_t>(n)}, DType::Float32, s.where()), st);
    s.comm->all_reduce(t.raw_data(), t.raw_data(), n, DType::Float32, Reduction::Sum, st);
    device::trace_command_end(stream_id);
    st.synchronize();
    EXPECT_FALSE(st.error());
  };
  Stream existing = device::stream_for(9001, s.where());
  command(42, 9001, nullptr);
  Stream made;
  command(43, 9002, &made);  // its first use makes the stream
  device::trace_flush(true);
  trace::disable();
  command(44, 9001, nullptr);
  device::trace_flush(true);
  const std::int64_t end = trace::now_ns();
  const std::vector<trace::Event> events = trace::take_all();
  trace::current_ident = 0;
  device::release_stream(9001);
  device::release_stream(9002);
  device::set_placement(before_test);

  const bool cuda = under_test() == Accelerator::Cuda;
  // The timeline names a span's track as the device layer names its stream.
  for (const auto& [ident, stream] : {std::pair{42, existing.to_string()}, std::pair{43, made.to_string()}}) {
    std::size_t spans = 0;
    for (const trace::Event& e : events) {
      if (e.kind != trace::Kind::Device || e.ident != static_cast<std::uint64_t>(ident)) continue;
      ++spans;
      EXPECT_EQ(e.type, cuda ? 1 : 0) << "command " << ident;
      EXPECT_EQ(fmt::format("{}:{} stream {}", e.type == 1 ? "cuda" : "emulated", e.c, e.b), stream);
      EXPECT_FALSE(e.failed) << "command " << ident;
      EXPECT_LE(start, e.queued_ns) << "command " << ident;
      EXPECT_LE(e.queued_ns, e.start_ns) << "command " << ident;
      EXPECT_LE(e.start_ns, e.end_ns) << "command " << ident;
      EXPECT_LE(e.end_ns, end) << "command " << ident;
    }
    if (cuda) {
      EXPECT_EQ(spans, 1u) << "command " << ident << ": one span of its work on the GPU";
    } else {
      EXPECT_GE(spans, 2u) << "command " << ident << ": its zeros and its all_reduce";
    }
  }
  for (const trace::Event& e : events) EXPECT_NE(e.ident, 44u) << "recorded while the timeline was off";
}

// One visible device per rank, as the Slurm GPU templates give each rank one GPU: every
// rank's device is 0, and ranks are told apart by the physical device behind it, as NCCL
// does by PCI bus id (issue 29, N1). CTest runs it through tests/mpi/visible_devices.sh
// with MESHRT_DEVICE=0: each rank on its own device (a communicator is made), and every
// rank on one (refused on every rank, naming two ranks and the device).
TEST(DevicePlacement, RanksAreToldApartByThePhysicalDeviceNotItsIndex) {
  const char* visible = std::getenv("MESHRT_EMULATED_VISIBLE_DEVICES");
  if (under_test() != Accelerator::Emulated || visible == nullptr) {
    GTEST_SKIP() << "CTest runs it with MESHRT_EMULATED_VISIBLE_DEVICES set per rank";
  }
  const int dev = device::select_device(under_test(), MPI_COMM_WORLD);
  ASSERT_EQ(dev, 0);
  // The node's device behind index 0 is the first one listed, on every rank.
  const int mine = std::atoi(visible);
  std::vector<int> all(static_cast<std::size_t>(world_size()));
  MPI_Allgather(&mine, 1, MPI_INT, all.data(), 1, MPI_INT, MPI_COMM_WORLD);
  int first = -1;
  int second = -1;
  for (int i = 0; i < world_size() && first < 0; ++i) {
    for (int j = i + 1; j < world_size(); ++j) {
      if (all[static_cast<std::size_t>(i)] == all[static_cast<std::size_t>(j)]) {
        first = i;
        second = j;
        break;
      }
    }
  }
  if (first < 0) {
    emulated().make_current(dev);
    Stream stream = emulated().create_stream(dev);
    auto comm = device::create_communicator(under_test(), MPI_COMM_WORLD, dev, kInitTimeout);
    const Tensor in = device::to_device(Tensor::from<std::int32_t>({1}, {world_rank()}), on_device(dev), stream);
    Tensor out = emulated().empty(in.meta(), stream);
    comm->all_reduce(in.raw_data(), out.raw_data(), 1, DType::Int32, Reduction::Sum, stream);
    EXPECT_TRUE(fetched(out, stream).equals(Tensor::from<std::int32_t>({1}, {world_size() * (world_size() - 1) / 2})));
    comm->destroy();
  } else {
    const std::string text =
        usage_error([&] { (void)device::create_communicator(under_test(), MPI_COMM_WORLD, dev, kInitTimeout); });
    const std::string a = std::to_string(first);
    const std::string b = std::to_string(second);
    expect_contains(text, "expected one rank per device, found world ranks " + a + " and " + b + " (members " + a +
                              " and " + b + ") both on emulated:0 of one node (emulated device " +
                              std::to_string(mine) + " of the node)");
  }
}

TEST(DevicePlacement, LocalRankModuloTheDeviceCountAndTheOverride) {
  if (under_test() != Accelerator::Emulated) GTEST_SKIP() << "written for the emulated device count";
  // All ranks of a test run on one node: the local rank is the world rank.
  EXPECT_EQ(device::local_rank(MPI_COMM_WORLD), world_rank());
  EXPECT_EQ(device::select_device(Accelerator::Emulated, MPI_COMM_WORLD), world_rank() % emulated().device_count());
  const int last = emulated().device_count() - 1;
  setenv("MESHRT_DEVICE", std::to_string(last).c_str(), 1);
  EXPECT_EQ(device::select_device(Accelerator::Emulated, MPI_COMM_WORLD), last);
  setenv("MESHRT_DEVICE", "99", 1);
  expect_contains(usage_error([] { (void)device::select_device(Accelerator::Emulated, MPI_COMM_WORLD); }),
                  "setting MESHRT_DEVICE: expected a device of the emulated accelerator in 0.." +
                      std::to_string(emulated().device_count() - 1) + ", found 99");
  unsetenv("MESHRT_DEVICE");
}

}  // namespace
}  // namespace meshrt::test
