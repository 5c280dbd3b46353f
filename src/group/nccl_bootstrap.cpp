// The NCCL bootstrap over a StatelessGroup (docs/ARCHITECTURE.md sections 1 and 5): group rank 0
// makes the ncclUniqueId, broadcast_obj carries its 128 bytes, every member joins.
#include <fmt/format.h>

#include <cstring>
#include <string>

#include "common/checks.hpp"
#include "meshrt/group.hpp"

namespace meshrt {

ncclComm* make_nccl_comm(StatelessGroup& group, int device, Timeout timeout) {
  ncclUniqueId id{};
  std::string bytes;
  if (group.rank() == 0) {
    MESHRT_NCCL_CHECK(ncclGetUniqueId(&id));
    bytes.assign(reinterpret_cast<const char*>(&id), sizeof id);
  }
  bytes = group.broadcast_obj(std::move(bytes), 0, timeout);
  if (bytes.size() != sizeof id) {
    throw ProtocolError(fmt::format("make_nccl_comm on group rank {}: expected a {}-byte ncclUniqueId, found {} bytes",
                                    group.rank(), sizeof id, bytes.size()));
  }
  std::memcpy(&id, bytes.data(), sizeof id);
  MESHRT_CUDA_CHECK(cudaSetDevice(device));
  ncclComm_t comm = nullptr;
  MESHRT_NCCL_CHECK(ncclCommInitRank(&comm, group.world_size(), id, group.rank()));
  return comm;
}

}  // namespace meshrt
