// The worker: every rank's event loop (docs/ARCHITECTURE.md sections 1 and 3). It runs the
// commands the controller sends, in arrival order, keeps the values they define, joins
// collectives and sends, marks what depends on a failure, and reports status, failures
// and fetched values. meshrt::Runtime starts it; users do not call it directly.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

namespace meshrt {

namespace detail {
class Monitor;
}
namespace control {
class Transport;
}

inline constexpr int kNoStatusTree = -1;
inline constexpr int kStatusToController = -2;

struct WorkerOptions {
  int rank = 0;                          // this rank in `world`
  MPI_Comm world = MPI_COMM_NULL;        // parent of mesh communicators (a duplicate of MPI_COMM_WORLD)
  MPI_Comm control = MPI_COMM_NULL;      // commands and replies with the controller
  MPI_Comm p2p = MPI_COMM_NULL;          // SendTensor
  double status_interval_seconds = 1.0;  // Status cadence when the worker moved
  detail::Monitor* monitor = nullptr;    // the flight recorder, if any (outlives restarts)
  // Commands and replies travel here; null: over MPI on `control`. A test gives an
  // in-memory one (control::MemoryNetwork, meshrt/internal/control.hpp) to drive the loop without
  // mpiexec.
  std::shared_ptr<control::Transport> transport;
  // Fan-in (docs/ARCHITECTURE.md section 8, control::StatusTree): the worker rank this
  // rank's subtree reports its minimum first-uncompleted ident to (kStatusToController
  // for a top node), and the ranks that report to it. kNoStatusTree: every worker sends
  // its own Status to the controller.
  int status_parent = kNoStatusTree;
  std::vector<int> status_children;
  // Below the status tree, run CPU collectives and sends as the blocking MPI call on the
  // loop's thread (src/worker/in_flight.hpp, InFlight::cpu_completion). The runtime sets it when this
  // node has a core per rank (MESHRT_WORKER_BLOCKING): a rank that waits in a blocking
  // call for a late peer keeps polling its core, which an oversubscribed peer needs.
  bool block_in_mpi = false;
  // The session of the event loop: Worker::serve bumps it at each restart.
  std::uint32_t epoch = 0;
};

// WorkerOptions::block_in_mpi from MESHRT_WORKER_BLOCKING's value: "auto" blocks when the
// node runs no more ranks than it has online cores; a boolean (1/0, true/false, yes/no,
// on/off) forces it. Anything else is a UsageError naming the setting and what it takes.
bool worker_blocks_in_mpi(std::string_view setting, int ranks_on_node, long online_cores);

enum class WorkerExit { Restart, Shutdown };

namespace detail {
// The worker whose event loop runs on the calling thread: its rank, and the function
// whose kernel (or fetch preprocess) runs now (empty between them). The controller refuses
// calls from such a thread: on rank 0 it would wait for this very worker.
struct WorkerThread {
  int rank = -1;
  std::string_view function;
};
// Null on any thread that is not running a worker's loop.
const WorkerThread* worker_thread() noexcept;
}  // namespace detail

// What watches a rank's worker for as long as the Runtime lives (across restarts): its
// flight recorder (WorkerOptions::monitor), the watch thread that answers the
// controller's out-of-band queries on `control` even while the event loop is stuck, and
// the signal handlers (SIGUSR1 dumps the flight recorder; unless MESHRT_SIGNAL_HANDLER=0,
// a fatal signal reports what ran and ends the whole job).
class WorkerWatch {
 public:
  // Called from the SIGTERM handler, after it noted the signal: async-signal-safe code
  // only. The Python package raises its program's exception through it (meshrt.Terminated).
  // nullptr removes it.
  static void set_sigterm_hook(void (*hook)()) noexcept;

  WorkerWatch(int rank, std::shared_ptr<control::Transport> control, std::size_t flight_recorder_entries);
  ~WorkerWatch();
  WorkerWatch(const WorkerWatch&) = delete;
  WorkerWatch& operator=(const WorkerWatch&) = delete;

  detail::Monitor* monitor() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

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
