// The control plane (docs/ARCHITECTURE.md section 2: `control` sits between comm and worker): the
// transport between the controller (world rank 0) and the workers, framed messages sent
// to a set of ranks without blocking and received without knowing their size in
// advance. The controller, the workers' event loops and their watch threads see only
// the Transport interface; mpi_transport() carries it over a communicator of its own,
// MemoryNetwork inside one process, for tests. An internal interface of meshrt, public
// only so that its modules and tests share it; not part of meshrt.hpp.
#pragma once

#include <mpi.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "meshrt/traffic.hpp"

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

constexpr MessageKind kind_of(Tag tag) noexcept {
  return static_cast<MessageKind>(static_cast<int>(tag) - static_cast<int>(Tag::Command));
}

// Every send and receive goes through the non-virtual send() and try_receive() below,
// which count it (traffic()) before the implementation moves the bytes: an
// implementation cannot forget to count, and the counts are exact.
class Transport {
 public:
  virtual ~Transport() = default;

  // Sends `bytes` to every rank in `dests` without blocking; the transport keeps the
  // buffer until every send has completed. Messages from one sender with one tag arrive
  // in the order they were sent. Counted as one message per destination.
  void send(const std::vector<int>& dests, Tag tag, std::shared_ptr<const Bytes> bytes);
  void send(int dest, Tag tag, std::shared_ptr<const Bytes> bytes) {
    send(std::vector<int>{dest}, tag, std::move(bytes));
  }

  // Takes one waiting message with `tag` from `source` (or kAnySource) into `out`;
  // returns false at once if there is none. `from` receives the sender's rank.
  bool try_receive(int source, Tag tag, Bytes& out, int* from = nullptr);

  // Completes the sends that have finished; never blocks.
  virtual void reap() = 0;
  // Waits for every send; gives up (returns false) after `timeout`.
  virtual bool drain(std::chrono::duration<double> timeout) = 0;

  // What this transport has sent and received so far (safe from any thread).
  ControlTraffic traffic() const;

  // Commands a process sends to itself (the controller to worker 0, which share rank 0)
  // ring a doorbell, so that worker can sleep until its next command instead of polling
  // a core the controller needs (docs/ARCHITECTURE.md section 6). rings(): how many so
  // far; wait_ring(seen, d) returns once rings() > seen, or after `d`. A transport
  // without one counts 0 and sleeps `d`.
  virtual std::uint64_t rings() const { return 0; }
  virtual void wait_ring(std::uint64_t seen, std::chrono::microseconds d);

 protected:
  virtual void do_send(const std::vector<int>& dests, Tag tag, std::shared_ptr<const Bytes> bytes) = 0;
  virtual bool do_try_receive(int source, Tag tag, Bytes& out, int* from) = 0;

 private:
  struct Counter {
    std::atomic<std::uint64_t> messages{0};
    std::atomic<std::uint64_t> bytes{0};
  };
  std::array<Counter, kNumMessageKinds> sent_{};
  std::array<Counter, kNumMessageKinds> received_{};
};

// Everything every transport of this process has sent and received (on rank 0 with a
// worker, the controller's and worker 0's together): what the worker's state query
// reports, since a rank's worker loop, watch thread and restarts each have a transport.
ControlTraffic process_traffic();

// The transport over MPI on `comm` (a communicator of its own: the tags are its only
// users), received with matched probes so several threads of a process can share it.
std::shared_ptr<Transport> mpi_transport(MPI_Comm comm);

// The start-up handshake on the control communicator: every rank sends rank 0 its
// protocol::Handshake (or why it cannot run); rank 0 compares them and broadcasts the
// verdict, so all ranks fail the start together, naming the culprits. Collective: every
// rank of `control` calls it.
// Throws meshrt::Error on every rank when a rank cannot run or the ranks run different
// builds (meshrt version, protocol version or function table). `provided` is the MPI
// thread level granted; `dedicated_controller`: rank 0 runs no worker.
void handshake(MPI_Comm control, int provided, bool dedicated_controller);

// The transport inside one process, for tests: a MemoryNetwork holds one mailbox per
// (rank, tag), and each endpoint() is the transport of one rank. A controller and a
// worker meet through it with no mpiexec, as they meet through the MPI transport
// otherwise (rank 0 may be both, as in a real job: the tags keep their messages apart).
// Thread-safe: a worker's loop and a scripted controller may run on two threads.
class MemoryNetwork : public std::enable_shared_from_this<MemoryNetwork> {
 public:
  static std::shared_ptr<MemoryNetwork> create() { return std::shared_ptr<MemoryNetwork>(new MemoryNetwork()); }

  // The transport of `rank`; endpoints of one rank share its mailboxes.
  std::shared_ptr<Transport> endpoint(int rank);

  // For a test that plays one side: waits up to `timeout` for a message to `rank` with
  // `tag`; nullopt when none came. The message's sender goes to `from`.
  std::optional<Bytes> wait_for(int rank, Tag tag, std::chrono::duration<double> timeout, int* from = nullptr);
  // How many messages wait for `rank` with `tag`.
  std::size_t waiting(int rank, Tag tag) const;

 private:
  MemoryNetwork() = default;
  friend class MemoryEndpoint;
  struct Message {
    int from;
    std::shared_ptr<const Bytes> bytes;
  };
  void post(int from, const std::vector<int>& dests, Tag tag, const std::shared_ptr<const Bytes>& bytes);
  bool take(int rank, int source, Tag tag, Bytes& out, int* from);

  mutable std::mutex mutex_;
  std::condition_variable posted_;
  std::map<std::pair<int, Tag>, std::deque<Message>> boxes_;
};

}  // namespace meshrt::control
