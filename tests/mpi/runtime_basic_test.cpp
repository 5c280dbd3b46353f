// The tutorial flows of the source document on a 2x2 mesh (4 ranks).
#include <gtest/gtest.h>

#include "runtime_support.hpp"

using namespace meshrt;
using meshrt::test::session;

MESHRT_RUNTIME_TEST_ENVIRONMENT();

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
