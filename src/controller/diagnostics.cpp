#include "controller/diagnostics.hpp"
#include "common/checks.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <mpi.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>

#include <nlohmann/json.hpp>

#include "common/backoff.hpp"
#include "controller/batcher.hpp"
#include "controller/completion.hpp"
#include "meshrt/internal/control.hpp"
#include "meshrt/internal/settings.hpp"
#include "meshrt/log.hpp"

namespace meshrt::detail {

std::string command_words(std::string_view kind, std::string_view description) {
  std::string_view first = description.substr(0, description.find_first_of(" ,"));
  if (first.ends_with('_')) first.remove_suffix(1);  // "reduce_": the in-place form
  const bool repeats =
      first.size() == kind.size() && std::equal(first.begin(), first.end(), kind.begin(), [](char a, char b) {
        return std::tolower(static_cast<unsigned char>(a)) == std::tolower(static_cast<unsigned char>(b));
      });
  return repeats ? std::string(description) : fmt::format("{} {}", kind, description);
}

Diagnostics::Diagnostics(Batcher& batcher, const CompletionTracker& tracker, std::vector<int> workers)
    : batcher_(batcher), tracker_(tracker), workers_(std::move(workers)) {}

std::map<int, protocol::QueryAnswer> Diagnostics::query(protocol::Query query, std::chrono::duration<double> timeout) {
  query.id = next_query_++;
  batcher_.send_query(workers_, query);
  std::map<int, protocol::QueryAnswer> answers;
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::nanoseconds>(timeout);
  protocol::QueryAnswer answer;
  int from = -1;
  Backoff backoff;
  while (answers.size() < workers_.size() && std::chrono::steady_clock::now() < deadline) {
    try {
      if (!batcher_.try_receive_answer(answer, from)) {
        backoff.pause();
        continue;
      }
    } catch (const ProtocolError& e) {
      MESHRT_LOG(warning) << "rank " << from << " answered a state query with something unreadable: " << e.what();
      continue;
    }
    if (answer.query == query.id) answers[from] = std::move(answer);  // older answers are stale
  }
  batcher_.reap();
  return answers;
}

std::string Diagnostics::desync_report(const std::string& what) {
  std::chrono::duration<double> wait{2.0};
  try {
    wait = settings::get_seconds("MESHRT_STATE_QUERY_TIMEOUT");
  } catch (const std::exception&) {
  }
  // Each worker writes the end of its flight recorder to its log; then the state table.
  query({.op = protocol::QueryOp::Dump, .limit = 20, .reason = what.substr(0, what.find(':'))}, wait);
  std::map<int, nlohmann::json> states;
  for (auto& [rank, answer] : query({.op = protocol::QueryOp::State}, wait)) {
    try {
      if (answer.error.empty()) states[rank] = nlohmann::json::parse(answer.payload);
    } catch (const std::exception& e) {
      MESHRT_LOG(warning) << "rank " << rank << " answered a state query with something unreadable: " << e.what();
    }
  }
  auto current_result = [&](int rank) -> std::uint64_t {
    auto it = states.find(rank);
    if (it == states.end() || it->second["current"].is_null()) return 0;
    return it->second["current"].value("result", std::uint64_t{0});
  };
  // "done before": every invocation this worker was sent before that ident has finished.
  auto done_before = [](const nlohmann::json& st) {
    const auto f = st.value("first_uncompleted", 0ull);
    return f == 0 ? std::string("-") : std::to_string(f);
  };
  std::string out = "desync report: what every worker is doing now\n";
  std::vector<int> stuck;          // ranks inside a command of their own, or not answering
  std::vector<int> waiting_inner;  // ranks in a collective, waiting for others to join
  out += fmt::format("  {:>5}  {:>11}  {:>9}  {}\n", "rank", "done before", "for", "current command");
  for (int rank : workers_) {
    auto it = states.find(rank);
    if (it == states.end()) {
      out +=
          fmt::format("  {:>5}  no answer within {:.3g} s (the process may be stopped or gone)\n", rank, wait.count());
      stuck.push_back(rank);
      continue;
    }
    nlohmann::json& st = it->second;
    const nlohmann::json& cur = st["current"];
    if (cur.is_null()) {
      out += fmt::format("  {:>5}  {:>11}  {:>9}  idle ({} queued)\n", rank, done_before(st), "",
                         st.value("queued", 0ull));
      continue;
    }
    std::string cmd = cur.value("kind", std::string("?"));
    const auto ident_of = cur.value("ident", 0ull);
    if (ident_of && tracker_.described(ident_of)) {
      cmd = fmt::format("{} (invocation {})", command_words(cmd, tracker_.describe_ident(ident_of)), ident_of);
    } else {
      if (const auto n = cur.value("name", std::string()); !n.empty()) cmd += " " + n;
      if (ident_of) cmd += fmt::format(" (invocation {})", ident_of);
    }
    const std::uint64_t result = cur.value("result", std::uint64_t{0});
    std::vector<int> waiting;
    if (cur.contains("peers") && result != 0) {
      for (int p : cur["peers"].get<std::vector<int>>()) {
        if (p != rank && current_result(p) != result) waiting.push_back(p);
      }
    }
    if (!waiting.empty())
      cmd += fmt::format("; waiting for rank{} {} to join", waiting.size() == 1 ? "" : "s", fmt::join(waiting, ", "));
    (waiting.empty() ? stuck : waiting_inner).push_back(rank);
    out += fmt::format("  {:>5}  {:>11}  {:>7.3f} s  {}\n", rank, done_before(st), cur.value("seconds", 0.0), cmd);
  }
  // A worker forwards batches and its children's status reports only between commands:
  // while one is stuck, its subtree hears nothing through it and reports nothing past
  // it. The rows above came from every rank directly (the queries bypass the tree).
  // Named: the inner nodes busy on their own account or silent; those only waiting for
  // a peer in a collective are listed in one line, as they relay again once it ends.
  if (tree_ != nullptr) {
    auto inner = [&](int rank) { return tree_->contains(rank) && !tree_->children(rank).empty(); };
    for (int rank : stuck) {
      if (!inner(rank)) continue;
      std::vector<int> below = tree_->subtree(rank);
      below.erase(below.begin());
      out += fmt::format(
          "  status tree: rank {} is busy or silent; its subtree (rank{} {}) is unreachable through it: they get no "
          "batch it relays, and their status reaches the controller only through it\n",
          rank, below.size() == 1 ? "" : "s", fmt::join(below, ", "));
    }
    std::erase_if(waiting_inner, [&](int rank) { return !inner(rank); });
    if (!waiting_inner.empty()) {
      out += fmt::format("  status tree: inner node{} {} relay{} nothing to {} subtree{} until {} collective ends\n",
                         waiting_inner.size() == 1 ? "" : "s", fmt::join(waiting_inner, ", "),
                         waiting_inner.size() == 1 ? "s" : "", waiting_inner.size() == 1 ? "its" : "their",
                         waiting_inner.size() == 1 ? "" : "s", waiting_inner.size() == 1 ? "its" : "their");
    }
  }
  return out;
}

std::string Diagnostics::dump_flight_recorder() {
  double wait = 2.0;
  try {
    wait = settings::get_double("MESHRT_STATE_QUERY_TIMEOUT");
  } catch (const std::exception&) {
  }
  const auto answers = query({.op = protocol::QueryOp::Dump, .reason = "Controller::dump_flight_recorder()"},
                             std::chrono::duration<double>(wait));
  std::string out;
  for (int rank : workers_) {
    auto it = answers.find(rank);
    if (it == answers.end()) {
      out += fmt::format("rank {}: no answer within {} s\n", rank, wait);
    } else if (!it->second.error.empty()) {
      out += fmt::format("rank {}: {}\n", rank, it->second.error);
    } else {
      out += it->second.payload;
    }
  }
  return out;
}

void Diagnostics::abort_job(const std::string& reason) {
  MESHRT_LOG(fatal) << "aborting the job: " << reason;
  std::fprintf(stderr, "meshrt: aborting the job: %s\n", reason.c_str());
  std::fflush(stderr);
  query({.op = protocol::QueryOp::Abort, .reason = reason}, std::chrono::milliseconds(500));
  // The return code is ignored on purpose: MPI_Abort does not return on success, and
  // std::abort below ends this process if it does.
  MESHRT_MPI_IGNORE(MPI_Abort(MPI_COMM_WORLD, 1));
  std::abort();
}

}  // namespace meshrt::detail
