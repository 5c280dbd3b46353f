// Device tests skip only what the job's devices cannot run, and say what they need: on a
// node with one GPU the suites run at one rank and every test that one device allows
// runs; a test that needs two members on two devices skips with "needs 2 GPUs, one per
// rank, found 1 rank and 1 GPU". (Not a MESHRT_SKIP_WITHOUT_GPU: under
// MESHRT_REQUIRE_GPU=1 too, fewer GPUs than a test needs is a skip, not a failure.)
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <optional>
#include <string>

#include "meshrt/internal/device.hpp"
#include "mpi_world.hpp"

namespace meshrt::test {

// The job's accelerator kind (MESHRT_ACCELERATOR), or `otherwise` when the job has none.
inline DeviceKind job_kind(DeviceKind otherwise) {
  const device::Accelerator a = device::configured_accelerator();
  return a == device::Accelerator::None ? otherwise : device::device_kind(a);
}

// Why this job cannot run a test of a communicator over every rank, with `ranks` ranks or
// more each on a device of its own (NCCL, and the emulated accelerator like it, refuse
// two members on one device of one host; all ranks of a test run on one node, which a
// NCCL_HOSTID per rank makes hosts of their own: scripts/gpu-check.sh); nullopt when it
// can.
inline std::optional<std::string> lacks_devices(device::Accelerator accelerator, int ranks) {
  const int world = world_size();
  const int devices = device::backend(accelerator).device_count();
  const int need = std::max(ranks, world);
  if (world >= ranks && devices >= device::most_ranks_on_a_host(MPI_COMM_WORLD)) return std::nullopt;
  auto devices_text = [&](int n) {
    const bool cuda = accelerator == device::Accelerator::Cuda;
    return fmt::format("{} {}{}", n, cuda ? "GPU" : "emulated device", n == 1 ? "" : "s");
  };
  return fmt::format("needs {}, one per rank, found {} rank{} and {}", devices_text(need), world, world == 1 ? "" : "s",
                     devices_text(devices));
}

}  // namespace meshrt::test

// In a test body: skips unless the job has `ranks` ranks or more, each on a device of its
// own (lacks_devices).
#define MESHRT_SKIP_UNLESS_DEVICES(accelerator, ranks)                            \
  do {                                                                            \
    if (const auto why = ::meshrt::test::lacks_devices((accelerator), (ranks))) { \
      GTEST_SKIP() << *why;                                                       \
    }                                                                             \
  } while (false)
