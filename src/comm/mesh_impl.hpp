// The state behind WorkerMesh, shared by the MPI and NCCL halves of the comm module.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <functional>
#include <map>
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
  std::vector<MPI_Comm> dim_comms;              // MPI_COMM_NULL until first use
  std::map<std::uint64_t, MPI_Comm> set_comms;  // of several (not all) dimensions, by mask
};

// The communicator of `members` (ranks of `parent`, in the new communicator's order; the
// world ranks world_of(r) name them), made once every member has agreed to within
// MESHRT_GROUP_TIMEOUT (detail::CreationAgreement, on `agree_tag`): a member that does not
// come gives every other a TimeoutError naming it, never a wait without end.
// MPI_Comm_create_group's tag is `create_tag`. `what`: "the communicator of ...", for errors.
MPI_Comm create_agreed(const std::string& what, MPI_Comm parent, int me, const std::vector<int>& members,
                       const std::function<int(int)>& world_of, int agree_tag, int create_tag);

}  // namespace meshrt
