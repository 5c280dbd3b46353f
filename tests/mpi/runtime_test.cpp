// The single-controller runtime end to end (issue: worker event loop, controller API,
// errors, futures, streams and borrows). Runs at 4 ranks as a 2x2 mesh and at 3 ranks as
// a 1x3 mesh: every TEST is one controller session, so consecutive tests also check
// that workers restart cleanly between sessions.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <thread>

#include <fmt/format.h>

#include "../support/expect_error.hpp"
#include "../support/mpi_world.hpp"
#include "meshrt/internal/comm.hpp"
#include "runtime_support.hpp"

using namespace meshrt;
using meshrt::test::error_text;
using meshrt::test::session;

MESHRT_RUNTIME_TEST_ENVIRONMENT();

namespace {

using Coords = std::vector<std::pair<std::string, std::int64_t>>;

Mesh make_mesh(Controller& ctl) {
  if (ctl.world_size() == 4) return ctl.world_mesh({{"host", 2}, {"gpu", 2}});
  return ctl.world_mesh({{"host", 1}, {"gpu", ctl.world_size()}});
}

// Every coordinate of `mesh` with its world rank.
std::vector<std::pair<Coords, int>> coordinates(const Mesh& mesh) {
  std::vector<std::pair<Coords, int>> out;
  const NDSlice& r = mesh.ranks();
  for (auto rank : r) {
    const auto c = r.coordinates(rank);
    Coords coords;
    for (std::size_t d = 0; d < c.size(); ++d) coords.emplace_back(mesh.names()[d], c[d]);
    out.emplace_back(coords, static_cast<int>(rank));
  }
  return out;
}

// The world ranks along `dim` through `rank`, by coordinate.
std::vector<int> line(const Mesh& mesh, std::size_t dim, int rank) {
  auto c = mesh.ranks().coordinates(rank);
  std::vector<int> out;
  for (std::int64_t j = 0; j < mesh.ranks().sizes()[dim]; ++j) {
    c[dim] = j;
    out.push_back(static_cast<int>(mesh.ranks().location(c)));
  }
  return out;
}

double pattern(int rank, std::int64_t i) {
  return rank * 100 + static_cast<double>(i) + 1;
}

double combine(Reduction r, const std::vector<int>& ranks, std::int64_t i) {
  std::vector<double> v;
  for (int rank : ranks) v.push_back(pattern(rank, i));
  switch (r) {
    case Reduction::Sum:
      return std::accumulate(v.begin(), v.end(), 0.0);
    case Reduction::Avg:
      return std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
    case Reduction::Product:
      return std::accumulate(v.begin(), v.end(), 1.0, std::multiplies<>());
    case Reduction::Min:
      return *std::min_element(v.begin(), v.end());
    case Reduction::Max:
      return *std::max_element(v.begin(), v.end());
    case Reduction::Band:
    case Reduction::Bor:
    case Reduction::Bxor: {
      auto acc = static_cast<std::int64_t>(v[0]);
      for (std::size_t k = 1; k < v.size(); ++k) {
        const auto x = static_cast<std::int64_t>(v[k]);
        acc = r == Reduction::Band ? (acc & x) : r == Reduction::Bor ? (acc | x) : (acc ^ x);
      }
      return static_cast<double>(acc);
    }
    default:
      return NAN;
  }
}

std::vector<double> as_doubles(const Tensor& t) {
  std::vector<double> out;
  dispatch_dtype(t.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_arithmetic_v<T>) {
      for (T x : t.span<T>()) out.push_back(static_cast<double>(x));
    }
  });
  return out;
}

}  // namespace

TEST(Runtime, EveryReductionOverEachDimensionAtEveryCoordinate) {
  session([](Controller& ctl) {
    Mesh mesh = make_mesh(ctl);
    for (std::size_t d = 0; d < mesh.names().size(); ++d) {
      const std::string dim = mesh.names()[d];
      for (Reduction r : {Reduction::Sum, Reduction::Avg, Reduction::Product, Reduction::Min, Reduction::Max,
                          Reduction::Band, Reduction::Bor, Reduction::Bxor}) {
        const DType dtype = is_bitwise(r) ? DType::Int64 : DType::Float64;
        DTensor x = mesh.call("test.pattern", {2, 3}, dtype);
        DTensor y = x.reduce(dim, r);
        for (const auto& [coords, rank] : coordinates(mesh)) {
          const auto got = as_doubles(ctl.fetch_shard(y, coords).get());
          ASSERT_EQ(got.size(), 6u);
          for (std::int64_t i = 0; i < 6; ++i) {
            EXPECT_DOUBLE_EQ(got[static_cast<std::size_t>(i)], combine(r, line(mesh, d, rank), i))
                << name(r) << " over " << dim << " at rank " << rank << " element " << i;
          }
        }
      }
    }
  });
}

TEST(Runtime, StackScatterAndInPlace) {
  session([](Controller& ctl) {
    Mesh mesh = make_mesh(ctl);
    const std::int64_t n = mesh.size("gpu");
    DTensor x = mesh.call("test.pattern", {2}, DType::Float32);
    DTensor g = x.reduce("gpu", Reduction::Stack);  // all_gather
    EXPECT_EQ(g.meta().shape(), (std::vector<std::int64_t>{n, 2}));
    DTensor s = mesh.call("test.pattern", {n, 2}, DType::Int32);
    DTensor a2a = s.reduce("gpu", Reduction::Stack, /*scatter=*/true);  // all_to_all
    DTensor rs = s.reduce("gpu", Reduction::Sum, /*scatter=*/true);     // reduce_scatter
    EXPECT_EQ(rs.meta().shape(), (std::vector<std::int64_t>{2}));
    DTensor inplace = mesh.call("test.pattern", {3}, DType::Float64);
    inplace.reduce_("gpu", Reduction::Max);
    for (const auto& [coords, rank] : coordinates(mesh)) {
      const auto peers = line(mesh, 1, rank);
      const auto me = static_cast<std::size_t>(mesh.ranks().coordinates(rank)[1]);
      const auto gv = as_doubles(ctl.fetch_shard(g, coords).get());
      const auto av = as_doubles(ctl.fetch_shard(a2a, coords).get());
      const auto rv = as_doubles(ctl.fetch_shard(rs, coords).get());
      const auto iv = as_doubles(ctl.fetch_shard(inplace, coords).get());
      for (std::size_t j = 0; j < peers.size(); ++j) {
        for (std::int64_t i = 0; i < 2; ++i) {
          EXPECT_EQ(gv[j * 2 + static_cast<std::size_t>(i)], pattern(peers[j], i));
          // Chunk `me` of peer j's input lands at position j.
          EXPECT_EQ(av[j * 2 + static_cast<std::size_t>(i)], pattern(peers[j], static_cast<std::int64_t>(me) * 2 + i));
        }
      }
      for (std::int64_t i = 0; i < 2; ++i) {
        double sum = 0;
        for (int p : peers) sum += pattern(p, static_cast<std::int64_t>(me) * 2 + i);
        EXPECT_EQ(rv[static_cast<std::size_t>(i)], sum);
      }
      for (std::int64_t i = 0; i < 3; ++i)
        EXPECT_EQ(iv[static_cast<std::size_t>(i)], combine(Reduction::Max, peers, i));
    }
  });
}

TEST(Runtime, ToMeshAndSliceMesh) {
  session([](Controller& ctl) {
    Mesh mesh = make_mesh(ctl);
    DTensor x = mesh.call("test.pattern", {4}, DType::Float32);
    // Between hosts on the 2x2 mesh; reversed along gpu on the 1x3 mesh.
    Mesh from = mesh.slice("host", 0);
    Mesh to = mesh.size("host") == 2 ? mesh.slice("host", 1) : mesh.slice("host", 0);
    DTensor moved = x.slice_mesh("host", 0).to_mesh(to);
    for (std::int64_t g = 0; g < mesh.size("gpu"); ++g) {
      const int src = static_cast<int>(from.ranks()[g]);
      const auto got = as_doubles(ctl.fetch_shard(moved, {{"gpu", g}}).get());
      for (std::int64_t i = 0; i < 4; ++i) EXPECT_EQ(got[static_cast<std::size_t>(i)], pattern(src, i));
    }
    // A strided, reversed target: positions pair up by index.
    const std::int64_t n = mesh.size("gpu");
    Mesh row = mesh.slice("host", 0);
    DTensor back = x.slice_mesh("host", 0).to_mesh(row);  // self-pairs: a local copy
    for (std::int64_t g = 0; g < n; ++g) {
      const auto got = as_doubles(ctl.fetch_shard(back, {{"gpu", g}}).get());
      EXPECT_EQ(got[0], pattern(static_cast<int>(row.ranks()[g]), 0));
    }
  });
}

TEST(Runtime, MeshRankRenameSplitFlatten) {
  session([](Controller& ctl) {
    Mesh mesh = make_mesh(ctl);
    DTensor r = mesh.rank("gpu");
    for (const auto& [coords, rank] : coordinates(mesh)) {
      EXPECT_EQ(ctl.fetch_shard(r, coords).get().item(), static_cast<double>(coords[1].second));
    }
    Mesh renamed = mesh.rename("gpu", "tp");
    EXPECT_EQ(renamed.names(), (std::vector<std::string>{"host", "tp"}));
    Mesh flat = mesh.flatten("all");
    EXPECT_EQ(flat.sizes(), (std::vector<std::int64_t>{ctl.world_size()}));
    DTensor f = flat.call("test.pattern", {1}, DType::Float64).reduce("all", Reduction::Sum);
    double total = 0;
    for (int k = 0; k < ctl.world_size(); ++k) total += pattern(k, 0);
    EXPECT_EQ(ctl.fetch_shard(f, {{"all", 0}}).get().item(), total);
    Mesh split = flat.split("all", {{"a", 1}, {"b", ctl.world_size()}});
    EXPECT_EQ(split.ranks().to_vector(), flat.ranks().to_vector());
    EXPECT_THROW(flat.split("all", {{"a", 5}, {"b", 5}}), UsageError);
  });
}

TEST(Runtime, KernelsSeeTheMeshSizes) {
  session([](Controller& ctl) {
    Mesh mesh = make_mesh(ctl);
    auto sizes_at = [&](const Mesh& m, const Coords& coords) {
      const Tensor t =
          ctl.fetch_shard(m.call("test.mesh_sizes", static_cast<std::int64_t>(m.sizes().size())), coords).get();
      return std::vector<std::int64_t>(t.span<std::int64_t>().begin(), t.span<std::int64_t>().end());
    };
    for (const auto& [coords, rank] : coordinates(mesh)) EXPECT_EQ(sizes_at(mesh, coords), mesh.sizes()) << rank;
    // A slice, a split and a flattened mesh: the sizes of the mesh the call runs on.
    const Mesh row = mesh.slice("host", 0);
    EXPECT_EQ(sizes_at(row, {{"gpu", row.sizes()[0] - 1}}), row.sizes());
    const Mesh flat = mesh.flatten("all");
    const Mesh split = flat.split("all", {{"a", 1}, {"b", ctl.world_size()}});
    EXPECT_EQ(sizes_at(split, {{"a", 0}, {"b", ctl.world_size() - 1}}),
              (std::vector<std::int64_t>{1, ctl.world_size()}));
  });
}

TEST(Runtime, CallTakesAnyNumberOfArguments) {
  session([](Controller& ctl) {
    Mesh mesh = make_mesh(ctl);
    const Coords at = coordinates(mesh).back().first;
    // 8 arguments of mixed types, then 12: each reaches the kernel in its place.
    const DTensor eight = mesh.call("test.weighted_sum", 1, 2.0, 3.0F, 4L, 5LL, 6U, 7UL, 8);
    EXPECT_EQ(ctl.fetch_shard(eight, at).get().item(), 204.0);  // sum of i * i, i = 1..8
    const DTensor twelve = mesh.call("test.weighted_sum", 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1);
    EXPECT_EQ(ctl.fetch_shard(twelve, at).get().item(), 78.0);  // 1 + 2 + ... + 12
    // Six go through the overloads that also take braced lists.
    const DTensor six = mesh.call("test.weighted_sum", 1, 0, 0, 0, 0, 2);
    EXPECT_EQ(ctl.fetch_shard(six, at).get().item(), 13.0);
  });
}

// Outputs of many sizes leave the CPU output pool holding their buffers after every
// tensor is gone; release_cached_memory() gives them back on every worker.
TEST(Runtime, ReleaseCachedMemoryEmptiesEveryWorkersOutputPool) {
  session([](Controller& ctl) {
    Mesh mesh = make_mesh(ctl);
    const Mesh flat = mesh.flatten("all");
    auto cached_per_rank = [&] {
      const DTensor c = flat.call("test.output_pool_cached");
      std::vector<std::int64_t> out;
      for (std::int64_t r = 0; r < ctl.world_size(); ++r) {
        out.push_back(static_cast<std::int64_t>(ctl.fetch_shard(c, {{"all", r}}).get().item()));
      }
      return out;
    };
    for (std::int64_t kib : {300, 520, 1100, 2300}) {  // float32 outputs from 300 KiB: pooled
      DTensor x = flat.call("test.pattern", {kib * 256}, DType::Float32);
      DTensor y = x.reduce("all", Reduction::Sum);
      (void)ctl.fetch_shard(y, {{"all", 0}}, "meshrt.sum").get();
    }
    for (std::int64_t bytes : cached_per_rank()) EXPECT_GT(bytes, 0);
    EXPECT_GT(ctl.release_cached_memory(), 0u);
    for (std::int64_t bytes : cached_per_rank()) EXPECT_EQ(bytes, 0);
    EXPECT_EQ(ctl.release_cached_memory(), 0u);
  });
}

TEST(Runtime, FailureOnOneRankPoisonsOnlyItsDependents) {
  session([](Controller& ctl) {
    Mesh mesh = make_mesh(ctl);
    const int bad = ctl.world_size() - 1;
    DTensor f = mesh.call("meshrt.fail", "deliberate failure", {bad});
    const int line_no = __LINE__ - 1;
    DTensor g = f.reduce("gpu", Reduction::Sum);
    DTensor unrelated = mesh.call("test.pattern", {2}, DType::Float32);
    std::uint64_t root = 0;
    for (const auto& [coords, rank] : coordinates(mesh)) {
      for (const DTensor* t : {&f, &g}) {
        try {
          ctl.fetch_shard(*t, coords).get();
          ADD_FAILURE() << "expected RemoteError at rank " << rank;
        } catch (const RemoteError& e) {
          const std::string what = e.what();
          EXPECT_EQ(e.function(), "meshrt.fail");
          EXPECT_EQ(e.ranks(), std::vector<int>{bad});
          EXPECT_EQ(e.worker_message(), "deliberate failure");
          EXPECT_NE(what.find("meshrt.fail failed on rank " + std::to_string(bad)), std::string::npos) << what;
          EXPECT_NE(what.find("runtime_test.cpp:" + std::to_string(line_no)), std::string::npos) << what;
          if (t == &g) EXPECT_NE(what.find("chain: fetch"), std::string::npos) << what;
          if (root == 0) root = e.ident();
          EXPECT_EQ(e.ident(), root) << "the same root cause everywhere";
        }
      }
      EXPECT_EQ(as_doubles(ctl.fetch_shard(unrelated, coords).get())[1], pattern(rank, 1));
    }
    // Later collectives still work, and synchronize reports nothing already observed.
    DTensor later = unrelated.reduce("gpu", Reduction::Sum);
    EXPECT_EQ(as_doubles(ctl.fetch_shard(later, coordinates(mesh)[0].first).get())[0],
              combine(Reduction::Sum, line(mesh, 1, coordinates(mesh)[0].second), 0));
    EXPECT_NO_THROW(ctl.synchronize());
  });
}

TEST(Runtime, SynchronizeRaisesAnUnobservedFailureOnce) {
  session([](Controller& ctl) {
    Mesh mesh = make_mesh(ctl);
    DTensor f = mesh.call("meshrt.fail", "nobody fetched this", {0});
    const std::string text = error_text([&] { ctl.synchronize(); });
    EXPECT_NE(text.find("meshrt.fail failed on rank 0"), std::string::npos) << text;
    EXPECT_NE(text.find("nobody fetched this"), std::string::npos) << text;
    EXPECT_NO_THROW(ctl.synchronize());
  });
}

TEST(Runtime, UsageErrorsAtTheCallSite) {
  session([](Controller& ctl) {
    Mesh mesh = make_mesh(ctl);
    DTensor x = mesh.call("test.pattern", {5}, DType::Float32);
    auto has = [](const std::string& text, const std::string& part) {
      EXPECT_NE(text.find(part), std::string::npos) << "expected \"" << part << "\" in: " << text;
    };
    has(error_text([&] {
          ctl.world_mesh({{"a", 5}});
        }),
        "expected sizes that hold the " + std::to_string(ctl.world_size()) + " worker ranks, found [5]");
    has(error_text([&] { mesh.call("no.such.function"); }), "unknown function 'no.such.function'");
    has(error_text([&] { mesh.call("meshrt.add", x, mesh.call("test.pattern", {4}, DType::Float32)); }), "meshrt.add");
    has(error_text([&] { x.reduce("nope", Reduction::Sum); }), "unknown mesh dimension 'nope'");
    has(error_text([&] { x.reduce("gpu", Reduction::Bxor); }),
        "bitwise reduction bxor needs an integer or bool dtype, found float32");
    has(error_text([&] { x.reduce("gpu", Reduction::Sum, true); }), "needs an input with size(0) ==");
    has(error_text([&] { x.reduce_("gpu", Reduction::Stack); }), "cannot run in place");
    has(error_text([&] { x.to_mesh(mesh.slice("host", 0)); }),
        "expected a target mesh of the same sizes as the source [host=");
    has(error_text([&] { ctl.fetch_shard(x, {{"gpu", 7}}); }), "outside the mesh");
    has(error_text([&] { ctl.fetch_shard(x, {{"rack", 0}}); }), "unknown mesh dimension 'rack'");
    has(error_text([&] {
          ctl.fetch_shard(x, {{"host", 0}, {"gpu", 0}}, std::string("no.such"));
        }),
        "unknown function 'no.such'");
    // A tensor made on ranks of one slice, used on ranks it does not live on.
    if (mesh.size("gpu") > 1) {
      Mesh first = mesh.slice("gpu", 0);
      Mesh second = mesh.slice("gpu", 1);
      DTensor only_first = first.call("test.pattern", {1}, DType::Float32);
      has(error_text([&] { second.call("meshrt.copy", only_first); }), "the tensor lives on ranks");
    }
    // Nothing was sent for any of these: the session still works.
    EXPECT_EQ(as_doubles(ctl.fetch_shard(x, coordinates(mesh)[0].first).get())[0],
              pattern(coordinates(mesh)[0].second, 0));
  });
}

TEST(Runtime, ShortLivedTensorsLeaveNothingBehind) {
  session([](Controller& ctl) {
    Mesh mesh = make_mesh(ctl);
    ctl.synchronize();
    std::vector<std::uint64_t> before;
    for (auto r : ctl.worker_ranks()) before.push_back(ctl.live_values(static_cast<int>(r)));
    for (int i = 0; i < 100000; ++i) {
      DTensor t = mesh.call("meshrt.zeros", {1}, DType::Float32);
    }
    ctl.synchronize();
    // The stream "default" is the only value added since (the mesh was made before).
    for (std::size_t k = 0; k < before.size(); ++k) {
      EXPECT_LE(ctl.live_values(static_cast<int>(ctl.worker_ranks()[static_cast<std::int64_t>(k)])), before[k] + 2);
    }
  });
}

TEST(Runtime, MeshesAndStreamsAreFreedWithTheirLastHandle) {
  session([](Controller& ctl) {
    Mesh mesh = make_mesh(ctl);
    DTensor x = mesh.call("test.pattern", {2}, DType::Float32);
    ctl.synchronize();
    std::vector<std::uint64_t> before;
    for (auto r : ctl.worker_ranks()) before.push_back(ctl.live_values(static_cast<int>(r)));
    const bool worker_here = ctl.worker_ranks().contains(0);
    const std::int64_t comms_before = WorkerMesh::live_communicators();
    // Hundreds of distinct meshes (each with a dimension communicator in use) and streams.
    for (int i = 0; i < 300; ++i) {
      const std::string dim = fmt::format("g{}", i);
      Mesh m = mesh.rename("gpu", dim);
      DTensor r = m.call("meshrt.copy", x).reduce(dim, Reduction::Sum);
      Stream s = ctl.stream(fmt::format("s{}", i));
      DTensor b = s.borrow(x);
      DTensor c = b.reduce("host", Reduction::Max);
      b.drop();
    }
    // The same slice in a loop is one mesh: made once on the workers.
    for (int i = 0; i < 300; ++i) {
      Mesh s = mesh.slice("host", 0);
      DTensor r = s.call("meshrt.copy", x).reduce("gpu", Reduction::Sum);
    }
    EXPECT_TRUE(mesh.slice("host", 0) == mesh.slice("host", 0));
    ctl.synchronize();
    ctl.synchronize();  // the deletes the first one carried are counted by now
    // Left: the session's recent meshes, each with its communicators.
    const auto recent = static_cast<std::uint64_t>(17);
    for (std::size_t k = 0; k < before.size(); ++k) {
      const int rank = static_cast<int>(ctl.worker_ranks()[static_cast<std::int64_t>(k)]);
      EXPECT_LE(ctl.live_values(rank), before[k] + recent) << "worker " << rank;
    }
    if (worker_here) EXPECT_LE(WorkerMesh::live_communicators(), comms_before + 3 * 17);
    // The mesh and the tensor are still usable.
    const auto c0 = coordinates(mesh)[0];
    EXPECT_EQ(as_doubles(ctl.fetch_shard(x.reduce("gpu", Reduction::Max), c0.first).get())[0],
              combine(Reduction::Max, line(mesh, 1, c0.second), 0));
  });
}

TEST(Runtime, BorrowRules) {
  session([](Controller& ctl) {
    Mesh mesh = make_mesh(ctl);
    Stream comms = ctl.stream("comms");
    DTensor y = mesh.call("test.pattern", {2}, DType::Float64);
    DTensor b = comms.borrow(y, /*mutable=*/true);
    EXPECT_THROW(comms.borrow(y), UsageError);                // a mutable borrow is exclusive
    EXPECT_THROW(mesh.call("meshrt.copy", y), UsageError);    // the origin waits for the drop
    EXPECT_THROW(mesh.call("meshrt.add", y, b), UsageError);  // two streams in one call
    b.reduce_("gpu", Reduction::Sum);                         // runs on comms
    b.drop();
    EXPECT_THROW(b.drop(), UsageError);
    EXPECT_THROW(b.reduce("gpu", Reduction::Sum), UsageError);  // dropped
    const auto c0 = coordinates(mesh)[0];
    EXPECT_EQ(as_doubles(ctl.fetch_shard(y, c0.first).get())[0], combine(Reduction::Sum, line(mesh, 1, c0.second), 0));

    DTensor r1 = comms.borrow(y);
    DTensor r2 = ctl.stream("other").borrow(y);                    // several immutable borrows
    EXPECT_THROW(mesh.call("meshrt.fill_", y, 0.0), UsageError);   // no mutation while borrowed
    EXPECT_THROW(mesh.call("meshrt.fill_", r1, 0.0), UsageError);  // an immutable borrow cannot mutate
    DTensor sum = r1.reduce("gpu", Reduction::Sum);                // use on the second stream
    EXPECT_EQ(sum.stream().name(), "comms");
    EXPECT_EQ(as_doubles(ctl.fetch_shard(sum, c0.first).get())[0],
              line(mesh, 1, c0.second).size() * combine(Reduction::Sum, line(mesh, 1, c0.second), 0));
    r1.drop();
    r2.drop();
    mesh.call("meshrt.fill_", y, 7.0);
    EXPECT_EQ(as_doubles(ctl.fetch_shard(y, c0.first).get())[0], 7.0);
    {
      DTensor dies = comms.borrow(y, true);  // dropped implicitly, with a warning
    }
    DTensor again = comms.borrow(y, true);
    again.drop();
  });
}

TEST(Runtime, AFetchPreprocessThatMutatesIsAMutatingUse) {
  session([](Controller& ctl) {
    Mesh mesh = make_mesh(ctl);
    DTensor y = mesh.call("test.pattern", {2}, DType::Float64);
    const auto c0 = coordinates(mesh)[0];
    const std::optional<std::string> bump("test.bump_and_copy_");
    // Its signature says it mutates its argument: refused while the tensor is borrowed.
    DTensor r = ctl.stream("comms").borrow(y);
    const std::string text = error_text([&] { ctl.fetch_shard(y, c0.first, bump); });
    EXPECT_NE(text.find("fetch_shard via test.bump_and_copy_: the tensor is borrowed by 1 other stream"),
              std::string::npos)
        << text;
    r.drop();
    // Allowed once dropped; the change is the value's, seen by the next use.
    EXPECT_EQ(as_doubles(ctl.fetch_shard(y, c0.first, bump).get())[0], pattern(c0.second, 0) + 1);
    EXPECT_EQ(as_doubles(ctl.fetch_shard(y, c0.first).get())[0], pattern(c0.second, 0) + 1);
  });
}

TEST(Runtime, RestartWorkersClearsEverything) {
  session([](Controller& ctl) {
    Mesh mesh = make_mesh(ctl);
    DTensor x = mesh.call("test.pattern", {2}, DType::Float32);
    ctl.synchronize();
    // A failure of the old session, reported as the workers restart, is not the new one's.
    DTensor f = mesh.call("meshrt.fail", "old session", {0});
    ctl.restart_workers();
    EXPECT_THROW(x.reduce("gpu", Reduction::Sum), UsageError);
    // Every old handle, meshes included.
    EXPECT_THROW(mesh.slice("gpu", 0), UsageError);
    EXPECT_THROW(mesh.flatten("all"), UsageError);
    EXPECT_THROW(x.slice_mesh("gpu", 0), UsageError);
    EXPECT_NO_THROW(ctl.synchronize());
    Mesh fresh = make_mesh(ctl);
    DTensor y = fresh.call("test.pattern", {2}, DType::Float32);
    const auto c0 = coordinates(fresh)[0];
    EXPECT_EQ(as_doubles(ctl.fetch_shard(y, c0.first).get())[1], pattern(c0.second, 1));
    ctl.synchronize();
    for (auto r : ctl.worker_ranks()) EXPECT_LE(ctl.live_values(static_cast<int>(r)), 3u);
  });
}

TEST(Runtime, ControllerThatThrowsEndsTheSessionCleanly) {
  const auto body = [](Controller& ctl) {
    Mesh mesh = make_mesh(ctl);
    mesh.call("test.pattern", {2}, DType::Float32).reduce("gpu", Reduction::Sum);
    throw std::runtime_error("the controller gave up");
  };
  if (meshrt::test::world_rank() == 0) {
    EXPECT_THROW(session(body), std::runtime_error);
  } else {
    session(body);
  }
  // The next session starts from clean workers.
  session([](Controller& ctl) {
    Mesh mesh = make_mesh(ctl);
    DTensor x = mesh.call("test.pattern", {1}, DType::Float32);
    EXPECT_EQ(ctl.fetch_shard(x, coordinates(mesh)[0].first).get().item(), pattern(coordinates(mesh)[0].second, 0));
  });
}

TEST(Runtime, GetWithTimeoutNamesTheRankThatHangs) {
  session([](Controller& ctl) {
    Mesh mesh = make_mesh(ctl);
    const int slow = ctl.world_size() - 1;
    // The mesh's communicators exist before the timed part: under load their creation
    // alone can outlast the timeout, and then it is what the report names.
    (void)mesh.call("test.sleep", 0.0, {slow}).reduce("gpu", Reduction::Sum);
    ctl.synchronize();
    DTensor s = mesh.call("test.sleep", 2.0, {slow});
    DTensor r = s.reduce("gpu", Reduction::Sum);
    auto fut = ctl.fetch_shard(r, coordinates(mesh)[0].first);
    try {
      fut.get(std::chrono::milliseconds(300));
      ADD_FAILURE() << "expected a TimeoutError";
    } catch (const TimeoutError& e) {
      const std::string what = e.what();
      // The headline names the sleeping rank behind, in its function, and no other.
      EXPECT_EQ(e.missing_ranks(), std::vector<int>{slow}) << what;
      EXPECT_NE(
          what.substr(0, what.find('\n')).find(fmt::format("rank {} is behind: running test.sleep (invocation", slow)),
          std::string::npos)
          << what;
      // The desync report: the sleeping rank inside its function, its peers in the
      // reduction waiting for it.
      EXPECT_NE(what.find("desync report"), std::string::npos) << what;
      const std::string slow_row = fmt::format("\n  {:>5}  ", slow);
      const auto row = what.find(slow_row);
      ASSERT_NE(row, std::string::npos) << what;
      EXPECT_NE(what.substr(row, what.find('\n', row + 1) - row).find("CallFunction test.sleep"), std::string::npos)
          << what;
      // The reduce has an ident: named once (not "Reduce reduce"), with its call site.
      EXPECT_NE(what.find(" reduce sum over 'gpu', issued at runtime_test.cpp:"), std::string::npos) << what;
      EXPECT_EQ(what.find("Reduce reduce"), std::string::npos) << what;
      EXPECT_NE(what.find(fmt::format("waiting for rank {} to join", slow)), std::string::npos) << what;
    }
    EXPECT_FALSE(fut.done());
    EXPECT_EQ(fut.get().item(), 0.0);  // it completes once the sleeper wakes
    EXPECT_TRUE(fut.done());
    EXPECT_EQ(fut.exception(), nullptr);
  });
}

TEST(Runtime, FlightRecorderOnRequest) {
  session([](Controller& ctl) {
    Mesh mesh = make_mesh(ctl);
    DTensor x = mesh.call("test.pattern", {2}, DType::Float32);
    DTensor y = x.reduce("gpu", Reduction::Sum);
    ctl.synchronize();
    const std::string dump = ctl.dump_flight_recorder();
    for (int r = 0; r < ctl.world_size(); ++r) {
      EXPECT_NE(dump.find(fmt::format("flight recorder of rank {}", r)), std::string::npos) << dump;
    }
    EXPECT_NE(dump.find("done     CallFunction test.pattern (invocation 1)"), std::string::npos) << dump;
    EXPECT_NE(dump.find("done     Reduce all_reduce sum over dimension 'gpu'"), std::string::npos) << dump;
    EXPECT_NE(dump.find("took "), std::string::npos) << dump;
  });
}

TEST(Runtime, AnIdleBatchIsSentAfterTheTimeBound) {
  session([](Controller& ctl) {
    Mesh mesh = make_mesh(ctl);
    DTensor x = mesh.call("test.pattern", {2}, DType::Float32);
    // No fetch, no synchronize: the controller only "does something else".
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    // The flight recorders are read out of band, without flushing anything.
    const std::string dump = ctl.dump_flight_recorder();
    for (int r = 0; r < ctl.world_size(); ++r) {
      EXPECT_NE(dump.find("done     CallFunction test.pattern (invocation 1)"), std::string::npos) << dump;
    }
  });
}

TEST(Runtime, DesignExample) {
  session([](Controller& ctl) {
    if (ctl.world_size() != 4) GTEST_SKIP() << "the example is written for 4 ranks";
    Mesh mesh = ctl.world_mesh({{"host", 2}, {"gpu", 2}});
    DTensor x = mesh.call("meshrt.full", {3, 4}, DType::Float32, 1.0);
    DTensor y = x.reduce("gpu", Reduction::Sum);
    DTensor g = y.reduce("gpu", Reduction::Stack);
    DTensor z = y.slice_mesh("host", 0).to_mesh(mesh.slice("host", 1));
    Tensor local = ctl.fetch_shard(g, {{"host", 1}, {"gpu", 0}}).get();
    EXPECT_EQ(local.shape(), (std::vector<std::int64_t>{2, 3, 4}));
    EXPECT_EQ(local.span<float>()[0], 2.0f);
    EXPECT_EQ(ctl.fetch_shard(z, {{"gpu", 1}}).get().span<float>()[11], 2.0f);
    Stream comms = ctl.stream("comms");
    DTensor b = comms.borrow(y, /*mutable=*/true);
    b.reduce_("host", Reduction::Sum);
    b.drop();
    EXPECT_EQ(ctl.fetch_shard(y, {{"host", 0}, {"gpu", 1}}).get().span<float>()[5], 4.0f);
  });
}
