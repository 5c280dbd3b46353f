#include "controller/completion.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "common/site.hpp"
#include "meshrt/error.hpp"

namespace meshrt::detail {

CompletionTracker::CompletionTracker(const std::vector<int>& workers) {
  for (int r : workers) workers_[r];
}

Ident CompletionTracker::new_ident(const char* label) {
  const Ident i = next_ident_++;
  if (what_.empty()) first_described_ = i;
  what_.push_back(IdentInfo{.what = {}, .where = {}, .replayed_at = {}, .label = label});
  return i;
}

const CompletionTracker::IdentInfo* CompletionTracker::info(Ident ident) const {
  if (ident < first_described_ || ident - first_described_ >= what_.size()) return nullptr;
  return &what_[ident - first_described_];
}

void CompletionTracker::describe(Ident ident, const Words& what, const CallSite& where, const CallSite& replayed_at) {
  if (IdentInfo* i = info(ident)) {
    i->what = what;
    i->where = where;
    i->replayed_at = replayed_at;
  }
}

std::string CompletionTracker::describe_ident(Ident ident) const {
  const IdentInfo* i = info(ident);
  if (i == nullptr) return "?";
  if (!i->what.empty())
    return fmt::format("{}, issued at {}", i->what.str(), detail::describe(i->where, i->replayed_at));
  return i->label ? i->label : "?";
}

std::string CompletionTracker::what_of(Ident ident) const {
  const IdentInfo* i = info(ident);
  return i == nullptr ? std::string() : i->what.str();
}

std::string CompletionTracker::site_of(Ident ident) const {
  const IdentInfo* i = info(ident);
  if (i == nullptr || i->what.empty()) return {};
  return detail::describe(i->where, i->replayed_at);
}

void CompletionTracker::sent(const std::vector<int>& dests, Ident ident) {
  for (int r : dests) workers_[r].outstanding.push_back(ident);
}

void CompletionTracker::completed(int rank, Ident before) {
  Worker& w = workers_[rank];
  w.reported = std::max(w.reported, before);
  while (!w.outstanding.empty() && w.outstanding.front() < before) w.outstanding.pop_front();
}

void CompletionTracker::status(int rank, const protocol::Status& status) {
  completed(rank, status.first_uncompleted_ident);
  workers_[rank].live_values = status.live_values;
}

Ident CompletionTracker::frontier() const {
  Ident f = next_ident_ - 1;
  for (const auto& [rank, w] : workers_) {
    if (!w.outstanding.empty()) f = std::min(f, w.outstanding.front() - 1);
  }
  return f;
}

std::vector<int> CompletionTracker::to_ask(Ident ident, bool idle_too) {
  std::vector<int> lagging;
  for (auto& [rank, w] : workers_) {
    if (w.owes(ident) && w.status_requested < ident && (idle_too || w.outstanding.back() > ident)) {
      lagging.push_back(rank);
      w.status_requested = ident;
    }
  }
  return lagging;
}

std::vector<int> CompletionTracker::missing(Ident ident) const {
  std::vector<int> out;
  for (const auto& [rank, w] : workers_) {
    if (w.owes(ident)) out.push_back(rank);
  }
  return out;
}

bool CompletionTracker::owes(int rank, Ident ident) const {
  auto it = workers_.find(rank);
  return it != workers_.end() && it->second.owes(ident);
}

Ident CompletionTracker::newest_owed(int rank, Ident ident) const {
  auto it = workers_.find(rank);
  if (it == workers_.end()) return 0;
  Ident newest = 0;
  for (Ident i : it->second.outstanding) {
    if (i <= ident) newest = std::max(newest, i);
  }
  return newest;
}

std::string CompletionTracker::lagging_report(Ident ident) const {
  std::string out;
  for (const auto& [rank, w] : workers_) {
    if (!w.owes(ident)) continue;
    const Ident on = w.outstanding.front();
    out += fmt::format("\n  rank {}: has not reported invocation {} done ({})", rank, on, describe_ident(on));
  }
  return out;
}

void CompletionTracker::forget_complete() {
  const Ident f = frontier();
  while (!what_.empty() && first_described_ <= f) {
    what_.pop_front();
    ++first_described_;
  }
}

std::uint64_t CompletionTracker::live_values(int rank) const {
  auto it = workers_.find(rank);
  if (it == workers_.end()) throw UsageError(fmt::format("live_values: rank {} runs no worker", rank));
  return it->second.live_values;
}

std::size_t CompletionTracker::outstanding(int rank) const {
  auto it = workers_.find(rank);
  return it == workers_.end() ? 0 : it->second.outstanding.size();
}

void CompletionTracker::restart() {
  for (auto& [rank, w] : workers_) {
    w.outstanding.clear();
    w.live_values = 0;
  }
  what_.clear();
  first_described_ = next_ident_;
  // The workers' fresh loops count their direct replies from 0 and know nothing of their
  // children yet; every report of the old session arrived before its node's Restarted.
  direct_received_.clear();
  held_.clear();
  held_count_ = 0;
}

void CompletionTracker::use_tree(std::map<int, std::vector<int>> subtrees) {
  for (const auto& [node, ranks] : subtrees) {
    for (int r : ranks) {
      if (!workers_.count(r)) {
        throw UsageError(fmt::format("status tree: rank {} below rank {} runs no worker", r, node));
      }
    }
  }
  subtrees_ = std::move(subtrees);
}

void CompletionTracker::direct_reply(int rank) {
  ++direct_received_[rank];
  if (held_count_ == 0) return;
  for (auto& [node, q] : held_) apply_held(node);
}

void CompletionTracker::tree_status(int node, protocol::TreeStatus report) {
  if (!subtrees_.count(node)) {
    throw ProtocolError(
        fmt::format("a subtree status (first uncompleted ident {}) came from rank {}, which is not a "
                    "top node of the status tree{}",
                    report.first_uncompleted_ident, node,
                    subtrees_.empty() ? " (the controller has none: do all ranks have the same MESHRT_FANOUT and "
                                        "MESHRT_FANOUT_THRESHOLD?)"
                                      : ""));
  }
  held_[node].push_back(std::move(report));
  ++held_count_;
  apply_held(node);
}

bool CompletionTracker::ready(const protocol::TreeStatus& report) const {
  for (std::size_t i = 0; i < report.direct_ranks.size() && i < report.direct_counts.size(); ++i) {
    auto it = direct_received_.find(report.direct_ranks[i]);
    if ((it == direct_received_.end() ? 0 : it->second) < report.direct_counts[i]) return false;
  }
  return true;
}

void CompletionTracker::apply_held(int node) {
  auto& q = held_[node];
  while (!q.empty() && ready(q.front())) {
    for (int r : subtrees_[node]) completed(r, q.front().first_uncompleted_ident);
    q.pop_front();
    --held_count_;
  }
}

}  // namespace meshrt::detail
