// A worker's incoming commands: batches taken from the transport, envelopes forwarded down
// the fan-out tree and run in the controller's numbered order, undecodable frames reported,
// and the queue of commands not yet started, each recorded in the flight recorder as it is
// queued (a replay as one command: the worker runs its recording's commands in place).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>

#include <boost/container/deque.hpp>
#include <boost/container/options.hpp>

#include "meshrt/internal/control.hpp"
#include "meshrt/internal/protocol.hpp"
#include "worker/monitor.hpp"
#include "worker/recordings.hpp"

namespace meshrt::detail {

class Reporter;

class Inbox {
 public:
  struct Queued {
    std::uint64_t seq;  // the flight recorder's; 0 for a command it does not record
    protocol::Command command;
    // A CallRecording's recording, kept from when it is queued: a DeleteRefs queued after
    // the replay may drop the last handle before it runs.
    std::shared_ptr<Recording> recording = nullptr;
  };
  // receive() takes no more batches past it: the next ones wait in the transport, encoded
  // (a few dozen bytes a command against ~600 decoded), so a controller far ahead does not
  // set the worker's memory.
  static constexpr std::size_t kMaxQueued = 4096;

  Inbox(control::Transport& channel, Monitor& monitor, int rank);

  // Takes the batches waiting in the transport (from the controller or a fan-out parent)
  // into the queue; false when there were none. An undecodable frame is reported through
  // `reporter` and dropped.
  bool receive(Reporter& reporter);
  bool empty() const noexcept { return queue_.empty(); }
  // The next command, in order; only when !empty().
  Queued pop();
  // The next command, left in the queue to run in place (not moved out); only when !empty().
  Queued& next() noexcept { return queue_.front(); }
  // Drops the next command; only when !empty().
  void drop() noexcept { queue_.pop_front(); }
  // The next command, left in the queue; only when !empty().
  const protocol::Command& front() const noexcept { return queue_.front().command; }
  // Whether the next command is a replay (it runs its recording in place); only when !empty().
  bool front_is_replay() const noexcept { return queue_.front().recording != nullptr; }

 private:
  // Forwards an envelope to this rank's children before anything in it runs, then queues
  // its payload in order.
  void route(const control::Bytes& frame, Reporter& reporter);
  // Queues the envelopes that are next in number.
  void run_early(Reporter& reporter);
  void undecodable(const ProtocolError& e, std::size_t size, int from, Reporter& reporter);
  // Queues a command frame's commands (a group's one by one), decoded in place in the
  // queue, and records them.
  void take(std::span<const std::byte> frame);
  // Records a command just decoded into the queue; false for a DefineRecording, which is
  // kept, not queued (a replay is queued with the recording it runs).
  bool admit(Queued& q, Monitor::Queuing& recorder);

  control::Transport& channel_;
  Monitor& monitor_;
  int rank_;
  Recordings recordings_{rank_};
  // Boost's deque with 32 commands per block: one allocation per block, not per command,
  // and blocks go back as they empty (a vector would keep its longest queue's room).
  boost::container::deque<Queued, void, boost::container::deque_options_t<boost::container::block_size<32u>>> queue_;
  control::Bytes rx_;
  std::chrono::steady_clock::time_point arrived_{};  // when the message being queued came
  // Fan-out (docs/ARCHITECTURE.md section 8): the number of the next envelope this rank
  // runs, and the envelopes that overtook it (one from the controller can pass one still
  // travelling through a parent).
  std::uint64_t next_envelope_ = 1;
  std::map<std::uint64_t, control::Bytes> early_;
};

}  // namespace meshrt::detail
