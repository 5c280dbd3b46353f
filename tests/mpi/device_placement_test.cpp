// A mesh placed on the emulated accelerator in a job without it (NP 2, no
// MESHRT_ACCELERATOR): no device per rank was chosen, so both ranks would share
// emulated:0; the first collective says what is expected (MESHRT_ACCELERATOR=emulated,
// or a real accelerator) and what was found, on every rank, and nothing hangs.
#include <gtest/gtest.h>

#include "meshrt/device.hpp"
#include "runtime_support.hpp"

using namespace meshrt;
using meshrt::test::session;

MESHRT_RUNTIME_TEST_ENVIRONMENT();

TEST(DevicePlacement, AnEmulatedMeshWithoutTheEmulatedAcceleratorSaysWhatItNeeds) {
  if (device::configured_accelerator() == device::Accelerator::Emulated) GTEST_SKIP() << "the job has the accelerator";
  session([](Controller& ctl) {
    Mesh mesh = ctl.world_mesh({{"r", 2}}, DeviceKind::Emulated);
    DTensor x = mesh.call("meshrt.full", {4}, DType::Float32, 1.0);
    DTensor y = x.reduce("r", Reduction::Sum);
    try {
      (void)ctl.fetch_shard(y, {{"r", 1}}).get();
      ADD_FAILURE() << "expected a RemoteError";
    } catch (const RemoteError& e) {
      const std::string text = e.what();
      EXPECT_NE(text.find("found world ranks 0 and 1 (members 0 and 1) both on emulated:0 of one node (emulated "
                          "device 0 of the node); this job's accelerator is none, so no emulated device was chosen "
                          "per rank: a mesh placed on emulated needs MESHRT_ACCELERATOR=emulated, or a real "
                          "accelerator"),
                std::string::npos)
          << text;
    }
    try {
      ctl.synchronize();
    } catch (const Error&) {
      // raising is as good as returning
    }
  });
}
