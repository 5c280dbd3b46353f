// What this build of meshrt is and what it runs on: versions of meshrt and of the
// libraries it was built and runs with. meshrt-info prints it; the start-up handshake
// compares it between ranks.
#pragma once

#include <string>
#include <vector>

#include "meshrt/config.hpp"

namespace meshrt {

struct BuildInfo {
  std::string meshrt_version;
  std::string build_type;
  std::string compiler;
  std::string sanitize;
  bool cuda = false;
  bool nccl = false;
  std::string mpi_library;    // MPI_Get_library_version, first line
  std::string mpi_standard;   // e.g. "3.1"
  std::string boost_version;  // e.g. "1.81.0"
  std::string cuda_runtime;   // e.g. "13.0", or "not built"
  std::string cuda_driver;    // e.g. "13.0", "no driver", or "not built"
  int cuda_devices = 0;       // visible devices; 0 without a GPU
  std::string cuda_status;    // "2 devices", "no CUDA device (...)", "not built"
  std::string nccl_version;   // e.g. "2.27.3", or "not built"
};

// Fills in everything that does not need MPI to be initialised, and the MPI library's
// version (which MPI allows before MPI_Init). Never throws for a missing GPU.
BuildInfo build_info();

// "single", "funneled", "serialized", "multiple" for an MPI_THREAD_* level.
std::string thread_level_name(int level);

}  // namespace meshrt
