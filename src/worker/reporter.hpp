// What a worker tells the controller, and when (docs/ARCHITECTURE.md sections 3.3 and 8):
// replies in an order that never claims past a fetch whose value is still copying, Status
// when the worker moved, and with the status tree its subtree's minimum through its parent.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "meshrt/device.hpp"
#include "meshrt/internal/control.hpp"
#include "meshrt/internal/device.hpp"
#include "meshrt/internal/protocol.hpp"
#include "meshrt/internal/worker.hpp"

namespace meshrt::detail {

class Backoff;
class Env;
class Monitor;

// An invocation whose device work is still in flight (Reporter::poll finishes it once
// every event completed): a device fetch's copies to the host (its FetchResult goes then),
// or a call's host tasks (docs/ARCHITECTURE.md section 7: a task's exception fails the call,
// whose outputs and mutated inputs are re-marked then). Status claims nothing from it on.
struct PendingWork {
  protocol::Ident ident = 0;
  std::string function;
  std::vector<Ref> mutates;
  Value value;  // a fetch: device leaves already replaced by their pinned host copies
  std::vector<std::pair<device::Event, device::Stream>> copies;  // the events to wait for
  bool is_call = false;                                          // no FetchResult
  std::vector<Ref> results;                                      // a call's outputs
  std::uint64_t seq = 0;                                         // a call's flight-recorder entry, finished here
  std::shared_ptr<device::TaskFailures> tasks;                   // the host tasks' errors
};

// The status tree seen from one rank (section 8): instead of its own Status, a rank reports
// the minimum first-uncompleted ident of its subtree to its parent, once the subtree has
// passed the last RequestStatus it ran (every worker gets it, so every node answers it
// once), and about once a second when the minimum moved; not at every move, which would
// triple the controller's receives per fetch. Failures and fetch results still go straight
// to the controller; as a report through a parent can overtake them (MPI orders per sender
// only), each report carries, per rank, the direct replies sent so far, and the controller
// holds a report until those have arrived.
class FanIn {
 public:
  FanIn(control::Transport& channel, const WorkerOptions& options);

  // A reply went straight to the controller.
  void counted_direct() { direct_unreported_[rank_] = ++direct_sent_; }
  // Takes the children's reports; false when there were none.
  bool receive();
  // The subtree's minimum, given this rank's own (0 below a child that has not reported).
  protocol::Ident subtree_min(protocol::Ident own) const;
  // A RequestStatus(ident) ran here: answered up once the whole subtree passed it.
  void ask(protocol::Ident ident);
  // Whether the subtree still owes the answer to the last RequestStatus.
  bool owes(protocol::Ident own) const { return ask_pending_ && subtree_min(own) <= asked_; }
  // Reports the subtree's minimum when it answers the last ask, or on the timer when it
  // moved; true when a report went.
  bool report_up(protocol::Ident own, bool timer);

 private:
  control::Transport& channel_;
  int rank_;
  std::uint32_t epoch_;
  int parent_;  // a worker rank, or kStatusToController
  control::Tag tag_;
  // Per child, the minimum its subtree last reported (0 until it reports: nothing below a
  // silent child counts as complete). Fresh each session.
  std::vector<std::pair<int, protocol::Ident>> child_min_;
  std::map<int, std::uint64_t> direct_unreported_;  // (rank, direct replies sent) not yet passed up
  std::uint64_t direct_sent_ = 0;
  protocol::Ident asked_ = 0;  // the highest RequestStatus this rank ran
  bool ask_pending_ = false;   // not yet answered up the tree
  protocol::Ident last_sent_ = 0;
  control::Bytes rx_;
};

class Reporter {
 public:
  using Clock = std::chrono::steady_clock;

  Reporter(control::Transport& channel, Monitor& monitor, const WorkerOptions& options);

  // Sends `r` now, or behind the fetches still copying: the controller counts a FetchResult
  // or a failure for ident i as "everything up to i done on this rank", so nothing that
  // names a later ident may overtake a fetch's result.
  void reply(const protocol::Reply& r);
  // A fetch's result: sent when its copies are done (at once without any). It counts as
  // this rank's report up to the fetch: no Status needs to follow it.
  void fetched(PendingWork&& fetch);
  // A call whose host tasks are still on their stream: it completes (or fails) when they
  // have run.
  void call_pending(PendingWork&& call);
  // Sends what is ready at the head of the held replies, in order; true when something
  // went. A fetch whose copy failed re-marks what it mutates in `env`.
  bool poll(Env& env);
  bool holding() const noexcept { return !outgoing_.empty(); }

  // Everything before `ident` is done on this rank (an invocation, Reduce or SendTensor ran),
  // except an ident held back.
  void passed(protocol::Ident ident);
  // The Reduce or SendTensor `ident` is in flight while later commands run: Status claims
  // nothing from it on until passed(ident).
  void hold(protocol::Ident ident) noexcept { held_ = ident; }
  // A RequestStatus(ident): answered at once, or with the status tree once the subtree
  // passed it.
  void asked(protocol::Ident ident, std::size_t live_values);
  // What Status may claim: never past a fetch whose result has not been sent (section 3.3:
  // the fetch's value must be there when it completes).
  protocol::Ident reportable() const;

  // Whether the status interval passed since the last report.
  bool due() const { return Clock::now() - last_status_time_ > interval_; }
  // The loop's report at the end of a turn: Status when the worker `moved_and_idle` or the
  // interval passed; with the status tree, the children's reports taken and the subtree's
  // passed up when due.
  bool receive_tree() { return tree_ && tree_->receive(); }
  void report(bool moved_and_idle, std::size_t live_values);
  // At Exit: sends the held replies as their copies finish, the last Status, and with the
  // status tree waits until the subtree answered the last RequestStatus.
  void finish(Env& env, Backoff& backoff);

 private:
  // Longest error text a failure carries (a kernel's exception may say more).
  static constexpr std::size_t kMaxErrorBytes = std::size_t{1} << 20;
  // Sends `r` to the controller; a fetch result the control plane refuses goes as that
  // fetch's failure.
  void send(const protocol::Reply& r);
  void send_status(bool force, std::size_t live_values);
  // Sends a held fetch's result (or its failure) once its copies completed; false while
  // one is still in flight.
  bool finish(PendingWork& w, Env& env);

  control::Transport& channel_;
  Monitor& monitor_;
  int rank_;
  std::chrono::duration<double> interval_;
  std::deque<std::variant<PendingWork, protocol::Reply>> outgoing_;
  protocol::Ident first_uncompleted_ = 0;
  protocol::Ident held_ = 0;  // 0: none
  protocol::Ident last_status_sent_ = 0;
  Clock::time_point last_status_time_ = Clock::now();
  std::optional<FanIn> tree_;
};

}  // namespace meshrt::detail
