// The controller's internal state (shared by controller.cpp and runtime.cpp).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <source_location>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "meshrt/controller.hpp"
#include "meshrt/protocol.hpp"
#include "worker/channel.hpp"

namespace meshrt::detail {

using protocol::Ident;

// One step in the dependency graph: an invocation (it has an ident) or a value derived
// from others without one (a reduction, a send, a borrow).
struct Node {
  Ident ident = 0;
  std::string what;            // "meshrt.fail", "reduce sum over 'gpu'", "fetch"
  std::source_location where;  // the controller call that issued it (formatted only for errors)
  std::string issued_at() const;
  std::vector<std::shared_ptr<Node>> inputs;
  bool clean = false;     // known complete without failure: inputs dropped
  bool poisoned = false;  // known to depend on a failure: inputs kept for the error's chain
};

struct Failure {
  std::string function;
  std::string message;
  std::string exception_type;
  std::set<int> ranks;
  bool observed = false;
};

struct MeshState {
  std::weak_ptr<ControllerState> controller;
  std::uint64_t epoch = 0;
  Ref ref;
  std::vector<std::string> names;
  NDSlice ranks = NDSlice::row_major({});
  Device::Kind kind = Device::Kind::Cpu;  // what it is placed on; slices keep it
  std::vector<int> dests;                 // ranks as a sorted list
  bool created = false;
  std::int64_t dim_index(std::string_view dim) const;  // throws UsageError naming the dims
};

struct StreamState {
  std::weak_ptr<ControllerState> controller;
  std::uint64_t epoch = 0;
  Ref ref;
  std::string name;
  bool is_default = false;
  bool created = false;
};

struct TensorState {
  ~TensorState();
  std::weak_ptr<ControllerState> controller;
  std::uint64_t epoch = 0;
  Ref ref;
  TensorMeta meta;
  std::shared_ptr<MeshState> home;  // the mesh whose ranks hold the value
  std::shared_ptr<StreamState> stream;
  std::shared_ptr<Node> node;
  // Borrows of this tensor that are active, and whether one of them is mutable.
  int active_borrows = 0;
  bool mutably_borrowed = false;
  std::string borrowed_by;  // the stream name of the mutable borrow
  // When this tensor is itself a borrow:
  std::shared_ptr<TensorState> origin;
  bool borrow_mutable = false;
  bool first_use_sent = false;
  bool dropped = false;
};

struct FutureState {
  std::weak_ptr<ControllerState> controller;
  Ident ident = 0;
  int rank = -1;
  std::shared_ptr<Node> node;
  std::optional<Value> value;
  bool finished = false;
  std::exception_ptr error;
};

struct WorkerTrack {
  Ident reported = 0;             // latest first_uncompleted_ident
  std::deque<Ident> outstanding;  // idents sent to it, not yet reported complete
  Ident status_requested = 0;     // the highest RequestStatus sent to it
  std::uint64_t live_values = 0;
};

struct ControllerState : std::enable_shared_from_this<ControllerState> {
  ControllerState(MPI_Comm control, int world_size, NDSlice workers);
  ~ControllerState();

  Channel channel;
  int world_size;
  NDSlice worker_ranks;
  std::vector<int> all_dests;
  std::uint64_t epoch = 1;
  std::uint64_t next_ref = 1;
  Ident next_ident = 1;
  std::map<int, WorkerTrack> workers;
  std::map<Ident, Failure> failures;
  // Outstanding invocations, for timeout reports: the node, or a label for the runtime's own.
  struct IdentInfo {
    std::string what;  // the function's name (short: no allocation), or empty
    std::source_location where{};
    const char* label = nullptr;
  };
  std::map<Ident, IdentInfo> ident_what;
  std::string describe_ident(Ident ident) const;
  std::unordered_map<Ident, std::weak_ptr<FutureState>> fetches;
  std::map<std::string, std::shared_ptr<StreamState>> streams;
  // Nodes not yet known clean or poisoned, oldest first. prune() settles them as the
  // workers report progress, so a long-running program's graph stays as small as the
  // work in flight.
  std::deque<std::weak_ptr<Node>> young_nodes;
  std::size_t nodes_since_prune = 0;
  void prune();
  int restarted = 0;

  // The batch being built: consecutive commands for the same ranks.
  std::vector<int> batch_dests;
  std::vector<protocol::Command> batch;
  std::size_t batch_limit = 256;
  std::chrono::steady_clock::time_point batch_started;
  std::chrono::duration<double> batch_time_limit{0.002};
  // A batch the program leaves alone is sent by the flusher thread after the time bound,
  // so workers start while the controller does something else.
  std::mutex batch_mutex;
  std::atomic<bool> stop_flusher{false};
  std::thread flusher;
  void flush_locked();
  // Work that handle destructors leave for the next command: deletes per rank set, and
  // borrows dropped implicitly.
  std::map<std::vector<int>, std::vector<Ref>> pending_deletes;
  std::size_t pending_delete_count = 0;
  std::vector<std::pair<std::vector<int>, Ref>> pending_drops;

  Ref new_ref() { return Ref{next_ref++}; }
  Ident new_ident(const char* label = nullptr) {
    const Ident i = next_ident++;
    ident_what.emplace(i, IdentInfo{{}, {}, label});
    return i;
  }

  // Queues `c` for `dests`, flushing the batch first if it was for other ranks.
  // `ident`, when non-zero, is recorded as outstanding on every destination.
  void append(const std::vector<int>& dests, protocol::Command c, Ident ident = 0);
  void flush();
  void flush_deferred();
  void poll_replies();
  // Every ident <= the returned one is complete on every worker it was sent to.
  Ident frontier() const;
  // Sends RequestStatus(ident) to the workers that have not reported past `ident`.
  void request_status(Ident ident);
  // Waits until frontier() >= ident; throws TimeoutError after `timeout`.
  void wait_for(Ident ident, std::optional<std::chrono::duration<double>> timeout, const std::string& what);
  std::string lagging_report(Ident ident) const;

  // Out-of-band queries to every worker's watch thread (answered even while a worker is
  // stuck): the answers by rank; ranks that do not answer within `timeout` are missing.
  std::map<int, nlohmann::json> query(nlohmann::json request, std::chrono::duration<double> timeout);
  // The table of what every worker is doing, for a timeout.
  std::string desync_report(const std::string& what);
  [[noreturn]] void abort_job(const std::string& reason);
  std::uint64_t next_query = 1;

  // The failure a node depends on (smallest ident), with the chain to it; nullopt when clean.
  std::exception_ptr failure_of(const std::shared_ptr<Node>& node, const std::string& subject);
  std::shared_ptr<StreamState> stream(const std::string& name);
  void ensure_mesh(MeshState& mesh);
  void ensure_stream(StreamState& stream);
  std::shared_ptr<Node> make_node(Ident ident, std::string what, const std::source_location& where,
                                  std::vector<std::shared_ptr<Node>> inputs);
  void check_epoch(std::uint64_t e, std::string_view what) const;
};

std::string describe(const std::source_location& where);
std::vector<int> to_dests(const NDSlice& slice);

}  // namespace meshrt::detail
