// The status tree of fan-in (docs/ARCHITECTURE.md section 8): who reports to whom.
#include <fmt/format.h>

#include "meshrt/error.hpp"
#include "meshrt/internal/control.hpp"
#include "meshrt/internal/protocol.hpp"

namespace meshrt::control {

std::optional<StatusTree> StatusTree::for_job(const std::vector<int>& workers, std::size_t fanout,
                                              std::size_t threshold) {
  if (fanout == 0 || workers.size() <= threshold) return std::nullopt;
  return StatusTree(workers, fanout);
}

StatusTree::StatusTree(std::vector<int> workers, std::size_t fanout) : ranks_(std::move(workers)), fanout_(fanout) {
  if (fanout_ == 0) throw UsageError("status tree: expected at least 1 child per node, found 0");
  for (std::size_t i = 0; i < ranks_.size(); ++i) {
    if (!position_.emplace(ranks_[i], i).second) {
      throw UsageError(fmt::format("status tree: expected distinct worker ranks, found rank {} twice", ranks_[i]));
    }
  }
}

std::size_t StatusTree::position(int rank) const {
  auto it = position_.find(rank);
  if (it == position_.end()) {
    throw UsageError(fmt::format("status tree: rank {} runs no worker of this job ({} workers)", rank, ranks_.size()));
  }
  return it->second;
}

int StatusTree::parent(int rank) const {
  const std::int64_t p = protocol::tree_parent(fanout_, position(rank));
  return p < 0 ? kControllerRank : ranks_[static_cast<std::size_t>(p)];
}

bool StatusTree::is_top(int rank) const {
  return position(rank) < fanout_;
}

std::vector<int> StatusTree::children(int rank) const {
  const auto [first, end] = protocol::tree_children(ranks_.size(), fanout_, static_cast<std::int64_t>(position(rank)));
  return std::vector<int>(ranks_.begin() + static_cast<std::ptrdiff_t>(first),
                          ranks_.begin() + static_cast<std::ptrdiff_t>(end));
}

std::vector<int> StatusTree::subtree(int rank) const {
  // Breadth first: the positions below p form one contiguous run per level.
  std::vector<int> out;
  std::size_t lo = position(rank), hi = lo + 1;
  while (lo < ranks_.size()) {
    for (std::size_t i = lo; i < std::min(hi, ranks_.size()); ++i) out.push_back(ranks_[i]);
    lo = (lo + 1) * fanout_;
    hi = hi * fanout_ + fanout_;  // children of positions lo..hi-1 are (lo+1)k .. (hi-1+1)k+k-1
  }
  return out;
}

std::vector<int> StatusTree::ancestors(int rank) const {
  std::vector<int> out;
  for (std::int64_t p = protocol::tree_parent(fanout_, position(rank)); p >= 0;
       p = protocol::tree_parent(fanout_, static_cast<std::size_t>(p))) {
    out.insert(out.begin(), ranks_[static_cast<std::size_t>(p)]);
  }
  return out;
}

std::vector<int> StatusTree::top() const {
  return std::vector<int>(ranks_.begin(),
                          ranks_.begin() + static_cast<std::ptrdiff_t>(std::min(fanout_, ranks_.size())));
}

}  // namespace meshrt::control
