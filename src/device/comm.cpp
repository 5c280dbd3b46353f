// Device placement and the backend-neutral parts of making a device communicator.
#include "device/comm.hpp"

#include <fmt/format.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/checks.hpp"
#include "common/comm_creation.hpp"
#include "common/hash.hpp"
#include "device/backend.hpp"
#include "device/emulated_comm.hpp"
#include "meshrt/internal/settings.hpp"

#if MESHRT_HAVE_CUDA
#include "device/cuda.hpp"
#endif

namespace meshrt::device {
namespace {

std::uint64_t host_hash() {
  return detail::fnv1a_64(detail::processor_name());  // as NCCL hashes host names
}

struct MemberPlace {
  std::uint64_t host = 0;
  std::int32_t device = 0;
  std::int32_t world_rank = 0;
};

}  // namespace

std::unique_ptr<Communicator> create_communicator(Accelerator accelerator, MPI_Comm members, int device,
                                                  std::chrono::duration<double> timeout) {
  ensure_current(device_kind(accelerator));
  switch (accelerator) {
    case Accelerator::Emulated:
      return create_emulated_communicator(members, device, timeout);
    case Accelerator::Cuda:
#if MESHRT_HAVE_NCCL
      return create_nccl_communicator(members, device, timeout);
#else
      throw UsageError("device communicator: expected NCCL for cuda, found a build without it");
#endif
    case Accelerator::None:
      break;
  }
  throw UsageError("device communicator: expected an accelerator (cuda or emulated), found none");
}

namespace {
// This rank's place on its node: {index, ranks on the node}.
std::pair<int, int> on_node(MPI_Comm world) {
  MPI_Comm node = MPI_COMM_NULL;
  {
    std::lock_guard creation(meshrt::detail::comm_creation_mutex());  // one creation at a time per rank
    MESHRT_MPI_CHECK(MPI_Comm_split_type(world, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  }
  int rank = 0, size = 1;
  MESHRT_MPI_CHECK(MPI_Comm_rank(node, &rank));
  MESHRT_MPI_CHECK(MPI_Comm_size(node, &size));
  MESHRT_MPI_CHECK(MPI_Comm_free(&node));
  return {rank, size};
}
}  // namespace

int local_rank(MPI_Comm world) {
  return on_node(world).first;
}

int node_size(MPI_Comm world) {
  return on_node(world).second;
}

int select_device(Accelerator accelerator, MPI_Comm world) {
  // Collective first, before anything can throw: ranks with and without MESHRT_DEVICE,
  // and ranks that fail here and ranks that do not, still make the same calls.
  const int local = local_rank(world);
#if MESHRT_HAVE_CUDA
  // Counting CUDA devices needs no backend (and so no context) yet.
  const int count = accelerator == Accelerator::Cuda ? cuda_visible_devices() : backend(accelerator).device_count();
#else
  const int count = backend(accelerator).device_count();
#endif
  if (count < 1) {
    throw UsageError(
        fmt::format("device placement: expected at least one {} device on this node, found none", name(accelerator)));
  }
  if (const std::optional<std::int64_t> chosen = settings::kDevice.from_environment()) {
    if (*chosen >= count) {
      throw UsageError(fmt::format("setting MESHRT_DEVICE: expected a device of the {} accelerator in 0..{}, found {}",
                                   name(accelerator), count - 1, *chosen));
    }
    return static_cast<int>(*chosen);
  }
  return local % count;
}

void check_distinct_devices(MPI_Comm members, Accelerator accelerator, int device) {
  int size = 0;
  MESHRT_MPI_CHECK(MPI_Comm_size(members, &size));
  MemberPlace mine;
  mine.host = host_hash();
  mine.device = device;
  MESHRT_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &mine.world_rank));
  std::vector<MemberPlace> all(static_cast<std::size_t>(size));
  MESHRT_MPI_CHECK(
      MPI_Allgather(&mine, sizeof(MemberPlace), MPI_BYTE, all.data(), sizeof(MemberPlace), MPI_BYTE, members));
  // Every member sees the same table, so every member throws the same error: none waits.
  const Accelerator job = placement().accelerator;
  for (int i = 0; i < size; ++i) {
    for (int j = i + 1; j < size; ++j) {
      if (all[i].host != all[j].host || all[i].device != all[j].device) continue;
      // In a job without this accelerator no device per rank was chosen: say what the
      // job needs rather than how to spread ranks over devices.
      const std::string fix =
          job != accelerator
              ? fmt::format(
                    "; this job's accelerator is {}, so no {} device was chosen per rank: a mesh placed on {} needs "
                    "MESHRT_ACCELERATOR={}{}",
                    name(job), name(accelerator), name(accelerator), name(accelerator),
                    accelerator == Accelerator::Emulated ? ", or a real accelerator" : "")
              : std::string("; give each rank its own device (MESHRT_DEVICE, or fewer ranks per node than devices)");
      throw UsageError(fmt::format(
          "device communicator: expected one rank per device, found world ranks {} and {} (members {} and {}) both "
          "on {}:{} of one node{}",
          all[i].world_rank, all[j].world_rank, i, j, name(accelerator), all[i].device, fix));
    }
  }
}

}  // namespace meshrt::device
