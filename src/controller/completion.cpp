#include "controller/completion.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "controller/site.hpp"
#include "meshrt/error.hpp"

namespace meshrt::detail {

CompletionTracker::CompletionTracker(const std::vector<int>& workers) {
  for (int r : workers) workers_[r];
}

Ident CompletionTracker::new_ident(const char* label) {
  const Ident i = next_ident_++;
  if (what_.empty()) first_described_ = i;
  what_.push_back(IdentInfo{{}, {}, label});
  return i;
}

const CompletionTracker::IdentInfo* CompletionTracker::info(Ident ident) const {
  if (ident < first_described_ || ident - first_described_ >= what_.size()) return nullptr;
  return &what_[ident - first_described_];
}

void CompletionTracker::describe(Ident ident, const std::string& what, const std::source_location& where) {
  if (IdentInfo* i = info(ident)) {
    i->what = what;
    i->where = where;
  }
}

std::string CompletionTracker::describe_ident(Ident ident) const {
  const IdentInfo* i = info(ident);
  if (i == nullptr) return "?";
  if (!i->what.empty()) return fmt::format("{}, issued at {}", i->what, detail::describe(i->where));
  return i->label ? i->label : "?";
}

std::string CompletionTracker::what_of(Ident ident) const {
  const IdentInfo* i = info(ident);
  return i == nullptr ? std::string() : i->what;
}

std::string CompletionTracker::site_of(Ident ident) const {
  const IdentInfo* i = info(ident);
  if (i == nullptr || i->what.empty()) return {};
  return detail::describe(i->where);
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
    if (!w.outstanding.empty() && w.outstanding.front() <= ident && w.status_requested < ident &&
        (idle_too || w.outstanding.back() > ident)) {
      lagging.push_back(rank);
      w.status_requested = ident;
    }
  }
  return lagging;
}

std::vector<int> CompletionTracker::missing(Ident ident) const {
  std::vector<int> out;
  for (const auto& [rank, w] : workers_) {
    if (!w.outstanding.empty() && w.outstanding.front() <= ident) out.push_back(rank);
  }
  return out;
}

std::string CompletionTracker::lagging_report(Ident ident) const {
  std::string out;
  for (const auto& [rank, w] : workers_) {
    if (w.outstanding.empty() || w.outstanding.front() > ident) continue;
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
}

}  // namespace meshrt::detail
