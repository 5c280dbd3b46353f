// One meshrt::Runtime per MPI test binary: every TEST runs one controller session, with
// the body on rank 0 and workers everywhere.
#pragma once

#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdlib>
#include <functional>
#include <memory>
#include <string>

#include "meshrt/meshrt.hpp"

namespace meshrt::test {

inline std::unique_ptr<Runtime>& runtime_slot() {
  static std::unique_ptr<Runtime> rt;
  return rt;
}

class RuntimeEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    int argc = 0;
    char** argv = nullptr;
    runtime_slot() = std::make_unique<Runtime>(argc, argv);
  }
  void TearDown() override { runtime_slot().reset(); }
};

// Where a suite's meshes go: MESHRT_TEST_PLACEMENT=emulated places them on the emulated
// accelerator (the suite's *_emulated run, with MESHRT_ACCELERATOR=emulated), else the CPU.
inline DeviceKind test_placement() {
  const char* p = std::getenv("MESHRT_TEST_PLACEMENT");
  return p != nullptr && std::string(p) == "emulated" ? DeviceKind::Emulated : DeviceKind::Cpu;
}

// Runs `body` as the controller of one session.
inline void session(const std::function<void(Controller&)>& body) {
  runtime_slot()->session(body);
}

}  // namespace meshrt::test

#define MESHRT_RUNTIME_TEST_ENVIRONMENT()                                     \
  [[maybe_unused]] static ::testing::Environment* const meshrt_runtime_env_ = \
      ::testing::AddGlobalTestEnvironment(new ::meshrt::test::RuntimeEnvironment)
