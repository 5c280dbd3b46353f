// The state behind WorkerMesh, shared by the MPI and NCCL halves of the comm module.
#pragma once

#include <mpi.h>

#include <string>
#include <vector>

#include "meshrt/internal/comm.hpp"

namespace meshrt {

struct WorkerMesh::Impl {
  std::vector<std::string> names;
  NDSlice ranks;
  std::vector<std::int64_t> coords;
  int world_rank = -1;
  MPI_Comm comm = MPI_COMM_NULL;
  std::vector<MPI_Comm> dim_comms;  // MPI_COMM_NULL until first use
};

}  // namespace meshrt
