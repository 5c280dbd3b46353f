// One check macro per library (after NCCL's checks.h): a failing MPI, CUDA or NCCL call
// becomes a meshrt::SystemError naming the call, its error text, the file and the line.
// Internal header: it includes the libraries' own headers.
//
// MPI error policy. MPI's default handler, MPI_ERRORS_ARE_FATAL, aborts the job inside
// the failing call, so MESHRT_MPI_CHECK would never see a return code. Every
// communicator meshrt makes therefore gets MPI_ERRORS_RETURN at once, by
// set_error_policy(): the runtime's control, world and p2p duplicates (Runtime::Runtime),
// each mesh communicator and each per-dimension split (WorkerMesh), and every
// StatelessGroup communicator. MPI_COMM_WORLD itself keeps the handler its owner chose:
// meshrt never changes a communicator it did not make. A failing call then raises
// SystemError on the rank where it failed; the runtime's rules (a worker reports, the
// controller aborts the job when a worker cannot go on) keep the others from hanging.
//
// Every MPI call is either checked with MESHRT_MPI_CHECK, or its return code is handled
// by hand (a receive that may be cancelled), or it is wrapped in MESHRT_MPI_IGNORE with
// the reason: teardown (frees, cancels) where there is nothing left to report to and
// raising would hide the error that led there.
#pragma once

#include <mpi.h>

#include "meshrt/config.hpp"

#include <string>

#include "meshrt/error.hpp"

namespace meshrt::detail {

[[noreturn]] void throw_mpi_error(int code, const char* call, const char* file, int line);
std::string mpi_error_string(int code);

// Sets MPI_ERRORS_RETURN on `comm` (see the policy above); throws SystemError if MPI
// refuses. Call it on every communicator meshrt creates, right after creating it.
void set_error_policy(MPI_Comm comm);

// The text an MPI_Get_* call wrote into `buffer` of `length` (some MPI libraries count the
// terminating NUL in it, some do not).
std::string mpi_text(const char* buffer, int length);

// MPI_Get_processor_name: this host's name as MPI reports it.
std::string processor_name();

// Ends the whole job after a report this process has just written to stderr: a tenth of
// a second first, so that the launcher's proxy reads the report from its pipe before
// MPI_Abort tears the proxy down (MPICH's hydra under load lost a crash report that way
// once in about thirty CI runs: exit 139, no output), then MPI_Abort(code), then
// _exit(code) if that returns. Async-signal-safe as far as MPI_Abort is.
[[noreturn]] void end_job_after_report(int code);

}  // namespace meshrt::detail

#define MESHRT_MPI_CHECK(call)                                                      \
  do {                                                                              \
    const int meshrt_mpi_rc_ = (call);                                              \
    if (meshrt_mpi_rc_ != MPI_SUCCESS) {                                            \
      ::meshrt::detail::throw_mpi_error(meshrt_mpi_rc_, #call, __FILE__, __LINE__); \
    }                                                                               \
  } while (0)

// An MPI call whose result is ignored on purpose (teardown: say why at the call).
#define MESHRT_MPI_IGNORE(call) static_cast<void>(call)

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
