#include "worker/reporter.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <memory>

#include "common/backoff.hpp"
#include "meshrt/error.hpp"
#include "meshrt/log.hpp"
#include "worker/env.hpp"
#include "worker/monitor.hpp"

namespace meshrt::detail {

using namespace protocol;

FanIn::FanIn(control::Transport& channel, const WorkerOptions& options)
    : channel_(channel),
      rank_(options.rank),
      epoch_(options.epoch),
      parent_(options.status_parent),
      tag_(control::tree_status_tag(options.epoch)) {
  for (int r : options.status_children) child_min_.emplace_back(r, 0);
}

bool FanIn::receive() {
  bool any = false;
  int from = -1;
  while (channel_.try_receive(control::kAnySource, tag_, rx_, &from)) {
    any = true;
    try {
      const Reply r = decode_reply(rx_);
      const auto* t = std::get_if<TreeStatus>(&r);
      if (t == nullptr) throw ProtocolError(fmt::format("expected a TreeStatus, found {}", name(r)));
      if (t->epoch != epoch_) continue;  // a child's earlier session: stale
      auto child =
          std::find_if(child_min_.begin(), child_min_.end(), [from](const auto& c) { return c.first == from; });
      if (child == child_min_.end()) {
        std::vector<int> children;
        for (const auto& [rank, min] : child_min_) children.push_back(rank);
        throw ProtocolError(fmt::format("rank {} reports to rank {}, which is not its parent (children: {})", from,
                                        rank_, fmt::join(children, ",")));
      }
      child->second = std::max(child->second, t->first_uncompleted_ident);
      for (std::size_t i = 0; i < t->direct_ranks.size(); ++i) {
        auto& c = direct_unreported_[t->direct_ranks[i]];
        c = std::max(c, t->direct_counts[i]);
      }
    } catch (const ProtocolError& e) {
      MESHRT_LOG(error) << "rank " << rank_ << ": dropped a status report from rank " << from << ": " << e.what();
    }
  }
  return any;
}

Ident FanIn::subtree_min(Ident own) const {
  Ident m = own;
  for (const auto& [rank, v] : child_min_) m = std::min(m, v);
  return m;
}

void FanIn::ask(Ident ident) {
  asked_ = std::max(asked_, ident);
  ask_pending_ = true;
}

bool FanIn::report_up(Ident own, bool timer) {
  const Ident m = subtree_min(own);
  if (ask_pending_ && m > asked_) {
    ask_pending_ = false;
  } else if (!(timer && m > last_sent_)) {
    return false;
  }
  TreeStatus t{.first_uncompleted_ident = m, .epoch = epoch_, .direct_ranks = {}, .direct_counts = {}};
  for (const auto& [rank, count] : direct_unreported_) {
    t.direct_ranks.push_back(rank);
    t.direct_counts.push_back(count);
  }
  direct_unreported_.clear();
  auto bytes = std::make_shared<control::Bytes>(encode(Reply{std::move(t)}));
  if (parent_ == kStatusToController) {
    channel_.send(control::kControllerRank, control::Tag::Reply, std::move(bytes));
  } else {
    channel_.send(parent_, tag_, std::move(bytes));
  }
  last_sent_ = m;
  return true;
}

Reporter::Reporter(control::Transport& channel, Monitor& monitor, const WorkerOptions& options)
    : channel_(channel), monitor_(monitor), rank_(options.rank), interval_(options.status_interval_seconds) {
  if (options.status_parent != kNoStatusTree) tree_.emplace(channel, options);
}

void Reporter::send(const Reply& r) {
  // An error's text is the user's (a kernel's exception): past kMaxErrorBytes it is cut,
  // so the reply fits the control plane's limit on one message.
  if (const auto* f = std::get_if<RemoteFunctionFailed>(&r); f && f->error.size() > kMaxErrorBytes) {
    RemoteFunctionFailed cut = *f;
    cut.error =
        fmt::format("{}... ({} more bytes)", f->error.substr(0, kMaxErrorBytes), f->error.size() - kMaxErrorBytes);
    return send(Reply{std::move(cut)});
  }
  try {
    auto bytes = std::make_shared<control::Bytes>(encode(r));
    channel_.send(control::kControllerRank, control::Tag::Reply, std::move(bytes));
  } catch (const std::exception& e) {
    // A fetch whose value the control plane refuses (a preprocess function's result over
    // its limit) fails that fetch: the controller waits for its ident, and this loop goes on.
    const auto* fetch = std::get_if<FetchResult>(&r);
    if (fetch == nullptr) throw;
    return send(RemoteFunctionFailed{
        .ident = fetch->ident,
        .error = fmt::format("fetch on rank {}: its value could not be sent to the controller: {}", rank_, e.what()),
        .rank = rank_,
        .function = "fetch",
        .exception_type = "meshrt::UsageError"});
  }
  // With the tree only failures and fetch results take this path.
  if (tree_) tree_->counted_direct();
}

void Reporter::reply(const Reply& r) {
  if (outgoing_.empty()) {
    send(r);
  } else {
    outgoing_.emplace_back(r);
  }
}

void Reporter::call_pending(PendingWork&& call) {
  outgoing_.emplace_back(std::move(call));
  monitor_.completed_ident(reportable());
}

void Reporter::fetched(PendingWork&& fetch) {
  const Ident ident = fetch.ident;
  if (fetch.copies.empty()) {
    reply(FetchResult{.ident = ident, .value = std::move(fetch.value)});
  } else {
    outgoing_.emplace_back(std::move(fetch));
  }
  last_status_sent_ = std::max(last_status_sent_, ident + 1);
}

bool Reporter::poll(Env& env) {
  bool moved = false;
  while (!outgoing_.empty()) {
    if (const auto* r = std::get_if<Reply>(&outgoing_.front())) {
      send(*r);
    } else if (!finish(*std::get_if<PendingWork>(&outgoing_.front()), env)) {
      break;
    }
    outgoing_.pop_front();
    moved = true;
  }
  if (moved) monitor_.completed_ident(reportable());
  return moved;
}

// A failed host task fails its call (or a fetch's preprocess) with the task's message; a
// faulted stream fails a fetch with the device's message, as the copy's value cannot be
// trusted (the worker ends the rank for the fault itself: device_fault).
bool Reporter::finish(PendingWork& w, Env& env) {
  std::optional<std::string> error;
  std::string type = "meshrt::SystemError";
  try {
    for (const auto& [done, stream] : w.copies) {
      if (!done.query()) return false;
    }
    if (w.tasks) error = w.tasks->error();
    if (error) {
      type = "meshrt::RemoteError";
    } else {
      for (const auto& [done, stream] : w.copies) {
        if (auto e = stream.error()) {
          error = w.is_call ? fmt::format("{} on rank {}: its work on {} failed: device error: {}", w.function, rank_,
                                          stream.to_string(), *e)
                            : fmt::format("{} on rank {}: the copy to the host on {} failed: device error: {}",
                                          w.function, rank_, stream.to_string(), *e);
          break;
        }
      }
    }
  } catch (const std::exception& e) {
    error = fmt::format("{} on rank {}: polling its device work failed: {}", w.function, rank_, e.what());
  }
  if (w.seq) monitor_.finished(w.seq, error.has_value());
  if (error) {
    for (Ref r : w.results) env.define(r, DependentOnError{w.ident});
    for (Ref r : w.mutates) env.define(r, DependentOnError{w.ident});
    MESHRT_LOG(info) << "function " << w.function << " (ident " << w.ident << ") failed: " << *error;
    send(RemoteFunctionFailed{.ident = w.ident,
                              .error = std::move(*error),
                              .rank = rank_,
                              .function = w.function,
                              .exception_type = std::move(type)});
  } else if (!w.is_call) {
    send(FetchResult{.ident = w.ident, .value = std::move(w.value)});
  }
  return true;
}

void Reporter::passed(Ident ident) {
  if (ident == held_) held_ = 0;
  first_uncompleted_ = std::max(first_uncompleted_, ident + 1);
  monitor_.completed_ident(reportable());
}

void Reporter::asked(Ident ident, std::size_t live_values) {
  passed(ident);
  if (tree_) tree_->ask(ident);  // answered by report_up once the whole subtree passed it
  send_status(true, live_values);
}

Ident Reporter::reportable() const {
  const Ident done = held_ != 0 ? std::min(first_uncompleted_, held_) : first_uncompleted_;
  for (const auto& o : outgoing_) {
    if (const auto* w = std::get_if<PendingWork>(&o)) return std::min(done, w->ident);
  }
  return done;
}

void Reporter::send_status(bool force, std::size_t live_values) {
  if (tree_) return;  // the subtree's report goes up the tree (report)
  const Ident done = reportable();
  if (!force && done <= last_status_sent_) return;
  // A Status passes held replies: it claims nothing at or past the first pending fetch,
  // and every held reply names an ident at or past it.
  send(Status{.first_uncompleted_ident = done, .live_values = static_cast<std::uint64_t>(live_values)});
  last_status_sent_ = std::max(last_status_sent_, done);
  last_status_time_ = Clock::now();
}

void Reporter::report(bool moved_and_idle, std::size_t live_values) {
  if (!tree_) {
    if (moved_and_idle || due()) send_status(false, live_values);
    return;
  }
  if (tree_->report_up(reportable(), due())) last_status_time_ = Clock::now();
}

void Reporter::finish(Env& env, Backoff& backoff) {
  // Fetches still copying finish first (their events complete even on a faulted stream).
  while (!outgoing_.empty()) {
    if (!poll(env)) backoff.pause();
  }
  send_status(false, env.size());
  if (tree_) {
    // The controller's last RequestStatus (shutdown's) is answered through this node, so
    // it leaves only once its subtree has answered it. A child that never does is hung:
    // the controller's shutdown times out and ends the job.
    while (tree_->owes(reportable())) {
      if (!tree_->receive()) backoff.pause();
    }
    tree_->report_up(reportable(), false);
  }
}

}  // namespace meshrt::detail
