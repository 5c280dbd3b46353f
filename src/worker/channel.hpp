// The control channel between the controller (world rank 0) and the workers: framed
// messages over a communicator of their own, received without knowing their size in
// advance (matched probes, safe with several threads per process) and sent without
// blocking (the channel owns each buffer until MPI is done with it).
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstddef>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

#include "common/backoff.hpp"  // Backoff, used with the channel by its callers

namespace meshrt::detail {

inline constexpr int kCommandTag = 101;  // controller -> worker: encoded Commands
inline constexpr int kReplyTag = 102;    // worker -> controller: encoded Replies
inline constexpr int kControllerRank = 0;

using Bytes = std::vector<std::byte>;

class Channel {
 public:
  explicit Channel(MPI_Comm comm) : comm_(comm) {}
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;
  ~Channel();

  MPI_Comm comm() const noexcept { return comm_; }

  // Takes one waiting message with `tag` from `source` (or MPI_ANY_SOURCE) into `out`;
  // returns false at once if there is none. `from` receives the sender's rank.
  bool try_receive(int source, int tag, Bytes& out, int* from = nullptr);

  // Sends `bytes` to every rank in `dests` without blocking; the buffer is kept until
  // every send has completed.
  void send(const std::vector<int>& dests, int tag, std::shared_ptr<const Bytes> bytes);
  void send(int dest, int tag, std::shared_ptr<const Bytes> bytes) {
    send(std::vector<int>{dest}, tag, std::move(bytes));
  }

  // Completes the sends MPI has finished with; never blocks.
  void reap();
  // Waits for every send; gives up (returns false) after `timeout`.
  bool drain(std::chrono::duration<double> timeout);
  std::size_t in_flight() const noexcept { return sends_.size(); }

 private:
  void reap_locked();
  struct Send {
    MPI_Request request;
    std::shared_ptr<const Bytes> bytes;
  };
  MPI_Comm comm_;
  std::mutex mutex_;  // the controller's batch flusher sends from its own thread
  std::deque<Send> sends_;
};

}  // namespace meshrt::detail
