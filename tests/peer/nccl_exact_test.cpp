// nccl-tests' exactness, ported to meshrt's reductions: CheckData and its #wrong count in
//   https://github.com/NVIDIA/nccl-tests/blob/a0b82b2260cf5152b9f8c061bbf7eaf0ba096432/src/common.cu
// and the inputs and expected outputs of
//   https://github.com/NVIDIA/nccl-tests/blob/a0b82b2260cf5152b9f8c061bbf7eaf0ba096432/verifiable/verifiable.cu
// (the properties and closed forms, written afresh).
//
// Every rank's input is made of small integers times powers of two, so that the sum, the
// product, the minimum and the maximum over the ranks are exact in every dtype whatever
// order the reduction runs in: the result must equal the closed form bit for bit, and avg
// (a sum, then a division) must be within 2 ulps of it. Every dtype meshrt has, through
// every collective a reduction becomes (all_reduce and all_to_all in place and out of
// place, reduce_scatter and all_gather out of place), at counts from 1 to
// PEER_NCCL_MAX_COUNT elements per rank (2^20 by default; counts() says which run where):
// on the CPU (MPI) and on the job's accelerator (the emulated one under CTest; NCCL with
// MESHRT_ACCELERATOR=cuda, where nccl-tests goes to 2^27 elements). A failure names, per
// rank, the combination, its #wrong elements and the first of them.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "../mpi/comm_test_util.hpp"
#include "../support/devices.hpp"
#include "meshrt/internal/device.hpp"
#include "meshrt/internal/settings.hpp"

namespace meshrt::test {
namespace {

constexpr std::uint64_t kStream = 11;

// ---- inputs ---------------------------------------------------------------------------
//
// Element i of the input of the rank at coordinate c of the line (n ranks), from a seed
// per combination. Where the closed form allows, the expected value is computed from i
// alone (sums, averages and float products), as nccl-tests does: not by reducing the
// inputs again.

std::uint64_t mix(std::uint64_t x) {
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9u;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebu;
  return x ^ (x >> 31);
}

// Random bits of element i: the same on every rank (c = -1), or the rank's own.
std::uint64_t bits(std::uint64_t seed, int c, std::int64_t i) {
  return mix(seed + static_cast<std::uint64_t>(i) * 0x9e3779b97f4a7c15u +
             static_cast<std::uint64_t>(c + 1) * 0xd1b54a32d192ed03u);
}

// A value in [lo, hi].
std::int64_t in_range(std::uint64_t r, std::int64_t lo, std::int64_t hi) {
  return lo + static_cast<std::int64_t>(r % static_cast<std::uint64_t>(hi - lo + 1));
}

// 2^e, for e in the normal range of a double.
double pow2(int e) {
  return std::bit_cast<double>(static_cast<std::uint64_t>(e + 1023) << 52);
}

struct FloatLayout {
  int precision;  // significand bits, the implicit one included
  int min_exp;    // of the least normal number
  int max_exp;
};

template <class T>
constexpr FloatLayout layout() {
  if constexpr (std::is_same_v<T, Half>) return {11, -14, 15};
  if constexpr (std::is_same_v<T, BFloat16>) return {8, -126, 127};
  if constexpr (std::is_same_v<T, float>) return {24, -126, 127};
  return {53, -1022, 1023};
}

template <class T>
constexpr bool is_float_v = std::is_floating_point_v<T> || std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>;

// The largest b with b^n <= max.
std::int64_t product_bound(std::int64_t max, int n) {
  auto fits = [&](std::int64_t b) {
    std::int64_t p = 1;
    for (int k = 0; k < n; ++k) {
      if (p > max / b) return false;
      p *= b;
    }
    return true;
  };
  auto b = static_cast<std::int64_t>(std::pow(static_cast<double>(max), 1.0 / n));
  while (b > 1 && !fits(b)) --b;
  while (fits(b + 1)) ++b;
  return b;
}

// Sums: rank c holds a + b * c, so the sum is n * a + b * n (n - 1) / 2 whatever the
// order. For floats, a and b are integers times 2^e and |a + b * c| <= (2^precision - 1) / n,
// so every partial sum is exact; for integers the sum fits the dtype, and uint8 wraps (as
// unsigned sums do: NCCL's, torch's, numpy's).
struct Affine {
  std::int64_t a, b;
  int e;
};

template <class T>
Affine affine(std::uint64_t seed, std::int64_t i, int n) {
  const std::uint64_t r = bits(seed, -1, i);
  std::int64_t k_max = 0;
  int e = 0;
  if constexpr (is_float_v<T>) {
    constexpr FloatLayout f = layout<T>();
    k_max = static_cast<std::int64_t>((std::uint64_t{1} << f.precision) - 1) / n;
    // From a little above the normal range's bottom (an average stays normal) to where
    // the largest sum still fits.
    e = static_cast<int>(in_range(r >> 40, f.min_exp + 8, f.max_exp + 1 - f.precision));
  } else if constexpr (std::is_same_v<T, std::uint8_t>) {
    return {static_cast<std::int64_t>(r & 0xff), static_cast<std::int64_t>((r >> 8) & 0xff), 0};
  } else {
    k_max = std::numeric_limits<T>::max() / n;
  }
  const std::int64_t a = in_range(r, -k_max / 2, k_max / 2);
  const std::int64_t b_max = n > 1 ? (k_max / 2) / (n - 1) : 0;
  return {a, in_range(mix(r), -b_max, b_max), e};
}

// Float products: +-2^(p + q * (2c - n + 1)) on every rank, times a mantissa m of full
// precision on one of them; the exponents add up to n * p, and odd coordinates are
// negative, so the product is (-1)^(n/2) * m * 2^(n * p), exact and normal.
struct Powers {
  int p, q, holder;
  double m;
};

template <class T>
Powers powers(std::uint64_t seed, std::int64_t i, int n) {
  constexpr FloatLayout f = layout<T>();
  const std::uint64_t r = bits(seed, -1, i);
  const int e_max = std::min(30, std::min(f.max_exp - 1, -f.min_exp) / n);
  const int p_max = e_max / 2;
  const int q_max = n > 1 ? (e_max - p_max) / (n - 1) : 0;
  const std::uint64_t frac = (r >> 20) & ((std::uint64_t{1} << (f.precision - 1)) - 1);
  return {static_cast<int>(in_range(r, -p_max, p_max)), static_cast<int>(in_range(r >> 8, -q_max, q_max)),
          static_cast<int>((r >> 16) % static_cast<std::uint64_t>(n)),
          1.0 + std::ldexp(static_cast<double>(frac), 1 - f.precision)};
}

// Any value of the dtype (normal numbers for floats): min, max and stack.
template <class T>
T any_value(std::uint64_t seed, int c, std::int64_t i) {
  const std::uint64_t r = bits(seed, c, i);
  if constexpr (std::is_same_v<T, bool>) {
    return (r & 1) != 0;
  } else if constexpr (is_float_v<T>) {
    constexpr FloatLayout f = layout<T>();
    const std::uint64_t frac = (r >> 16) & ((std::uint64_t{1} << (f.precision - 1)) - 1);
    const auto e = static_cast<int>(in_range(r >> 4, std::max(f.min_exp, -60), std::min(f.max_exp, 60)));
    const double v = (1.0 + std::ldexp(static_cast<double>(frac), 1 - f.precision)) * pow2(e);
    return from_double<T>((r >> 63) & 1 ? -v : v);
  } else {
    return static_cast<T>(r);
  }
}

// Integer products: +-v with 1 <= v and |product| <= the dtype's largest (uint8 wraps).
template <class T>
std::int64_t integer_factor(std::uint64_t seed, int c, std::int64_t i, int n) {
  const std::uint64_t r = bits(seed, c, i);
  if constexpr (std::is_same_v<T, std::uint8_t>) {
    return (r & 0xff) == 0 ? 1 : static_cast<std::int64_t>(r & 0xff);
  } else {
    static std::vector<std::int64_t> bounds;  // by n, computed once
    if (bounds.size() <= static_cast<std::size_t>(n)) bounds.resize(static_cast<std::size_t>(n) + 1, 0);
    auto& bound = bounds[static_cast<std::size_t>(n)];
    if (bound == 0) bound = product_bound(std::numeric_limits<T>::max(), n);
    const std::int64_t v = in_range(r, 1, bound);
    return (r >> 62) & 1 ? -v : v;
  }
}

template <class T>
T input_element(Reduction red, std::uint64_t seed, int c, std::int64_t i, int n) {
  if (red == Reduction::Min || red == Reduction::Max || red == Reduction::Stack) return any_value<T>(seed, c, i);
  if constexpr (std::is_same_v<T, bool>) {
    return false;  // bool takes min, max and stack only
  } else if (red == Reduction::Product) {
    if constexpr (is_float_v<T>) {
      const Powers w = powers<T>(seed, i, n);
      const double v = (c == w.holder ? w.m : 1.0) * pow2(w.p + w.q * (2 * c - n + 1));
      return from_double<T>(c % 2 ? -v : v);
    } else {
      return static_cast<T>(integer_factor<T>(seed, c, i, n));
    }
  } else {
    const Affine s = affine<T>(seed, i, n);
    if constexpr (is_float_v<T>) {
      return from_double<T>(static_cast<double>(s.a + s.b * c) * pow2(s.e));
    } else {
      return static_cast<T>(s.a + s.b * c);  // uint8: modulo 256
    }
  }
}

// The closed form of element i of the reduction over the line (the order of the ranks
// does not matter, which is the point).
template <class T>
T expected_element(Reduction red, std::uint64_t seed, std::int64_t i, int n) {
  if (red == Reduction::Min || red == Reduction::Max) {
    T acc = any_value<T>(seed, 0, i);
    for (int c = 1; c < n; ++c) {
      const T v = any_value<T>(seed, c, i);
      if constexpr (is_float_v<T>) {
        const bool less = to_double<T>(v) < to_double<T>(acc);
        if (red == Reduction::Min ? less : to_double<T>(v) > to_double<T>(acc)) acc = v;
      } else {
        if (red == Reduction::Min ? v < acc : v > acc) acc = v;
      }
    }
    return acc;
  }
  if constexpr (std::is_same_v<T, bool>) {
    return false;
  } else if (red == Reduction::Product) {
    if constexpr (is_float_v<T>) {
      const Powers w = powers<T>(seed, i, n);
      const double v = w.m * pow2(n * w.p);
      return from_double<T>((n / 2) % 2 ? -v : v);
    } else {
      std::int64_t acc = 1;
      for (int c = 0; c < n; ++c) {
        acc *= integer_factor<T>(seed, c, i, n);
        if constexpr (std::is_same_v<T, std::uint8_t>) acc &= 0xff;
      }
      return static_cast<T>(acc);
    }
  } else {
    const Affine s = affine<T>(seed, i, n);
    const std::int64_t sum = s.a * n + s.b * (static_cast<std::int64_t>(n) * (n - 1) / 2);
    if constexpr (is_float_v<T>) {
      const double total = static_cast<double>(sum) * pow2(s.e);
      return from_double<T>(red == Reduction::Avg ? total / n : total);  // the average's one rounding
    } else {
      return static_cast<T>(sum);  // uint8: modulo 256
    }
  }
}

// ---- checking -------------------------------------------------------------------------

template <class T>
std::uint64_t bits_of(T v) {
  std::uint64_t b = 0;
  std::memcpy(&b, &v, sizeof v);
  return b;
}

// How many representable values apart two floats are (0 for equal bits).
template <class T>
std::uint64_t ulps_apart(T a, T b) {
  constexpr int width = 8 * static_cast<int>(sizeof(T));
  auto ordered = [&](std::uint64_t x) {
    const std::uint64_t sign = std::uint64_t{1} << (width - 1);
    return (x & sign) ? -static_cast<std::int64_t>(x & ~sign) : static_cast<std::int64_t>(x);
  };
  const std::int64_t d = ordered(bits_of(a)) - ordered(bits_of(b));
  return static_cast<std::uint64_t>(d < 0 ? -d : d);
}

struct Wrong {
  std::int64_t count = 0;
  std::string first;
};

template <class T>
void check_element(Wrong& w, std::int64_t i, T got, T want, bool avg) {
  bool ok = bits_of(got) == bits_of(want);
  if constexpr (is_float_v<T>) {
    if (avg) ok = ulps_apart(got, want) <= 2;
  }
  if (ok) return;
  if (w.count++ == 0) {
    w.first = fmt::format("element {}: expected {:#x} ({}), found {:#x} ({})", i, bits_of(want), to_double<T>(want),
                          bits_of(got), to_double<T>(got));
  }
}

// ---- the sweep ------------------------------------------------------------------------

enum class Backend { Cpu, Accelerator };

device::Accelerator under_test() {
  return settings::kAccelerator.get() == "cuda" ? device::Accelerator::Cuda : device::Accelerator::Emulated;
}

// Places this rank on its device once, as the runtime does at start.
Device here() {
  static const Device d = [] {
    setenv("MESHRT_EMULATED_DELAY_US", "20", 0);
    const int index = device::select_device(under_test(), MPI_COMM_WORLD);
    device::set_placement({under_test(), index});
    device::backend(under_test()).make_current(index);
    return device::rank_device(device::device_kind(under_test()));
  }();
  return d;
}

struct Collective {
  const char* name;
  bool scatter;
  bool stack;
};
constexpr Collective kAllReduce{"all_reduce", false, false};
constexpr Collective kReduceScatter{"reduce_scatter", true, false};
constexpr Collective kAllGather{"all_gather", false, true};
constexpr Collective kAllToAll{"all_to_all", true, true};

std::int64_t env_count(const char* name, std::int64_t otherwise) {
  const char* text = std::getenv(name);
  return text != nullptr && *text != '\0' ? std::atoll(text) : otherwise;
}

// The counts per rank, from 1 to PEER_NCCL_MAX_COUNT (2^20 by default). Up to 4097 every
// combination runs at every count: 1, 2, 3, the powers of 8 and odd counts that leave a
// remainder in every chunking. Above, at 2^13, 2^14, ... and the maximum, the
// combinations take turns, so that each count costs what 4096 does: count c runs one
// combination in c / 4096 (at least one combination per count); PEER_NCCL_EVERY_COUNT=1
// runs every combination at every count (the GPU check's sweep).
struct Counts {
  std::vector<std::int64_t> every;
  std::vector<std::int64_t> in_turn;
};

Counts counts() {
  const std::int64_t max = env_count("PEER_NCCL_MAX_COUNT", std::int64_t{1} << 20);
  Counts out;
  for (std::int64_t c : {1, 2, 3, 7, 8, 33, 64, 512, 1000, 4096, 4097}) {
    if (c <= max) out.every.push_back(c);
  }
  for (std::int64_t c = 8192; c <= max; c *= 2) out.in_turn.push_back(c);
  if (max > 4097 && (out.in_turn.empty() || out.in_turn.back() != max)) out.in_turn.push_back(max);
  if (env_count("PEER_NCCL_EVERY_COUNT", 0) != 0) {
    out.every.insert(out.every.end(), out.in_turn.begin(), out.in_turn.end());
    out.in_turn.clear();
  }
  return out;
}

struct Combination {
  DType dtype;
  const Collective* collective;
  Reduction reduction;
  bool inplace;
};

// Every reduction the collective runs, on every dtype that takes it, in place where the
// collective has that form.
std::vector<Combination> combinations() {
  std::vector<Combination> out;
  for (DType dtype : {DType::Bool, DType::UInt8, DType::Int32, DType::Int64, DType::Float16, DType::BFloat16,
                      DType::Float32, DType::Float64}) {
    for (const Collective* c : {&kAllReduce, &kReduceScatter, &kAllGather, &kAllToAll}) {
      for (Reduction red : {Reduction::Sum, Reduction::Avg, Reduction::Product, Reduction::Min, Reduction::Max}) {
        if (c->stack && red != Reduction::Sum) continue;
        const Reduction r = c->stack ? Reduction::Stack : red;
        if (dtype == DType::Bool && (r == Reduction::Sum || r == Reduction::Avg || r == Reduction::Product)) continue;
        if (r == Reduction::Avg && !is_floating(dtype)) continue;  // refused: it would truncate
        for (bool inplace : {false, true}) {
          // all_gather and reduce_scatter have no in-place form (the output's size differs).
          if (!inplace || c->stack == c->scatter) out.push_back({dtype, c, r, inplace});
        }
      }
    }
  }
  return out;
}

struct Sweep {
  WorkerMesh& mesh;
  Backend backend;
  int n;
  std::int64_t me;  // this rank's coordinate in the line
  int failures = 0;
  int ran = 0;
  std::int64_t wrong_here = 0;  // elements, on this rank

  template <class T>
  void one(DType dtype, const Collective& c, Reduction red, bool inplace, std::int64_t count, std::uint64_t seed) {
    const int rank = world_rank();
    const std::vector<std::int64_t> shape = c.scatter ? std::vector<std::int64_t>{n, count} : std::vector{count};
    Tensor host = TensorMeta(shape, dtype).empty();
    T* in = host.data<T>();
    for (std::int64_t i = 0; i < host.numel(); ++i) in[i] = input_element<T>(red, seed, static_cast<int>(me), i, n);

    std::unique_ptr<Pending> p;
    Tensor input;
    if (backend == Backend::Cpu) {
      input = inplace ? host : host.clone();
      p = start_reduce(mesh, "x", red, c.scatter, inplace, input, TensorMeta(shape, dtype));
    } else {
      input = device::to_device(host, here(), device::stream_for(kStream, here()));
      p = start_reduce_device(mesh, "x", red, c.scatter, inplace, input,
                              TensorMeta(shape, dtype, Device::of(device::device_kind(under_test()), 0)), kStream);
    }
    const Outcome out = wait(*p);
    Tensor got = out.tensor;
    if (backend == Backend::Accelerator) {
      device::Fetch f = device::fetch(got, device::stream_for(kStream, here()));
      f.done.synchronize();
      got = f.host;
    }
    ++ran;

    Wrong wrong;
    const T* g = got.data<T>();
    const auto elements = got.numel();
    if (c.stack && !c.scatter) {  // [n, count]: every rank's input, by coordinate
      for (std::int64_t i = 0; i < elements; ++i) {
        check_element<T>(wrong, i, g[i], any_value<T>(seed, static_cast<int>(i / count), i % count), false);
      }
    } else if (c.stack) {  // block k of rank k's input, row `me`
      for (std::int64_t i = 0; i < elements; ++i) {
        check_element<T>(wrong, i, g[i], any_value<T>(seed, static_cast<int>(i / count), me * count + i % count),
                         false);
      }
    } else {  // row `me` of the reduction when scattered
      const std::int64_t base = c.scatter ? me * count : 0;
      for (std::int64_t i = 0; i < elements; ++i) {
        check_element<T>(wrong, i, g[i], expected_element<T>(red, seed, base + i, n), red == Reduction::Avg);
      }
    }
    wrong_here += wrong.count;
    if (elements != (c.stack ? n * count : count) || wrong.count != 0) {
      if (++failures <= 20) {
        ADD_FAILURE() << fmt::format("rank {}: {} {} {} {}, {} elements per rank ({}): #wrong {} of {}{}{}", rank,
                                     c.name, name(red), name(dtype), inplace ? "in place" : "out of place", count,
                                     backend == Backend::Cpu ? "cpu" : "accelerator", wrong.count, elements,
                                     wrong.count ? "; first: " : "", wrong.first);
      }
    }
    if (!inplace && backend == Backend::Cpu) {
      EXPECT_EQ(compare(input, host), "") << "out of place must leave the input alone";
    }
    EXPECT_EQ(out.tensor.same_storage(input), inplace);
  }

  void run() {
    const Counts sizes = counts();
    const std::vector<Combination> all = combinations();
    std::uint64_t seed = 1;
    for (std::size_t j = 0; j < all.size(); ++j) {
      const Combination& k = all[j];
      dispatch_dtype(k.dtype, [&](auto tag) {
        using T = decltype(tag);
        for (std::int64_t count : sizes.every) one<T>(k.dtype, *k.collective, k.reduction, k.inplace, count, seed++);
        for (std::size_t level = 0; level < sizes.in_turn.size(); ++level) {
          const std::int64_t count = sizes.in_turn[level];
          const auto turns = static_cast<std::size_t>(std::clamp<std::int64_t>(count / 4096, 1, std::ssize(all)));
          if (j % turns == (level * 7) % turns) one<T>(k.dtype, *k.collective, k.reduction, k.inplace, count, seed);
          ++seed;
        }
      });
    }
  }
};

Sweep make_sweep(WorkerMesh& mesh, Backend backend) {
  Sweep s{mesh, backend, static_cast<int>(mesh.size(0)), mesh.coordinates()[0]};
  return s;
}

// nccl-tests' summary: the #wrong elements of every rank together.
void summarize(const Sweep& s, const char* where) {
  std::int64_t total = 0;
  MPI_Allreduce(&s.wrong_here, &total, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  if (world_rank() == 0) {
    const Counts c = counts();
    fmt::print("nccl exactness on the {}: {} runs of {} combinations at counts 1 to {}, #wrong {} on {} ranks\n", where,
               s.ran, combinations().size(), c.in_turn.empty() ? c.every.back() : c.in_turn.back(), total,
               world_size());
  }
  EXPECT_EQ(total, 0);
}

TEST(NcclExactness, EveryReductionDtypeAndCountOnTheCpu) {
  World world;
  WorkerMesh mesh({"x"}, NDSlice::row_major({world_size()}), world.comm());
  Sweep s = make_sweep(mesh, Backend::Cpu);
  s.run();
  summarize(s, "cpu");
}

TEST(NcclExactness, EveryReductionDtypeAndCountOnTheAccelerator) {
  MESHRT_SKIP_UNLESS_DEVICES(under_test(), 1);
  World world;
  WorkerMesh mesh({"x"}, NDSlice::row_major({world_size()}), world.comm());
  Sweep s = make_sweep(mesh, Backend::Accelerator);
  s.run();
  summarize(s, under_test() == device::Accelerator::Cuda ? "cuda accelerator" : "emulated accelerator");
  EXPECT_FALSE(device::stream_for(kStream, here()).error());
}

}  // namespace
}  // namespace meshrt::test
