// A kernel that breaks its promise on one rank (issue 12 item 4, review finding E2): it
// returns outputs that differ from its shape function, or throws something that is not a
// std::exception. That call fails on that rank only: every dependent fetch, through a
// reduce that the bad rank joins too, raises RemoteError naming the function and the
// rank; unrelated work gives correct values; synchronize() returns; the workers live on.
// Runs at 4 ranks as a 2x2 mesh; every TEST is one session. With
// MESHRT_TEST_PLACEMENT=emulated (and MESHRT_ACCELERATOR=emulated) the meshes are placed on
// the emulated accelerator, and the kernels' outputs are device tensors
// (kernel_failure_emulated).
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "runtime_support.hpp"

using namespace meshrt;
using meshrt::test::session;

MESHRT_RUNTIME_TEST_ENVIRONMENT();

namespace {

struct Case {
  std::string mode;
  std::vector<std::string> expect;  // parts of the worker's message
};

void expect_poisoned_everywhere(Controller& ctl, const Case& c, int bad) {
  Mesh mesh = ctl.world_mesh({{"host", 2}, {"gpu", ctl.world_size() / 2}}, test::test_placement());
  DTensor f = mesh.call("test.misbehave", c.mode, {bad});
  ASSERT_EQ(f.meta().device().kind(), test::test_placement()) << "the mesh's placement reaches its calls";
  DTensor g = f.reduce("gpu", Reduction::Sum);   // the bad rank joins it too
  DTensor h = g.reduce("host", Reduction::Max);  // and a chain behind it
  DTensor unrelated = mesh.call("test.pattern", {2}, DType::Float32);
  DTensor unrelated_sum = unrelated.reduce("gpu", Reduction::Sum);
  const NDSlice& ranks = mesh.ranks();
  for (auto rank : ranks) {
    const auto c0 = ranks.coordinates(rank);
    const std::vector<std::pair<std::string, std::int64_t>> coords{{"host", c0[0]}, {"gpu", c0[1]}};
    for (const DTensor* t : {&f, &g, &h}) {
      try {
        ctl.fetch_shard(*t, coords).get();
        ADD_FAILURE() << c.mode << ": expected RemoteError at rank " << rank;
      } catch (const RemoteError& e) {
        EXPECT_EQ(e.function(), "test.misbehave") << c.mode;
        EXPECT_EQ(e.ranks(), std::vector<int>{bad}) << c.mode;
        for (const std::string& part : c.expect) {
          EXPECT_NE(e.worker_message().find(part), std::string::npos)
              << c.mode << ": expected \"" << part << "\" in: " << e.worker_message();
        }
      }
    }
    // Unrelated work, including a collective the bad rank joins after its failure.
    const Tensor u = ctl.fetch_shard(unrelated, coords).get();
    EXPECT_EQ(u.span<float>()[1], static_cast<float>(rank * 100 + 2)) << c.mode << " at rank " << rank;
    const Tensor s = ctl.fetch_shard(unrelated_sum, coords).get();
    float want = 0;
    for (std::int64_t j = 0; j < mesh.size("gpu"); ++j) {
      const std::vector<std::int64_t> at{c0[0], j};
      want += static_cast<float>(ranks.location(at) * 100 + 1);
    }
    EXPECT_EQ(s.span<float>()[0], want) << c.mode << " at rank " << rank;
  }
  // Every failure was observed by a fetch: nothing left to raise.
  EXPECT_NO_THROW(ctl.synchronize()) << c.mode;
}

std::vector<Case> cases(int bad) {
  const std::string r = "on rank " + std::to_string(bad);
  return {
      {"shape", {"test.misbehave returned " + r + " as output 0", "expected float32[4]", "found float32[3]"}},
      {"dtype", {"as output 0", "expected float32[4]", "found int32[4]"}},
      {"count", {"test.misbehave returned 2 tensors " + r, "its shape function declared 1"}},
      {"throw42", {"test.misbehave " + r + " threw an exception of type int, not derived from std::exception"}},
      {"runtime", {"misbehave: a plain runtime_error"}},
  };
}

}  // namespace

TEST(KernelFailure, BrokenPromiseOnOneRankFailsOnlyThatCall) {
  session([](Controller& ctl) {
    ASSERT_EQ(ctl.world_size() % 2, 0) << "runs on an even number of ranks (a 2 x n mesh)";
    const int bad = ctl.world_size() - 1;
    for (const Case& c : cases(bad)) expect_poisoned_everywhere(ctl, c, bad);
  });
}

TEST(KernelFailure, UnobservedFailureIsRaisedBySynchronize) {
  session([](Controller& ctl) {
    Mesh mesh = ctl.world_mesh({{"all", ctl.world_size()}}, test::test_placement());
    DTensor f = mesh.call("test.misbehave", "throw42", {1});
    DTensor g = f.reduce("all", Reduction::Sum);
    try {
      ctl.synchronize();
      ADD_FAILURE() << "expected synchronize to raise the failure of test.misbehave";
    } catch (const RemoteError& e) {
      EXPECT_EQ(e.function(), "test.misbehave");
      EXPECT_EQ(e.ranks(), std::vector<int>{1});
    }
    EXPECT_NO_THROW(ctl.synchronize());
    // The worker that threw still runs calls.
    DTensor ok = mesh.call("test.misbehave", "throw42", {-1});
    EXPECT_EQ(ctl.fetch_shard(ok, {{"all", 1}}).get().span<float>()[3], 104.0f);
  });
}

// A kernel whose output is an input's memory (the input itself, a reshape of it, a tensor
// of a list argument, a mutated input) or another output's: the call fails on every rank
// naming the output and the argument, and the input is untouched, so later work on it
// (an in-place reduce) is right and the failed output does not follow it.
TEST(KernelFailure, AnOutputThatIsAnInputsMemoryFailsTheCall) {
  session([](Controller& ctl) {
    const DeviceKind kind = test::test_placement();
    Mesh mesh = ctl.world_mesh({{"x", ctl.world_size()}}, kind);
    const std::int64_t n = ctl.world_size();
    struct AliasCase {
      std::string mode;
      std::string expect;
    };
    const std::string on = " on " + std::string(name(kind));
    const std::vector<AliasCase> modes{
        {"same", "as output 0 (float32[2, 2]" + on},      {"reshape", "as output 0 (float32[4]" + on},
        {"item", "the memory of its argument 2 item 1:"}, {"mutated", "the memory of its argument 1:"},
        {"twice", "outputs 0 and 1 in the same memory"},
    };
    for (const AliasCase& c : modes) {
      DTensor x = mesh.call("test.pattern", {2, 2}, DType::Float32);
      DTensor other = mesh.call("test.pattern", {2, 2}, DType::Float32);
      std::vector<DTensor> out = mesh.call_n("test.alias", {c.mode, x, Arg{x, other}});
      for (std::int64_t r = 0; r < n; ++r) {
        try {
          (void)ctl.fetch_shard(out[0], {{"x", r}}).get();
          ADD_FAILURE() << c.mode << ": expected RemoteError from rank " << r;
        } catch (const RemoteError& e) {
          EXPECT_EQ(e.function(), "test.alias") << c.mode;
          const std::string text = e.worker_message();
          EXPECT_NE(text.find("test.alias returned on rank"), std::string::npos) << text;
          EXPECT_NE(text.find(c.expect), std::string::npos)
              << c.mode << ": expected \"" << c.expect << "\" in " << text;
          if (c.mode == "same" || c.mode == "reshape") {
            EXPECT_NE(text.find(") the memory of its argument 1:"), std::string::npos) << text;
          }
          EXPECT_NE(text.find("return a new tensor (a clone"), std::string::npos) << text;
          EXPECT_NE(text.find("or declare the output a view of the argument"), std::string::npos) << text;
        }
      }
      if (c.mode == "mutated") {
        // The mutated input is poisoned by the failed call: nothing later runs on it.
        EXPECT_THROW((void)ctl.fetch_shard(x, {{"x", 0}}).get(), RemoteError);
        continue;
      }
      // The input is intact, and an in-place reduce of it changes it alone.
      x.reduce_("x", Reduction::Sum);
      float want = 0;
      for (std::int64_t r = 0; r < n; ++r) want += static_cast<float>(r * 100 + 1);
      EXPECT_EQ(ctl.fetch_shard(x, {{"x", n - 1}}).get().span<float>()[0], want) << c.mode;
    }
    // A copy is a new tensor: accepted, and not changed by a later in-place reduce of x.
    DTensor x = mesh.call("test.pattern", {4}, DType::Float32);
    DTensor copy = mesh.call("test.alias", "clone", x, Arg{x, x});
    x.reduce_("x", Reduction::Sum);
    EXPECT_EQ(ctl.fetch_shard(copy, {{"x", n - 1}}).get().span<float>()[0], static_cast<float>((n - 1) * 100 + 1));
    EXPECT_NO_THROW(ctl.synchronize());
  });
}

// Declared views (docs/guide.md "Declared views"): chunks of a [4, 2] tensor are accepted,
// an in-place reduce of one changes the base's rows, a mutating call on the base is seen
// through the views, a borrow of a view covers the base, the base may go while a view
// lives, and a view declared but returned outside its argument fails the call (and, as a
// use that shares the argument's storage, poisons the argument).
TEST(KernelFailure, DeclaredViewsShareTheirArgumentsStorage) {
  session([](Controller& ctl) {
    const DeviceKind kind = test::test_placement();
    Mesh mesh = ctl.world_mesh({{"x", ctl.world_size()}}, kind);
    const std::int64_t n = ctl.world_size();
    // test.pattern: element i on rank r is r * 100 + i + 1.
    const auto pattern = [](std::int64_t r, std::int64_t i) { return static_cast<float>(r * 100 + i + 1); };
    const auto summed = [&](std::int64_t i) {
      float s = 0;
      for (std::int64_t r = 0; r < n; ++r) s += pattern(r, i);
      return s;
    };
    DTensor base = mesh.call("test.pattern", {4, 2}, DType::Float32);
    std::vector<DTensor> halves = mesh.call_n("test.view", {"chunks", base});
    ASSERT_EQ(halves.size(), 2u);
    EXPECT_EQ(halves[0].meta().shape(), (std::vector<std::int64_t>{2, 2}));
    halves[0].reduce_("x", Reduction::Sum);
    for (std::int64_t r = 0; r < n; ++r) {
      const Tensor b = ctl.fetch_shard(base, {{"x", r}}).get();
      for (std::int64_t i = 0; i < 8; ++i) {
        EXPECT_EQ(b.span<float>()[static_cast<std::size_t>(i)], i < 4 ? summed(i) : pattern(r, i))
            << "base element " << i << " at rank " << r;
      }
    }
    // A mutating call on the base (x += x) is seen through both views.
    (void)mesh.call_n("meshrt.add_", {base, base});
    const Tensor top = ctl.fetch_shard(halves[0], {{"x", 1}}).get();
    const Tensor bottom = ctl.fetch_shard(halves[1], {{"x", 1}}).get();
    for (std::int64_t i = 0; i < 4; ++i) {
      EXPECT_EQ(top.span<float>()[static_cast<std::size_t>(i)], 2 * summed(i)) << i;
      EXPECT_EQ(bottom.span<float>()[static_cast<std::size_t>(i)], 2 * pattern(1, i + 4)) << i;
    }
    // A borrow of a view is a borrow of the base's storage.
    Stream side = ctl.stream("side");
    DTensor lent = side.borrow(halves[1], /*mutable_borrow=*/true);
    try {
      (void)mesh.call_n("meshrt.add_", {base, base});
      ADD_FAILURE() << "expected UsageError: the base is borrowed through its view";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("borrowed mutably by stream 'side'"), std::string::npos) << e.what();
    }
    lent.drop();
    // The base goes; its view keeps the storage.
    DTensor whole;
    {
      DTensor gone = mesh.call("test.pattern", {2, 3}, DType::Float32);
      whole = mesh.call("test.view", "reshape", gone);
    }
    whole.reduce_("x", Reduction::Max);
    const Tensor w = ctl.fetch_shard(whole, {{"x", 0}}).get();
    for (std::int64_t i = 0; i < 6; ++i) EXPECT_EQ(w.span<float>()[static_cast<std::size_t>(i)], pattern(n - 1, i));
    // Declared, but outside its argument's storage: refused on every rank.
    DTensor victim = mesh.call("test.pattern", {2, 2}, DType::Float32);
    DTensor outside = mesh.call("test.view", "outside", victim);
    for (const DTensor* t : {&outside, &victim}) {
      try {
        (void)ctl.fetch_shard(*t, {{"x", 0}}).get();
        ADD_FAILURE() << "expected RemoteError";
      } catch (const RemoteError& e) {
        EXPECT_EQ(e.function(), "test.view");
        EXPECT_NE(e.worker_message().find("memory outside its argument 1"), std::string::npos) << e.worker_message();
      }
    }
    EXPECT_NO_THROW(ctl.synchronize());  // the failure was observed above
  });
}
