// The device layer's MPI helpers that only its backends use. Internal header.
#pragma once

#include <mpi.h>

#include "meshrt/device.hpp"

namespace meshrt::device {

// Members' (node, device) pairs must differ; throws UsageError naming both ranks
// otherwise, on every member alike. Collective over `members`.
void check_distinct_devices(MPI_Comm members, Accelerator accelerator, int device);

}  // namespace meshrt::device
