#include "controller/graph.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "common/site.hpp"
#include "meshrt/controller.hpp"

namespace meshrt::detail {

std::string Node::issued_at() const {
  return describe(where, replayed_at);
}

namespace {

// 19995 -> "19,995": a count in an error is read, not parsed.
std::string grouped(std::uint64_t n) {
  std::string digits = std::to_string(n), out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

std::string link_text(const Node& n) {
  return n.ident ? fmt::format("{} (invocation {}, {})", n.what.str(), n.ident, n.issued_at())
                 : fmt::format("{} ({})", n.what.str(), n.issued_at());
}

// The first links of a chain of `total`, then how many more: a 20,000-step chain is five
// lines, not megabytes.
std::string chain_text(const std::vector<std::string>& first, std::uint64_t total) {
  std::string text = fmt::format("{}", fmt::join(first, " <- "));
  if (total > first.size()) text += fmt::format(" <- ... and {} more", grouped(total - first.size()));
  return text;
}

}  // namespace

std::string Failure::describe(Ident ident) const {
  const std::vector<int> r(ranks.begin(), ranks.end());
  const std::string where = ident == 0 ? std::string("outside any invocation") : fmt::format("invocation {}", ident);
  return fmt::format("{} failed on rank{} {} ({}{}{}): {}", what.empty() ? function : what, r.size() == 1 ? "" : "s",
                     fmt::join(r, ", "), where, issued_at.empty() ? "" : ", issued at ", issued_at, message);
}

std::shared_ptr<Node> DependencyGraph::make_node(Ident ident, Words what, const CallSite& where,
                                                 std::span<const std::shared_ptr<Node>> inputs) {
  auto n = std::make_shared<Node>();
  n->ident = ident;
  n->what = std::move(what);
  n->where = where;
  // Inputs already known clean add nothing: drop them so chains stay short.
  for (const auto& i : inputs) {
    if (i && !i->clean) n->inputs.push_back(i);
  }
  // A value the program dropped before this command (a loop's discarded results) left
  // its node expired at the back. Forget it now: its memory (node and control block are
  // one allocation, held until the last weak_ptr goes) then returns while it is the one
  // the next node reuses, not in a burst of a thousand at the next prune, more than
  // glibc's per-thread cache holds, after which each new node would take malloc's slow
  // path.
  while (!young_.empty() && young_.back().expired()) young_.pop_back();
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
      // The cause is the smallest failed ident behind it (its own, when it failed): what
      // failure_of would find by walking, found once here.
      if (failed) {
        n->cause = n->ident;
        n->links = 0;
      } else {
        for (const auto& in : n->inputs) {
          if (in->poisoned && in->cause != 0 && (n->cause == 0 || in->cause < n->cause)) {
            n->cause = in->cause;
            n->links = in->links + 1;
          }
        }
      }
    } else if (inputs_settled) {
      n->clean = true;
      n->inputs.clear();
    } else {
      break;  // an input is still pending (e.g. a borrow's drop comes later)
    }
    young_.pop_front();
  }
}

void DependencyGraph::record_failure(const protocol::RemoteFunctionFailed& r, std::string what, std::string issued_at) {
  // Each failure outside an invocation is an entry of its own: none overwrites another.
  Failure& f = r.ident == 0 ? outside_.emplace_back() : failures_[r.ident];
  f.function = r.function;
  f.message = r.error;
  f.exception_type = r.exception_type;
  f.ranks.insert(r.rank);
  if (!what.empty()) f.what = std::move(what);
  if (!issued_at.empty()) f.issued_at = std::move(issued_at);
}

std::exception_ptr DependencyGraph::failure_of(const std::shared_ptr<Node>& root, const Subject& subject, Ident done) {
  if (root->clean) return nullptr;  // settled clean by prune: the common case, no search
  // Settled by prune: the cause is known; only the first links are followed for the text.
  if (root->poisoned && root->cause != 0) {
    if (auto f = failures_.find(root->cause); f != failures_.end()) {
      f->second.observed = true;
      const std::vector<int> ranks(f->second.ranks.begin(), f->second.ranks.end());
      Node* n = root.get();
      std::string site;
      std::vector<std::string> first;
      while (n != nullptr) {
        if (first.size() < kChainLinks) first.push_back(link_text(*n));
        if (n->links == 0) break;
        Node* next = nullptr;
        for (const auto& in : n->inputs) {
          if (in->poisoned && in->cause == root->cause && in->links + 1 == n->links) {
            next = in.get();
            break;
          }
        }
        if (first.size() >= kChainLinks) break;
        n = next;
      }
      // The cause's own node is at the chain's end; its site is the failure's.
      const std::string issued_at = f->second.issued_at;
      const std::string head = f->second.describe(root->cause);
      const std::string text = root->links == 0 ? head
                                                : fmt::format("{} depends on a failed invocation: {}\n  chain: {}",
                                                              subject.str(), head, chain_text(first, root->links + 1));
      return std::make_exception_ptr(
          RemoteError(text, root->cause, f->second.function, ranks, f->second.message, issued_at));
    }
  }
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
  if (f.issued_at.empty()) f.issued_at = cause->issued_at();
  const std::vector<int> ranks(f.ranks.begin(), f.ranks.end());
  const std::string head = f.describe(cause->ident);
  std::string text;
  if (cause == root.get()) {
    text = head;
  } else {
    // From the value used back to the cause: the first links only.
    std::vector<std::size_t> path;
    for (std::size_t i = best; i != SIZE_MAX; i = seen[i].parent) path.push_back(i);
    std::vector<std::string> first;
    for (auto it = path.rbegin(); it != path.rend() && first.size() < kChainLinks; ++it)
      first.push_back(link_text(*seen[*it].node));
    text = fmt::format("{} depends on a failed invocation: {}\n  chain: {}", subject.str(), head,
                       chain_text(first, path.size()));
  }
  return std::make_exception_ptr(RemoteError(text, cause->ident, f.function, ranks, f.message, f.issued_at));
}

std::exception_ptr DependencyGraph::take_unobserved(int* more) {
  std::vector<std::pair<Ident, Failure*>> todo;
  for (auto& f : outside_) {
    if (!f.observed) todo.emplace_back(0, &f);
  }
  for (auto& [i, f] : failures_) {
    if (!f.observed) todo.emplace_back(i, &f);
  }
  if (more != nullptr) *more = todo.empty() ? 0 : static_cast<int>(todo.size() - 1);
  if (todo.empty()) return nullptr;
  for (auto& [i, f] : todo) f->observed = true;
  const auto& [ident, root] = todo.front();
  std::string text = root->describe(ident);
  if (todo.size() > 1) {
    // Every one is named, up to a screenful; the count says how many there were.
    constexpr std::size_t kListed = 20;
    text += fmt::format("\n  and {} more unobserved failure{}:", grouped(todo.size() - 1), todo.size() == 2 ? "" : "s");
    for (std::size_t k = 1; k < todo.size() && k <= kListed; ++k)
      text += "\n  - " + todo[k].second->describe(todo[k].first);
    if (todo.size() - 1 > kListed) text += fmt::format("\n  ... and {} more", grouped(todo.size() - 1 - kListed));
  }
  const std::vector<int> ranks(root->ranks.begin(), root->ranks.end());
  auto e = std::make_exception_ptr(RemoteError(text, ident, root->function, ranks, root->message, root->issued_at));
  // Raised ones outside an invocation are kept by nothing (no node names them).
  std::erase_if(outside_, [](const Failure& f) { return f.observed; });
  return e;
}

}  // namespace meshrt::detail
