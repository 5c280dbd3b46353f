#include "meshrt/version.hpp"

#include <fmt/format.h>
#include <mpi.h>

#include <boost/version.hpp>

#include <cstring>

#include "common/checks.hpp"

#if MESHRT_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif
#if MESHRT_HAVE_NCCL
#include <nccl.h>
#endif

namespace meshrt {

std::string thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE:
      return "single";
    case MPI_THREAD_FUNNELED:
      return "funneled";
    case MPI_THREAD_SERIALIZED:
      return "serialized";
    case MPI_THREAD_MULTIPLE:
      return "multiple";
    default:
      return fmt::format("unknown ({})", level);
  }
}

BuildInfo build_info() {
  BuildInfo info;
  info.meshrt_version = MESHRT_VERSION_STRING;
  info.build_type = MESHRT_BUILD_TYPE;
  info.compiler = MESHRT_COMPILER;
  info.sanitize = MESHRT_SANITIZE;
  info.cuda = MESHRT_HAVE_CUDA;
  info.nccl = MESHRT_HAVE_NCCL;

  char lib[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int len = 0;
  MESHRT_MPI_CHECK(MPI_Get_library_version(lib, &len));
  info.mpi_library = detail::mpi_text(lib, len);
  if (auto nl = info.mpi_library.find('\n'); nl != std::string::npos) info.mpi_library.resize(nl);
  while (!info.mpi_library.empty() && (info.mpi_library.back() == ',' || info.mpi_library.back() == ' ')) {
    info.mpi_library.pop_back();
  }
  int major = 0, minor = 0;
  MESHRT_MPI_CHECK(MPI_Get_version(&major, &minor));
  info.mpi_standard = fmt::format("{}.{}", major, minor);
  info.boost_version = fmt::format("{}.{}.{}", BOOST_VERSION / 100000, BOOST_VERSION / 100 % 1000, BOOST_VERSION % 100);

#if MESHRT_HAVE_CUDA
  int runtime = 0, driver = 0;
  info.cuda_runtime = cudaRuntimeGetVersion(&runtime) == cudaSuccess
                          ? fmt::format("{}.{}", runtime / 1000, runtime % 1000 / 10)
                          : "unknown";
  info.cuda_driver = (cudaDriverGetVersion(&driver) == cudaSuccess && driver > 0)
                         ? fmt::format("{}.{}", driver / 1000, driver % 1000 / 10)
                         : "no driver";
  int count = 0;
  const cudaError_t rc = cudaGetDeviceCount(&count);
  if (rc == cudaSuccess && count > 0) {
    info.cuda_devices = count;
    info.cuda_status = fmt::format("{} device{}", count, count == 1 ? "" : "s");
  } else {
    info.cuda_status = fmt::format("no CUDA device ({})", rc == cudaSuccess ? "count is 0" : cudaGetErrorString(rc));
    (void)cudaGetLastError();  // clear the sticky error
  }
#else
  info.cuda_runtime = "not built";
  info.cuda_driver = "not built";
  info.cuda_status = "not built";
#endif
#if MESHRT_HAVE_NCCL
  int nccl = 0;
  if (ncclGetVersion(&nccl) == ncclSuccess) {
    // NCCL >= 2.9 encodes major*10000 + minor*100 + patch.
    info.nccl_version = fmt::format("{}.{}.{}", nccl / 10000, nccl / 100 % 100, nccl % 100);
  } else {
    info.nccl_version = "unknown";
  }
#else
  info.nccl_version = "not built";
#endif
  return info;
}

}  // namespace meshrt
