// What the flight recorder (worker/monitor.hpp) shows of a worker's commands: each
// command's fields as it is queued, and for a collective or send the words of what it does
// and its peers. A loop of the same few collectives (a step's sum and average) or the same
// send reuses the words of the first: formatting them per command would cost as much as
// the rest of the worker's part in a small collective.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "meshrt/internal/comm.hpp"
#include "meshrt/internal/protocol.hpp"
#include "meshrt/ndslice.hpp"
#include "worker/monitor.hpp"

namespace meshrt::detail {

// Writes what the flight recorder shows of a queued command into its slot (cleared).
void record(const protocol::Command& command, CommandRecord& slot);

// The world ranks that `rank` exchanges with in send `s`.
std::vector<int> peers_of(const protocol::SendTensor& s, int rank);

class CollectiveWords {
 public:
  // Before a Reduce is posted: this rank may block in the first use of the dimension's
  // communicator, which needs every member of the mesh ("joining"). Once the same
  // collective ran before, its communicator exists: it is described as running from the
  // start.
  void posting(Monitor& monitor, std::uint64_t seq, const protocol::Reduce& c, const WorkerMesh& mesh);
  // Once it is posted (`op` in flight): the first time, the words of what it runs and its peers.
  void posted(Monitor& monitor, std::uint64_t seq, const protocol::Reduce& c, const Pending& op,
              const WorkerMesh& mesh);
  // The same for a Collective (not cached: not the 8-byte hot path's command).
  void posting(Monitor& monitor, std::uint64_t seq, const protocol::Collective& c, const WorkerMesh& mesh);
  void posted(Monitor& monitor, std::uint64_t seq, const protocol::Collective& c, const Pending& op,
              const WorkerMesh& mesh);
  // The same for a SendTensor on `rank`.
  void posting(Monitor& monitor, std::uint64_t seq, const protocol::SendTensor& c, int rank);
  void posted(Monitor& monitor, std::uint64_t seq, const protocol::SendTensor& c, const Pending& op, int rank);

 private:
  // The last few Reduces' words, each reused while a later one matches it.
  struct ReduceWords {
    std::uint64_t mesh = 0;
    std::string dim;
    Reduction reduction = Reduction::Sum;
    bool scatter = false, inplace = false;
    std::uint64_t bytes = 0;
    Device::Kind kind = Device::Kind::Cpu;
    std::string joining, running;  // before and after the collective is posted
    std::vector<int> members, peers;
    bool matches(const protocol::Reduce& c) const;
  };
  // The last SendTensor's words and peers.
  struct SendWords {
    NDSlice from = NDSlice::row_major({}), to = NDSlice::row_major({});
    std::vector<std::int64_t> order;
    std::vector<std::int64_t> sources;
    std::uint64_t bytes = 0;
    Device::Kind kind = Device::Kind::Cpu;
    std::string running;  // set once the send is posted
    std::vector<int> peers;
    bool matches(const protocol::SendTensor& c) const;
  };
  static constexpr std::size_t kReduceWords = 4;
  std::array<ReduceWords, kReduceWords> reduce_;
  std::size_t reduce_at_ = 0;    // the entry posting() chose for the Reduce being posted
  std::size_t reduce_next_ = 0;  // the entry the next new Reduce replaces
  SendWords send_;
};

}  // namespace meshrt::detail
