// The cuda backend: the device layer over the CUDA runtime and NCCL. Internal header,
// compiled only with MESHRT_HAVE_CUDA.
#pragma once

#include <mpi.h>

#include <chrono>
#include <memory>
#include <string>

#include "common/checks.hpp"
#include "common/cuda_guard.hpp"
#include "meshrt/internal/device.hpp"

namespace meshrt::device {

using detail::CudaDeviceGuard;  // common/cuda_guard.hpp, shared with tensor

// Created on first use; creating it makes no context (only cudaGetDeviceCount).
Backend& cuda_backend();
// cudaGetDeviceCount, 0 when it fails (no driver, no device; `why`, if given, gets CUDA's
// error then); makes no context.
int cuda_visible_devices(std::string* why = nullptr) noexcept;
// device::trace_flush for the CUDA streams with spans not yet recorded.
void cuda_trace_flush(bool wait);
// Backend::trim of the cuda backend, if it was made.
void cuda_trim() noexcept;
// device::make_native_wait on a CUDA stream: an event recorded on `stream`, waited for by
// `native`.
void cuda_make_native_wait(void* native, Stream::Impl& stream);

#if MESHRT_HAVE_NCCL
// ncclCommInitRankConfig with blocking = 0 over `members`, polled against `timeout`.
std::unique_ptr<Communicator> create_nccl_communicator(MPI_Comm members, int device,
                                                       std::chrono::duration<double> timeout);
#endif

}  // namespace meshrt::device
