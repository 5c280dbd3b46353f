// The worker: every rank's event loop (DESIGN.md sections 1 and 3). It runs the
// commands the controller sends, in arrival order, keeps the values they define, joins
// collectives and sends, marks what depends on a failure, and reports status, failures
// and fetched values. meshrt::Runtime starts it; users do not call it directly.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <memory>

namespace meshrt {

namespace detail {
class Monitor;
}
namespace control {
class Transport;
}

struct WorkerOptions {
  int rank = 0;                          // this rank in `world`
  MPI_Comm world = MPI_COMM_NULL;        // parent of mesh communicators (a duplicate of MPI_COMM_WORLD)
  MPI_Comm control = MPI_COMM_NULL;      // commands and replies with the controller
  MPI_Comm p2p = MPI_COMM_NULL;          // SendTensor
  double status_interval_seconds = 1.0;  // Status cadence when the worker moved
  detail::Monitor* monitor = nullptr;    // the flight recorder, if any (outlives restarts)
  // Commands and replies travel here; null: over MPI on `control`. A test gives an
  // in-memory one (src/control/memory_transport.hpp) to drive the loop without mpiexec.
  std::shared_ptr<control::Transport> transport;
};

enum class WorkerExit { Restart, Shutdown };

class Worker {
 public:
  explicit Worker(WorkerOptions options);
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // Runs the event loop until Exit; all values, meshes and streams are gone afterwards.
  WorkerExit run();

  // Runs event loops until an Exit that shuts down, sending Restarted after each restart.
  static void serve(const WorkerOptions& options);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace meshrt
