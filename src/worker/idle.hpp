// How the worker loop waits when it has nothing to do.
#pragma once

#include "common/backoff.hpp"
#include "meshrt/internal/worker.hpp"

namespace meshrt::detail {

// Worker 0 (rank 0, beside the controller): kDoorbell. A worker with a core of its own
// (WorkerOptions::block_in_mpi: no more ranks than cores on the node): kOwnCore. Any
// other (an oversubscribed node): kControl.
BackoffPolicy worker_idle_policy(const WorkerOptions& options);

}  // namespace meshrt::detail
