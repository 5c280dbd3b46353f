#include "controller/diagnostics.hpp"
#include "common/checks.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <mpi.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <nlohmann/json.hpp>

#include "common/backoff.hpp"
#include "common/timeline.hpp"
#include "controller/batcher.hpp"
#include "controller/completion.hpp"
#include "meshrt/internal/control.hpp"
#include "meshrt/internal/settings.hpp"
#include "meshrt/internal/stacks.hpp"
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

namespace {

// What one worker's answer to the state query says, for the summary of a timeout.
struct RankFacts {
  enum class Kind { Silent, Idle, Own, Waiting } kind = Kind::Silent;
  std::string command;  // short: "my.slow (invocation 5)"
  double seconds = 0;
  std::vector<int> waiting_for;  // peers of its collective that have not joined
  std::uint64_t first_uncompleted = 0;
};

// `text`'s lines, each indented by `spaces`.
std::string indented(const std::string& text, std::size_t spaces) {
  std::string out;
  std::size_t at = 0;
  while (at < text.size()) {
    const std::size_t end = text.find('\n', at);
    out.append(spaces, ' ').append(text, at, end == std::string::npos ? std::string::npos : end - at).append("\n");
    if (end == std::string::npos) break;
    at = end + 1;
  }
  return out;
}

std::string rank_list(const std::vector<int>& ranks) {
  return fmt::format("rank{} {}", ranks.size() == 1 ? "" : "s", fmt::join(ranks, ", "));
}

// The summary line of a timeout of `ident`, and the ranks it names behind.
void summarize(const CompletionTracker& tracker, protocol::Ident ident, const std::map<int, RankFacts>& facts,
               double wait, DesyncReport& report) {
  using Kind = RankFacts::Kind;
  // Only the ranks the controller has not heard past `ident` from can hold it up. Of
  // those, a rank whose own answer says it has finished its share is only late to report
  // (a Status cannot leave a worker blocked in a collective, nor a status tree node busy
  // in a command); a rank inside a collective that waits for peers to join is waiting;
  // the rest are behind: inside a command of their own, silent, or idle without it.
  std::vector<int> behind, idle, late;
  std::map<std::pair<std::string, std::vector<int>>, std::vector<int>> waiting;  // (command, for whom) -> ranks
  for (int rank : tracker.missing(ident)) {
    auto it = facts.find(rank);
    if (it == facts.end()) continue;
    const RankFacts& f = it->second;
    if (f.kind != Kind::Silent && f.first_uncompleted > tracker.newest_owed(rank, ident)) {
      late.push_back(rank);
    } else if (f.kind == Kind::Waiting) {
      waiting[{f.command, f.waiting_for}].push_back(rank);
    } else {
      (f.kind == Kind::Idle ? idle : behind).push_back(rank);
    }
  }
  // The peers a waiting rank waits for are behind when busy on their own or silent; idle
  // ones have not received the collective yet, like the idle ranks above.
  for (const auto& [key, ranks] : waiting) {
    for (int p : key.second) {
      auto it = facts.find(p);
      if (it == facts.end() || it->second.kind == Kind::Waiting) continue;
      std::vector<int>& into = it->second.kind == Kind::Idle ? idle : behind;
      if (std::find(into.begin(), into.end(), p) == into.end()) into.push_back(p);
    }
  }
  // An idle rank that still owes `ident` has not received it: behind, unless a rank
  // behind already explains it (a fan-out node that relays nothing while stuck).
  if (behind.empty()) behind = idle;
  std::sort(behind.begin(), behind.end());
  // What a rank behind is doing; ranks in the same state share a clause.
  auto state_of = [&](int rank) {
    const RankFacts& f = facts.at(rank);
    switch (f.kind) {
      case Kind::Silent:
        return fmt::format("no answer within {:.3g} s (the process may be stopped or gone)", wait);
      case Kind::Idle:
        return fmt::format("idle, invocation {} has not reached it", tracker.newest_owed(rank, ident));
      case Kind::Own:
      case Kind::Waiting:
        break;
    }
    return "running " + f.command;
  };
  std::string& s = report.summary;
  if (!behind.empty()) {
    report.behind = behind;
    std::vector<std::pair<std::string, std::vector<int>>> clauses;
    for (int rank : behind) {
      const std::string state = state_of(rank);
      auto c = std::find_if(clauses.begin(), clauses.end(), [&](const auto& e) { return e.first == state; });
      if (c == clauses.end()) {
        clauses.push_back({state, {rank}});
      } else {
        c->second.push_back(rank);
      }
    }
    auto text = [&](const std::pair<std::string, std::vector<int>>& clause) {
      double longest = 0;
      for (int r : clause.second) longest = std::max(longest, facts.at(r).seconds);
      return clause.first.starts_with("running ") ? fmt::format("{} for {:.3g} s", clause.first, longest)
                                                  : clause.first;
    };
    s = fmt::format("{} {} behind: ", rank_list(behind), behind.size() == 1 ? "is" : "are");
    if (clauses.size() == 1) {
      s += text(clauses.front());
    } else {
      for (std::size_t i = 0; i < clauses.size(); ++i)
        s += fmt::format("{}{} {}", i ? ", " : "", rank_list(clauses[i].second), text(clauses[i]));
    }
    for (const auto& [key, ranks] : waiting) {
      const std::string whom = key.second == behind ? (behind.size() == 1 ? "it" : "them") : rank_list(key.second);
      s += fmt::format("; {} {} waiting for {} in {}", rank_list(ranks), ranks.size() == 1 ? "is" : "are", whom,
                       key.first);
    }
  } else if (!waiting.empty()) {
    // Every rank that holds it up waits for another: collectives entered in different orders.
    s = "the ranks wait for one another";
    for (const auto& [key, ranks] : waiting) {
      s += fmt::format("; {} in {} {} waiting for {}", rank_list(ranks), key.first, ranks.size() == 1 ? "is" : "are",
                       rank_list(key.second));
      report.behind.insert(report.behind.end(), ranks.begin(), ranks.end());
    }
    std::sort(report.behind.begin(), report.behind.end());
  } else if (!late.empty()) {
    s = fmt::format("{} {} finished it, but {} report{} not reached the controller", rank_list(late),
                    late.size() == 1 ? "has" : "have", late.size() == 1 ? "its" : "their",
                    late.size() == 1 ? " has" : "s have");
    report.behind = late;
  } else {
    s = "every rank has reported it done";
  }
}

}  // namespace

DesyncReport Diagnostics::desync_report(protocol::Ident ident, const std::string& what) {
  const settings::Seconds wait = settings::kStateQueryTimeout.get();
  // The end of every worker's flight recorder (the caller decides where it goes); then
  // the state table.
  const auto dumps = query({.op = protocol::QueryOp::Dump, .limit = 20, .reason = what}, wait);
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
  DesyncReport report;
  std::map<int, RankFacts> facts;
  std::string& out = report.table;
  out = "desync report: what every worker is doing now\n";
  std::vector<int> stuck;          // ranks inside a command of their own, or not answering
  std::vector<int> waiting_inner;  // ranks in a collective, waiting for others to join
  out += fmt::format("  {:>5}  {:>11}  {:>9}  {}\n", "rank", "done before", "for", "current command");
  for (int rank : workers_) {
    RankFacts& fact = facts[rank];
    auto it = states.find(rank);
    if (it == states.end()) {
      out +=
          fmt::format("  {:>5}  no answer within {:.3g} s (the process may be stopped or gone)\n", rank, wait.count());
      stuck.push_back(rank);
      continue;
    }
    nlohmann::json& st = it->second;
    fact.first_uncompleted = st.value("first_uncompleted", std::uint64_t{0});
    const nlohmann::json& cur = st["current"];
    if (cur.is_null()) {
      fact.kind = RankFacts::Kind::Idle;
      out += fmt::format("  {:>5}  {:>11}  {:>9}  idle ({} queued)\n", rank, done_before(st), "",
                         st.value("queued", 0ull));
      continue;
    }
    std::string cmd = cur.value("kind", std::string("?"));
    std::string plain = cmd;  // the worker's own words, for commands the controller did not describe
    if (const auto n = cur.value("name", std::string()); !n.empty()) plain += " " + n;
    const auto ident_of = cur.value("ident", 0ull);
    const std::string what_of = ident_of ? tracker_.what_of(ident_of) : std::string();
    if (ident_of && tracker_.described(ident_of)) {
      cmd = fmt::format("{} (invocation {})", command_words(cmd, tracker_.describe_ident(ident_of)), ident_of);
    } else {
      cmd = plain;
      if (ident_of) cmd += fmt::format(" (invocation {})", ident_of);
    }
    // The summary names the command as the program wrote it ("my.slow", "reduce sum over 'x'").
    fact.command = what_of.empty() ? plain : what_of;
    if (ident_of) fact.command += fmt::format(" (invocation {})", ident_of);
    fact.seconds = cur.value("seconds", 0.0);
    const std::uint64_t result = cur.value("result", std::uint64_t{0});
    std::vector<int> waiting;
    if (cur.contains("peers") && result != 0) {
      for (int p : cur["peers"].get<std::vector<int>>()) {
        if (p != rank && current_result(p) != result) waiting.push_back(p);
      }
    }
    if (!waiting.empty())
      cmd += fmt::format("; waiting for rank{} {} to join", waiting.size() == 1 ? "" : "s", fmt::join(waiting, ", "));
    fact.kind = waiting.empty() ? RankFacts::Kind::Own : RankFacts::Kind::Waiting;
    fact.waiting_for = waiting;
    std::sort(fact.waiting_for.begin(), fact.waiting_for.end());
    (waiting.empty() ? stuck : waiting_inner).push_back(rank);
    out += fmt::format("  {:>5}  {:>11}  {:>7.3f} s  {}\n", rank, done_before(st), fact.seconds, cmd);
    // The kernel's own stack (a Python kernel's frames), as the rank's watch thread read it.
    if (const auto stack = st.find("stack"); stack != st.end() && stack->is_string()) {
      out += indented(stack->get<std::string>(), 9);
    }
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
  // And the controller's, when the program's language has a provider (a Python controller).
  out += language_stack({.owner = StackOwner::Controller, .thread = this_thread_id()}, 2);
  for (const auto& [rank, answer] : dumps) report.dumps += answer.error.empty() ? answer.payload : answer.error + "\n";
  summarize(tracker_, ident, facts, wait.count(), report);
  return report;
}

std::string Diagnostics::dump_flight_recorder() {
  const settings::Seconds wait = settings::kStateQueryTimeout.get();
  const auto answers = query({.op = protocol::QueryOp::Dump, .reason = "Controller::dump_flight_recorder()"}, wait);
  std::string out;
  for (int rank : workers_) {
    auto it = answers.find(rank);
    if (it == answers.end()) {
      out += fmt::format("rank {}: no answer within {} s\n", rank, wait.count());
    } else if (!it->second.error.empty()) {
      out += fmt::format("rank {}: {}\n", rank, it->second.error);
    } else {
      out += it->second.payload;
    }
  }
  return out;
}

std::uint64_t Diagnostics::write_trace(const std::string& path) {
  const trace::Session& session = trace::session();
  const settings::Seconds wait = std::max(settings::kStateQueryTimeout.get(), settings::Seconds(10));
  const auto answers = query({.op = protocol::QueryOp::Trace}, wait);
  std::vector<trace::RankEvents> ranks;
  std::vector<int> missing;
  auto add = [&](int rank, trace::RankEvents r) {
    r.rank = rank;
    r.calls_here = rank == 0;
    r.offset_ns = static_cast<std::size_t>(rank) < session.offsets_ns.size() ? session.offsets_ns[rank] : 0;
    r.residual_ns = static_cast<std::size_t>(rank) < session.residuals_ns.size() ? session.residuals_ns[rank] : 0;
    ranks.push_back(std::move(r));
  };
  // A dedicated controller's rank runs no worker: its own events are here.
  if (std::find(workers_.begin(), workers_.end(), 0) == workers_.end()) {
    trace::RankEvents mine{.host = session.host};
    mine.events = trace::snapshot(&mine.dropped);
    add(0, std::move(mine));
  }
  for (int rank : workers_) {
    const auto it = answers.find(rank);
    const std::string* payload = it == answers.end() || !it->second.error.empty() ? nullptr : &it->second.payload;
    const std::size_t host_end = payload ? payload->find('\0') : std::string::npos;
    if (host_end == std::string::npos || payload->size() < host_end + 1 + sizeof(std::uint64_t) ||
        (payload->size() - host_end - 1 - sizeof(std::uint64_t)) % sizeof(trace::Event) != 0) {
      missing.push_back(rank);
      continue;
    }
    trace::RankEvents r{.host = payload->substr(0, host_end)};
    const char* p = payload->data() + host_end + 1;
    std::memcpy(&r.dropped, p, sizeof r.dropped);
    p += sizeof r.dropped;
    r.events.resize((payload->size() - host_end - 1 - sizeof r.dropped) / sizeof(trace::Event));
    if (!r.events.empty()) std::memcpy(static_cast<void*>(r.events.data()), p, r.events.size() * sizeof(trace::Event));
    add(rank, std::move(r));
  }
  std::sort(ranks.begin(), ranks.end(), [](const auto& a, const auto& b) { return a.rank < b.rank; });
  std::uint64_t n = 0;
  for (const auto& r : ranks) n += r.events.size();
  if (n == 0 && !trace::enabled()) {
    throw UsageError(fmt::format(
        "write_trace(\"{}\"): expected a timeline to write (MESHRT_TRACE=path, or start_trace() before), found none "
        "recorded",
        path));
  }
  nlohmann::json extra = nlohmann::json::object();
  if (!missing.empty()) extra["missing_ranks"] = missing;
  trace::write_chrome_trace(path, ranks, trace::names(), false, fmt::format("write_trace(\"{}\")", path), extra);
  if (!missing.empty()) {
    throw TimeoutError(
        fmt::format("write_trace(\"{}\"): expected every rank's timeline, found no answer from rank(s) {} within {} s "
                    "(MESHRT_STATE_QUERY_TIMEOUT, at least 10 s); the file holds the other {} ranks",
                    path, fmt::join(missing, ", "), wait.count(), ranks.size()));
  }
  return n;
}

void Diagnostics::switch_trace(bool on) {
  if (on) trace::enable(trace::session().capacity);  // this process's threads, the controller's among them
  const settings::Seconds wait = settings::kStateQueryTimeout.get();
  const auto answers = query({.op = protocol::QueryOp::TraceSwitch, .limit = on ? 1u : 0u}, wait);
  if (!on) trace::disable();
  std::vector<int> missing;
  for (int rank : workers_) {
    if (!answers.count(rank)) missing.push_back(rank);
  }
  if (!missing.empty()) {
    throw TimeoutError(
        fmt::format("{}: expected every rank to answer, found no answer from rank(s) {} within {} s "
                    "(MESHRT_STATE_QUERY_TIMEOUT)",
                    on ? "start_trace()" : "stop_trace()", fmt::join(missing, ", "), wait.count()));
  }
}

void Diagnostics::abort_job(const std::string& reason) {
  // Once on stderr: the log's console sink writes fatal records there unless it is off.
  MESHRT_LOG(fatal) << "aborting the job: " << reason;
  if (!log::enabled(log::Level::fatal)) {
    std::fprintf(stderr, "meshrt: aborting the job: %s\n", reason.c_str());
    std::fflush(stderr);
  }
  // The workers log the first line only: the rest (a desync report) is the controller's.
  // Each watch writes its rank's own timeline file first when MESHRT_TRACE is set.
  query({.op = protocol::QueryOp::Abort, .reason = reason.substr(0, reason.find('\n'))},
        trace::session().path.empty() ? std::chrono::milliseconds(500) : std::chrono::milliseconds(5000));
  // A dedicated controller's rank has no watch to do it (on the others this is a no-op:
  // its watch has written the file).
  if (std::find(workers_.begin(), workers_.end(), 0) == workers_.end()) {
    if (const std::string dumped = trace::dump_rank("the controller aborted the job", {}); !dumped.empty()) {
      std::fprintf(stderr, "meshrt: rank 0: %s\n", dumped.c_str());
    }
  }
  // The return code is ignored on purpose: MPI_Abort does not return on success, and
  // std::abort below ends this process if it does.
  MESHRT_MPI_IGNORE(MPI_Abort(MPI_COMM_WORLD, 1));
  std::abort();
}

}  // namespace meshrt::detail
