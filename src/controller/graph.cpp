#include "controller/graph.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "controller/site.hpp"
#include "meshrt/controller.hpp"

namespace meshrt::detail {

std::string Node::issued_at() const {
  return describe(where);
}

std::shared_ptr<Node> DependencyGraph::make_node(Ident ident, std::string what, const std::source_location& where,
                                                 std::vector<std::shared_ptr<Node>> inputs) {
  auto n = std::make_shared<Node>();
  n->ident = ident;
  n->what = std::move(what);
  n->where = where;
  // Inputs already known clean add nothing: drop them so chains stay short.
  for (auto& i : inputs) {
    if (i && !i->clean) n->inputs.push_back(std::move(i));
  }
  young_.push_back(n);
  return n;
}

bool DependencyGraph::prune_due() {
  if (++since_prune_ < 1024) return false;
  since_prune_ = 0;
  return true;
}

void DependencyGraph::prune(Ident done) {
  while (!young_.empty()) {
    auto n = young_.front().lock();
    if (!n) {
      young_.pop_front();
      continue;
    }
    if (n->ident != 0 && n->ident > done) break;  // still running somewhere
    const bool failed = n->ident != 0 && failures_.count(n->ident) > 0;
    bool inputs_settled = true, inputs_poisoned = false;
    for (const auto& in : n->inputs) {
      if (in->poisoned)
        inputs_poisoned = true;
      else if (!in->clean)
        inputs_settled = false;
    }
    if (failed || inputs_poisoned) {
      n->poisoned = true;
    } else if (inputs_settled) {
      n->clean = true;
      n->inputs.clear();
    } else {
      break;  // an input is still pending (e.g. a borrow's drop comes later)
    }
    young_.pop_front();
  }
}

void DependencyGraph::record_failure(const protocol::RemoteFunctionFailed& r) {
  Failure& f = failures_[r.ident];
  f.function = r.function;
  f.message = r.error;
  f.exception_type = r.exception_type;
  f.ranks.insert(r.rank);
}

std::exception_ptr DependencyGraph::failure_of(const std::shared_ptr<Node>& root, const std::string& subject,
                                               Ident done) {
  // Iterative search (chains can be long): the failed invocation with the smallest ident.
  struct Item {
    Node* node;
    std::size_t parent;
  };
  std::vector<Item> seen{{root.get(), SIZE_MAX}};
  std::set<Node*> visited{root.get()};
  std::size_t best = SIZE_MAX;
  for (std::size_t i = 0; i < seen.size(); ++i) {
    Node* n = seen[i].node;
    if (n->clean) continue;
    if (n->ident != 0) {
      if (auto f = failures_.find(n->ident); f != failures_.end()) {
        if (best == SIZE_MAX || n->ident < seen[best].node->ident) best = i;
        continue;
      }
    }
    for (auto& in : n->inputs) {
      if (visited.insert(in.get()).second) seen.push_back({in.get(), i});
    }
  }
  if (best == SIZE_MAX) {
    // Everything reachable is complete and clean: prune, so later checks stop here.
    for (auto& item : seen) {
      Node* n = item.node;
      if (!n->clean && (n->ident == 0 || n->ident <= done)) {
        bool inputs_clean = std::all_of(n->inputs.begin(), n->inputs.end(), [](auto& p) { return p->clean; });
        if (inputs_clean) {
          n->clean = true;
          n->inputs.clear();
        }
      }
    }
    // A second pass catches parents whose inputs became clean above (children come later
    // in `seen`, so walk backwards).
    for (auto it = seen.rbegin(); it != seen.rend(); ++it) {
      Node* n = it->node;
      if (!n->clean && (n->ident == 0 || n->ident <= done) &&
          std::all_of(n->inputs.begin(), n->inputs.end(), [](auto& p) { return p->clean; })) {
        n->clean = true;
        n->inputs.clear();
      }
    }
    return nullptr;
  }
  Node* cause = seen[best].node;
  Failure& f = failures_.at(cause->ident);
  f.observed = true;
  const std::vector<int> ranks(f.ranks.begin(), f.ranks.end());
  std::string head =
      fmt::format("{} failed on rank{} {} (invocation {}, issued at {}): {}", f.function, ranks.size() == 1 ? "" : "s",
                  fmt::join(ranks, ", "), cause->ident, cause->issued_at(), f.message);
  std::string text;
  if (cause == root.get()) {
    text = head;
  } else {
    std::vector<std::string> chain;
    for (std::size_t i = best; i != SIZE_MAX; i = seen[i].parent) {
      const Node* n = seen[i].node;
      chain.push_back(n->ident ? fmt::format("{} (invocation {}, {})", n->what, n->ident, n->issued_at())
                               : fmt::format("{} ({})", n->what, n->issued_at()));
    }
    std::reverse(chain.begin(), chain.end());
    text = fmt::format("{} depends on a failed invocation: {}\n  chain: {}", subject, head, fmt::join(chain, " <- "));
  }
  return std::make_exception_ptr(RemoteError(text, cause->ident, f.function, ranks, f.message, cause->issued_at()));
}

std::exception_ptr DependencyGraph::take_unobserved(int* more) {
  std::exception_ptr first;
  int others = 0;
  for (auto& [i, f] : failures_) {
    if (f.observed) continue;
    f.observed = true;
    if (!first) {
      const std::vector<int> ranks(f.ranks.begin(), f.ranks.end());
      first = std::make_exception_ptr(
          RemoteError(fmt::format("{} failed on rank{} {} (invocation {}): {}", f.function,
                                  ranks.size() == 1 ? "" : "s", fmt::join(ranks, ", "), i, f.message),
                      i, f.function, ranks, f.message, ""));
    } else {
      ++others;
    }
  }
  if (more != nullptr) *more = others;
  return first;
}

}  // namespace meshrt::detail
