// Making device communicators and choosing this rank's device: the parts of the device
// layer that need MPI. Internal header (includes mpi.h).
#pragma once

#include <mpi.h>

#include <chrono>
#include <memory>

#include "meshrt/device.hpp"

namespace meshrt::device {

// Collective over exactly the ranks of `members` (every one must call it, as for
// ncclCommInitRank): member 0 makes the unique id and broadcasts it, then every member
// joins on `device` of `accelerator`. Throws UsageError on every member when two of them
// are on one device of one node (naming both ranks), and TimeoutError when the init does
// not finish within `timeout`.
std::unique_ptr<Communicator> create_communicator(Accelerator accelerator, MPI_Comm members, int device,
                                                  std::chrono::duration<double> timeout);

// This rank's index among the ranks of its node (MPI_Comm_split_type SHARED); collective
// over `world`.
int local_rank(MPI_Comm world);
// This rank's device of `accelerator`: MESHRT_DEVICE if set, else the local rank modulo
// the node's device count. Collective over `world`.
int select_device(Accelerator accelerator, MPI_Comm world);

// Members' (node, device) pairs must differ; throws UsageError naming both ranks
// otherwise. Collective over `members`.
void check_distinct_devices(MPI_Comm members, Accelerator accelerator, int device);

}  // namespace meshrt::device
