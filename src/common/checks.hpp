// One check macro per library (after NCCL's checks.h): a failing MPI, CUDA or NCCL call
// becomes a meshrt::SystemError naming the call, its error text, the file and the line.
// Internal header: it includes the libraries' own headers.
#pragma once

#include <mpi.h>

#include "meshrt/config.hpp"

#include <string>

#include "meshrt/error.hpp"

namespace meshrt::detail {

[[noreturn]] void throw_mpi_error(int code, const char* call, const char* file, int line);
std::string mpi_error_string(int code);

}  // namespace meshrt::detail

#define MESHRT_MPI_CHECK(call)                                                      \
  do {                                                                              \
    const int meshrt_mpi_rc_ = (call);                                              \
    if (meshrt_mpi_rc_ != MPI_SUCCESS) {                                            \
      ::meshrt::detail::throw_mpi_error(meshrt_mpi_rc_, #call, __FILE__, __LINE__); \
    }                                                                               \
  } while (0)

#if MESHRT_HAVE_CUDA
#include <cuda_runtime_api.h>
namespace meshrt::detail {
[[noreturn]] void throw_cuda_error(int code, const char* call, const char* file, int line);
}
#define MESHRT_CUDA_CHECK(call)                                                                         \
  do {                                                                                                  \
    const cudaError_t meshrt_cuda_rc_ = (call);                                                         \
    if (meshrt_cuda_rc_ != cudaSuccess) {                                                               \
      ::meshrt::detail::throw_cuda_error(static_cast<int>(meshrt_cuda_rc_), #call, __FILE__, __LINE__); \
    }                                                                                                   \
  } while (0)
#endif

#if MESHRT_HAVE_NCCL
#include <nccl.h>
namespace meshrt::detail {
[[noreturn]] void throw_nccl_error(int code, const char* call, const char* file, int line);
}
#define MESHRT_NCCL_CHECK(call)                                                                         \
  do {                                                                                                  \
    const ncclResult_t meshrt_nccl_rc_ = (call);                                                        \
    if (meshrt_nccl_rc_ != ncclSuccess) {                                                               \
      ::meshrt::detail::throw_nccl_error(static_cast<int>(meshrt_nccl_rc_), #call, __FILE__, __LINE__); \
    }                                                                                                   \
  } while (0)
#endif
