// The tutorial flows of the source document on a 2x2 mesh (4 ranks).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "runtime_support.hpp"

using namespace meshrt;
using meshrt::test::session;

MESHRT_RUNTIME_TEST_ENVIRONMENT();

namespace {

// Worker objects: a counter each rank keeps, counting the ones this process freed.
std::atomic<int> g_counters_freed{0};
struct Counter {
  int rank = 0;
  std::int64_t count = 0;
  ~Counter() { g_counters_freed.fetch_add(1); }
};
WorkerObject make_counter(CallContext& ctx, Args& args) {
  if (args.integer(0) < 0 && ctx.rank() == 1) throw std::invalid_argument("no counter below zero on rank 1");
  auto counter = std::make_shared<Counter>();  // made in place: a temporary's end would count as freed
  counter->rank = ctx.rank();
  counter->count = args.integer(0);
  return WorkerObject(std::move(counter));
}
// test.bump(counter) -> int64[3]: [the counter's rank, its count after one more, freed so far]
std::vector<Tensor> bump_counter(CallContext&, Args& args) {
  Counter& c = args.object<Counter>(0);
  c.count++;
  return {Tensor::from<std::int64_t>({3}, {c.rank, c.count, g_counters_freed.load()})};
}
Signature bump_counter_shape(const ArgMetas& args) {
  args.expect_count(1, 1);
  if (!args.value(0).is_none()) args.fail_arg(0, "expected a worker object (None to shape functions)");
  return {{TensorMeta({3}, DType::Int64)}, {}};
}

}  // namespace

MESHRT_REGISTER_OBJECT("test.counter", make_counter);
MESHRT_REGISTER_FUNCTION("test.bump_counter", bump_counter, bump_counter_shape);

// Worker-side objects: each rank keeps its own, the same across calls; the last handle
// frees them; a constructor that throws poisons its handle's uses; another mesh's call
// and Mesh::call of a constructor are refused.
TEST(Runtime, WorkerObjectsAreEachRanksOwnAndGoWithTheirHandle) {
  session([](Controller& ctl) {
    Mesh mesh = ctl.world_mesh({{"host", 2}, {"gpu", 2}});
    auto at = [](std::int64_t rank) {
      return std::vector<std::pair<std::string, std::int64_t>>{{"host", rank / 2}, {"gpu", rank % 2}};
    };
    Object c = mesh.call_object("test.counter", {Arg(10)});
    DTensor first = mesh.call("test.bump_counter", c);
    DTensor second = mesh.call("test.bump_counter", c);
    std::vector<std::int64_t> freed_before(4);
    for (std::int64_t r = 0; r < 4; ++r) {
      const Tensor a = ctl.fetch_shard(first, at(r)).get(), b = ctl.fetch_shard(second, at(r)).get();
      EXPECT_EQ(a.data<std::int64_t>()[0], r);
      EXPECT_EQ(a.data<std::int64_t>()[1], 11);
      EXPECT_EQ(b.data<std::int64_t>()[1], 12);
      freed_before[r] = b.data<std::int64_t>()[2];
    }
    Object other = mesh.call_object("test.counter", {Arg(0)});
    c.drop();
    EXPECT_FALSE(c.defined());
    DTensor after = mesh.call("test.bump_counter", other);
    for (std::int64_t r = 0; r < 4; ++r) {
      const Tensor t = ctl.fetch_shard(after, at(r)).get();
      EXPECT_EQ(t.data<std::int64_t>()[1], 1);
      EXPECT_EQ(t.data<std::int64_t>()[2], freed_before[r] + 1) << "rank " << r << " kept the dropped counter";
    }
    const auto usage_error = [](auto f) -> std::string {
      try {
        f();
      } catch (const UsageError& e) {
        return e.what();
      }
      return "no UsageError";
    };
    EXPECT_NE(usage_error([&] { mesh.slice("host", 0).call("test.bump_counter", other); })
                  .find("a worker object made on mesh [host=2, gpu=2] on ranks [0, 1, 2, 3] was passed to a call on "
                        "mesh [gpu=2] on ranks [0, 1]"),
              std::string::npos);
    EXPECT_NE(usage_error([&] { mesh.call("test.counter", 1); }).find("call it with mesh.call_object"),
              std::string::npos);
    EXPECT_NE(usage_error([&] {
                mesh.call_object("test.bump_counter", {Arg(other)});
              }).find("returns tensors, not an object"),
              std::string::npos);
    Object bad = mesh.call_object("test.counter", {Arg(-1)});
    DTensor poisoned = mesh.call("test.bump_counter", bad);
    try {
      ctl.fetch_shard(poisoned, at(1)).get();
      ADD_FAILURE() << "a use of an object whose constructor threw returned";
    } catch (const RemoteError& e) {
      EXPECT_EQ(e.function(), "test.counter");
      EXPECT_EQ(e.ranks(), std::vector<int>{1});
      EXPECT_NE(std::string(e.what()).find("no counter below zero on rank 1"), std::string::npos) << e.what();
      EXPECT_NE(e.issued_at().find("runtime_basic_test.cpp"), std::string::npos) << e.issued_at();
    }
    EXPECT_EQ(ctl.fetch_shard(mesh.call("test.bump_counter", other), at(3)).get().data<std::int64_t>()[1], 2);
    try {
      ctl.synchronize();
    } catch (const RemoteError&) {
      // the constructor's failure may be raised again here
    }
  });
}

TEST(Runtime, FullReduceFetch) {
  session([](Controller& ctl) {
    Mesh mesh = ctl.world_mesh({{"host", 2}, {"gpu", 2}});
    DTensor x = mesh.call("meshrt.full", {3, 4}, DType::Float32, 1.0);
    DTensor y = x.reduce("gpu", Reduction::Sum);
    Tensor local = ctl.fetch_shard(y, {{"host", 1}, {"gpu", 0}}).get();
    ASSERT_EQ(local.shape(), (std::vector<std::int64_t>{3, 4}));
    for (float v : local.span<float>()) EXPECT_EQ(v, 2.0f);
  });
}

// Host data onto a mesh (issue 24): from_host copies the controller's tensor to every
// rank; scatter gives the ranks at coordinate i along a dimension shard i of its first
// axis; a list of numbers where a tensor belongs is refused with the form to use.
TEST(Runtime, HostDataOntoAMesh) {
  session([](Controller& ctl) {
    Mesh mesh = ctl.world_mesh({{"host", 2}, {"gpu", 2}});
    Tensor host = Tensor::from<float>({4, 2}, {0, 1, 2, 3, 4, 5, 6, 7});
    const Tensor original = host.clone();
    DTensor all = mesh.from_host(host);
    DTensor by_host = mesh.scatter("host", host);
    DTensor by_gpu = mesh.scatter("gpu", host);
    host.data<float>()[0] = 100;  // after the calls: what they sent is the tensor as it was
    EXPECT_EQ(by_host.meta(), TensorMeta({2, 2}, DType::Float32));
    DTensor total = by_host.reduce("host", Reduction::Sum);  // an ordinary DTensor
    for (std::int64_t h = 0; h < 2; ++h) {
      for (std::int64_t g = 0; g < 2; ++g) {
        const std::vector<std::pair<std::string, std::int64_t>> at = {{"host", h}, {"gpu", g}};
        EXPECT_TRUE(ctl.fetch_shard(all, at).get().equals(original)) << h << g;
        const float hb = static_cast<float>(4 * h), gb = static_cast<float>(4 * g);
        EXPECT_TRUE(
            ctl.fetch_shard(by_host, at).get().equals(Tensor::from<float>({2, 2}, {hb, hb + 1, hb + 2, hb + 3})))
            << h << g;
        EXPECT_TRUE(ctl.fetch_shard(by_gpu, at).get().equals(Tensor::from<float>({2, 2}, {gb, gb + 1, gb + 2, gb + 3})))
            << h << g;
        EXPECT_TRUE(ctl.fetch_shard(total, at).get().equals(Tensor::from<float>({2, 2}, {4, 6, 8, 10}))) << h << g;
      }
    }
    const auto usage_error = [](auto f) -> std::string {
      try {
        f();
      } catch (const UsageError& e) {
        return e.what();
      }
      ADD_FAILURE() << "expected a UsageError";
      return "";
    };
    const std::string odd = usage_error([&] { mesh.scatter("host", Tensor::from<float>({3}, {1, 2, 3})); });
    EXPECT_NE(odd.find("scatter over 'host': expected a tensor whose first axis splits into 2 equal shards, found "
                       "float32[3] on cpu (at runtime_basic_test.cpp:"),
              std::string::npos)
        << odd;
    EXPECT_NE(usage_error([&] { mesh.scatter("rack", host); }).find("rack"), std::string::npos);
    const std::vector<float> numbers = {1, 2, 3};
    const std::string list = usage_error([&] { mesh.call("meshrt.copy", Value(numbers)); });
    EXPECT_NE(list.find("meshrt.copy(x): argument 0 (x): expected a tensor, found list ["), std::string::npos) << list;
    EXPECT_NE(list.find("host numbers go as a meshrt::Tensor, e.g. meshrt::Tensor::from<float>({3}, values)"),
              std::string::npos)
        << list;
    ctl.synchronize();
  });
}

namespace {

std::string usage_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const UsageError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a UsageError";
  return "";
}

// x(h, g) = 100h + [4g, 4g+1, 4g+2, 4g+3], float32[2, 2]: distinct along both dimensions.
Tensor expected_x(std::int64_t h, std::int64_t g) {
  const auto b = static_cast<float>(100 * h + 4 * g);
  return Tensor::from<float>({2, 2}, {b, b + 1, b + 2, b + 3});
}

// Entry i of a stack of float32[2, 2] tensors.
Tensor entry(const Tensor& stacked, std::int64_t i) {
  const auto all = stacked.span<float>();
  const auto at = static_cast<std::size_t>(4 * i);
  return Tensor::from<float>({2, 2}, {all[at], all[at + 1], all[at + 2], all[at + 3]});
}

// test.stamp(ms, rank) -> int64 0-d: sleeps `ms` milliseconds on world rank `rank` only,
// then gives this rank's steady clock (shared by the processes of one host) in ns.
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

std::int64_t stamp(Controller& ctl, const DTensor& t, std::int64_t h, std::int64_t g) {
  return ctl.fetch_shard(t, {{"host", h}, {"gpu", g}}).get().span<std::int64_t>()[0];
}

}  // namespace

// Controller::fetch_call: a registered function's output on one rank, made into no DTensor.
TEST(Runtime, FetchCallRunsAFunctionOnOneRank) {
  session([](Controller& ctl) {
    Mesh mesh = ctl.world_mesh({{"host", 2}, {"gpu", 2}});
    DTensor x = mesh.scatter("gpu", Tensor::from<float>({4}, {1, 2, 3, 4}));  // gpu g: [1 + 2g, 2 + 2g]
    EXPECT_EQ(ctl.fetch_call(mesh, "meshrt.sum", {x}, {{"gpu", 1}}).get().span<float>()[0], 7.0f);
    EXPECT_EQ(ctl.fetch_call(mesh, "meshrt.sum", {x}, {{"host", 1}}).get().span<float>()[0], 3.0f);  // gpu 0
    const std::string mutating = usage_error([&] { (void)ctl.fetch_call(mesh, "meshrt.add_", {x, x}); });
    EXPECT_NE(mutating.find("fetch of meshrt.add_: expected a function with one output that mutates no argument"),
              std::string::npos)
        << mutating;
  });
}

// The small forms users of the source document write: reduce(out=), "mean", a mesh split
// with an inferred size, Mesh::size over several dimensions, and drop() of any tensor.
TEST(Runtime, ReduceIntoOutSplitInferredAndDropOfAnyTensor) {
  session([](Controller& ctl) {
    Mesh mesh = ctl.world_mesh({{"host", 2}, {"gpu", 2}});
    EXPECT_EQ(mesh.size({"host", "gpu"}), 4);
    EXPECT_EQ(mesh.size({}), 4);
    Mesh split = ctl.world_mesh({{"all", 4}}).split("all", {{"a", 2}, {"b", -1}});
    EXPECT_EQ(split.sizes(), (std::vector<std::int64_t>{2, 2}));
    const std::string bad = usage_error([&] {
      (void)ctl.world_mesh({{"all", 4}}).split("all", {{"a", 3}, {"b", -1}});
    });
    EXPECT_NE(bad.find("the other parts' sizes multiply to 3, which does not divide its size 4"), std::string::npos)
        << bad;
    EXPECT_EQ(parse_reduction("mean"), Reduction::Avg);

    // x = 1 + 10 * gpu on (host, gpu): its sum over gpu is 12 on every rank.
    DTensor x = mesh.scatter("gpu", Tensor::from<float>({2}, {1, 11}));
    auto at = [&](const DTensor& t, std::int64_t h, std::int64_t g) {
      return ctl.fetch_shard(t, {{"host", h}, {"gpu", g}}).get().span<float>()[0];
    };
    DTensor out = mesh.call("meshrt.full", std::vector<std::int64_t>{1}, DType::Float32, -5.0);
    DTensor alias = out;  // a handle sharing out's value sees the write
    DTensor& r = x.reduce("gpu", Reduction::Sum, false, out);
    EXPECT_EQ(&r, &out);
    for (std::int64_t h = 0; h < 2; ++h)
      for (std::int64_t g = 0; g < 2; ++g) EXPECT_EQ(at(alias, h, g), 12.0f) << h << g;
    DTensor all = mesh.call("meshrt.full", std::vector<std::int64_t>{1}, DType::Float32, 0.0);
    (void)x.reduce({"host", "gpu"}, Reduction::Sum, false, all);
    EXPECT_EQ(at(all, 1, 1), 24.0f);
    DTensor wrong = mesh.call("meshrt.full", std::vector<std::int64_t>{2}, DType::Float32, 0.0);
    const std::string meta = usage_error([&] { (void)x.reduce("gpu", Reduction::Sum, false, wrong); });
    EXPECT_NE(meta.find("reduce: expected out of the result's meta float32[1] on cpu, found float32[2] on cpu"),
              std::string::npos)
        << meta;

    DTensor gone = mesh.call("meshrt.full", std::vector<std::int64_t>{3}, DType::Float32, 2.0);
    DTensor other = gone;
    gone.drop();
    const std::string use = usage_error([&] { (void)other.reduce("gpu", Reduction::Sum); });
    EXPECT_NE(use.find("the tensor was dropped at "), std::string::npos) << use;
    EXPECT_NE(use.find("runtime_basic_test.cpp"), std::string::npos) << use;
    const std::string again = usage_error([&] { other.drop(); });
    EXPECT_NE(again.find("drop: the tensor was already dropped at"), std::string::npos) << again;
    ctl.synchronize();  // the delete ran: no failure, and the session goes on
    EXPECT_EQ(at(x, 0, 1), 11.0f);
  });
}

// A barrier over 'gpu': no rank of a line leaves before the line's last one enters. World
// rank 1 (host 0, gpu 1) sleeps before it, so every stamp taken after the barrier on host 0
// is later than rank 1's stamp before it (and a barrier that waited for nobody would
// stamp rank 0 first). The ordering is the clock's, not a duration.
TEST(Runtime, ABarrierOverADimensionWaitsForEveryRankOfItsLine) {
  session([](Controller& ctl) {
    Mesh mesh = ctl.world_mesh({{"host", 2}, {"gpu", 2}});
    // The communicators are made on first use, which itself waits for the line: made here
    // first, so that only the barrier can order the stamps below.
    mesh.barrier("gpu").get();
    mesh.barrier().get();
    DTensor before = mesh.call("test.stamp", 200, 1);
    Future<void> f = mesh.barrier("gpu");
    DTensor after = mesh.call("test.stamp", 0, -1);
    f.get();
    EXPECT_TRUE(f.done());
    const std::int64_t slept = stamp(ctl, before, 0, 1);
    for (std::int64_t g = 0; g < 2; ++g) EXPECT_GE(stamp(ctl, after, 0, g), slept) << g;
    EXPECT_GE(std::chrono::steady_clock::now().time_since_epoch().count(), slept);  // f completed after it

    // Several dimensions as one line, and every dimension: rank 1 sleeps, all wait.
    before = mesh.call("test.stamp", 200, 1);
    Future<void> all = mesh.barrier({"gpu", "host"});
    after = mesh.call("test.stamp", 0, -1);
    Future<void> every = mesh.barrier();
    all.get(std::chrono::seconds(60));
    every.get(std::chrono::seconds(60));
    const std::int64_t slept_again = stamp(ctl, before, 0, 1);
    for (std::int64_t r = 0; r < 4; ++r) EXPECT_GE(stamp(ctl, after, r / 2, r % 2), slept_again) << r;
    mesh.slice("host", 1).barrier("gpu").get();  // a sub-mesh's line

    const std::string unknown = usage_error([&] { (void)mesh.barrier("rack"); });
    EXPECT_NE(unknown.find("rack"), std::string::npos) << unknown;
    const std::string twice = usage_error([&] { (void)mesh.barrier({"gpu", "gpu"}); });
    EXPECT_NE(twice.find("barrier: expected each mesh dimension at most once, found 'gpu' twice in [gpu, gpu]"),
              std::string::npos)
        << twice;
    DTensor x = mesh.rank("gpu");
    const std::string recorded = usage_error([&] {
      (void)ctl.record({x}, [&](const std::vector<DTensor>& in) {
        (void)mesh.barrier("gpu");
        return in;
      });
    });
    EXPECT_NE(recorded.find("barrier over 'gpu' inside a recording"), std::string::npos) << recorded;
    ctl.synchronize();
  });
}

// when_all: one future for several, their values in order; the first failure in the
// list's order named by its position; barriers compose as a completion; an empty list is
// done at once.
TEST(Runtime, WhenAllComposesFuturesAndNamesTheFirstFailure) {
  session([](Controller& ctl) {
    Mesh mesh = ctl.world_mesh({{"host", 2}, {"gpu", 2}});
    DTensor x = mesh.rank("gpu");
    DTensor y = mesh.rank("host");
    std::vector<Future<Tensor>> fs;
    for (std::int64_t r = 0; r < 4; ++r)
      fs.push_back(ctl.fetch_shard(r % 2 ? x : y, {{"host", r / 2}, {"gpu", r % 2}}));
    Future<std::vector<Tensor>> all = when_all(std::move(fs));
    const std::vector<Tensor> got = all.get(std::chrono::seconds(30));
    ASSERT_EQ(got.size(), 4u);
    for (std::int64_t r = 0; r < 4; ++r) {
      const std::int64_t want = r % 2 ? r % 2 : r / 2;  // x: the gpu coordinate; y: the host one
      EXPECT_EQ(got[r].item(), static_cast<double>(want)) << r;
    }
    EXPECT_TRUE(all.done());

    DTensor bad = mesh.call("meshrt.fail", "when_all's failure", std::vector<std::int64_t>{3});
    std::vector<Future<Tensor>> mixed;
    mixed.push_back(ctl.fetch_shard(x, {{"host", 0}, {"gpu", 0}}));
    mixed.push_back(ctl.fetch_shard(bad, {{"host", 1}, {"gpu", 1}}));
    mixed.push_back(ctl.fetch_shard(x, {{"host", 1}, {"gpu", 0}}));
    Future<std::vector<Tensor>> failing = when_all(std::move(mixed));
    try {
      (void)failing.get();
      ADD_FAILURE() << "expected a RemoteError";
    } catch (const RemoteError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("when_all: future 2 of 3 failed"), std::string::npos) << what;
      EXPECT_EQ(e.function(), "meshrt.fail") << what;
      EXPECT_NE(e.worker_message().find("when_all's failure"), std::string::npos) << e.worker_message();
    }
    EXPECT_TRUE(failing.exception() != nullptr);

    Future<void> both = when_all(std::vector<Future<void>>{mesh.barrier("gpu"), mesh.barrier()});
    both.get(std::chrono::seconds(30));
    EXPECT_TRUE(both.done());
    EXPECT_TRUE(when_all(std::vector<Future<Tensor>>{}).done());
    EXPECT_TRUE(when_all(std::vector<Future<Tensor>>{}).get().empty());
    ctl.synchronize();  // the failure was reported through the fetch: not again
  });
}

// Rooted collectives over one dimension: the expected values are closed forms of x.
TEST(Runtime, RootedCollectivesOverADimension) {
  session([](Controller& ctl) {
    Mesh mesh = ctl.world_mesh({{"host", 2}, {"gpu", 2}});
    DTensor by_gpu = mesh.scatter("gpu", Tensor::from<float>({4, 2}, {0, 1, 2, 3, 4, 5, 6, 7}));
    DTensor by_host = mesh.scatter("host", Tensor::from<float>({4, 2}, {0, 0, 0, 0, 100, 100, 100, 100}));
    DTensor x = mesh.call("meshrt.add", by_gpu, by_host);

    DTensor to1 = x.reduce("gpu", Reduction::Sum, Dst{1});
    EXPECT_EQ(to1.mesh().names(), (std::vector<std::string>{"host"}));
    EXPECT_EQ(to1.mesh().ranks().to_vector(), (std::vector<NDSlice::Int>{1, 3}));  // gpu=1 of each host
    DTensor gathered = x.gather("gpu", 0);
    EXPECT_EQ(gathered.meta(), TensorMeta({2, 2, 2}, DType::Float32));
    DTensor from_host1 = x.broadcast("host", 1);
    DTensor parts = x.scatter("gpu", 0);
    EXPECT_EQ(parts.meta(), TensorMeta({1, 2}, DType::Float32));
    for (std::int64_t h = 0; h < 2; ++h) {
      const auto hb = static_cast<float>(200 * h);
      EXPECT_TRUE(ctl.fetch_shard(to1, {{"host", h}})
                      .get()
                      .equals(Tensor::from<float>({2, 2}, {hb + 4, hb + 6, hb + 8, hb + 10})))
          << h;
      const Tensor g = ctl.fetch_shard(gathered, {{"host", h}}).get();
      for (std::int64_t i = 0; i < 2; ++i) EXPECT_TRUE(entry(g, i).equals(expected_x(h, i))) << h << i;
      for (std::int64_t i = 0; i < 2; ++i) {
        const std::vector<std::pair<std::string, std::int64_t>> at = {{"host", h}, {"gpu", i}};
        EXPECT_TRUE(ctl.fetch_shard(from_host1, at).get().equals(expected_x(1, i))) << h << i;
        const auto p = static_cast<float>(100 * h + 2 * i);  // row i of x(h, 0)
        EXPECT_TRUE(ctl.fetch_shard(parts, at).get().equals(Tensor::from<float>({1, 2}, {p, p + 1}))) << h << i;
      }
    }

    const std::string root = usage_error([&] { (void)x.reduce("gpu", Reduction::Sum, Dst{2}); });
    EXPECT_NE(root.find("reduce over 'gpu': expected a coordinate in 0..1 (the size of 'gpu' is 2), found 2"),
              std::string::npos)
        << root;
    const std::string scalar = usage_error([&] { (void)mesh.rank("gpu").scatter("host", 0); });
    EXPECT_NE(scalar.find("scatter over 'host' from host=0: scatter over 2 ranks needs an input whose size(0) splits "
                          "into 2 equal parts, found int64[] on cpu"),
              std::string::npos)
        << scalar;
    const std::string avg = usage_error([&] { (void)mesh.rank("gpu").reduce("host", Reduction::Avg, Dst{0}); });
    EXPECT_NE(avg.find("reduction avg needs a floating-point dtype, found int64"), std::string::npos) << avg;
    ctl.synchronize();
  });
}

// Several dimensions as one collective: the line is the mesh flattened over them, in the
// mesh's order whatever order the call gives; {} is every dimension.
TEST(Runtime, AReductionOverSeveralDimensionsIsOneCollective) {
  session([](Controller& ctl) {
    Mesh mesh = ctl.world_mesh({{"host", 2}, {"gpu", 2}});
    DTensor by_gpu = mesh.scatter("gpu", Tensor::from<float>({4, 2}, {0, 1, 2, 3, 4, 5, 6, 7}));
    DTensor by_host = mesh.scatter("host", Tensor::from<float>({4, 2}, {0, 0, 0, 0, 100, 100, 100, 100}));
    DTensor x = mesh.call("meshrt.add", by_gpu, by_host);
    EXPECT_EQ(mesh.size({"host", "gpu"}), 4);
    EXPECT_EQ(mesh.size({}), 4);

    DTensor sum = x.reduce({"host", "gpu"}, Reduction::Sum);
    DTensor every = x.reduce({}, Reduction::Sum);
    DTensor stacked = x.reduce({"gpu", "host"}, Reduction::Stack);  // ranked host-major, the mesh's order
    EXPECT_EQ(stacked.meta(), TensorMeta({4, 2, 2}, DType::Float32));
    DTensor scattered = stacked.reduce({"host", "gpu"}, Reduction::Sum, /*scatter=*/true);
    EXPECT_EQ(scattered.meta(), TensorMeta({2, 2}, DType::Float32));
    const Tensor total = Tensor::from<float>({2, 2}, {208, 212, 216, 220});  // sum of 100h + 4g + k
    for (std::int64_t h = 0; h < 2; ++h) {
      for (std::int64_t g = 0; g < 2; ++g) {
        const std::vector<std::pair<std::string, std::int64_t>> at = {{"host", h}, {"gpu", g}};
        EXPECT_TRUE(ctl.fetch_shard(sum, at).get().equals(total)) << h << g;
        EXPECT_TRUE(ctl.fetch_shard(every, at).get().equals(total)) << h << g;
        const Tensor s = ctl.fetch_shard(stacked, at).get();
        for (std::int64_t p = 0; p < 4; ++p) EXPECT_TRUE(entry(s, p).equals(expected_x(p / 2, p % 2))) << p;
        // Four equal stacks, scattered: position h*2+g gets four times x(h, g).
        const Tensor part = ctl.fetch_shard(scattered, at).get();
        const auto b = static_cast<float>(4 * (100 * h + 4 * g));
        EXPECT_TRUE(part.equals(Tensor::from<float>({2, 2}, {b, b + 4, b + 8, b + 12}))) << h << g;
      }
    }
    x.reduce_({"gpu", "host"}, Reduction::Max);
    for (std::int64_t r = 0; r < 4; ++r) {
      EXPECT_TRUE(ctl.fetch_shard(x, {{"host", r / 2}, {"gpu", r % 2}}).get().equals(expected_x(1, 1))) << r;
    }

    const std::string twice = usage_error([&] { (void)x.reduce({"gpu", "gpu"}, Reduction::Sum); });
    EXPECT_NE(twice.find("reduce: expected each mesh dimension at most once, found 'gpu' twice in [gpu, gpu]"),
              std::string::npos)
        << twice;
    const std::string unknown = usage_error([&] { (void)x.reduce({"host", "rack"}, Reduction::Sum); });
    EXPECT_NE(unknown.find("rack"), std::string::npos) << unknown;
    const std::string split = usage_error([&] { (void)x.reduce({"host", "gpu"}, Reduction::Sum, true); });
    EXPECT_NE(split.find("reduce sum with scatter over 'host', 'gpu': "), std::string::npos) << split;
    ctl.synchronize();
  });
}

// A broadcast to_mesh: from a slice of a mesh onto the mesh, every rank gets the shard of
// the source rank whose coordinates agree with its own on the source's dimensions.
TEST(Runtime, ToMeshFromASliceBroadcastsAlongTheMissingDimensions) {
  session([](Controller& ctl) {
    Mesh mesh = ctl.world_mesh({{"host", 2}, {"gpu", 2}});
    DTensor by_gpu = mesh.scatter("gpu", Tensor::from<float>({4, 2}, {0, 1, 2, 3, 4, 5, 6, 7}));
    DTensor by_host = mesh.scatter("host", Tensor::from<float>({4, 2}, {0, 0, 0, 0, 100, 100, 100, 100}));
    DTensor x = mesh.call("meshrt.add", by_gpu, by_host);

    DTensor rooted = x.reduce("gpu", Reduction::Sum, Dst{0}).to_mesh(mesh);    // x.reduce("gpu", Sum)
    DTensor host1 = x.slice_mesh("host", 1).to_mesh(mesh);                     // sources not at host 0
    DTensor one = x.slice_mesh("host", 0).slice_mesh("gpu", 1).to_mesh(mesh);  // one rank to all four
    EXPECT_TRUE(rooted.mesh() == mesh);
    for (std::int64_t h = 0; h < 2; ++h) {
      const auto hb = static_cast<float>(200 * h);
      for (std::int64_t g = 0; g < 2; ++g) {
        const std::vector<std::pair<std::string, std::int64_t>> at = {{"host", h}, {"gpu", g}};
        EXPECT_TRUE(
            ctl.fetch_shard(rooted, at).get().equals(Tensor::from<float>({2, 2}, {hb + 4, hb + 6, hb + 8, hb + 10})))
            << h << g;
        EXPECT_TRUE(ctl.fetch_shard(host1, at).get().equals(expected_x(1, g))) << h << g;
        EXPECT_TRUE(ctl.fetch_shard(one, at).get().equals(expected_x(0, 1))) << h << g;
      }
    }

    const DTensor row = x.slice_mesh("host", 0);
    const std::string sizes = usage_error([&] { (void)row.to_mesh(ctl.world_mesh({{"all", 4}})); });
    EXPECT_NE(sizes.find("to_mesh: expected a target mesh of the same sizes as the source [gpu=2], or one the "
                         "source is a slice of"),
              std::string::npos)
        << sizes;
    EXPECT_NE(sizes.find("found the target [all=4], which has no dimension 'gpu' of size 2"), std::string::npos)
        << sizes;
    const std::string permuted = usage_error([&] { (void)row.to_mesh(mesh, MeshPermutation::rotate("gpu", 1)); });
    EXPECT_NE(permuted.find("a permutation does not combine with a broadcast"), std::string::npos) << permuted;
    // Same names, but the ranks of gpu-major order: [0, 1] is no slice of it.
    const std::string sliced = usage_error([&] { (void)row.to_mesh(ctl.world_mesh({{"gpu", 2}, {"host", 2}})); });
    EXPECT_NE(sliced.find("of which the source (ranks "), std::string::npos) << sliced;
    EXPECT_NE(sliced.find("is no slice"), std::string::npos) << sliced;
    EXPECT_NE(sliced.find("runtime_basic_test.cpp"), std::string::npos) << sliced;  // the call's line
    ctl.synchronize();
  });
}
