// to_mesh with a permutation (issue 14 item 8): rotations along a dimension (ring
// attention, pipeline loops), transposes, explicit mappings, onto the tensor's own mesh
// (every rank both sends and receives: one SendTensor) or onto another mesh of the same
// sizes, at 8 B and 64 MiB, values checked element by element. Runs at 4 ranks; every
// TEST is one controller session.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "../support/expect_error.hpp"
#include "runtime_support.hpp"

using namespace meshrt;
using meshrt::test::error_text;
using meshrt::test::session;

MESHRT_RUNTIME_TEST_ENVIRONMENT();

namespace {

using Coords = std::vector<std::pair<std::string, std::int64_t>>;

// test.pattern's element i on world rank r (int32: exact up to 64 MiB of elements).
std::int32_t pattern(std::int64_t rank, std::int64_t i) {
  return static_cast<std::int32_t>(rank * 100 + i + 1);
}

Coords coords_of(const Mesh& mesh, std::int64_t position) {
  Coords c;
  std::int64_t rest = position;
  const auto sizes = mesh.sizes();
  std::vector<std::int64_t> idx(sizes.size());
  for (std::size_t d = sizes.size(); d-- > 0;) {
    idx[d] = rest % sizes[d];
    rest /= sizes[d];
  }
  for (std::size_t d = 0; d < sizes.size(); ++d) c.emplace_back(mesh.names()[d], idx[d]);
  return c;
}

// Checks that position k of `mesh` holds the pattern of world rank source_rank(k), all
// `n` elements.
template <class SourceRank>
void expect_holds(Controller& ctl, const DTensor& t, const Mesh& mesh, std::int64_t n, SourceRank source_rank,
                  const std::string& what) {
  for (std::int64_t k = 0; k < mesh.ranks().len(); ++k) {
    const Tensor got = ctl.fetch_shard(t, coords_of(mesh, k)).get();
    ASSERT_EQ(got.numel(), n) << what;
    const auto span = got.span<std::int32_t>();
    const std::int64_t src = source_rank(k);
    std::int64_t wrong = 0, first_wrong = -1;
    for (std::int64_t i = 0; i < n; ++i) {
      if (span[static_cast<std::size_t>(i)] != pattern(src, i)) {
        if (first_wrong < 0) first_wrong = i;
        ++wrong;
      }
    }
    EXPECT_EQ(wrong, 0) << what << ": position " << k << " (world rank " << mesh.ranks()[k]
                        << ") expected the values of world rank " << src << "; first wrong element " << first_wrong;
  }
}

constexpr std::int64_t kSmall = 2;                 // 8 B of int32
constexpr std::int64_t kLarge = 16 * 1024 * 1024;  // 64 MiB of int32

}  // namespace

TEST(Permutation, RingRotationByPlusAndMinusOne) {
  session([](Controller& ctl) {
    ASSERT_EQ(ctl.world_size(), 4);
    Mesh ring = ctl.world_mesh({{"ring", 4}});
    for (std::int64_t n : {kSmall, kLarge}) {
      DTensor x = ring.call("test.pattern", {n}, DType::Int32);
      const auto rank_at = [&](std::int64_t k) { return ring.ranks()[(k + 4) % 4]; };
      // +1: coordinate i sends to i + 1, so position k holds what k - 1 had.
      DTensor plus = x.rotate("ring", 1);
      EXPECT_EQ(plus.mesh().ranks().to_vector(), ring.ranks().to_vector()) << "the result lives on the ring";
      expect_holds(
          ctl, plus, ring, n, [&](std::int64_t k) { return rank_at(k - 1); }, "rotate +1");
      DTensor minus = x.to_mesh(ring, MeshPermutation::rotate("ring", -1));
      expect_holds(
          ctl, minus, ring, n, [&](std::int64_t k) { return rank_at(k + 1); }, "rotate -1");
      // x itself is untouched.
      expect_holds(ctl, x, ring, n, rank_at, "the source after the rotations");
    }
    ctl.synchronize();
  });
}

TEST(Permutation, ChainedRotationsReturnToTheStart) {
  session([](Controller& ctl) {
    Mesh ring = ctl.world_mesh({{"ring", 4}});
    DTensor x = ring.call("test.pattern", {kSmall}, DType::Int32);
    DTensor y = x;
    for (int step = 0; step < 4; ++step) y = y.rotate("ring", 1);  // a pipeline loop
    expect_holds(
        ctl, y, ring, kSmall, [&](std::int64_t k) { return ring.ranks()[k]; }, "4 x rotate +1");
    DTensor z = x.rotate("ring", 3).rotate("ring", -2).rotate("ring", -1);
    expect_holds(
        ctl, z, ring, kSmall, [&](std::int64_t k) { return ring.ranks()[k]; }, "+3 -2 -1");
    // A shift of a whole turn is the identity (the plain positional send).
    DTensor w = x.rotate("ring", 8);
    expect_holds(
        ctl, w, ring, kSmall, [&](std::int64_t k) { return ring.ranks()[k]; }, "rotate +8");
    // A long loop (x = x.rotate(...)) keeps one live tensor, not one per step.
    ctl.synchronize();
    std::vector<std::uint64_t> before;
    for (auto r : ctl.worker_ranks()) before.push_back(ctl.live_values(static_cast<int>(r)));
    DTensor v = x;
    for (int step = 0; step < 1001; ++step) v = v.rotate("ring", step % 2 == 0 ? 1 : 2);
    // 501 steps of +1 and 500 of +2: 1501 = 375 turns + 1.
    expect_holds(
        ctl, v, ring, kSmall, [&](std::int64_t k) { return ring.ranks()[(k + 3) % 4]; }, "1001 rotations");
    ctl.synchronize();
    for (std::size_t k = 0; k < before.size(); ++k) {
      EXPECT_LE(ctl.live_values(static_cast<int>(ctl.worker_ranks()[static_cast<std::int64_t>(k)])), before[k] + 2)
          << "worker " << k;
    }
  });
}

TEST(Permutation, TransposeOnTwoByTwoWithSelfMappedRanks) {
  session([](Controller& ctl) {
    Mesh grid = ctl.world_mesh({{"row", 2}, {"col", 2}});
    for (std::int64_t n : {kSmall, kLarge}) {
      DTensor x = grid.call("test.pattern", {n}, DType::Int32);
      // (r, c) <- (c, r): positions 0 and 3 are their own sources (a local copy), 1 and 2
      // swap (each both sends and receives).
      DTensor t = x.to_mesh(grid, MeshPermutation::transpose("row", "col"));
      const std::int64_t source_of[] = {0, 2, 1, 3};
      expect_holds(
          ctl, t, grid, n, [&](std::int64_t k) { return grid.ranks()[source_of[k]]; }, "transpose");
      // Transposed twice: back where it started.
      DTensor back = t.to_mesh(grid, MeshPermutation::transpose("col", "row"));
      expect_holds(
          ctl, back, grid, n, [&](std::int64_t k) { return grid.ranks()[k]; }, "transpose twice");
    }
  });
}

TEST(Permutation, RotationAlongOneDimensionAndOntoAnotherMesh) {
  session([](Controller& ctl) {
    Mesh grid = ctl.world_mesh({{"host", 2}, {"gpu", 2}});
    DTensor x = grid.call("test.pattern", {kSmall}, DType::Int32);
    // Along gpu only: (h, g) <- (h, g - 1).
    DTensor r = x.rotate("gpu", 1);
    const std::int64_t source_of[] = {1, 0, 3, 2};
    expect_holds(
        ctl, r, grid, kSmall, [&](std::int64_t k) { return grid.ranks()[source_of[k]]; }, "rotate gpu");
    // From host 0 onto host 1, in rotated order: a rank sends or receives, none both.
    Mesh h0 = grid.slice("host", 0), h1 = grid.slice("host", 1);
    DTensor moved = x.slice_mesh("host", 0).to_mesh(h1, MeshPermutation::rotate("gpu", 1));
    expect_holds(
        ctl, moved, h1, kSmall, [&](std::int64_t k) { return h0.ranks()[(k + 1) % 2]; }, "host 0 -> 1");
    // An explicit mapping with a fixed point and a 3-cycle: 0 -> 0, 1 -> 2, 2 -> 3, 3 -> 1.
    DTensor m = x.to_mesh(grid, MeshPermutation::mapping({0, 2, 3, 1}));
    const std::int64_t mapped_from[] = {0, 3, 1, 2};
    expect_holds(
        ctl, m, grid, kSmall, [&](std::int64_t k) { return grid.ranks()[mapped_from[k]]; }, "mapping");
  });
}

TEST(Permutation, UsageErrorsAtTheCallSite) {
  session([](Controller& ctl) {
    Mesh grid = ctl.world_mesh({{"host", 2}, {"gpu", 2}});
    DTensor x = grid.call("test.pattern", {kSmall}, DType::Int32);
    const std::string file = "permutation_test.cpp:";
    auto has = [&](const std::string& text, const std::string& part) {
      EXPECT_NE(text.find(part), std::string::npos) << "expected \"" << part << "\" in: " << text;
      EXPECT_NE(text.find(file), std::string::npos) << "expected the call site in: " << text;
    };
    has(error_text([&] { x.rotate("nope", 1); }), "unknown mesh dimension 'nope'; the mesh has [host, gpu]");
    has(error_text([&] { x.to_mesh(grid.slice("host", 0), MeshPermutation::rotate("gpu", 1)); }),
        "expected a target mesh of the same sizes as the source [host=2, gpu=2], or one the source is a slice of");
    has(error_text([&] {
          x.to_mesh(grid, MeshPermutation::mapping({0, 1, 1, 3}));
        }),
        "expected a permutation of 0..3, found 1 at source position 2 a second time");
    has(error_text([&] {
          x.to_mesh(grid, MeshPermutation::mapping({0, 1, 2}));
        }),
        "expected a target position for each of the 4 ranks, found 3");
    has(error_text([&] { x.to_mesh(grid, MeshPermutation::mapping({0, 1, 2, 4})); }), "found 4 at source position 3");
    Mesh wide = ctl.world_mesh({{"a", 1}, {"b", 4}});
    DTensor y = wide.call("test.pattern", {kSmall}, DType::Int32);
    has(error_text([&] { y.to_mesh(wide, MeshPermutation::transpose("a", "b")); }),
        "expected dimensions of one size, found 'a' = 1 and 'b' = 4");
    // Nothing was sent: the session goes on.
    expect_holds(
        ctl, x.rotate("host", 1), grid, kSmall, [&](std::int64_t k) { return grid.ranks()[(k + 2) % 4]; },
        "after the refusals");
  });
}
