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
