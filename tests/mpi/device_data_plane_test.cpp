// The device data plane on the emulated accelerator (NP 2 and 4): every reduction x
// dtype x scatter x in place over 1-D and 2-D meshes against a reference each rank
// computes; broken and mismatched inputs; sends between sub-meshes (disjoint,
// overlapping, self, chained); bitwise refusal. Inputs are made and results fetched in
// the order of the command's device stream, with a delay on every stream operation.
// MESHRT_ACCELERATOR=cuda runs the same tests on the cuda backend (NCCL, one GPU per rank;
// scripts/gpu-check.sh); CTest runs them on emulated.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <string>
#include <thread>

#include "../support/devices.hpp"
#include "comm_test_util.hpp"
#include "meshrt/internal/device.hpp"
#include "meshrt/internal/settings.hpp"

namespace meshrt::test {
namespace {

using ::testing::HasSubstr;

constexpr std::uint64_t kStream = 7;

constexpr std::array kReductions{Reduction::Stack,   Reduction::Sum, Reduction::Avg,
                                 Reduction::Product, Reduction::Min, Reduction::Max};
constexpr std::array kDTypes{DType::Bool,    DType::UInt8,    DType::Int32,   DType::Int64,
                             DType::Float16, DType::BFloat16, DType::Float32, DType::Float64};

// The accelerator under test: cuda when MESHRT_ACCELERATOR=cuda, else emulated (CTest).
device::Accelerator under_test() {
  return settings::kAccelerator.get() == "cuda" ? device::Accelerator::Cuda : device::Accelerator::Emulated;
}

// Places this rank on its device once, as the runtime does at start, with a delay on
// every emulated stream operation (unless the environment sets one) so that anything
// left unordered reads a wrong value.
Device here() {
  static const Device d = [] {
    setenv("MESHRT_EMULATED_DELAY_US", "100", 0);
    const int index = device::select_device(under_test(), MPI_COMM_WORLD);
    device::set_placement({under_test(), index});
    device::backend(under_test()).make_current(index);
    return device::rank_device(device::device_kind(under_test()));
  }();
  return d;
}

device::Stream stream() {
  return device::stream_for(kStream, here());
}

// The controller's factory (device index 0 stands for "each rank's own device").
TensorMeta factory(std::vector<std::int64_t> shape, DType dtype) {
  return TensorMeta(std::move(shape), dtype, Device::of(device::device_kind(under_test()), 0));
}

Tensor to_here(const Tensor& host) {
  return device::to_device(host, here(), stream());
}

Tensor fetched(const Tensor& t) {
  device::Fetch f = device::fetch(t, stream());
  f.done.synchronize();
  return f.host;
}

Outcome finish(Pending& p) {
  while (!p.test()) std::this_thread::yield();  // 4 ranks share 2 cores here
  return p.take();
}

std::vector<int> line_of(const NDSlice& ranks, std::size_t dim) {
  std::vector<std::int64_t> at = ranks.coordinates(world_rank());
  std::vector<int> out;
  for (std::int64_t k = 0; k < ranks.sizes()[dim]; ++k) {
    at[dim] = k;
    out.push_back(static_cast<int>(ranks.location(at)));
  }
  return out;
}

bool refused(Reduction red, DType dtype, bool scatter, bool inplace) {
  if (dtype == DType::Bool && (red == Reduction::Sum || red == Reduction::Avg || red == Reduction::Product))
    return true;
  if (red == Reduction::Avg && !is_floating(dtype)) return true;  // it would truncate
  if (red == Reduction::Stack && !scatter && inplace) return true;
  if (red != Reduction::Stack && scatter && inplace) return true;
  return false;
}

// The expected host output on this rank; `broken_rank` joins with zeros.
Tensor expected(Reduction red, const TensorMeta& in, bool scatter, const std::vector<int>& line, std::int64_t me,
                int broken_rank = -1) {
  const auto n = static_cast<std::int64_t>(line.size());
  const std::int64_t numel = in.numel();
  auto value = [&](int rank, std::int64_t i) {
    return rank == broken_rank ? 0.0 : fill_value(red, in.dtype(), rank, i);
  };
  std::vector<std::int64_t> shape = in.shape();
  if (red == Reduction::Stack && !scatter) shape.insert(shape.begin(), n);
  if (red != Reduction::Stack && scatter) shape.erase(shape.begin());
  Tensor out = TensorMeta(shape, in.dtype()).empty();
  dispatch_dtype(in.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* p = out.data<T>();
    if (red == Reduction::Stack && !scatter) {
      for (std::int64_t k = 0; k < n; ++k)
        for (std::int64_t i = 0; i < numel; ++i) p[k * numel + i] = from_double<T>(value(line[k], i));
    } else if (red == Reduction::Stack) {
      const std::int64_t chunk = numel / n;
      for (std::int64_t k = 0; k < n; ++k)
        for (std::int64_t j = 0; j < chunk; ++j) p[k * chunk + j] = from_double<T>(value(line[k], me * chunk + j));
    } else {
      const std::int64_t count = scatter ? numel / n : numel;
      for (std::int64_t j = 0; j < count; ++j) {
        std::vector<double> values;
        for (int r : line) values.push_back(value(r, (scatter ? me * count : 0) + j));
        p[j] = reduce_values<T>(red, values);
      }
    }
  });
  return out;
}

int sweep(WorkerMesh& mesh, std::size_t dim) {
  const std::string& dim_name = mesh.names()[dim];
  const std::vector<int> line = line_of(mesh.ranks(), dim);
  const std::int64_t n = mesh.size(dim);
  const std::int64_t me = mesh.coordinates()[dim];
  int ran = 0;
  for (Reduction red : kReductions) {
    for (DType dtype : kDTypes) {
      for (bool scatter : {false, true}) {
        for (bool inplace : {false, true}) {
          SCOPED_TRACE(fmt::format("{} {} scatter={} inplace={} dim {} of {}", name(red), name(dtype), scatter, inplace,
                                   dim_name, mesh.to_string()));
          const TensorMeta host_meta(scatter ? std::vector<std::int64_t>{n, 3} : std::vector<std::int64_t>{2, 3},
                                     dtype);
          const Tensor host_in = make_input(host_meta, red, world_rank());
          const Tensor input = to_here(host_in);
          std::unique_ptr<Pending> p;
          try {
            p = start_reduce_device(mesh, dim_name, red, scatter, inplace, input, factory(host_meta.shape(), dtype),
                                    kStream);
          } catch (const UsageError& e) {
            EXPECT_TRUE(refused(red, dtype, scatter, inplace)) << e.what();
            continue;
          }
          EXPECT_FALSE(refused(red, dtype, scatter, inplace));
          ++ran;
          const Outcome out = finish(*p);
          EXPECT_FALSE(out.broken.has_value());
          EXPECT_EQ(out.tensor.device(), here());
          EXPECT_EQ(compare(fetched(out.tensor), expected(red, host_meta, scatter, line, me)), "");
          EXPECT_EQ(out.tensor.same_storage(input), inplace);
          if (!inplace) {
            EXPECT_EQ(compare(fetched(input), host_in), "") << "out of place must leave the input alone";
          }
        }
      }
    }
  }
  return ran;
}

// Every combination that is not refused (counted independently of the sweep).
int expected_runs() {
  int n = 0;
  for (Reduction red : kReductions)
    for (DType dtype : kDTypes)
      for (bool scatter : {false, true})
        for (bool inplace : {false, true}) n += refused(red, dtype, scatter, inplace) ? 0 : 1;
  return n;
}

TEST(DeviceDataPlane, EveryReductionDtypeAndFlagOnTheWorldMesh) {
  MESHRT_SKIP_UNLESS_DEVICES(under_test(), 1);
  World world;
  WorkerMesh mesh({"x"}, NDSlice::row_major({world_size()}), world.comm());
  EXPECT_EQ(sweep(mesh, 0), expected_runs());
  EXPECT_FALSE(stream().error());
}

TEST(DeviceDataPlane, TwoDimensionalMeshBothDimensions) {
  MESHRT_SKIP_UNLESS_DEVICES(under_test(), 4);
  if (world_size() % 2 != 0) GTEST_SKIP() << "needs an even number of ranks, found " << world_size();
  World world;
  WorkerMesh mesh({"host", "gpu"}, NDSlice::row_major({2, world_size() / 2}), world.comm());
  EXPECT_EQ(sweep(mesh, 1), expected_runs());
  EXPECT_EQ(sweep(mesh, 0), expected_runs());
}

TEST(DeviceDataPlane, BrokenInputJoinsWithZerosAndAMismatchRaisesAfterCompletion) {
  MESHRT_SKIP_UNLESS_DEVICES(under_test(), 1);
  World world;
  WorkerMesh mesh({"x"}, NDSlice::row_major({world_size()}), world.comm());
  const int me = world_rank();
  const auto n = static_cast<std::int64_t>(world_size());
  const TensorMeta host_meta({n, 4}, DType::Float32);
  const std::vector<int> line = line_of(mesh.ranks(), 0);
  Input input = me == 1 ? Input(DependentOnError{42}) : Input(to_here(make_input(host_meta, Reduction::Sum, me)));
  auto p = start_reduce_device(mesh, "x", Reduction::Sum, false, false, std::move(input),
                               factory({n, 4}, DType::Float32), kStream);
  const Outcome out = finish(*p);
  EXPECT_EQ(out.broken.has_value(), me == 1);
  EXPECT_EQ(compare(fetched(out.tensor), expected(Reduction::Sum, host_meta, false, line, me, 1)), "");

  // Rank 0's input has the wrong shape: it joins with zeros, and only it raises.
  const Tensor wrong = to_here(make_input(TensorMeta({5}, DType::Int32), Reduction::Sum, me));
  const Tensor right = to_here(make_input(TensorMeta({4}, DType::Int32), Reduction::Sum, me));
  auto q = start_reduce_device(mesh, "x", Reduction::Sum, false, false, me == 0 ? wrong : right,
                               factory({4}, DType::Int32), kStream);
  while (!q->test()) {
  }
  if (me == 0) {
    const std::string text = usage_error([&] { (void)q->take(); });
    EXPECT_THAT(
        text, HasSubstr("all_reduce: expected an input int32[4] on " + std::string(device::name(under_test())) + ":"));
    // And where: the dimension, the mesh and this rank.
    EXPECT_THAT(text, HasSubstr("peers complete (dimension 'x' of mesh "));
    EXPECT_THAT(text, HasSubstr(", world rank 0)"));
  } else {
    EXPECT_EQ(
        compare(fetched(q->take().tensor), expected(Reduction::Sum, TensorMeta({4}, DType::Int32), false, line, me, 0)),
        "");
  }
}

TEST(DeviceDataPlane, RefusesBitwiseReductions) {
  World world;
  WorkerMesh mesh({"x"}, NDSlice::row_major({world_size()}), world.comm());
  EXPECT_THAT(usage_error([&] {
                (void)start_reduce_device(mesh, "x", Reduction::Bxor, false, false, DependentOnError{1},
                                          factory({4}, DType::Int32), kStream);
              }),
              HasSubstr("bitwise reduction bxor is not supported by NCCL"));
}

// from[i] sends to to[i] (to[to_order[i]] when given); every rank checks what it received
// against the sender's data.
void check_send(const NDSlice& from, const NDSlice& to, MPI_Comm p2p, std::vector<std::int64_t> to_order = {}) {
  const int me = world_rank();
  const Tensor mine = to_here(Tensor::from<std::int64_t>({3}, {me, 10 * me, 100 + me}));
  auto p = start_send_tensor_device(p2p, me, from, to, mine, factory({3}, DType::Int64), kStream, to_order);
  const Outcome out = finish(*p);
  if (!to.contains(me)) {
    EXPECT_FALSE(out.tensor.defined());
    return;
  }
  auto position = static_cast<std::int64_t>(to.index(me));
  if (!to_order.empty()) position = std::find(to_order.begin(), to_order.end(), position) - to_order.begin();
  const auto sender = static_cast<std::int64_t>(from[position]);
  EXPECT_TRUE(fetched(out.tensor).equals(Tensor::from<std::int64_t>({3}, {sender, 10 * sender, 100 + sender})))
      << "from " << sender << " to " << me << " in " << from.to_string() << " -> " << to.to_string();
}

TEST(DeviceDataPlane, SendsBetweenSubMeshesOverExactlyTheirRanks) {
  MESHRT_SKIP_UNLESS_DEVICES(under_test(), 2);
  World world;
  const int n = world_size();
  const int half = n / 2;
  // Disjoint halves, swapped; then self; then a chain of shifted ones (overlapping).
  check_send(NDSlice(0, {half}, {1}), NDSlice(half, {half}, {1}), world.comm());
  check_send(NDSlice(half, {half}, {1}), NDSlice(0, {half}, {1}), world.comm());
  check_send(NDSlice::row_major({n}), NDSlice::row_major({n}), world.comm());
  if (n >= 3) {
    check_send(NDSlice(0, {n - 1}, {1}), NDSlice(1, {n - 1}, {1}), world.comm());
    check_send(NDSlice(1, {n - 1}, {1}), NDSlice(0, {n - 1}, {1}), world.comm());
  }
  EXPECT_FALSE(stream().error());
}

// Ranks mapped to themselves copy locally and take no part in the communicator, which
// spans the moving ranks only: every rank computes the same members (issue 29, N2).
TEST(DeviceDataPlane, SendsWithFixedPointsLeaveTheSelfMappedRanksOut) {
  if (world_size() < 4) GTEST_SKIP() << "needs 4 ranks (a 2x2 transpose)";
  World world;
  // The 2x2 transpose, as a permutation of the row-major world (0->0, 1->2, 2->1, 3->3),
  // and as a pair of slices whose strides are swapped.
  check_send(NDSlice::row_major({4}), NDSlice::row_major({4}), world.comm(), {0, 2, 1, 3});
  check_send(NDSlice(0, {2, 2}, {2, 1}), NDSlice(0, {2, 2}, {1, 2}), world.comm());
  // A mapping with one fixed point that leaves rank 3 out: 0->0, 1->2, 2->1.
  check_send(NDSlice(0, {3}, {1}), NDSlice(0, {3}, {1}), world.comm(), {0, 2, 1});
  // Two fixed points and a pair (0->1, 1->0, 2->2, 3->3): the pair's communicator.
  check_send(NDSlice::row_major({4}), NDSlice::row_major({4}), world.comm(), {1, 0, 2, 3});
  EXPECT_FALSE(stream().error());
}

TEST(DeviceDataPlane, MaxAndMinPropagateNaNFromAnyRank) {
  MESHRT_SKIP_UNLESS_DEVICES(under_test(), 1);
  World world;
  WorkerMesh mesh({"x"}, NDSlice::row_major({world_size()}), world.comm());
  expect_nan_propagates(world_size(), [&](Reduction red, bool scatter, const Tensor& in) {
    const Outcome out = finish(
        *start_reduce_device(mesh, "x", red, scatter, false, to_here(in), factory(in.shape(), in.dtype()), kStream));
    EXPECT_FALSE(out.broken.has_value());
    return fetched(out.tensor);
  });
  EXPECT_FALSE(stream().error());
}

// An error at enqueue is fatal to an NCCL communicator: it is aborted and dropped, and the
// next operation over those ranks is refused naming why, instead of being posted into it
// (issue 29, N7). Every rank fails alike here, so none waits for a peer.
TEST(DeviceDataPlane, AnErrorAtEnqueueDropsTheCommunicator) {
  if (under_test() != device::Accelerator::Emulated) GTEST_SKIP() << "the fault is the emulator's test switch";
  World world;
  WorkerMesh mesh({"x"}, NDSlice::row_major({world_size()}), world.comm());
  const auto reduce = [&] {
    return start_reduce_device(mesh, "x", Reduction::Sum, false, false,
                               to_here(Tensor::from<std::int32_t>({1}, {world_rank()})), factory({1}, DType::Int32),
                               kStream);
  };
  const int n = world_size();
  EXPECT_TRUE(fetched(finish(*reduce()).tensor).equals(Tensor::from<std::int32_t>({1}, {n * (n - 1) / 2})));
  device::set_enqueue_fault_for_testing("an enqueue error for the test");
  expect_contains(error_of<SystemError>([&] { (void)reduce(); }), "an enqueue error for the test");
  const std::string next = usage_error([&] { (void)reduce(); });
  expect_contains(next,
                  "expected a live one, found the one this rank had failed (this rank's part failed at or "
                  "before its enqueue: all_reduce on emulated communicator");
  expect_contains(next, "an enqueue error for the test");
  free_device_communicators();  // as a new job: the tests after this one make fresh ones
  EXPECT_FALSE(stream().error());
}

// An operation that completed is not failed by an error its communicator reports after
// it (a peer that failed since: that is later work's to fail). DevicePending::test looks at
// the operation's completion before the communicator's asynchronous error; it used to fail
// the finished reduction and drop its communicator.
TEST(DeviceDataPlane, ACompletedOperationIsNotFailedByALaterError) {
  if (under_test() != device::Accelerator::Emulated) GTEST_SKIP() << "the failure is the emulator's test switch";
  World world;
  WorkerMesh mesh({"x"}, NDSlice::row_major({world_size()}), world.comm());
  const int n = world_size();
  std::unique_ptr<Pending> p = start_reduce_device(mesh, "x", Reduction::Sum, false, false,
                                                   to_here(Tensor::from<std::int32_t>({1}, {world_rank()})),
                                                   factory({1}, DType::Int32), kStream);
  stream().synchronize();  // it ran on every rank
  MPI_Barrier(MPI_COMM_WORLD);
  device::set_async_error_for_testing("a peer failed after the reduction");
  EXPECT_TRUE(fetched(finish(*p).tensor).equals(Tensor::from<std::int32_t>({1}, {n * (n - 1) / 2})));
  free_device_communicators();  // the failed one is aborted; the tests after this one make fresh ones
  EXPECT_FALSE(stream().error());
}

// Last (gtest runs a file's tests in order): the cache is freed while MPI is up, and the
// next operation makes a fresh communicator.
TEST(DeviceDataPlane, FreedCommunicatorsAreMadeAgain) {
  MESHRT_SKIP_UNLESS_DEVICES(under_test(), 1);
  World world;
  WorkerMesh mesh({"x"}, NDSlice::row_major({world_size()}), world.comm());
  free_device_communicators();
  auto p = start_reduce_device(mesh, "x", Reduction::Max, false, false,
                               to_here(Tensor::from<std::int32_t>({1}, {world_rank()})), factory({1}, DType::Int32),
                               kStream);
  EXPECT_TRUE(fetched(finish(*p).tensor).equals(Tensor::from<std::int32_t>({1}, {world_size() - 1})));
  free_device_communicators();
}

}  // namespace
}  // namespace meshrt::test
