// One lock per process around every creation of an MPI communicator (MPI_Comm_create_group,
// MPI_Comm_split, MPI_Comm_dup) made while other threads may create one too: a mesh's
// communicators on the worker thread and a StatelessGroup on any thread (rank 0's
// controller thread among them). Open MPI agrees on a new communicator's id with a
// multi-round protocol that two concurrent creations on one rank can deadlock in
// (ompi_comm_nextcid), so a rank makes one at a time.
//
// Why it cannot deadlock across ranks: a thread holds the lock across one creation only.
// A group takes it after every member has announced that it is at this create (so all of
// them enter MPI_Comm_create_group holding their own lock, and it completes), and its
// waits while holding it are bounded by the group's timeout. Meshes are created by the
// one worker thread of each rank, in command order, the same order on every member. A
// chain of waits therefore ends in a creation that completes or a group timeout.
#pragma once

#include <mutex>

namespace meshrt::detail {

std::timed_mutex& comm_creation_mutex();

}  // namespace meshrt::detail
