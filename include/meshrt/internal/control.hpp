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
#include <string>
#include <utility>
#include <vector>

#include "meshrt/error.hpp"
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
  // Fan-in: a child's protocol::TreeStatus to its parent worker, on one of two tags by the
  // parity of the workers' session, so a parent never takes a report that a child's next
  // session sent before the parent's own loop restarted (it waits for the next loop),
  // and drops one its child's previous session left behind (older epoch). Not Reply:
  // rank 0's controller takes every Reply sent to rank 0, and worker 0 may be a parent.
  TreeStatusEven = 105,
  TreeStatusOdd = 106,
};

inline constexpr int kControllerRank = 0;
inline constexpr int kAnySource = -1;  // try_receive from whichever rank sent first

constexpr MessageKind kind_of(Tag tag) noexcept {
  // A tree report goes up like a reply, to a worker instead of the controller.
  if (tag == Tag::TreeStatusEven || tag == Tag::TreeStatusOdd) return MessageKind::Reply;
  return static_cast<MessageKind>(static_cast<int>(tag) - static_cast<int>(Tag::Command));
}

constexpr Tag tree_status_tag(std::uint32_t epoch) noexcept {
  return epoch % 2 == 0 ? Tag::TreeStatusEven : Tag::TreeStatusOdd;
}

// The status tree of a job (fan-in, docs/ARCHITECTURE.md section 8): a fixed k-ary tree
// over the worker ranks in order, of the same shape as the fan-out tree of a batch to
// all of them. A node reports the minimum first-uncompleted ident of its subtree to its
// parent; the top nodes (the first k) report to the controller. Used when fan-out is on
// (k > 0) and there are more workers than the fan-out threshold; below it every worker
// sends Status to the controller itself.
class StatusTree {
 public:
  // nullopt where the job reports flat.
  static std::optional<StatusTree> for_job(const std::vector<int>& workers, std::size_t fanout, std::size_t threshold);
  StatusTree(std::vector<int> workers, std::size_t fanout);

  std::size_t fanout() const noexcept { return fanout_; }
  const std::vector<int>& ranks() const noexcept { return ranks_; }
  bool contains(int rank) const { return position_.count(rank) > 0; }
  // The rank `rank` reports to: kControllerRank for a top node.
  int parent(int rank) const;
  bool is_top(int rank) const;
  std::vector<int> children(int rank) const;
  // `rank` and every rank below it, in tree order.
  std::vector<int> subtree(int rank) const;
  // The path from the top node down to `rank` (its ancestors, top first; empty for a top node).
  std::vector<int> ancestors(int rank) const;
  std::vector<int> top() const;

 private:
  std::size_t position(int rank) const;
  std::vector<int> ranks_;
  std::size_t fanout_;
  std::map<int, std::size_t> position_;
};

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

  // Messages a process sends to itself ring a doorbell per tag (docs/ARCHITECTURE.md
  // section 6), for the two threads that share rank 0:
  // - Tag::Command (the controller to worker 0): that worker sleeps until its next
  //   command instead of polling a core the controller needs;
  // - Tag::Reply (worker 0 to the controller): a controller waiting on worker 0 sleeps
  //   until that worker has said something instead of polling beside it.
  // rings(tag): how many so far; wait_ring(tag, seen, d) returns once rings(tag) > seen,
  // or after `d`. A transport without doorbells (has_doorbells() false) counts 0 and
  // sleeps `d`.
  virtual bool has_doorbells() const { return false; }
  virtual std::uint64_t rings(Tag tag) const {
    (void)tag;
    return 0;
  }
  virtual void wait_ring(Tag tag, std::uint64_t seen, std::chrono::microseconds d);

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
// When a rank cannot run or the ranks run different builds (meshrt version, protocol
// version or function table), prints the verdict on rank 0 and throws StartupError on
// every rank. `provided` is the MPI thread level granted; `dedicated_controller`: rank 0
// runs no worker.
void handshake(MPI_Comm control, int provided, bool dedicated_controller);

// The outcome of one step of the start (settings, logging, device placement, ...),
// agreed by the whole job: every rank passes what went wrong in the step on this rank
// (empty when nothing did). Rank 0 gathers them and, when any rank failed, prints each
// distinct message once with the ranks that hit it ("on every rank" when all did the
// same), then every rank throws StartupError with that text. Collective: every rank of
// `comm` calls it after the same step, failed or not, so a rank that gave up early
// never leaves its peers waiting; the step itself must make no collective call after
// its first chance to throw.
void agree_on_start(MPI_Comm comm, const std::string& local_error);

// A start-up failure every rank raises with the same text (the handshake's verdict or
// agree_on_start's, decided on rank 0, printed there once for the job, then broadcast):
// run() does not print it again.
class StartupError : public Error {
 public:
  using Error::Error;
};

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
