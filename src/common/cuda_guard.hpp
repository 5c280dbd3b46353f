// CudaDeviceGuard: makes a CUDA device current for a scope. Here, below tensor and device,
// so that both use the one guard. Internal header; empty without MESHRT_HAVE_CUDA.
#pragma once

#include "common/checks.hpp"
#include "meshrt/config.hpp"

#if MESHRT_HAVE_CUDA
#include <cuda_runtime_api.h>

namespace meshrt::detail {

// Makes `device` current for a scope and restores the caller's device after, so a call
// never changes the thread's CUDA device behind its back.
class CudaDeviceGuard {
 public:
  explicit CudaDeviceGuard(int device) {
    MESHRT_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) MESHRT_CUDA_CHECK(cudaSetDevice(device));
  }
  ~CudaDeviceGuard() { (void)cudaSetDevice(previous_); }  // a destructor cannot raise
  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace meshrt::detail
#endif
