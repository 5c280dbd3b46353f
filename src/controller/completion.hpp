// The completion rule (docs/ARCHITECTURE.md section 3.3): an invocation is complete when every worker
// it was sent to has reported a first uncompleted ident past it. The tracker keeps, per
// worker, the idents sent to it and not yet reported, so the frontier (every ident at or
// below it is complete everywhere) is the smallest outstanding ident less one. Pure
// bookkeeping: no MPI, no transport, no threads; the controller feeds it what it sends
// and what the replies say.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "controller/words.hpp"
#include "meshrt/call_site.hpp"
#include "meshrt/internal/protocol.hpp"

namespace meshrt::detail {

using protocol::Ident;

class CompletionTracker {
 public:
  explicit CompletionTracker(const std::vector<int>& workers);

  // A fresh ident; `label` names the runtime's own invocations ("synchronize") in reports.
  Ident new_ident(const char* label = nullptr);
  // What an outstanding ident runs, for reports (forgotten once it is complete).
  void describe(Ident ident, const Words& what, const CallSite& where, const CallSite& replayed_at = {});
  std::string describe_ident(Ident ident) const;
  bool described(Ident ident) const { return info(ident) != nullptr; }
  // What `ident` runs and where it was issued ("file:line (function)"), while it is
  // outstanding; empty when not known.
  std::string what_of(Ident ident) const;
  std::string site_of(Ident ident) const;

  // `ident` was sent to every rank in `dests`.
  void sent(const std::vector<int>& dests, Ident ident);
  // `rank` reported every ident below `before` complete.
  void completed(int rank, Ident before);
  void status(int rank, const protocol::Status& status);
  // Every ident <= the returned one is complete on every worker it was sent to.
  Ident frontier() const;
  // The workers that have not reported past `ident` and were not asked about it yet;
  // they count as asked from now on. Unless `idle_too`, only those with later work
  // queued behind `ident`: a worker reports by itself the moment it runs out of work, so
  // asking one whose last command is `ident` only doubles the messages of a fetch.
  std::vector<int> to_ask(Ident ident, bool idle_too = true);
  // The workers that have not reported past `ident`.
  std::vector<int> missing(Ident ident) const;
  // Whether `rank` has yet to report `ident` done (false for a rank with no worker).
  bool owes(int rank, Ident ident) const;
  // The newest ident at or below `ident` sent to `rank` and not reported complete (0 if
  // none): a worker whose own first uncompleted ident is past it has finished `ident`'s share.
  Ident newest_owed(int rank, Ident ident) const;
  // One line per lagging worker: the ident it has not reported and what that runs.
  std::string lagging_report(Ident ident) const;
  // Forgets the descriptions of complete idents (a long program keeps only what runs).
  void forget_complete();

  std::uint64_t live_values(int rank) const;  // throws UsageError for a rank with no worker
  std::size_t outstanding(int rank) const;

  // Restart: the workers answer Exit{restart} with Restarted, each once.
  void expect_restart() { restarted_ = 0; }
  void worker_restarted() { ++restarted_; }
  bool all_restarted() const { return restarted_ >= static_cast<int>(workers_.size()); }
  // After a restart nothing sent before it is outstanding.
  void restart();

  // Fan-in (docs/ARCHITECTURE.md section 8): the status tree's top nodes and, for each,
  // every rank of its subtree (control::StatusTree). Without it every worker reports
  // Status itself.
  void use_tree(std::map<int, std::vector<int>> subtrees);
  bool has_tree() const noexcept { return !subtrees_.empty(); }
  // A failure or fetch result from `rank` arrived: those travel outside the tree.
  void direct_reply(int rank);
  // A top node's report for its subtree, applied to every rank of it (each rank's own
  // first uncompleted ident is at least the subtree's minimum, so the completion rule
  // holds) once every direct reply it counts has arrived; held until then, in order, so
  // no Status past a failure is applied before the failure.
  void tree_status(int node, protocol::TreeStatus report);
  // Reports held for direct replies still on their way (for the desync report).
  std::size_t held_reports() const noexcept { return held_count_; }

 private:
  struct Worker {
    Ident reported = 0;             // latest first_uncompleted_ident
    std::deque<Ident> outstanding;  // idents sent to it, not yet reported complete
    Ident status_requested = 0;     // the highest RequestStatus sent to it
    std::uint64_t live_values = 0;
    // Whether it has yet to report `ident` done.
    bool owes(Ident ident) const { return !outstanding.empty() && outstanding.front() <= ident; }
  };
  struct IdentInfo {
    Words what;  // the function's name, or empty
    CallSite where{};
    CallSite replayed_at{};  // line 0: not run by a replay
    const char* label = nullptr;
  };
  const IdentInfo* info(Ident ident) const;
  IdentInfo* info(Ident ident) { return const_cast<IdentInfo*>(std::as_const(*this).info(ident)); }

  std::map<int, Worker> workers_;
  Ident next_ident_ = 1;
  // Idents are dense: what_[i] describes ident first_described_ + i (one push per
  // invocation, pops from the front as they complete: cheaper per call than a map).
  std::deque<IdentInfo> what_;
  Ident first_described_ = 1;
  int restarted_ = 0;
  // Fan-in: top node -> its subtree; per rank, direct replies received; held reports.
  bool ready(const protocol::TreeStatus& report) const;
  void apply_held(int node);
  std::map<int, std::vector<int>> subtrees_;
  std::map<int, std::uint64_t> direct_received_;
  std::map<int, std::deque<protocol::TreeStatus>> held_;
  std::size_t held_count_ = 0;
};

}  // namespace meshrt::detail
