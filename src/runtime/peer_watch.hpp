// Liveness of the job's processes (docs/ARCHITECTURE.md section 1). MPI does not say
// when a peer is gone: a rank on a node that lost power, or a process stopped, leaves the
// others blocked in their next collective until the resource manager notices the node
// (Slurm: SlurmdTimeout, minutes by default). So the ranks form a ring: every rank sends a
// heartbeat to the next one each second, from a thread of its own, and watches the one
// before it. A rank that hears nothing from its predecessor for MESHRT_PEER_TIMEOUT
// seconds names it and its host and ends the job with MPI_Abort.
#pragma once

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

namespace meshrt::detail {

class PeerWatch {
 public:
  // Collective over `world` (duplicated inside). `timeout` zero: no ring, no thread, on
  // every rank if on any (the ranks agree). A ring also needs MPI_THREAD_MULTIPLE on
  // every rank (`provided`); without it there is none, and rank 0 says so on stderr,
  // naming the ranks short of it.
  PeerWatch(MPI_Comm world, std::chrono::duration<double> timeout, int provided);
  // Says goodbye to the successor, then waits for the predecessor's goodbye: every
  // heartbeat sent is received before MPI_Finalize. The wait ends early only if the
  // predecessor goes silent, which ends the job as during the run.
  ~PeerWatch();
  PeerWatch(const PeerWatch&) = delete;
  PeerWatch& operator=(const PeerWatch&) = delete;

 private:
  void loop();
  [[noreturn]] void lost(const std::string& why);

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int next_ = 0;
  int prev_ = 0;
  std::string host_;
  std::string prev_host_;
  std::chrono::duration<double> timeout_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace meshrt::detail
