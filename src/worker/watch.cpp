#include "worker/watch.hpp"
#include "common/checks.hpp"

#include <execinfo.h>
#include <fmt/format.h>
#include <unistd.h>

#include <boost/stacktrace.hpp>

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
#include "meshrt/internal/mpi_session.hpp"
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
std::atomic<void (*)()> g_sigterm_hook{nullptr};
void on_sigterm(int) {
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);
  std::int64_t none = 0;
  g_term_arrived_ns.compare_exchange_strong(none, std::int64_t{now.tv_sec} * 1'000'000'000 + now.tv_nsec);
  if (auto* hook = g_sigterm_hook.load()) hook();
}

// A fatal signal's report. The handler runs on the crashing thread, where only
// async-signal-safe calls are safe: that thread may have crashed inside malloc, holding its
// lock. So the handler only captures the raw frames (Boost.Stacktrace's safe_dump_to walks
// the stack without allocating) and hands them to the watch thread, an ordinary thread,
// which names them (functions demangled, file:line from the debug information: this
// allocates and reads files), formats the report and writes it. The handler sleeps
// (nanosleep is safe) until the report is out, for a bounded time: when the watch thread
// does not write it (the crashed thread is the watch thread, or held a lock the watch
// thread then waits for), the handler writes the raw frames itself with
// backtrace_symbols_fd, which does not allocate.
enum CrashState : int { kNoCrash, kCapturing, kPosted, kAbandoned, kWriting, kWritten };
struct Crash {
  std::atomic<int> state{kNoCrash};
  int sig = 0;
  std::size_t frames = 0;
  boost::stacktrace::frame::native_frame_ptr_t frame[64] = {};
};
Crash g_crash;
// The watch thread's id while it runs (detail::this_thread_id()), else 0.
std::atomic<std::uint64_t> g_watch_thread{0};
// How long the handler waits for the watch thread's report: naming the frames reads the
// debug information of every library on the stack, which takes well under a second.
constexpr int kCrashWaitTicks = 1000;  // of 10 ms
// A number as decimal text into `out` (at least 24 bytes), without allocating.
const char* decimal(long v, char* out) {
  char* p = out + 23;
  *p = '\0';
  const bool negative = v < 0;
  unsigned long u = negative ? 0UL - static_cast<unsigned long>(v) : static_cast<unsigned long>(v);
  do {
    *--p = static_cast<char>('0' + u % 10);
    u /= 10;
  } while (u != 0);
  if (negative) *--p = '-';
  return p;
}
void write_safe(const char* s) {
  std::size_t n = 0;
  while (s[n] != '\0') ++n;
  while (n > 0) {
    const ssize_t w = ::write(STDERR_FILENO, s, n);
    if (w <= 0) return;
    s += w;
    n -= static_cast<std::size_t>(w);
  }
}

// The watch thread's part: the report, with the frames named, in one write (a launcher
// that tears the job down on MPI_Abort, MPICH's hydra under load, may stop forwarding a
// dying rank's output between two writes).
void write_crash_report(Monitor& monitor) {
  const int sig = g_crash.sig;
  std::string report;
  try {
    report = fmt::format("\nmeshrt: rank {} on {} caught signal {} ({}) while running:\n{}\nbacktrace:\n",
                         monitor.rank(), monitor.host(), sig, strsignal(sig), monitor.current_unlocked());
    for (std::size_t i = 0; i < g_crash.frames && g_crash.frame[i] != nullptr; ++i) {
      report +=
          fmt::format("  #{:<2} {}\n", i, boost::stacktrace::to_string(boost::stacktrace::frame(g_crash.frame[i])));
    }
    // MESHRT_TRACE: the rank's own timeline file (the monitor's lock may be held by the
    // crashed thread, so without the running command).
    if (const std::string dumped = trace::dump_rank(fmt::format("signal {}", sig), {}, true); !dumped.empty()) {
      report += fmt::format("meshrt: rank {}: {}\n", monitor.rank(), dumped);
    }
    report += fmt::format("meshrt: rank {}: ending the whole job (MPI_Abort) so that no rank waits for this one\n",
                          monitor.rank());
  } catch (...) {
    return;  // the handler's own report follows when this one does not come
  }
  int posted = kPosted;
  if (!g_crash.state.compare_exchange_strong(posted, kWriting)) return;  // the handler gave up on it
  write_stderr(report);
  g_crash.state.store(kWritten);
}

void on_fatal(int sig) {
  int none = kNoCrash;
  if (!g_crash.state.compare_exchange_strong(none, kCapturing)) {
    // Another thread crashed first: its report and MPI_Abort end the process.
    for (;;) pause();
  }
  g_crash.sig = sig;
  // From the frame that received the signal: the handler's own is left out.
  g_crash.frames = boost::stacktrace::safe_dump_to(1, g_crash.frame, sizeof g_crash.frame);
  const std::uint64_t watch = g_watch_thread.load();
  if (watch != 0 && watch != this_thread_id()) {
    g_crash.state.store(kPosted);
    timespec tick{.tv_sec = 0, .tv_nsec = 10'000'000};
    for (int i = 0; i < kCrashWaitTicks && g_crash.state.load() != kWritten; ++i) (void)nanosleep(&tick, nullptr);
    int posted = kPosted;
    if (!g_crash.state.compare_exchange_strong(posted, kAbandoned)) {
      // Written, or being written: it takes a moment.
      while (g_crash.state.load() != kWritten) (void)nanosleep(&tick, nullptr);
      end_job_after_report(128 + sig);
    }
  }
  // Without the watch thread: the rank, the signal and the raw frames, safely.
  Monitor* m = g_monitor.load();
  char number[24];
  write_safe("\nmeshrt: rank ");
  write_safe(decimal(m ? m->rank() : -1, number));
  write_safe(" caught signal ");
  write_safe(decimal(sig, number));
  write_safe(
      " (the watch thread did not name the frames; addr2line -f -C -e <library> <offset> names one)\nbacktrace:\n");
  backtrace_symbols_fd(const_cast<void* const*>(g_crash.frame), static_cast<int>(g_crash.frames), STDERR_FILENO);
  write_safe("meshrt: ending the whole job (MPI_Abort) so that no rank waits for this one\n");
  end_job_after_report(128 + sig);
}

constexpr int kFatalSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};

}  // namespace

Watch::Watch(std::shared_ptr<control::Transport> control, Monitor& monitor)
    : control_(std::move(control)), monitor_(monitor) {
  thread_ = std::thread([this] {
    // The watch outlives whatever one turn throws (memory for a dump, a bad query): it is
    // what reports on the rest, and an exception out of this thread would end the process.
    while (!stop_.load()) {
      try {
        loop();
      } catch (const std::exception& e) {
        MESHRT_LOG(error) << "watch: " << e.what() << "; watching on";
      } catch (...) {
        MESHRT_LOG(error) << "watch: an exception not derived from std::exception; watching on";
      }
    }
  });
}

Watch::~Watch() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
}

void Watch::loop() {
  log::set_thread_role(fmt::format("watch {}", monitor_.rank()));
  g_watch_thread.store(this_thread_id());
  control::Bytes buf;
  while (!stop_.load()) {
    if (g_crash.state.load() == kPosted) write_crash_report(monitor_);
    if (g_dump_requested.exchange(false)) {
      MESHRT_LOG(warning) << "SIGUSR1: " << monitor_.dump();
    }
    if (g_term_arrived_ns.load() != 0) report_sigterm();
    // Below MPI_THREAD_MULTIPLE the worker lends its turn at MPI only while it is idle.
    const mpi_session::TakenTurn turn;
    if (!turn) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      continue;
    }
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
      // An answer the control plane refuses (a timeline over one message's limit): the
      // controller hears why rather than waiting out its deadline.
      if (!answer.payload.empty()) {
        answer.payload.clear();
        answer.error = std::string("the answer could not be sent: ") + e.what();
        try {
          control_->send(control::kControllerRank, control::Tag::Answer,
                         std::make_shared<control::Bytes>(protocol::encode(answer)));
        } catch (const std::exception& again) {
          MESHRT_LOG(error) << "watch: cannot answer query " << answer.query << ": " << again.what();
        }
      }
    }
  }
  g_watch_thread.store(0);
  // Answers still in flight go to a controller that may be waiting for them.
  for (auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(1);
       std::chrono::steady_clock::now() < give_up;) {
    if (const mpi_session::TakenTurn turn; turn) {
      control_->drain(std::chrono::seconds(1));
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
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

void WorkerWatch::set_sigterm_hook(void (*hook)()) noexcept {
  detail::g_sigterm_hook.store(hook);
}

detail::Monitor* WorkerWatch::monitor() const noexcept {
  return &impl_->monitor;
}

}  // namespace meshrt
