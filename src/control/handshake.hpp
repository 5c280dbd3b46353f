// The start-up handshake on the control communicator: every rank sends rank 0 its
// protocol::Handshake (or why it cannot run); rank 0 compares them and broadcasts the
// verdict, so all ranks fail the start together, naming the culprits. Collective: every
// rank of `control` calls it.
#pragma once

#include <mpi.h>

namespace meshrt::control {

// Throws meshrt::Error on every rank when a rank cannot run or the ranks run different
// builds (meshrt version, protocol version or function table). `provided` is the MPI
// thread level granted; `dedicated_controller`: rank 0 runs no worker.
void handshake(MPI_Comm control, int provided, bool dedicated_controller);

}  // namespace meshrt::control
