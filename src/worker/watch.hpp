// The watch thread of a rank's worker: answers the controller's out-of-band queries
// (state for desync reports, flight-recorder dumps, abort) from the Monitor, so it
// answers even while the event loop is stuck inside a function or a collective, and
// dumps the flight recorder to the log on SIGUSR1.
#pragma once

#include <mpi.h>

#include <atomic>
#include <thread>

#include "worker/monitor.hpp"

namespace meshrt::detail {

inline constexpr int kQueryTag = 103;  // controller -> watch thread: JSON request
inline constexpr int kStateTag = 104;  // watch thread -> controller: JSON answer

class Watch {
 public:
  Watch(MPI_Comm control, Monitor& monitor);
  ~Watch();
  Watch(const Watch&) = delete;
  Watch& operator=(const Watch&) = delete;

 private:
  void loop();
  MPI_Comm control_;
  Monitor& monitor_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Installs the SIGUSR1 handler (dump the flight recorder to the log) and, unless
// MESHRT_SIGNAL_HANDLER=0, handlers for fatal signals that print the rank, the running
// command, a backtrace and the flight recorder, then end the whole job with MPI_Abort.
void install_signal_handlers(Monitor* monitor);
void uninstall_signal_handlers();

}  // namespace meshrt::detail
