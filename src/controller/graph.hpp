// The dependency graph (docs/ARCHITECTURE.md section 3.4): what every value was computed from, so a
// failure on a worker surfaces where the program uses a value that depends on it, with
// the root cause (the failed invocation with the smallest ident) and the chain to it.
// Nodes are settled (clean or poisoned) as the frontier passes them, and clean ones drop
// their inputs, so the graph stays as small as the work in flight. Pure: the frontier is
// an argument, not a dependency on the completion tracker.
#pragma once

#include <cstdint>
#include <deque>
#include <exception>
#include <initializer_list>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "controller/words.hpp"
#include "meshrt/call_site.hpp"
#include "meshrt/internal/protocol.hpp"

namespace meshrt::detail {

using protocol::Ident;

// One step in the dependency graph: an invocation (it has an ident) or a value derived
// from others without one (a reduction, a send, a borrow).
struct Node {
  Ident ident = 0;
  Words what;              // "meshrt.fail", "reduce sum over 'gpu'", "fetch"
  CallSite where;          // the controller call that issued it (formatted only for errors)
  CallSite replayed_at{};  // the replay that ran it, when `where` is in a recorded function
  std::string issued_at() const;
  std::vector<std::shared_ptr<Node>> inputs;
  bool clean = false;     // known complete without failure: inputs dropped
  bool poisoned = false;  // known to depend on a failure: inputs kept for the error's chain
  // Once poisoned: the failed invocation it depends on and how many links lead there, so
  // finding the cause of a long chain (a loop on a poisoned value) takes no walk.
  Ident cause = 0;
  std::uint64_t links = 0;
};

struct Failure {
  std::string function;
  std::string message;
  std::string exception_type;
  std::set<int> ranks;
  std::string what;       // the controller's name of the command ("reduce sum over 'gpu'"), or empty
  std::string issued_at;  // "file:line (function)" of the call that issued it, or empty
  bool observed = false;  // raised to the program already
  // "meshrt.fail failed on ranks 1, 2 (invocation 3, issued at x.cpp:9 (main)): boom"
  std::string describe(Ident ident) const;
};

class DependencyGraph {
 public:
  // A node for `ident` (0: none) computed from `inputs`; inputs known clean are dropped.
  std::shared_ptr<Node> make_node(Ident ident, Words what, const CallSite& where,
                                  std::span<const std::shared_ptr<Node>> inputs);
  // The same for the inputs in braces at a call site, with no vector to allocate for them.
  std::shared_ptr<Node> make_node(Ident ident, Words what, const CallSite& where,
                                  std::initializer_list<std::shared_ptr<Node>> inputs) {
    return make_node(ident, std::move(what), where, std::span(inputs.begin(), inputs.size()));
  }
  // True once every 1024 nodes: a program that never waits still gets its graph pruned.
  bool prune_due();
  // Settles the oldest nodes whose idents are at or below `done` (the frontier).
  void prune(Ident done);
  std::size_t unsettled() const { return young_.size(); }

  // A worker reported a failure (ident 0: one outside any invocation, an entry of its
  // own); `what` and `issued_at` name the command and its call site when the controller
  // knows them.
  void record_failure(const protocol::RemoteFunctionFailed& failure, std::string what = {}, std::string issued_at = {});
  const std::map<Ident, Failure>& failures() const { return failures_; }
  // How many links of a chain an error names before it summarises the rest.
  static constexpr std::size_t kChainLinks = 5;

  // The failure `node` depends on (smallest ident) as a RemoteError naming the chain, or
  // null when nothing reachable failed; `done` is the frontier, used to prune what is
  // found clean.
  std::exception_ptr failure_of(const std::shared_ptr<Node>& node, const Subject& subject, Ident done);
  // Every failure not raised yet, as one RemoteError whose root is the first (failures
  // outside an invocation first, then by ident) and whose text counts and lists the
  // others; all are marked raised. `more` receives how many others there were. Null
  // when there are none.
  std::exception_ptr take_unobserved(int* more);

 private:
  // Nodes not yet known clean or poisoned, oldest first.
  std::deque<std::weak_ptr<Node>> young_;
  std::size_t since_prune_ = 0;
  std::map<Ident, Failure> failures_;
  std::vector<Failure> outside_;  // failures outside any invocation, in arrival order
};

}  // namespace meshrt::detail
