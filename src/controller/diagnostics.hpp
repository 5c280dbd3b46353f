// What the controller can say about the workers when something is wrong: it asks every
// worker's watch thread (answered even while a worker is stuck) for its state or its
// flight recorder, writes the desync report of a timeout (who waits for whom), and
// aborts the job. It sends through the Batcher and reads the CompletionTracker's
// descriptions of outstanding invocations; it keeps no state of its own but the query id.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "meshrt/internal/protocol.hpp"

namespace meshrt::control {
class StatusTree;
}

namespace meshrt::detail {

class Batcher;
class CompletionTracker;

// A timeout's desync report, and what it says about the invocation that did not complete:
// the ranks behind it (inside a command of their own, silent, or without it yet) and the
// ranks only waiting for them in a collective, from the workers' own answers.
struct DesyncReport {
  // "rank 2 is behind: running my.slow (invocation 5) for 3 s; ranks 0, 1, 3 are waiting
  // for it in reduce sum over 'x' (invocation 6)"
  std::string summary;
  std::vector<int> behind;  // TimeoutError::missing_ranks()
  std::string table;        // what every worker is doing now, one row per rank
  std::string dumps;        // the end of every worker's flight recorder, in rank order
};

// A desync table's "current command": the command's kind and the controller's description
// of its invocation, the kind left out when the description starts with it in other case
// ("Reduce" + "reduce sum over 'x'" -> "reduce sum over 'x'").
std::string command_words(std::string_view kind, std::string_view description);

class Diagnostics {
 public:
  Diagnostics(Batcher& batcher, const CompletionTracker& tracker, std::vector<int> workers);

  // Asks every worker; the answers by rank. Ranks that do not answer within `timeout`
  // are missing; answers to older queries are dropped.
  std::map<int, protocol::QueryAnswer> query(protocol::Query query, std::chrono::duration<double> timeout);
  // For a timeout of `ident` (`what`: "fetch (invocation 7) did not complete within 3 s"):
  // asks every worker for its state and says who is behind and who waits for whom.
  DesyncReport desync_report(protocol::Ident ident, const std::string& what);
  // Every worker's flight recorder, in rank order (Controller::dump_flight_recorder).
  std::string dump_flight_recorder();
  // Every rank's timeline so far, written to `path` (Controller::write_trace); the events
  // written.
  std::uint64_t write_trace(const std::string& path);
  // Every rank starts (true) or stops recording its timeline (Controller::start_trace).
  void switch_trace(bool on);
  [[noreturn]] void abort_job(const std::string& reason);
  // Fan-in: the job's status tree (owned by the ControllerState), so the report can say
  // which ranks a stuck worker cuts off.
  void use_tree(const control::StatusTree* tree) { tree_ = tree; }

 private:
  const control::StatusTree* tree_ = nullptr;
  Batcher& batcher_;
  const CompletionTracker& tracker_;
  std::vector<int> workers_;
  std::uint64_t next_query_ = 1;
};

}  // namespace meshrt::detail
