// The MPI data plane's Reduce: every reduction x dtype x in/out of place x scatter x
// completion mode, over every dimension of 1-, 2- and 3-D meshes (sliced and strided on 6
// ranks), against a reference every rank computes locally; broken and mismatched inputs;
// every usage error with its text.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <time.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "comm_test_util.hpp"

namespace meshrt::test {
namespace {

using ::testing::HasSubstr;

constexpr std::array kReductions{Reduction::Stack, Reduction::Sum,  Reduction::Avg, Reduction::Product, Reduction::Min,
                                 Reduction::Max,   Reduction::Band, Reduction::Bor, Reduction::Bxor};
constexpr std::array kDTypes{DType::Bool,    DType::UInt8,    DType::Int32,   DType::Int64,
                             DType::Float16, DType::BFloat16, DType::Float32, DType::Float64};

// The world ranks of this rank's line along `dim`, computed from the NDSlice alone.
std::vector<int> line_of(const NDSlice& ranks, std::size_t dim) {
  std::vector<std::int64_t> at = ranks.coordinates(world_rank());
  std::vector<int> out;
  for (std::int64_t k = 0; k < ranks.sizes()[dim]; ++k) {
    at[dim] = k;
    out.push_back(static_cast<int>(ranks.location(at)));
  }
  return out;
}

// Which combinations the data plane must refuse (docs/ARCHITECTURE.md section 3.6: the table and the dtype rules).
bool refused(Reduction red, DType dtype, bool scatter, bool inplace) {
  const bool stack = red == Reduction::Stack;
  if (is_bitwise(red) && is_floating(dtype)) return true;
  if (dtype == DType::Bool && (red == Reduction::Sum || red == Reduction::Avg || red == Reduction::Product))
    return true;
  if (red == Reduction::Avg && !is_floating(dtype)) return true;  // it would truncate
  if (stack && !scatter && inplace) return true;
  if (!stack && scatter && inplace) return true;
  return false;
}

// The expected output on this rank. `broken_rank` joins with zeros.
Tensor expected_output(Reduction red, const TensorMeta& in_meta, bool scatter, const std::vector<int>& line,
                       std::int64_t my_coord, int broken_rank = -1) {
  const auto n = static_cast<std::int64_t>(line.size());
  const std::int64_t numel = in_meta.numel();
  auto value = [&](int rank, std::int64_t i) {
    return rank == broken_rank ? 0.0 : fill_value(red, in_meta.dtype(), rank, i);
  };
  std::vector<std::int64_t> shape = in_meta.shape();
  if (red == Reduction::Stack && !scatter) shape.insert(shape.begin(), n);
  if (red != Reduction::Stack && scatter) shape.erase(shape.begin());
  const TensorMeta out_meta = in_meta.with_shape(shape);
  Tensor out = out_meta.empty();
  dispatch_dtype(in_meta.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* p = static_cast<T*>(out.raw_data());
    if (red == Reduction::Stack && !scatter) {
      for (std::int64_t k = 0; k < n; ++k) {
        for (std::int64_t i = 0; i < numel; ++i)
          p[k * numel + i] = from_double<T>(value(line[static_cast<std::size_t>(k)], i));
      }
    } else if (red == Reduction::Stack) {
      const std::int64_t chunk = numel / n;
      for (std::int64_t k = 0; k < n; ++k) {
        for (std::int64_t j = 0; j < chunk; ++j) {
          p[k * chunk + j] = from_double<T>(value(line[static_cast<std::size_t>(k)], my_coord * chunk + j));
        }
      }
    } else {
      const std::int64_t count = scatter ? numel / n : numel;
      const std::int64_t base = scatter ? my_coord * count : 0;
      for (std::int64_t j = 0; j < count; ++j) {
        std::vector<double> values;
        for (int r : line) values.push_back(value(r, base + j));
        p[j] = reduce_values<T>(red, values);
      }
    }
  });
  return out;
}

// Where the inputs live: meshrt's own (64-byte aligned) storage, or memory adopted from
// another library (a numpy array through DLPack) at element alignment only.
enum class Memory { Own, Foreign };

// `t` copied into foreign memory 16 bytes plus one element past a cache line: an int64 at
// an address that is 8- but not 16-aligned, a uint8 at an odd one.
Tensor in_foreign_memory(const Tensor& t) {
  auto block = std::make_shared<std::vector<std::byte>>(t.nbytes() + 128);
  const auto base = reinterpret_cast<std::uintptr_t>(block->data());
  const std::uintptr_t at = (base + 63) / 64 * 64 + 16 + element_size(t.dtype());
  Tensor out = Tensor::adopt_host(t.meta(), std::shared_ptr<void>(block, reinterpret_cast<void*>(at)));
  out.copy_from(t);
  return out;
}

// Runs the whole sweep over one dimension of `mesh`; returns how many combinations ran.
int sweep(WorkerMesh& mesh, std::size_t dim, Completion completion, Memory memory = Memory::Own) {
  const std::string& dim_name = mesh.names()[dim];
  const std::vector<int> line = line_of(mesh.ranks(), dim);
  const std::int64_t n = mesh.size(dim);
  const std::int64_t my_coord = mesh.coordinates()[dim];
  int ran = 0;
  for (Reduction red : kReductions) {
    for (DType dtype : kDTypes) {
      for (bool scatter : {false, true}) {
        for (bool inplace : {false, true}) {
          SCOPED_TRACE(fmt::format("{} {} scatter={} inplace={} dim {} of {} ({})", name(red), name(dtype), scatter,
                                   inplace, dim_name, mesh.to_string(),
                                   completion == Completion::Blocking ? "blocking"
                                   : completion == Completion::Thread ? "comm thread"
                                   : completion == Completion::Auto   ? "auto"
                                                                      : "non-blocking"));
          const TensorMeta meta(scatter ? std::vector<std::int64_t>{n, 3} : std::vector<std::int64_t>{2, 3}, dtype);
          const Tensor own = make_input(meta, red, world_rank());
          const Tensor input = memory == Memory::Own ? own : in_foreign_memory(own);
          const Tensor pristine = input.clone();
          std::unique_ptr<Pending> p;
          bool threw = false;
          try {
            p = start_reduce(mesh, dim_name, red, scatter, inplace, input, meta, completion);
          } catch (const UsageError&) {
            threw = true;
          }
          EXPECT_EQ(threw, refused(red, dtype, scatter, inplace));
          if (threw) continue;
          ++ran;
          const Outcome out = wait(*p);
          EXPECT_FALSE(out.broken.has_value());
          EXPECT_EQ(compare(out.tensor, expected_output(red, meta, scatter, line, my_coord)), "");
          const bool shares = out.tensor.same_storage(input);
          EXPECT_EQ(shares, inplace) << "in place must reuse the input's storage, out of place must not";
          if (!inplace) {
            EXPECT_EQ(compare(input, pristine), "") << "out of place must leave the input alone";
          }
        }
      }
    }
  }
  return ran;
}

// Every combination that is not refused: 9 reductions x 8 dtypes x 4 flag pairs, less
// the refusals of refused() (counted independently here).
int expected_runs() {
  int n = 0;
  for (Reduction red : kReductions)
    for (DType dtype : kDTypes)
      for (bool scatter : {false, true})
        for (bool inplace : {false, true}) n += refused(red, dtype, scatter, inplace) ? 0 : 1;
  return n;
}

TEST(CommReduce, WorldMeshEveryCompletion) {
  World world;
  WorkerMesh mesh({"x"}, NDSlice::row_major({world_size()}), world.comm());
  EXPECT_EQ(sweep(mesh, 0, Completion::NonBlocking), expected_runs());
  EXPECT_EQ(sweep(mesh, 0, Completion::Blocking), expected_runs());
  EXPECT_EQ(sweep(mesh, 0, Completion::Thread), expected_runs());
  EXPECT_EQ(sweep(mesh, 0, Completion::Auto), expected_runs());
}

// Every kernel, copy and MPI datatype works at element alignment: memory adopted from
// numpy or torch runs in place, without a copy to realign it.
TEST(CommReduce, ForeignMemoryAtElementAlignment) {
  World world;
  WorkerMesh mesh({"x"}, NDSlice::row_major({world_size()}), world.comm());
  EXPECT_EQ(sweep(mesh, 0, Completion::NonBlocking, Memory::Foreign), expected_runs());
  EXPECT_EQ(sweep(mesh, 0, Completion::Thread, Memory::Foreign), expected_runs());
}

TEST(CommReduce, TwoDimensionalMesh) {
  if (world_size() < 4 || world_size() % 2 != 0) GTEST_SKIP() << "needs an even world of 4 or more";
  World world;
  WorkerMesh mesh({"host", "gpu"}, NDSlice::row_major({2, world_size() / 2}), world.comm());
  EXPECT_EQ(sweep(mesh, 1, Completion::NonBlocking), expected_runs());
  EXPECT_EQ(sweep(mesh, 0, Completion::NonBlocking), expected_runs());
}

TEST(CommReduce, StridedSlicesAndThreeDimensions) {
  if (world_size() != 6) GTEST_SKIP() << "written for 6 ranks";
  World world;
  const int me = world_rank();
  {
    // NDSlice(1, [3], [2]) and NDSlice(0, [3], [2]) reduce at the same time.
    WorkerMesh mesh({"x"}, NDSlice(me % 2, {3}, {2}), world.comm());
    EXPECT_EQ(sweep(mesh, 0, Completion::NonBlocking), expected_runs());
  }
  {
    WorkerMesh mesh({"a", "b", "c"}, NDSlice::row_major({1, 2, 3}), world.comm());
    for (std::size_t d = 0; d < 3; ++d) EXPECT_EQ(sweep(mesh, d, Completion::NonBlocking), expected_runs());
  }
  if (me >= 3) {
    // host=1 of a 2x3 mesh on the comm thread while ranks 0..2 run the blocking sweep
    // on host=0.
    WorkerMesh mesh({"gpu"}, NDSlice::row_major({2, 3}).at(0, 1), world.comm());
    EXPECT_EQ(sweep(mesh, 0, Completion::Thread), expected_runs());
  } else {
    WorkerMesh mesh({"gpu"}, NDSlice::row_major({2, 3}).at(0, 0), world.comm());
    EXPECT_EQ(sweep(mesh, 0, Completion::Blocking), expected_runs());
  }
}

// Coordinate 1 of the line is broken: it joins with zeros, its outcome is marked broken,
// its peers' are not (they cannot know), and every value is the zeros-substituted one.
TEST(CommReduce, BrokenInputJoinsWithZeros) {
  World world;
  WorkerMesh mesh({"x"}, NDSlice::row_major({world_size()}), world.comm());
  const int me = world_rank();
  const int broken_rank = 1;
  const std::vector<int> line = line_of(mesh.ranks(), 0);
  const auto n = static_cast<std::int64_t>(world_size());
  struct Case {
    Reduction red;
    bool scatter, inplace;
  };
  for (Case c :
       {Case{Reduction::Sum, false, false}, Case{Reduction::Max, false, true}, Case{Reduction::Stack, false, false},
        Case{Reduction::Stack, true, true}, Case{Reduction::Avg, true, false}}) {
    for (Completion completion : {Completion::NonBlocking, Completion::Blocking, Completion::Thread}) {
      SCOPED_TRACE(fmt::format("{} scatter={} inplace={}", name(c.red), c.scatter, c.inplace));
      const TensorMeta meta({n, 4}, DType::Float32);
      Input input = me == broken_rank ? Input(DependentOnError{42}) : Input(make_input(meta, c.red, me));
      auto p = start_reduce(mesh, "x", c.red, c.scatter, c.inplace, std::move(input), meta, completion);
      const Outcome out = wait(*p);
      if (me == broken_rank) {
        ASSERT_TRUE(out.broken.has_value());
        EXPECT_EQ(out.broken->ident, 42u);
      } else {
        EXPECT_FALSE(out.broken.has_value());
      }
      EXPECT_EQ(compare(out.tensor, expected_output(c.red, meta, c.scatter, line, me, broken_rank)), "");
    }
  }
}

// An input that does not match the factory joins with zeros (so the peers complete) and
// raises on take() on that rank only.
TEST(CommReduce, MismatchedInputRaisesAfterCompletion) {
  World world;
  WorkerMesh mesh({"x"}, NDSlice::row_major({world_size()}), world.comm());
  const int me = world_rank();
  const TensorMeta meta({4}, DType::Int32);
  const Tensor input =
      me == 0 ? make_input(TensorMeta({5}, DType::Int32), Reduction::Sum, me) : make_input(meta, Reduction::Sum, me);
  auto p = start_reduce(mesh, "x", Reduction::Sum, false, false, input, meta);
  if (me == 0) {
    while (!p->test()) {
    }
    try {
      (void)p->take();
      ADD_FAILURE() << "expected a UsageError";
    } catch (const UsageError& e) {
      EXPECT_THAT(e.what(), HasSubstr("all_reduce: expected an input int32[4] on cpu as the controller computed, found "
                                      "int32[5] on cpu; this rank joined with zeros so that its peers complete "
                                      "(dimension 'x' of mesh [x="));
      EXPECT_THAT(e.what(), HasSubstr("world rank 0)"));
    }
  } else {
    const Outcome out = wait(*p);
    EXPECT_EQ(compare(out.tensor, expected_output(Reduction::Sum, meta, false, line_of(mesh.ranks(), 0), me, 0)), "");
  }
}

TEST(CommReduce, UsageErrors) {
  World world;
  const int n = world_size();
  WorkerMesh mesh({"gpu"}, NDSlice::row_major({n}), world.comm());
  const std::string where = fmt::format(" (dimension 'gpu' of mesh [gpu={}], world rank {})", n, world_rank());
  const TensorMeta f32({n, 2}, DType::Float32);
  auto start = [&](std::string_view dim, Reduction red, bool scatter, bool inplace, const TensorMeta& meta) {
    // The input is a broken marker: no tensor of a (possibly absent) device is needed.
    return usage_error([&] { (void)start_reduce(mesh, dim, red, scatter, inplace, DependentOnError{1}, meta); });
  };
  EXPECT_EQ(start("gpu", Reduction::Bxor, false, false, f32),
            "bitwise reduction bxor needs an integer or bool dtype, found float32" + where);
  EXPECT_EQ(start("gpu", Reduction::Band, false, false, f32.with_shape({2}).with_device(Device::cpu())),
            "bitwise reduction band needs an integer or bool dtype, found float32" + where);
  EXPECT_EQ(start("gpu", Reduction::Sum, false, false, TensorMeta({2}, DType::Bool)),
            "reduction sum needs a numeric dtype, found bool; on bool use max or bor (any), min or band (all), bxor "
            "(parity)" +
                where);
  EXPECT_EQ(start("host", Reduction::Sum, false, false, f32),
            fmt::format("device mesh [gpu={}]: unknown dimension 'host', expected one of 'gpu' (world rank {})", n,
                        world_rank()));
  EXPECT_EQ(start("gpu", Reduction::Stack, false, true, f32),
            fmt::format("stack (all_gather) cannot run in place: its output [{}, ...] is larger than its input "
                        "float32[{}, 2] on cpu{}",
                        n, n, where));
  EXPECT_EQ(start("gpu", Reduction::Sum, true, true, f32),
            fmt::format("sum with scatter (reduce_scatter) cannot run in place: its output float32[2] on cpu is "
                        "smaller than its input float32[{}, 2] on cpu{}",
                        n, where));
  EXPECT_EQ(start("gpu", Reduction::Sum, true, false, TensorMeta({n + 1, 2}, DType::Float32)),
            fmt::format("sum with scatter over a dimension of size {} needs an input with size(0) == {}, found "
                        "float32[{}, 2] on cpu{}",
                        n, n, n + 1, where));
  EXPECT_EQ(start("gpu", Reduction::Stack, true, false, TensorMeta({}, DType::Float32)),
            fmt::format("stack with scatter over a dimension of size {} needs an input with size(0) == {}, found "
                        "float32[] on cpu{}",
                        n, n, where));
  EXPECT_THAT(start("gpu", Reduction::Sum, false, false, f32.with_device(Device::cuda(0))),
              HasSubstr("sum over MPI: expected a CPU tensor, found float32[" + std::to_string(n) +
                        ", 2] on cuda:0; CUDA tensors go through the NCCL data plane"));
  // take() before completion, and twice.
  auto p = start_reduce(mesh, "gpu", Reduction::Sum, false, false, f32.zeros(), f32);
  const Outcome out = wait(*p);
  // A second take() is a meshrt bug (the worker takes once), not the caller's mistake.
  EXPECT_THROW(
      {
        try {
          (void)p->take();
        } catch (const InternalError& e) {
          EXPECT_THAT(e.what(), HasSubstr("meshrt internal error"));
          EXPECT_THAT(e.what(), HasSubstr("Pending::take: expected an outcome not yet taken, found it taken: "
                                          "all_reduce sum over dimension 'gpu' of mesh [gpu="));
          EXPECT_EQ(e.file(), "src/comm/data_plane.cpp");
          throw;
        }
      },
      InternalError);
  EXPECT_TRUE(out.tensor.defined());
}

TEST(CommReduce, DescribeNamesTheCollectiveAndPeers) {
  if (world_size() != 4) GTEST_SKIP() << "written for 4 ranks";
  World world;
  WorkerMesh mesh({"host", "gpu"}, NDSlice::row_major({2, 2}), world.comm());
  const TensorMeta meta({1024}, DType::Float32);
  auto p = start_reduce(mesh, "host", Reduction::Sum, false, false, meta.zeros(), meta);
  const int me = world_rank();
  EXPECT_EQ(p->describe(), fmt::format("all_reduce sum over dimension 'host' of mesh [host=2, gpu=2], 4096 bytes, "
                                       "peers world ranks {},{} (MPI)",
                                       me % 2, me % 2 + 2));
  (void)wait(*p);
}

// Outputs of 256 KiB and more reuse the buffer of a dropped output (warm memory), never
// one still held, and stay correct.
TEST(CommReduce, LargeOutputsComeFromThePool) {
  World world;
  WorkerMesh mesh({"x"}, NDSlice::row_major({world_size()}), world.comm());
  const TensorMeta meta({world_size(), 1 << 16}, DType::Float32);  // 256 KiB per rank
  const Tensor input = make_input(meta, Reduction::Sum, world_rank());
  const std::vector<int> line = line_of(mesh.ranks(), 0);
  const Tensor expected = expected_output(Reduction::Sum, meta, false, line, world_rank());
  const OutputPoolStats before = output_pool_stats();
  const void* first_address = nullptr;
  {
    const Outcome first = reduce(mesh, "x", Reduction::Sum, false, false, input, meta);
    EXPECT_EQ(compare(first.tensor, expected), "");
    first_address = first.tensor.raw_data();
  }
  const Outcome second = reduce(mesh, "x", Reduction::Sum, false, false, input, meta);
  const Outcome third = reduce(mesh, "x", Reduction::Sum, false, false, input, meta);
  EXPECT_EQ(second.tensor.raw_data(), first_address) << "the dropped output's buffer is reused";
  EXPECT_NE(third.tensor.raw_data(), second.tensor.raw_data()) << "a held output is never handed out again";
  EXPECT_EQ(compare(second.tensor, expected), "");
  EXPECT_EQ(compare(third.tensor, expected), "");
  const OutputPoolStats after = output_pool_stats();
  EXPECT_GE(after.hits - before.hits, 1u);
  // Small outputs bypass the pool.
  const TensorMeta small({4}, DType::Float32);
  (void)reduce(mesh, "x", Reduction::Sum, false, false, small.zeros(), small);
  EXPECT_EQ(output_pool_stats().hits + output_pool_stats().misses, after.hits + after.misses);
}

double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// A peer 300 ms late: wait() on the non-blocking path backs off to sleeping, so the
// waiting thread uses a small fraction of a core, not all of it.
TEST(CommReduce, IdleWaitDoesNotBurnACore) {
  World world;
  WorkerMesh mesh({"x"}, NDSlice::row_major({world_size()}), world.comm());
  const TensorMeta meta({16}, DType::Float32);
  // The first operation on a dimension creates its communicator with MPI_Comm_split,
  // which blocks (and polls) until the whole line arrives: create it first.
  (void)mesh.dim_comm(0);
  if (world_rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const auto wall0 = std::chrono::steady_clock::now();
  const double cpu0 = thread_cpu_seconds();
  auto p = start_reduce(mesh, "x", Reduction::Sum, false, false, meta.zeros(), meta, Completion::NonBlocking);
  (void)wait(*p);
  const double cpu = thread_cpu_seconds() - cpu0;
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();
  if (world_rank() != 0) {
    EXPECT_GT(wall, 0.2) << "the late peer should have held this rank";
    EXPECT_LT(cpu, 0.25 * wall) << "waited " << wall << " s using " << cpu << " s of CPU";
  }
}

// Dropping an operation before it completes waits for it (MPI still uses its buffers);
// the next operation then runs normally.
TEST(CommReduce, DroppingAPendingOperationWaitsForIt) {
  World world;
  WorkerMesh mesh({"x"}, NDSlice::row_major({world_size()}), world.comm());
  const TensorMeta meta({world_size(), 1 << 17}, DType::Float32);  // 512 KiB per rank: Auto uses the thread
  const Tensor input = make_input(meta, Reduction::Sum, world_rank());
  const Tensor expected = expected_output(Reduction::Sum, meta, false, line_of(mesh.ranks(), 0), world_rank());
  for (Completion completion : {Completion::NonBlocking, Completion::Thread, Completion::Auto}) {
    { auto dropped = start_reduce(mesh, "x", Reduction::Sum, false, false, input, meta, completion); }
    const Outcome out = wait(*start_reduce(mesh, "x", Reduction::Sum, false, false, input, meta, completion));
    EXPECT_EQ(compare(out.tensor, expected), "");
  }
}

TEST(CommReduce, EmptyAndZeroDimensionalTensors) {
  World world;
  WorkerMesh mesh({"x"}, NDSlice::row_major({world_size()}), world.comm());
  const TensorMeta empty({0, 3}, DType::Float32);
  EXPECT_EQ(wait(*start_reduce(mesh, "x", Reduction::Sum, false, false, empty.zeros(), empty)).tensor.numel(), 0);
  const TensorMeta scalar({}, DType::Int64);
  const Outcome out =
      reduce(mesh, "x", Reduction::Sum, false, false, make_input(scalar, Reduction::Sum, world_rank()), scalar);
  EXPECT_EQ(compare(out.tensor, expected_output(Reduction::Sum, scalar, false, line_of(mesh.ranks(), 0), world_rank())),
            "");
}

TEST(CommReduce, MaxAndMinPropagateNaNFromAnyRank) {
  World world;
  WorkerMesh mesh({"x"}, NDSlice::row_major({world_size()}), world.comm());
  expect_nan_propagates(world_size(), [&](Reduction red, bool scatter, const Tensor& in) {
    const Outcome out = wait(*start_reduce(mesh, "x", red, scatter, false, Input(in), in.meta()));
    EXPECT_FALSE(out.broken.has_value());
    return out.tensor;
  });
}

}  // namespace
}  // namespace meshrt::test
