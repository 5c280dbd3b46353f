// What a worker is doing, readable from other threads: the flight recorder (the last N
// commands with their state and times) and the command running now. The worker's event
// loop writes it; the watch thread reads it to answer the controller's state queries
// (also while the loop is stuck inside a function) and to dump it on SIGUSR1; the fatal
// signal handler reads it to say what was running.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/trace.hpp"

namespace meshrt::detail {

enum class CommandState : std::uint8_t { Queued, Running, Done, Failed };

// Every field is reset for each command by Monitor::claim_slot.
struct CommandRecord {
  std::uint64_t seq = 0;     // arrival number on this worker
  std::uint64_t ident = 0;   // the invocation's ident, 0 for commands without one
  const char* kind = "";     // "CallFunction", "Reduce", ... (static strings)
  std::uint8_t tag = 0;      // the command's protocol tag (the timeline's)
  std::string name;          // function name, or what a collective does
  std::uint64_t result = 0;  // the result ref: the same command has the same one on every rank
  std::uint64_t mesh = 0;
  std::uint64_t stream = 0;
  std::string dim;
  std::uint64_t bytes = 0;
  std::vector<int> peers;  // world ranks taking part in a collective or send
  // A replay (one entry for all of its commands): the recording's ref, its number of
  // commands, and the place (from 1) of the one running, or failed (0 before the first).
  std::uint64_t replay = 0;
  std::uint32_t replay_step = 0;
  std::uint32_t replay_commands = 0;
  bool keep = false;  // a replay's entry names its first failed command until it ends
  struct Times {
    std::chrono::steady_clock::time_point queued{}, started{}, ended{};
  } at;
  CommandState state = CommandState::Queued;
};

class Monitor {
 public:
  Monitor(int rank, std::size_t capacity);

  int rank() const noexcept { return rank_; }
  // This node's name (gethostname), which reports print beside the rank.
  const std::string& host() const noexcept { return host_; }
  // Records a command as queued and returns its seq. `arrived`: when the message
  // carrying it came (one clock read per message, not per command of a batch).
  // `fill(slot)` writes the command's fields straight into its slot of the ring (cleared,
  // its strings' capacity kept), under the recorder's lock: no record is built and copied
  // per command on the worker's hot path.
  template <class Fill>
  std::uint64_t queued(std::chrono::steady_clock::time_point arrived, Fill&& fill) {
    std::lock_guard lock(mutex_);
    CommandRecord& slot = claim_slot(arrived);
    fill(slot);
    return slot.seq;
  }
  // Holds the recorder's lock while a batch's commands are queued one by one, so that a
  // batch takes it once: queued(fill) as Monitor::queued.
  class Queuing {
   public:
    Queuing(Monitor& monitor, std::chrono::steady_clock::time_point arrived)
        : monitor_(monitor), lock_(monitor.mutex_), arrived_(arrived) {}
    template <class Fill>
    std::uint64_t queued(Fill&& fill) {
      CommandRecord& slot = monitor_.claim_slot(arrived_);
      fill(slot);
      return slot.seq;
    }

   private:
    Monitor& monitor_;
    std::lock_guard<std::mutex> lock_;
    std::chrono::steady_clock::time_point arrived_;
  };
  void running(std::uint64_t seq);
  // `done` ended and `next` starts running: finished(done, failed) then running(next)
  // under one lock, with one clock read for the one's end and the other's start.
  void finished_then_running(std::uint64_t done, bool failed, std::uint64_t next);
  // Adds what only the start of a collective knows (its description and peers). Copied
  // into the record's own strings, whose capacity the ring keeps from one command to the
  // next: no allocation per collective once the ring has come round.
  void describe(std::uint64_t seq, std::string_view name, std::span<const int> peers, std::uint64_t bytes);
  void finished(std::uint64_t seq, bool failed);
  // Replay `seq` runs its command `step` (from 1): `fill(slot)` writes the command's fields
  // as queued() does, unless the entry shows the replay's operation in flight or its first
  // failed command.
  template <class Fill>
  void replay_step(std::uint64_t seq, std::uint32_t step, Fill&& fill) {
    std::lock_guard lock(mutex_);
    CommandRecord& r = ring_[seq % capacity_];
    if (r.seq != seq) return;
    current_.store(seq, std::memory_order_relaxed);
    r.state = CommandState::Running;  // again, after an operation of the replay ended
    if (r.keep || in_flight_.load(std::memory_order_relaxed) == seq) return;
    clear_command(r);
    r.replay_step = step;
    fill(r);
    trace::current_ident = r.ident;
  }
  // The command the entry of replay `seq` names now failed: it keeps naming it.
  void replay_failed(std::uint64_t seq);
  // Replay `seq` ran its last command: finished, unless its operation is still in flight
  // (whose end finishes it).
  void replay_finished(std::uint64_t seq, bool failed);
  // The collective or send in flight (0: none) while later commands run: the running
  // command again once each of them finishes, so a report shows what the rank waits in.
  void in_flight(std::uint64_t seq) noexcept { in_flight_.store(seq); }
  // A call whose host tasks still run on its device stream after the worker moved on: it
  // stays running (and current when nothing else is) until finished(seq).
  void on_device(std::uint64_t seq);
  void completed_ident(std::uint64_t first_uncompleted) noexcept { first_uncompleted_.store(first_uncompleted); }
  // A new event loop (after a restart) starts from an empty queue.
  void reset_queue();

  // {"rank", "first_uncompleted", "queued", "current": {...} or null}
  nlohmann::json state() const;
  // The flight recorder as a table, oldest first; `limit` keeps only the newest entries.
  std::string dump(std::size_t limit = SIZE_MAX) const;
  // The newest `limit` commands that have started (running, done or failed), oldest
  // first, and how many wait queued behind them: what a rank was doing when it was told
  // to end, where the controller's lead fills the ring's newest entries with queued ones.
  std::string recent(std::size_t limit) const;
  // The commands running now (an operation in flight among them) as timeline events
  // marked unfinished, ending now: a rank's own timeline file when the job is ended.
  std::vector<trace::Event> running_events() const;
  // For a fatal signal: the running command, without taking locks (best effort).
  std::string current_unlocked() const;
  // The thread that ran the latest command (detail::this_thread_id()'s number), 0 before
  // the first: the kernel's thread, whose stack a report may show.
  std::uint64_t worker_thread() const noexcept { return worker_thread_.load(std::memory_order_relaxed); }

 private:
  static std::string line(const CommandRecord& r, std::chrono::steady_clock::time_point now);
  // MESHRT_TRACE: the command `r` as a timeline event.
  static trace::Event trace_event(const CommandRecord& r);
  // The next seq's slot, reset to a queued record of it (name, dim and peers emptied with
  // their capacity kept). Under mutex_.
  CommandRecord& claim_slot(std::chrono::steady_clock::time_point arrived);
  // Empties what record() and describe() write, keeping the strings' capacity.
  static void clear_command(CommandRecord& r);
  void finished_locked(std::uint64_t seq, bool failed, std::chrono::steady_clock::time_point now);
  void running_locked(std::uint64_t seq, std::chrono::steady_clock::time_point now);
  int rank_;
  std::string host_;
  std::size_t capacity_;
  mutable std::mutex mutex_;
  std::vector<CommandRecord> ring_;
  std::uint64_t next_seq_ = 1;
  std::atomic<std::uint64_t> current_{0};    // seq of the running command, 0 when idle
  std::atomic<std::uint64_t> in_flight_{0};  // seq of the operation in flight, 0 when none
  std::vector<std::uint64_t> on_device_;     // seqs of calls whose host tasks run, oldest first
  std::atomic<std::uint64_t> first_uncompleted_{0};
  std::atomic<std::uint64_t> worker_thread_{0};
};

}  // namespace meshrt::detail
