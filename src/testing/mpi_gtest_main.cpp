// The GoogleTest main of meshrt's MPI tests (and of users' tests through
// meshrt_add_mpi_test). It
// - initialises MPI with MPI_THREAD_MULTIPLE and finalises it;
// - prints GoogleTest's usual output on rank 0 only, and after every test gathers the
//   failure text of every other rank to rank 0 and prints it there, so a failure on
//   rank 2 is seen with its file, line and message;
// - fails the binary on every rank if the test failed on any rank;
// - runs a watchdog (MESHRT_TEST_WATCHDOG seconds, set by meshrt_add_mpi_test): if the
//   binary is still running then, each rank says which test it is in and what it has
//   seen fail, and the job is ended with MPI_Abort so no rank is left behind.
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "meshrt/internal/settings.hpp"

namespace {

struct State {
  std::mutex mutex;
  std::string current_test = "(before the first test)";
  std::string failures;  // this rank's failure text for the current test
  bool waiting_for_peers = false;
};

State g_state;
int g_rank = 0;
int g_size = 1;

std::string hostname() {
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  return host;
}

class RankReporter : public testing::EmptyTestEventListener {
 public:
  explicit RankReporter(MPI_Comm comm) : comm_(comm) {}

  void OnTestStart(const testing::TestInfo& info) override {
    std::lock_guard lock(g_state.mutex);
    g_state.current_test = std::string(info.test_suite_name()) + "." + info.name();
    g_state.failures.clear();
    g_state.waiting_for_peers = false;
  }

  void OnTestPartResult(const testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::lock_guard lock(g_state.mutex);
    g_state.failures += std::string(r.file_name() ? r.file_name() : "?") + ":" + std::to_string(r.line_number()) +
                        ": Failure\n" + r.message() + "\n";
  }

  void OnTestEnd(const testing::TestInfo& info) override {
    std::string mine;
    {
      std::lock_guard lock(g_state.mutex);
      mine = g_state.failures;
      g_state.waiting_for_peers = true;
    }
    int len = static_cast<int>(mine.size());
    std::vector<int> lens(static_cast<std::size_t>(g_size));
    MPI_Gather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, 0, comm_);
    std::vector<int> displs(static_cast<std::size_t>(g_size), 0);
    int total = 0;
    for (int r = 0; r < g_size; ++r) {
      displs[static_cast<std::size_t>(r)] = total;
      total += lens[static_cast<std::size_t>(r)];
    }
    std::string all(static_cast<std::size_t>(std::max(total, 1)), '\0');
    MPI_Gatherv(mine.data(), len, MPI_CHAR, all.data(), lens.data(), displs.data(), MPI_CHAR, 0, comm_);
    {
      std::lock_guard lock(g_state.mutex);
      g_state.waiting_for_peers = false;
    }
    if (g_rank != 0) return;
    const std::string name = std::string(info.test_suite_name()) + "." + info.name();
    for (int r = 0; r < g_size; ++r) {
      const auto n = static_cast<std::size_t>(lens[static_cast<std::size_t>(r)]);
      if (n == 0) continue;
      failed_[name].push_back(r);
      if (r == 0) continue;  // rank 0's own printer has shown it
      std::printf("[  FAILED  ] %s on rank %d:\n%s", name.c_str(), r,
                  all.substr(static_cast<std::size_t>(displs[static_cast<std::size_t>(r)]), n).c_str());
    }
    std::fflush(stdout);
  }

  void OnTestProgramEnd(const testing::UnitTest&) override {
    if (g_rank != 0 || failed_.empty()) return;
    std::printf("[meshrt] %zu test(s) failed on some rank of %d:\n", failed_.size(), g_size);
    for (const auto& [name, ranks] : failed_) {
      std::string list;
      for (int r : ranks) list += (list.empty() ? "" : ", ") + std::to_string(r);
      std::printf("[meshrt]   %s (rank%s %s)\n", name.c_str(), ranks.size() == 1 ? "" : "s", list.c_str());
    }
    std::fflush(stdout);
  }

 private:
  MPI_Comm comm_;
  std::map<std::string, std::vector<int>> failed_;
};

class Watchdog {
 public:
  explicit Watchdog(double seconds) {
    if (seconds <= 0) return;
    thread_ = std::thread([this, seconds] { run(seconds); });
  }
  ~Watchdog() {
    {
      std::lock_guard lock(mutex_);
      done_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

 private:
  void run(double seconds) {
    std::unique_lock lock(mutex_);
    if (cv_.wait_for(lock, std::chrono::duration<double>(seconds), [this] { return done_; })) return;
    lock.unlock();
    bool waiting = false;
    {
      std::lock_guard state_lock(g_state.mutex);
      waiting = g_state.waiting_for_peers;
      std::fprintf(
          stderr,
          "[meshrt test watchdog] rank %d (%s): still running after %.0f s, %s test %s; aborting the MPI job\n%s",
          g_rank, hostname().c_str(), seconds, waiting ? "finished and waiting for the other ranks after" : "inside",
          g_state.current_test.c_str(),
          g_state.failures.empty()
              ? ""
              : ("[meshrt test watchdog] rank " + std::to_string(g_rank) + " failures so far:\n" + g_state.failures)
                    .c_str());
      std::fflush(stderr);
    }
    // Every rank's watchdog fires at about the same time: give all of them a moment to
    // speak before the first MPI_Abort takes the job down, the merely waiting ones longer.
    std::this_thread::sleep_for(std::chrono::seconds(waiting ? 3 : 1));
    MPI_Abort(MPI_COMM_WORLD, 142);  // 128 + SIGALRM: "timed out"
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  testing::InitGoogleTest(&argc, argv);

  // Unset, 0, inf and none read as no limit: no watchdog.
  const meshrt::settings::Seconds limit =
      meshrt::settings::kTestWatchdog.from_environment().value_or(meshrt::settings::Seconds::max());
  const double watchdog_seconds = limit == meshrt::settings::Seconds::max() ? 0 : limit.count();

  int result = 0;
  {
    Watchdog watchdog(watchdog_seconds);
    MPI_Comm report_comm = MPI_COMM_NULL;
    MPI_Comm_dup(MPI_COMM_WORLD, &report_comm);
    auto& listeners = testing::UnitTest::GetInstance()->listeners();
    if (g_rank != 0 && !meshrt::settings::kTestAllRanksOutput.get()) {
      delete listeners.Release(listeners.default_result_printer());
    }
    listeners.Append(new RankReporter(report_comm));

    const int local = RUN_ALL_TESTS();
    MPI_Allreduce(&local, &result, 1, MPI_INT, MPI_MAX, report_comm);
    MPI_Comm_free(&report_comm);
  }
  MPI_Finalize();
  return result;
}
