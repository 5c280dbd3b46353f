#include "runtime/peer_watch.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "common/checks.hpp"
#include "common/timeline.hpp"
#include "meshrt/log.hpp"
#include "meshrt/version.hpp"

namespace meshrt::detail {
namespace {

constexpr int kTag = 1;
constexpr char kBeat = 'b';
constexpr char kGoodbye = 'g';
// Between two looks at the predecessor and the clock; a beat goes out each interval.
constexpr std::chrono::milliseconds kTick{50};
constexpr std::chrono::duration<double> kLongestInterval{1.0};
// How long a rank that has said goodbye waits quietly for its predecessor's.
constexpr std::chrono::seconds kGoodbyeQuiet{10};

using Clock = std::chrono::steady_clock;

}  // namespace

PeerWatch::PeerWatch(MPI_Comm world, std::chrono::duration<double> timeout, int provided) : timeout_(timeout) {
  int size = 1;
  MESHRT_MPI_CHECK(MPI_Comm_rank(world, &rank_));
  MESHRT_MPI_CHECK(MPI_Comm_size(world, &size));
  const bool off = timeout <= std::chrono::duration<double>::zero() || timeout == std::chrono::duration<double>::max();
  // Rank 0 learns every rank's thread level: a ring that is off for want of it is said,
  // once for the job, with the ranks that lack it.
  const int mine[2] = {off ? 1 : 0, provided};
  std::vector<int> all(rank_ == 0 ? 2 * static_cast<std::size_t>(size) : 0);
  MESHRT_MPI_CHECK(MPI_Gather(mine, 2, MPI_INT, all.data(), 2, MPI_INT, 0, world));
  int on = 0;
  bool asked_off = false;  // MESHRT_PEER_TIMEOUT=0 on some rank: off by the user's choice
  for (std::size_t r = 0; r < all.size(); r += 2) asked_off = asked_off || all[r] != 0;
  if (rank_ == 0 && !asked_off && size >= 2) {
    std::vector<std::string> short_of;
    for (int r = 0; r < size; ++r) {
      const int level = all[2 * static_cast<std::size_t>(r) + 1];
      if (level < MPI_THREAD_MULTIPLE) short_of.push_back(fmt::format("rank {} ({})", r, thread_level_name(level)));
    }
    on = short_of.empty() ? 1 : 0;
    if (!on) {
      std::fputs(fmt::format("meshrt: the heartbeat ring (MESHRT_PEER_TIMEOUT) is off: it needs MPI_THREAD_MULTIPLE "
                             "on every rank, and {} {} MPI at a lower thread level; a lost node or a stopped process "
                             "will not be named, and the job waits until its launcher ends it (start MPI with "
                             "MPI_THREAD_MULTIPLE on every rank to have it)\n",
                             fmt::join(short_of, ", "), short_of.size() == 1 ? "runs" : "run")
                     .c_str(),
                 stderr);
      std::fflush(stderr);
    }
  }
  MESHRT_MPI_CHECK(MPI_Bcast(&on, 1, MPI_INT, 0, world));
  if (on == 0) return;
  MESHRT_MPI_CHECK(MPI_Comm_dup(world, &comm_));
  set_error_policy(comm_);
  next_ = (rank_ + 1) % size;
  prev_ = (rank_ + size - 1) % size;
  // The predecessor's host, for the message that names it.
  host_ = processor_name();
  std::vector<char> mine_name(MPI_MAX_PROCESSOR_NAME + 1, '\0'), prev_name(MPI_MAX_PROCESSOR_NAME + 1, '\0');
  std::copy_n(host_.begin(), std::min<std::size_t>(host_.size(), MPI_MAX_PROCESSOR_NAME), mine_name.begin());
  MESHRT_MPI_CHECK(MPI_Sendrecv(mine_name.data(), MPI_MAX_PROCESSOR_NAME, MPI_CHAR, next_, kTag, prev_name.data(),
                                MPI_MAX_PROCESSOR_NAME, MPI_CHAR, prev_, kTag, comm_, MPI_STATUS_IGNORE));
  prev_host_ = prev_name.data();
  thread_ = std::thread([this] {
    // Nothing leaves this thread (std::terminate would end the process without a word):
    // a watch that cannot go on says why and ends the job, as its successor would soon.
    try {
      loop();
    } catch (const std::exception& e) {
      lost(fmt::format("its heartbeat thread failed: {}", e.what()));
    } catch (...) {
      lost("its heartbeat thread failed with an exception not derived from std::exception");
    }
  });
}

PeerWatch::~PeerWatch() {
  if (thread_.joinable()) {
    stop_.store(true);
    thread_.join();
  }
  // Ignored on purpose: a destructor cannot raise, and MPI_Finalize follows.
  if (comm_ != MPI_COMM_NULL) MESHRT_MPI_IGNORE(MPI_Comm_free(&comm_));
}

void PeerWatch::loop() {
  log::set_thread_role(fmt::format("peers {}", rank_));
  const auto interval = std::min(kLongestInterval, timeout_ / 4);
  char in = 0;
  char out = kBeat;
  MPI_Request recv = MPI_REQUEST_NULL;
  MPI_Request send = MPI_REQUEST_NULL;
  const std::string from_prev = fmt::format("the heartbeat of rank {} on {}", prev_, prev_host_);
  const std::string to_next = fmt::format("the heartbeat to rank {}", next_);
  auto check = [&](int rc, const std::string& what) {
    if (rc != MPI_SUCCESS) lost(fmt::format("{} failed: {}", what, mpi_error_string(rc)));
  };
  check(MPI_Irecv(&in, 1, MPI_CHAR, prev_, kTag, comm_, &recv), from_prev);
  auto heard = Clock::now();
  auto next_beat = heard;
  bool said_goodbye = false;
  bool prev_gone = false;  // the predecessor's goodbye came
  Clock::time_point goodbye_at{};
  bool said_waiting = false;
  for (;;) {
    const auto now = Clock::now();
    int sent = 1;
    if (send != MPI_REQUEST_NULL) {
      check(MPI_Test(&send, &sent, MPI_STATUS_IGNORE), to_next);
    }
    // One message in flight at a time; the last one is the goodbye.
    if (sent && !said_goodbye && (stop_.load() || now >= next_beat)) {
      said_goodbye = stop_.load();
      if (said_goodbye) goodbye_at = now;
      out = said_goodbye ? kGoodbye : kBeat;
      check(MPI_Isend(&out, 1, MPI_CHAR, next_, kTag, comm_, &send), to_next);
      next_beat = now + std::chrono::duration_cast<Clock::duration>(interval);
      sent = 0;
    }
    while (!prev_gone) {
      int got = 0;
      check(MPI_Test(&recv, &got, MPI_STATUS_IGNORE), from_prev);
      if (!got) break;
      heard = Clock::now();
      if (in == kGoodbye) {
        prev_gone = true;
      } else {
        check(MPI_Irecv(&in, 1, MPI_CHAR, prev_, kTag, comm_, &recv), from_prev);
      }
    }
    if (!prev_gone && Clock::now() - heard > timeout_) {
      lost(
          fmt::format("rank {} on {} has sent no heartbeat for {:.3g} s (MESHRT_PEER_TIMEOUT): its node or its "
                      "process is gone, or stopped",
                      prev_, prev_host_, timeout_.count()));
    }
    if (said_goodbye && prev_gone && (sent || send == MPI_REQUEST_NULL)) return;
    // A live predecessor that never reaches its shutdown (a process stuck after its
    // program's end) keeps this rank, and the job, waiting: say so once.
    if (said_goodbye && !prev_gone && !said_waiting && Clock::now() - goodbye_at > kGoodbyeQuiet) {
      said_waiting = true;
      std::fputs(fmt::format("meshrt: rank {} on {} has finished and waits for rank {} on {} to finish too: its "
                             "heartbeats still come, but {} s after this rank's shutdown its process has not reached "
                             "meshrt's shutdown (is it still running the program after meshrt.run or Runtime "
                             "returned: a thread that is not a daemon, a call that blocks at exit?)\n",
                             rank_, host_, prev_, prev_host_, kGoodbyeQuiet.count())
                     .c_str(),
                 stderr);
      std::fflush(stderr);
    }
    std::this_thread::sleep_for(stop_.load() ? std::chrono::milliseconds(1) : kTick);
  }
}

void PeerWatch::lost(const std::string& why) {
  const std::string text = fmt::format(
      "meshrt: rank {} on {}: {}; ending the whole job (MPI_Abort) so that no rank waits for it\n", rank_, host_, why);
  std::fputs(text.c_str(), stderr);
  std::fflush(stderr);
  // MESHRT_TRACE: this rank's own timeline file (the others are ended by the launcher).
  if (const std::string dumped = trace::dump_rank(why, {}); !dumped.empty()) {
    std::fprintf(stderr, "meshrt: rank %d on %s: %s\n", rank_, host_.c_str(), dumped.c_str());
    std::fflush(stderr);
  }
  end_job_after_report(1);
}

}  // namespace meshrt::detail
