// Tests that need a GPU skip without one, except under MESHRT_REQUIRE_GPU=1, where the
// skip becomes a failure naming why (no device, or a driver older than the CUDA runtime):
// on a GPU node a green suite must mean the GPU tests ran, not that they all skipped.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "meshrt/internal/settings.hpp"
#include "meshrt/version.hpp"

namespace meshrt::test {

inline bool gpu_required() {
  return settings::kRequireGpu.get();
}

// "major.minor" as one comparable number (13.0 -> 13000); -1 when it is not a version.
inline int cuda_version_number(const std::string& text) {
  const auto dot = text.find('.');
  if (dot == std::string::npos || dot == 0) return -1;
  try {
    return std::stoi(text.substr(0, dot)) * 1000 + std::stoi(text.substr(dot + 1)) * 10;
  } catch (const std::exception&) {
    return -1;
  }
}

// Why CUDA cannot be used here, from what the build and the driver report.
inline std::string gpu_diagnosis() {
  const BuildInfo info = build_info();
  if (!info.cuda) return "meshrt was built without CUDA (configure with -DMESHRT_WITH_CUDA=ON)";
  std::string why = "CUDA runtime " + info.cuda_runtime + ", driver " + info.cuda_driver + ": " + info.cuda_status;
  const int runtime = cuda_version_number(info.cuda_runtime);
  const int driver = cuda_version_number(info.cuda_driver);
  if (runtime > 0 && driver > 0 && driver < runtime) {
    why += "; the driver is older than the CUDA runtime (cudaErrorInsufficientDriver): install a driver for CUDA " +
           info.cuda_runtime + " or build with an older toolkit";
  } else if (info.cuda_driver == "no driver") {
    why += "; no NVIDIA driver is loaded (is this a GPU node? does nvidia-smi work?)";
  }
  return why;
}

}  // namespace meshrt::test

// Use in a test body in place of GTEST_SKIP() for a missing GPU: `why` says what the test
// needs, e.g. MESHRT_SKIP_WITHOUT_GPU("needs one CUDA device per rank").
#define MESHRT_SKIP_WITHOUT_GPU(why)                                                   \
  do {                                                                                 \
    if (::meshrt::test::gpu_required()) {                                              \
      GTEST_FAIL() << "MESHRT_REQUIRE_GPU=1 but this test cannot run: " << why << " (" \
                   << ::meshrt::test::gpu_diagnosis() << ")";                          \
    } else {                                                                           \
      GTEST_SKIP() << why << " (" << ::meshrt::test::gpu_diagnosis() << ")";           \
    }                                                                                  \
  } while (0)
