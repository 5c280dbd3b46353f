#include "worker/watch.hpp"
#include "common/checks.hpp"

#include <execinfo.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

#include "common/timeline.hpp"
#include "meshrt/internal/comm.hpp"
#include "meshrt/internal/device.hpp"
#include "meshrt/internal/protocol.hpp"
#include "meshrt/internal/settings.hpp"
#include "meshrt/internal/stacks.hpp"
#include "meshrt/internal/worker.hpp"
#include "meshrt/log.hpp"

namespace meshrt::detail {
namespace {

std::atomic<bool> g_dump_requested{false};
std::atomic<Monitor*> g_monitor{nullptr};

void write_stderr(const std::string& s) {
  const char* p = s.data();
  std::size_t left = s.size();
  while (left > 0) {
    const ssize_t n = ::write(STDERR_FILENO, p, left);
    if (n <= 0) return;
    p += n;
    left -= static_cast<std::size_t>(n);
  }
}

void on_sigusr1(int) {
  g_dump_requested.store(true);
}

// SIGTERM (scancel, a time limit, a launcher ending the job) is reported by the watch
// thread, which may take the monitor's lock: the handler only notes when the first one
// arrived (CLOCK_MONOTONIC, steady_clock's; async-signal-safe), zero until then.
std::atomic<std::int64_t> g_term_arrived_ns{0};
void on_sigterm(int) {
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);
  std::int64_t none = 0;
  g_term_arrived_ns.compare_exchange_strong(none, std::int64_t{now.tv_sec} * 1'000'000'000 + now.tv_nsec);
}

// Crash-time reporting is best effort: formatting allocates, which a signal handler
// should not do, but the process is going down and the report is what matters most.
// The report goes out in one write: a launcher that tears the job down on MPI_Abort (MPICH's
// hydra, under load) may stop forwarding a dying rank's output between two writes.
void on_fatal(int sig) {
  Monitor* m = g_monitor.load();
  const int rank = m ? m->rank() : -1;
  std::string report = fmt::format("\nmeshrt: rank {} on {} caught signal {} ({}) while running:\n{}\nbacktrace:\n",
                                   rank, m ? m->host() : std::string("?"), sig, strsignal(sig),
                                   m ? m->current_unlocked() : std::string("(no worker on this rank)"));
  void* frames[64];
  const int n = backtrace(frames, 64);
  if (char** symbols = backtrace_symbols(frames, n)) {
    for (int i = 0; i < n; ++i) report.append(symbols[i]).append("\n");
  } else {
    report += "(no symbols)\n";
  }
  // MESHRT_TRACE: the rank's own timeline file (the monitor's lock may be held here, so
  // without the running command).
  if (const std::string dumped = trace::dump_rank(fmt::format("signal {}", sig), {}, true); !dumped.empty()) {
    report += fmt::format("meshrt: rank {}: {}\n", rank, dumped);
  }
  report += fmt::format("meshrt: rank {}: ending the whole job (MPI_Abort) so that no rank waits for this one\n", rank);
  write_stderr(report);
  end_job_after_report(128 + sig);
}

constexpr int kFatalSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};

}  // namespace

Watch::Watch(std::shared_ptr<control::Transport> control, Monitor& monitor)
    : control_(std::move(control)), monitor_(monitor) {
  thread_ = std::thread([this] { loop(); });
}

Watch::~Watch() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
}

void Watch::loop() {
  log::set_thread_role(fmt::format("watch {}", monitor_.rank()));
  control::Bytes buf;
  while (!stop_.load()) {
    if (g_dump_requested.exchange(false)) {
      MESHRT_LOG(warning) << "SIGUSR1: " << monitor_.dump();
    }
    if (g_term_arrived_ns.load() != 0) report_sigterm();
    bool got = false;
    try {
      got = control_->try_receive(control::kControllerRank, control::Tag::Query, buf);
    } catch (const std::exception& e) {
      // The watch must outlive a broken control channel: it is what reports on the rest.
      MESHRT_LOG(error) << "watch: cannot receive a query: " << e.what();
    }
    if (!got) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      continue;
    }
    protocol::QueryAnswer answer{.rank = monitor_.rank()};
    try {
      const protocol::Query query = protocol::decode_query(buf);
      answer.query = query.id;
      answer.op = query.op;
      switch (query.op) {
        case protocol::QueryOp::State: {
          // The rank's control traffic rides along: the counts a test or a report reads.
          auto state = monitor_.state();
          // A kernel's stack in its own language (a Python kernel's frames), read from
          // here while its thread runs on: the report's "where in my code".
          if (const auto& cur = state["current"];
              cur.is_object() && cur.value("kind", std::string()) == "CallFunction") {
            const std::string name = cur.value("name", std::string());
            std::string stack =
                language_stack({.owner = StackOwner::Kernel, .thread = monitor_.worker_thread(), .function = name}, 0);
            if (!stack.empty()) state["stack"] = std::move(stack);
          }
          state["traffic"] = nlohmann::json::parse(control::process_traffic().to_json());
          answer.payload = state.dump();
        } break;
        case protocol::QueryOp::Dump: {
          answer.payload = monitor_.dump(static_cast<std::size_t>(std::min<std::uint64_t>(query.limit, SIZE_MAX)));
          // At info: the controller has the dump and decides where it goes (the log
          // directory, or stderr once if nobody handles the timeout that asked for it).
          MESHRT_LOG(info) << "flight recorder requested by the controller"
                           << (query.reason.empty() ? "" : " (" + query.reason + ")") << ":\n"
                           << answer.payload;
          break;
        }
        case protocol::QueryOp::Abort: {
          // MPI_Abort follows from the controller and ends every process, device work included.
          MESHRT_LOG(fatal) << "the controller is aborting the job: " << query.reason;
          const std::string dumped = trace::dump_rank("the controller aborted the job", monitor_.running_events());
          if (!dumped.empty()) {
            MESHRT_LOG(error) << dumped;
          }
        } break;
        case protocol::QueryOp::Trace: {
          std::uint64_t dropped = 0;
          device::trace_flush(false);  // the CUDA streams' spans of work that has run
          const std::vector<trace::Event> events = trace::snapshot(&dropped);
          answer.payload = monitor_.host();
          answer.payload.push_back('\0');
          answer.payload.append(reinterpret_cast<const char*>(&dropped), sizeof dropped);
          answer.payload.append(reinterpret_cast<const char*>(events.data()), events.size() * sizeof(trace::Event));
        } break;
        case protocol::QueryOp::TraceSwitch:
          if (query.limit != 0) {
            trace::enable(trace::session().capacity);
          } else {
            trace::disable();
          }
          break;
      }
    } catch (const std::exception& e) {
      answer.error = std::string("bad query: ") + e.what();
    }
    try {
      control_->send(control::kControllerRank, control::Tag::Answer,
                     std::make_shared<control::Bytes>(protocol::encode(answer)));
      control_->reap();
    } catch (const std::exception& e) {
      MESHRT_LOG(error) << "watch: cannot answer query " << answer.query << ": " << e.what();
    }
  }
  // Answers still in flight go to a controller that may be waiting for them.
  control_->drain(std::chrono::seconds(1));
}

[[noreturn]] void Watch::report_sigterm() {
  std::string report = fmt::format(
      "meshrt: rank {} on {}: SIGTERM (scancel, a time limit or the launcher is ending the job); what it did last:\n{}",
      monitor_.rank(), monitor_.host(), monitor_.recent(kSigtermCommands));
  // MESHRT_TRACE: then the rank's own timeline file, the commands still running included.
  // The report goes first and names the file: a launcher may stop forwarding a rank's
  // output soon after its SIGTERM (Slurm ends the batch script, and srun with it).
  const std::string file = trace::rank_file();
  if (!file.empty()) {
    report += fmt::format("meshrt: rank {} on {}: writing its timeline so far to {} (MESHRT_TRACE)\n", monitor_.rank(),
                          monitor_.host(), file);
  }
  write_stderr(report);  // in one write, at any log level (the job's output keeps it)
  if (!file.empty()) device::trace_flush(false);
  if (const std::string dumped = trace::dump_rank("SIGTERM", monitor_.running_events()); !dumped.empty()) {
    write_stderr(fmt::format("meshrt: rank {} on {}: {}\n", monitor_.rank(), monitor_.host(), dumped));
  }
  // The launcher SIGTERMs every rank at once, and Open MPI's mpiexec sends SIGKILL to all
  // of them as soon as one has exited (its wait of odls_base_sigkill_timeout ends with
  // that child): a rank done first would cut the others' reports short. So each stays
  // until kSigtermLinger after its SIGTERM arrived.
  std::this_thread::sleep_until(
      std::chrono::steady_clock::time_point(std::chrono::nanoseconds(g_term_arrived_ns.load())) + kSigtermLinger);
  // Then the end SIGTERM would have brought: the default action, on this thread.
  signal(SIGTERM, SIG_DFL);
  raise(SIGTERM);
  _exit(128 + SIGTERM);  // raise returns only if SIGTERM is blocked on this thread
}

void install_signal_handlers(Monitor* monitor) {
  g_monitor.store(monitor);
  struct sigaction usr {};
  usr.sa_handler = on_sigusr1;
  sigemptyset(&usr.sa_mask);
  usr.sa_flags = SA_RESTART;
  sigaction(SIGUSR1, &usr, nullptr);
  if (!settings::kSignalHandler.get()) return;
  struct sigaction term {};
  term.sa_handler = on_sigterm;
  sigemptyset(&term.sa_mask);
  term.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &term, nullptr);
  struct sigaction sa {};
  sa.sa_handler = on_fatal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESETHAND;
  for (int sig : kFatalSignals) sigaction(sig, &sa, nullptr);
}

void uninstall_signal_handlers() {
  for (int sig : kFatalSignals) signal(sig, SIG_DFL);
  signal(SIGUSR1, SIG_DFL);
  signal(SIGTERM, SIG_DFL);
  g_monitor.store(nullptr);
}

}  // namespace meshrt::detail

namespace meshrt {

struct WorkerWatch::Impl {
  Impl(int rank, std::shared_ptr<control::Transport> control, std::size_t entries)
      : monitor(rank, entries), watch(std::move(control), monitor) {
    detail::install_signal_handlers(&monitor);
  }
  // The handlers go first: a late signal must not find the monitor gone.
  ~Impl() { detail::uninstall_signal_handlers(); }
  detail::Monitor monitor;
  detail::Watch watch;
};

WorkerWatch::WorkerWatch(int rank, std::shared_ptr<control::Transport> control, std::size_t entries)
    : impl_(std::make_unique<Impl>(rank, std::move(control), entries)) {}
WorkerWatch::~WorkerWatch() = default;

detail::Monitor* WorkerWatch::monitor() const noexcept {
  return &impl_->monitor;
}

}  // namespace meshrt
