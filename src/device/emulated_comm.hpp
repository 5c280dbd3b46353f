// The emulated accelerator's communicator: collectives run with MPI on the stream's
// thread, over its own MPI communicator (dup'd at creation, so it never interleaves with
// the worker's). Internal header.
#pragma once

#include <mpi.h>

#include <chrono>
#include <memory>

#include "meshrt/internal/device.hpp"

namespace meshrt::device {

std::unique_ptr<Communicator> create_emulated_communicator(MPI_Comm members, int device,
                                                           std::chrono::duration<double> timeout);

}  // namespace meshrt::device
