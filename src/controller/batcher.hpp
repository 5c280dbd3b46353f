// The controller's only door to the control transport. It batches consecutive commands
// for the same ranks into one CommandGroup frame (docs/ARCHITECTURE.md section 6: one message per
// batch, not per command), sends a batch the program leaves alone from its flusher
// thread after a time bound so workers start while the controller does something else,
// carries the deletes and borrow drops that handle destructors leave behind, and
// receives replies and query answers.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "meshrt/internal/control.hpp"
#include "meshrt/internal/protocol.hpp"

namespace meshrt::detail {

// The control plane's limit on one message: MPI counts its bytes in an int.
inline constexpr std::size_t kControlMessageLimit = 2147483647;
// Room in a message for what is not arguments: the other fields of a batch's commands,
// the batch's frame and a fan-out envelope's rank list.
inline constexpr std::size_t kCommandRoom = std::size_t{16} << 20;
// The bytes of arguments (host tensors, strings: protocol::encoded_size) one command, or
// one batch, may carry: kControlMessageLimit - kCommandRoom, unless a test lowered it
// (set_payload_limit in meshrt/internal/controller.hpp).
std::size_t payload_limit() noexcept;

class Batcher {
 public:
  explicit Batcher(std::shared_ptr<control::Transport> transport);
  ~Batcher();
  Batcher(const Batcher&) = delete;
  Batcher& operator=(const Batcher&) = delete;

  // Queues `c` for `dests`, flushing the batch first if it was for other ranks, or if
  // `payload` (the bytes of `c`'s arguments: host tensors, strings) would take the batch's
  // past payload_limit(). Raises, before queueing anything, the error of a batch the
  // flusher thread could not send (take_failure); a flush that fails here raises too,
  // with `c` not queued and the failed batch kept to be sent again.
  void append(const std::vector<int>& dests, protocol::Command&& c, std::size_t payload = 0);
  void flush();
  // Raises the error of a batch the flusher thread could not send (once; the batch stays
  // queued, sent again by the next flush), as an Error naming the batch.
  void take_failure();
  // Work for the next command to `dests` (safe from a handle's destructor: sends nothing).
  // The delete of a value of at most kSmallDeleteBytes (`value_bytes`; none for a mesh or
  // a stream, whose deletes ride with the next command) waits until
  // kSmallDeletes of them are pending for those ranks, or the next synchronize: freeing it
  // early gains nothing (malloc hands the worker warm memory at that size anyway), and
  // each delete riding on its own is a command for every worker to decode, queue and run
  // (an out-of-place 8 B collective in a loop sends one per call). At most 1 MiB per rank
  // set waits so, and 4096 deletes in all (append flushes them past that).
  void defer_delete(const std::vector<int>& dests, Ref ref, std::optional<std::size_t> value_bytes = std::nullopt);
  static constexpr std::size_t kSmallDeletes = 64;
  static constexpr std::size_t kSmallDeleteBytes = std::size_t{16} << 10;
  // Sends every deferred delete now, then flushes.
  void flush_deferred();

  // Takes one waiting reply (throws ProtocolError for an undecodable one).
  bool try_receive_reply(protocol::Reply& reply, int& from);
  void send_query(const std::vector<int>& dests, const protocol::Query& query);
  // Takes one waiting answer (throws ProtocolError for an undecodable one).
  bool try_receive_answer(protocol::QueryAnswer& answer, int& from);
  void reap();
  bool drain(std::chrono::duration<double> timeout);
  // How many times the flusher thread woke so far (tests: an idle one does not).
  std::uint64_t flusher_wakeups();

  // After a restart the workers have nothing to delete or drop.
  void restart();

  std::size_t batch_limit() const noexcept { return batch_limit_; }
  // Children per node of the fan-out tree (0: no envelopes, every rank hears the
  // controller) and the batch size above which the tree is used.
  std::size_t fanout() const noexcept { return fanout_; }
  std::size_t fanout_threshold() const noexcept { return fanout_threshold_; }
  // The controller's control messages so far, by kind.
  ControlTraffic traffic() const { return transport_->traffic(); }
  // The doorbell worker 0 rings with each reply it sends (control::Transport::rings).
  bool has_reply_doorbell() const { return transport_->has_doorbells(); }
  std::uint64_t reply_rings() const { return transport_->rings(control::Tag::Reply); }
  void wait_reply_ring(std::uint64_t seen, std::chrono::microseconds d) {
    transport_->wait_ring(control::Tag::Reply, seen, d);
  }

 private:
  void flush_locked();
  // Sends the encoded batch to batch_dests_, numbered (and enveloped) for the fan-out tree.
  void send_locked(std::shared_ptr<control::Bytes> bytes);
  // Moves the deferred deletes of `dests`, and of any sorted subset of them, into the batch.
  void ride_deletes(const std::vector<int>& dests);
  std::shared_ptr<control::Transport> transport_;
  control::Bytes rx_;
  // The batch being built: consecutive commands for the same ranks.
  std::vector<int> batch_dests_;
  std::vector<protocol::Command> batch_;
  std::size_t batch_limit_ = 256;
  std::chrono::steady_clock::time_point batch_started_;
  std::chrono::duration<double> batch_time_limit_{0.002};
  // MESHRT_FANOUT and MESHRT_FANOUT_THRESHOLD, read once.
  std::size_t fanout_ = 0;
  std::size_t fanout_threshold_ = 0;
  // Per rank, the number of the last command message sent to it (Envelope::seqs).
  std::unordered_map<int, std::uint64_t> sent_seq_;
  std::unordered_set<int> treed_;  // ranks that were sent a batch through the tree
  std::mutex mutex_;               // the batch, shared with the flusher thread
  // The flusher sleeps until a batch's deadline, or, with no batch, until append starts
  // one: it has no clock of its own, so it never wakes on the core the controller shares
  // with worker 0 (Open MPI binds rank 0 to it) in the middle of worker 0's collectives.
  // After a start's wake-up it waits for that batch's deadline even when the program has
  // flushed the batch by then (a fetch flushes at once): parking again would cost a
  // wake-up per batch. An idle controller (a long synchronize, the program's own work)
  // does not wake at all. Measured: docs/benchmarks.md, "Older figures".
  std::condition_variable flusher_wake_;
  bool flusher_parked_ = false;  // waiting for a batch to start, not for a deadline
  bool stop_flusher_ = false;
  std::uint64_t flusher_wakeups_ = 0;
  // What the flusher thread could not send (it raises nowhere: the controller's thread
  // raises it at its next call), and the bytes of arguments the batch holds.
  std::exception_ptr flusher_failure_;
  std::atomic<bool> failed_{false};  // flusher_failure_ is set (read without the lock)
  std::size_t batch_payload_ = 0;
  std::thread flusher_;
  // Work that handle destructors leave for the next command: deletes per rank set, and
  // borrows dropped implicitly.
  struct PendingDeletes {
    std::vector<Ref> refs;
    bool due = false;  // holds a delete that is not small: rides with the next command
    bool rides() const { return !refs.empty() && (due || refs.size() >= kSmallDeletes); }
  };
  // Empties `p` (its entry stays) and returns its refs, counted off pending_delete_count_.
  std::vector<Ref> take(PendingDeletes& p);
  std::map<std::vector<int>, PendingDeletes> pending_deletes_;
  std::size_t pending_delete_count_ = 0;
};

}  // namespace meshrt::detail
