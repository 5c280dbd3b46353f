// The NCCL bootstrap over a StatelessGroup (docs/ARCHITECTURE.md sections 1 and 5): group rank 0
// makes the ncclUniqueId, broadcast_obj sends its 128 bytes to all, the members meet at a
// barrier, and every member joins, each within the call's timeout.
#include <fmt/format.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "common/checks.hpp"
#include "common/mpi_wait.hpp"
#include "meshrt/group.hpp"

namespace meshrt {
namespace {

// One init on a thread of its own: its outcome, once there.
struct Init {
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  ncclResult_t rc = ncclSuccess;
  ncclComm_t comm = nullptr;
  std::string error;
};

}  // namespace

ncclComm* make_nccl_comm(StatelessGroup& group, int device, Timeout timeout) {
  const std::chrono::duration<double> limit = timeout ? *timeout : group.default_timeout();
  ncclUniqueId id{};
  std::string bytes;
  if (group.rank() == 0) {
    MESHRT_NCCL_CHECK(ncclGetUniqueId(&id));
    bytes.assign(reinterpret_cast<const char*>(&id), sizeof id);
  }
  bytes = group.broadcast_obj(std::move(bytes), 0, limit);
  if (bytes.size() != sizeof id) {
    throw ProtocolError(fmt::format("make_nccl_comm on group rank {}: expected a {}-byte ncclUniqueId, found {} bytes",
                                    group.rank(), sizeof id, bytes.size()));
  }
  std::memcpy(&id, bytes.data(), sizeof id);
  MESHRT_CUDA_CHECK(cudaSetDevice(device));
  // Every member at the init: a member that is not gives a TimeoutError naming it.
  group.barrier(limit);
  // ncclCommInitRank blocks until every member joined it, and a blocking communicator is
  // what the caller gets: the init runs on a thread of its own, which this one stops
  // waiting for at the deadline (a member that died between the barrier and its init).
  const auto deadline = detail::deadline_after(limit);
  auto init = std::make_shared<Init>();
  std::thread([init, id, size = group.world_size(), rank = group.rank(), device] {
    ncclComm_t comm = nullptr;
    ncclResult_t rc = ncclInvalidUsage;
    std::string error;
    if (const cudaError_t cuda = cudaSetDevice(device); cuda != cudaSuccess) {
      error = fmt::format("cudaSetDevice({}) failed: {}", device, cudaGetErrorString(cuda));
      (void)cudaGetLastError();
    } else {
      rc = ncclCommInitRank(&comm, size, id, rank);
      if (rc != ncclSuccess) error = fmt::format("ncclCommInitRank failed: {}", ncclGetErrorString(rc));
    }
    std::lock_guard lock(init->mutex);
    init->rc = rc;
    init->comm = comm;
    init->error = std::move(error);
    init->done = true;
    init->cv.notify_all();
  }).detach();
  std::unique_lock lock(init->mutex);
  if (!init->cv.wait_until(lock, deadline, [&] { return init->done; })) {
    throw TimeoutError(fmt::format(
        "make_nccl_comm on group rank {} of {} (cuda:{}): every member reached the init, but ncclCommInitRank did not "
        "finish within {:g} s (a member that failed or hangs inside it); the init is left to a thread of its own",
        group.rank(), group.world_size(), device, limit.count()));
  }
  if (init->rc != ncclSuccess || !init->error.empty()) {
    throw SystemError(fmt::format("make_nccl_comm on group rank {} of {} (cuda:{}): {}", group.rank(),
                                  group.world_size(), device, init->error));
  }
  return init->comm;
}

}  // namespace meshrt
