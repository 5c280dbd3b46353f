#include "worker/watch.hpp"

#include <execinfo.h>
#include <fmt/format.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <string>
#include <vector>

#include "meshrt/comm.hpp"
#include "meshrt/log.hpp"
#include "meshrt/settings.hpp"

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

// Crash-time reporting is best effort: formatting allocates, which a signal handler
// should not do, but the process is going down and the report is what matters most.
void on_fatal(int sig) {
  Monitor* m = g_monitor.load();
  const int rank = m ? m->rank() : -1;
  write_stderr(fmt::format("\nmeshrt: rank {} caught signal {} ({}) while running:\n{}\nbacktrace:\n", rank, sig,
                           strsignal(sig), m ? m->current_unlocked() : std::string("(no worker on this rank)")));
  void* frames[64];
  const int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
  write_stderr(
      fmt::format("meshrt: rank {}: ending the whole job (MPI_Abort) so that no rank waits for this one\n", rank));
  MPI_Abort(MPI_COMM_WORLD, 128 + sig);
  _exit(128 + sig);
}

constexpr int kFatalSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};

}  // namespace

Watch::Watch(MPI_Comm control, Monitor& monitor) : control_(control), monitor_(monitor) {
  thread_ = std::thread([this] { loop(); });
}

Watch::~Watch() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
}

void Watch::loop() {
  log::set_thread_role(fmt::format("watch {}", monitor_.rank()));
  std::vector<char> buf;
  while (!stop_.load()) {
    if (g_dump_requested.exchange(false)) {
      MESHRT_LOG(warning) << "SIGUSR1: " << monitor_.dump();
    }
    int flag = 0;
    MPI_Message message;
    MPI_Status status;
    if (MPI_Improbe(0, kQueryTag, control_, &flag, &message, &status) != MPI_SUCCESS || !flag) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      continue;
    }
    int count = 0;
    MPI_Get_count(&status, MPI_BYTE, &count);
    buf.resize(static_cast<std::size_t>(count));
    MPI_Mrecv(buf.data(), count, MPI_BYTE, &message, MPI_STATUS_IGNORE);
    nlohmann::json answer;
    try {
      const auto request = nlohmann::json::parse(buf.begin(), buf.end());
      const std::string op = request.at("op");
      if (op == "state") {
        answer = monitor_.state();
      } else if (op == "dump") {
        const std::string text = monitor_.dump(request.value("limit", std::size_t{SIZE_MAX}));
        MESHRT_LOG(warning) << "flight recorder requested by the controller"
                            << (request.contains("why") ? " (" + request["why"].get<std::string>() + ")" : "") << ":\n"
                            << text;
        answer = {{"rank", monitor_.rank()}, {"dump", text}};
      } else if (op == "abort") {
        MESHRT_LOG(fatal) << "the controller is aborting the job: " << request.value("reason", std::string("?"));
        abort_nccl_communicators();
        answer = {{"rank", monitor_.rank()}, {"aborting", true}};
      } else {
        answer = {{"rank", monitor_.rank()}, {"error", "unknown query op '" + op + "'"}};
      }
    } catch (const std::exception& e) {
      answer = {{"rank", monitor_.rank()}, {"error", std::string("bad query: ") + e.what()}};
    }
    answer["rank"] = monitor_.rank();
    if (!buf.empty()) {
      try {
        answer["query"] = nlohmann::json::parse(buf.begin(), buf.end()).value("query", 0);
      } catch (const std::exception&) {
      }
    }
    const std::string text = answer.dump();
    MPI_Send(text.data(), static_cast<int>(text.size()), MPI_BYTE, 0, kStateTag, control_);
  }
}

void install_signal_handlers(Monitor* monitor) {
  g_monitor.store(monitor);
  struct sigaction usr {};
  usr.sa_handler = on_sigusr1;
  sigemptyset(&usr.sa_mask);
  usr.sa_flags = SA_RESTART;
  sigaction(SIGUSR1, &usr, nullptr);
  bool fatal = true;
  try {
    fatal = settings::get_bool("MESHRT_SIGNAL_HANDLER");
  } catch (const std::exception& e) {
    MESHRT_LOG(warning) << e.what();
  }
  if (!fatal) return;
  struct sigaction sa {};
  sa.sa_handler = on_fatal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESETHAND;
  for (int sig : kFatalSignals) sigaction(sig, &sa, nullptr);
}

void uninstall_signal_handlers() {
  for (int sig : kFatalSignals) signal(sig, SIG_DFL);
  signal(SIGUSR1, SIG_DFL);
  g_monitor.store(nullptr);
}

}  // namespace meshrt::detail
