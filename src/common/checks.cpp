#include "common/checks.hpp"

#include <fmt/format.h>

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <ctime>

#include "common/assert.hpp"

namespace meshrt::detail {
namespace {

std::string short_file(const char* file) {
  std::string f(file);
  if (auto pos = f.rfind("/src/"); pos != std::string::npos) f = f.substr(pos + 1);
  return f;
}

// Already reporting an error: a failure here leaves the rank as -1 (unknown).
int world_rank_or_minus_one() {
  int initialized = 0, finalized = 0;
  MESHRT_MPI_IGNORE(MPI_Initialized(&initialized));
  MESHRT_MPI_IGNORE(MPI_Finalized(&finalized));
  int rank = -1;
  if (initialized && !finalized) MESHRT_MPI_IGNORE(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  return rank;
}

}  // namespace

std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return fmt::format("MPI error {}", code);
  return mpi_text(text, len);
}

std::string mpi_text(const char* buffer, int length) {
  return std::string(buffer, strnlen(buffer, static_cast<std::size_t>(std::max(length, 0))));
}

std::string processor_name() {
  char host[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  MESHRT_MPI_CHECK(MPI_Get_processor_name(host, &len));
  return mpi_text(host, len);
}

void set_error_policy(MPI_Comm comm) {
  MESHRT_MPI_CHECK(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
}

void throw_internal(std::string_view message, const char* file, int line) {
  const std::string where = short_file(file);
  throw InternalError(fmt::format("rank {}: meshrt internal error (a bug in meshrt, not in the calling program; "
                                  "please report it): {} at {}:{}",
                                  world_rank_or_minus_one(), message, where, line),
                      where, line);
}

void throw_mpi_error(int code, const char* call, const char* file, int line) {
  throw SystemError(fmt::format("rank {}: {} failed: {} (MPI error {}) at {}:{}", world_rank_or_minus_one(), call,
                                mpi_error_string(code), code, short_file(file), line));
}

#if MESHRT_HAVE_CUDA
void throw_cuda_error(int code, const char* call, const char* file, int line) {
  throw SystemError(fmt::format("rank {}: {} failed: {} ({}) at {}:{}", world_rank_or_minus_one(), call,
                                cudaGetErrorString(static_cast<cudaError_t>(code)),
                                cudaGetErrorName(static_cast<cudaError_t>(code)), short_file(file), line));
}
#endif

#if MESHRT_HAVE_NCCL
void throw_nccl_error(int code, const char* call, const char* file, int line) {
  throw SystemError(fmt::format("rank {}: {} failed: {} (NCCL error {}; last: {}) at {}:{}", world_rank_or_minus_one(),
                                call, ncclGetErrorString(static_cast<ncclResult_t>(code)), code,
                                ncclGetLastError(nullptr), short_file(file), line));
}
#endif

void end_job_after_report(int code) {
  timespec pause{.tv_sec = 0, .tv_nsec = 100'000'000};
  (void)nanosleep(&pause, nullptr);
  // Ignored on purpose: it does not return when it works, and _exit follows if it fails.
  MESHRT_MPI_IGNORE(MPI_Abort(MPI_COMM_WORLD, code));
  _exit(code);
}

}  // namespace meshrt::detail
