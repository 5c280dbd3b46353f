// The watch thread of a rank's worker: answers the controller's out-of-band queries
// (state for desync reports, flight-recorder dumps, abort) from the Monitor, so it
// answers even while the event loop is stuck inside a function or a collective, and
// dumps the flight recorder to the log on SIGUSR1.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>

#include "meshrt/internal/control.hpp"
#include "worker/monitor.hpp"

namespace meshrt::detail {

class Watch {
 public:
  // `control` carries the queries (control::Tag::Query) and the answers (Tag::Answer).
  Watch(std::shared_ptr<control::Transport> control, Monitor& monitor);
  ~Watch();
  Watch(const Watch&) = delete;
  Watch& operator=(const Watch&) = delete;

 private:
  // Commands of the flight recorder a SIGTERM report shows.
  static constexpr std::size_t kSigtermCommands = 20;
  // How long after its SIGTERM a rank that has written its report waits before it ends,
  // so that the slower ranks write theirs (mpiexec's SIGKILL follows 1 s after SIGTERM).
  static constexpr std::chrono::milliseconds kSigtermLinger{900};
  void loop();
  // On SIGTERM: the rank's last commands to stderr and its log, then SIGTERM's own end.
  [[noreturn]] void report_sigterm();
  std::shared_ptr<control::Transport> control_;
  Monitor& monitor_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Installs the SIGUSR1 handler (dump the flight recorder to the log) and, unless
// MESHRT_SIGNAL_HANDLER=0, handlers for fatal signals that print the rank, the running
// command, a backtrace and the flight recorder, then end the whole job with MPI_Abort,
// and for SIGTERM, whose report (the rank's last commands) the watch thread writes before
// the process ends as SIGTERM ends it.
void install_signal_handlers(Monitor* monitor);
void uninstall_signal_handlers();

}  // namespace meshrt::detail
