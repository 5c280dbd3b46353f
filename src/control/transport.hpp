// The control plane's transport (DESIGN.md section 4: `control` sits between comm and
// worker): framed messages between the controller (world rank 0) and the workers, sent
// to a set of ranks without blocking and received without knowing their size in
// advance. The controller, the workers' event loops and their watch threads see only
// this interface; MpiTransport (mpi_transport.hpp) carries it over a communicator of its
// own, MemoryNetwork (memory_transport.hpp) inside one process for tests.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <vector>

namespace meshrt::control {

using Bytes = std::vector<std::byte>;

// What a message is. The values are the MPI tags on the MPI transport: they must stay
// apart from any other tag used on the control communicator.
enum class Tag : int {
  Command = 101,  // controller -> worker: encoded protocol::Command
  Reply = 102,    // worker -> controller: encoded protocol::Reply
  Query = 103,    // controller -> watch thread: encoded protocol::Query
  Answer = 104,   // watch thread -> controller: encoded protocol::QueryAnswer
};

inline constexpr int kControllerRank = 0;
inline constexpr int kAnySource = -1;  // try_receive from whichever rank sent first

class Transport {
 public:
  virtual ~Transport() = default;

  // Sends `bytes` to every rank in `dests` without blocking; the transport keeps the
  // buffer until every send has completed. Messages from one sender with one tag arrive
  // in the order they were sent.
  virtual void send(const std::vector<int>& dests, Tag tag, std::shared_ptr<const Bytes> bytes) = 0;
  void send(int dest, Tag tag, std::shared_ptr<const Bytes> bytes) {
    send(std::vector<int>{dest}, tag, std::move(bytes));
  }

  // Takes one waiting message with `tag` from `source` (or kAnySource) into `out`;
  // returns false at once if there is none. `from` receives the sender's rank.
  virtual bool try_receive(int source, Tag tag, Bytes& out, int* from = nullptr) = 0;

  // Completes the sends that have finished; never blocks.
  virtual void reap() = 0;
  // Waits for every send; gives up (returns false) after `timeout`.
  virtual bool drain(std::chrono::duration<double> timeout) = 0;
};

}  // namespace meshrt::control
