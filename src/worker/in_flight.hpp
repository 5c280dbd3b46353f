// The collective or send a worker has in flight (at most one), how the loop completes it
// (polls, waits between polls, finishes it into the environment, or fails it), and which
// later commands may run while it is in flight: those on other streams that touch none of
// its values, so a kernel on stream A overlaps a collective on stream B.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "common/assert.hpp"
#include "common/backoff.hpp"
#include "meshrt/internal/comm.hpp"
#include "meshrt/internal/protocol.hpp"
#include "meshrt/internal/worker.hpp"

namespace meshrt::detail {

class Env;
class Monitor;
class Reporter;

// What an operation in flight reads and writes (ref ids), and its meshrt stream. At most
// one read and two writes (an in-place reduce): held inline and copied as plain bytes, so
// an operation allocates nothing for it.
struct Footprint {
  class Ids {
   public:
    Ids() = default;
    Ids(std::initializer_list<std::uint64_t> ids) {
      for (std::uint64_t id : ids) push_back(id);
    }
    void push_back(std::uint64_t id) {
      MESHRT_ASSERT(n_ < ids_.size(), "an operation touches at most two refs of a kind");
      ids_[n_++] = id;
    }
    const std::uint64_t* begin() const noexcept { return ids_.data(); }
    const std::uint64_t* end() const noexcept { return ids_.data() + n_; }

   private:
    std::array<std::uint64_t, 2> ids_{};
    std::size_t n_ = 0;
  };
  std::uint64_t stream = 0;
  Ids reads;
  Ids writes;
};

class InFlight {
 public:
  InFlight(Monitor& monitor, const WorkerOptions& options);

  // How this worker runs a CPU collective or send:
  // - the blocking MPI call on the loop's thread, without the status tree on a node with a
  //   core per rank: commands wait behind the collective anyway (queries go to the watch
  //   thread), and blocking saves the hand-offs and the non-blocking test loop;
  // - Completion::Auto with the status tree, so that a node keeps relaying its children's
  //   reports, and on a node with more ranks than cores, where a rank blocked in MPI for a
  //   late peer would keep polling the core that peer needs.
  Completion cpu_completion() const noexcept { return blocking_ ? Completion::Blocking : Completion::Auto; }

  bool active() const noexcept { return current_.has_value(); }
  // Tracks `op`, started by command `seq` (`kind`, `ident`); `result` is defined when it
  // completes. `cpu_bytes`: the size of a CPU operation (one at kThreadMinBytes and up
  // under Completion::Auto runs on meshrt's comm thread); nullopt for an accelerator one.
  void start(std::unique_ptr<Pending> op, std::optional<Ref> result, std::uint64_t seq, std::string_view kind,
             protocol::Ident ident, std::optional<std::size_t> cpu_bytes, Footprint footprint);
  const Pending& op() const noexcept { return *current_->op; }
  // Whether `command` may run while the operation is in flight (only when active()): it
  // must not need the operation's result or stream, nor change what it reads or writes.
  // Another collective or send, an exit, a borrow of what it touches wait for it (one
  // operation in flight); the controller's
  // completion rule holds because the reporter holds the operation's ident back until it
  // ends (Reporter::hold).
  bool admits(const protocol::Command& command) const;

  // Whether the operation moved: it completed (and is finished) or failed.
  bool poll(Env& env, Reporter& reporter);
  // Waits between two polls of the loop while nothing else moved. Commands wait until it
  // completes; the loop still polls the channel (status, queries).
  void pause(Backoff& flight);

 private:
  void finish(Env& env, Reporter& reporter);
  // Called inside a catch handler: the operation threw from test() or take().
  void fail(Env& env, Reporter& reporter);

  struct Current {
    std::unique_ptr<Pending> op;
    std::optional<Ref> result;  // defined when the operation completes
    std::uint64_t seq = 0;
    // On meshrt's comm thread: its Pending wakes a waiter in idle() the moment it completes.
    bool on_comm_thread = false;
    std::string_view kind;      // the command ("Reduce", "SendTensor"), for a failure report
    protocol::Ident ident = 0;  // complete (or failed) when the operation ends
    Footprint footprint;
  };
  Monitor& monitor_;
  int rank_;
  bool blocking_;
  std::optional<Current> current_;
};

}  // namespace meshrt::detail
