// Device placement and the backend-neutral parts of making a device communicator.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/checks.hpp"
#include "common/comm_creation.hpp"
#include "common/hash.hpp"
#include "common/mpi_wait.hpp"
#include "device/backend.hpp"
#include "device/emulated_comm.hpp"
#include "meshrt/internal/device.hpp"
#include "meshrt/internal/settings.hpp"

#if MESHRT_HAVE_CUDA
#include "device/cuda.hpp"
#endif

namespace meshrt::device {
namespace {

// This rank's host, told apart as NCCL tells hosts apart (its host hash): NCCL_HOSTID when
// set, NCCL's own override, else the node's name. With a NCCL_HOSTID per rank, ranks on
// one GPU are hosts of their own to NCCL, and so to this check (scripts/gpu-check.sh).
std::uint64_t host_hash() {
  if (const char* id = std::getenv("NCCL_HOSTID"); id != nullptr && *id != '\0') {
    return detail::fnv1a_64(id, detail::fnv1a_64("NCCL_HOSTID="));
  }
  return detail::fnv1a_64(detail::processor_name());
}

// One member's place: its node, and its device as a name every process of the node gives
// it (Backend::physical_device), which device indices are not when ranks see different
// devices (one visible GPU per rank: every rank's device is 0).
struct MemberPlace {
  std::uint64_t host = 0;
  std::int32_t device = 0;
  std::int32_t world_rank = 0;
  std::array<char, 96> physical{};
  std::string physical_name() const { return std::string(physical.data(), strnlen(physical.data(), physical.size())); }
};

// set_enqueue_fault_for_testing: the message the next call on a device communicator of
// this process fails with.
std::mutex g_enqueue_fault_mutex;
std::optional<std::string> g_enqueue_fault;

}  // namespace

void set_enqueue_fault_for_testing(std::string message) {
  std::lock_guard lock(g_enqueue_fault_mutex);
  g_enqueue_fault = std::move(message);
}

std::optional<std::string> take_enqueue_fault() {
  std::lock_guard lock(g_enqueue_fault_mutex);
  return std::exchange(g_enqueue_fault, std::nullopt);
}

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

int most_ranks_on_a_host(MPI_Comm world) {
  int size = 0;
  MESHRT_MPI_CHECK(MPI_Comm_size(world, &size));
  const std::uint64_t mine = host_hash();
  std::vector<std::uint64_t> all(static_cast<std::size_t>(size));
  MESHRT_MPI_CHECK(MPI_Allgather(&mine, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, world));
  std::map<std::uint64_t, int> count;
  int most = 0;
  for (std::uint64_t h : all) most = std::max(most, ++count[h]);
  return most;
}

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
  std::string why;  // CUDA's reason for none
#if MESHRT_HAVE_CUDA
  // Counting CUDA devices needs no backend (and so no context) yet.
  const int count = accelerator == Accelerator::Cuda ? cuda_visible_devices(&why) : backend(accelerator).device_count();
#else
  const int count = backend(accelerator).device_count();
#endif
  if (count < 1) {
    throw UsageError(fmt::format("device placement: expected at least one {} device on this node, found none{}",
                                 name(accelerator), why.empty() ? "" : " (" + why + ")"));
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

void check_distinct_devices(MPI_Comm members, Accelerator accelerator, int device,
                            std::chrono::steady_clock::time_point deadline) {
  int size = 0;
  MESHRT_MPI_CHECK(MPI_Comm_size(members, &size));
  // Owned past a timeout: the exchange stays posted, and a member that joins late still
  // writes into it.
  struct Exchange {
    MemberPlace mine;
    std::vector<MemberPlace> all;
  };
  auto x = std::make_unique<Exchange>();
  x->mine.host = host_hash();
  x->mine.device = device;
  MESHRT_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &x->mine.world_rank));
  const std::string physical = backend(accelerator).physical_device(device);
  std::copy_n(physical.data(), std::min(physical.size(), x->mine.physical.size() - 1), x->mine.physical.data());
  x->all.resize(static_cast<std::size_t>(size));
  MPI_Request request = MPI_REQUEST_NULL;
  MESHRT_MPI_CHECK(MPI_Iallgather(&x->mine, sizeof(MemberPlace), MPI_BYTE, x->all.data(), sizeof(MemberPlace), MPI_BYTE,
                                  members, &request));
  try {
    detail::wait_request(request, deadline, "device communicator", "the exchange of their devices");
  } catch (const TimeoutError&) {
    (void)x.release();  // left to the posted exchange
    throw;
  }
  const std::vector<MemberPlace>& all = x->all;
  // Every member sees the same table, so every member throws the same error: none waits.
  const Accelerator job = placement().accelerator;
  for (int i = 0; i < size; ++i) {
    for (int j = i + 1; j < size; ++j) {
      const MemberPlace& a = all[static_cast<std::size_t>(i)];
      const MemberPlace& b = all[static_cast<std::size_t>(j)];
      if (a.host != b.host || a.physical != b.physical) continue;
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
      const std::string where =
          a.device == b.device
              ? fmt::format("both on {}:{} of one node ({})", name(accelerator), a.device, a.physical_name())
              : fmt::format(
                    "both on one device of one node ({}, which world rank {} sees as {}:{} and world rank "
                    "{} as {}:{})",
                    a.physical_name(), a.world_rank, name(accelerator), a.device, b.world_rank, name(accelerator),
                    b.device);
      throw UsageError(fmt::format(
          "device communicator: expected one rank per device, found world ranks {} and {} (members {} and {}) {}{}",
          a.world_rank, b.world_rank, i, j, where, fix));
    }
  }
}

}  // namespace meshrt::device
