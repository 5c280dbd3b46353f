// The control transport inside one process, for tests: a MemoryNetwork holds one mailbox
// per (rank, tag), and each endpoint() is the transport of one rank. A controller and a
// worker meet through it with no mpiexec, as they meet through MpiTransport otherwise
// (rank 0 may be both, as in a real job: the tags keep their messages apart).
// Thread-safe: a worker's loop and a scripted controller may run on two threads.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>

#include "control/transport.hpp"

namespace meshrt::control {

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
