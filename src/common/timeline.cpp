#include "common/timeline.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <set>

#include "meshrt/error.hpp"

namespace meshrt::detail::trace {
namespace {

Session& the_session() {
  static Session s;
  return s;
}

}  // namespace

void set_session(Session s) {
  the_session() = std::move(s);
}
const Session& session() {
  return the_session();
}

nlohmann::json chrome_trace(const std::vector<RankEvents>& ranks, const std::vector<std::string>& names,
                            bool absolute) {
  using nlohmann::json;
  const Session& session = the_session();
  auto aligned = [](const RankEvents& r, std::int64_t t) { return t - r.offset_ns; };
  std::int64_t base = 0;
  if (!absolute) {
    base = std::numeric_limits<std::int64_t>::max();
    for (const RankEvents& r : ranks) {
      for (const Event& e : r.events)
        base = std::min(base, aligned(r, e.kind == Kind::Command ? e.queued_ns : e.start_ns));
    }
  }
  auto us = [&](const RankEvents& r, std::int64_t t) { return static_cast<double>(aligned(r, t) - base) / 1000.0; };
  auto name_of = [&](std::uint64_t i) { return i < names.size() ? names[i] : std::string("?"); };
  // Idents the controller issued (flows start there), by name. A rank's own file holds
  // no calls but rank 0's: its flows end at every ident, and a merge keeps those whose
  // call it finds.
  std::map<std::uint64_t, std::string> calls;
  for (const RankEvents& r : ranks) {
    if (!r.calls_here) continue;
    for (const Event& e : r.events) {
      if (e.track == Track::Controller && e.kind == Kind::Call) calls[e.ident] = name_of(e.a);
    }
  }
  json events = json::array();
  std::int64_t residual = 0;
  std::uint64_t dropped = 0;
  for (const RankEvents& r : ranks) {
    residual = std::max(residual, r.residual_ns);
    dropped += r.dropped;
    const int pid = r.rank;
    events.push_back({{"ph", "M"},
                      {"name", "process_name"},
                      {"pid", pid},
                      {"args", {{"name", fmt::format("rank {} on {}", r.rank, r.host)}}}});
    events.push_back({{"ph", "M"}, {"name", "process_sort_index"}, {"pid", pid}, {"args", {{"sort_index", pid}}}});
    events.push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", pid}, {"tid", 1}, {"args", {{"name", "worker"}}}});
    if (r.calls_here) {
      events.push_back(
          {{"ph", "M"}, {"name", "thread_name"}, {"pid", pid}, {"tid", 0}, {"args", {{"name", "controller"}}}});
    }
    std::set<int> streams;  // device stream tracks named so far
    for (const Event& e : r.events) {
      const double ts = us(r, e.start_ns);
      const double dur = std::max(us(r, e.end_ns) - ts, 0.0);
      switch (e.kind) {
        case Kind::Call: {
          json args{{"ident", e.ident}};
          const std::source_location where = Event::site(e.b);
          if (r.calls_here && where.line() != 0 && session.site) args["site"] = session.site(where, Event::site(e.c));
          events.push_back({{"ph", "X"},
                            {"cat", "call"},
                            {"name", name_of(e.a)},
                            {"pid", pid},
                            {"tid", 0},
                            {"ts", ts},
                            {"dur", 1.0},
                            {"args", args}});
          events.push_back({{"ph", "s"},
                            {"cat", "flow"},
                            {"name", "dispatch"},
                            {"id", e.ident},
                            {"pid", pid},
                            {"tid", 0},
                            {"ts", ts}});
          break;
        }
        case Kind::Wait:
          events.push_back({{"ph", "X"},
                            {"cat", "wait"},
                            {"name", "wait: " + name_of(e.a)},
                            {"pid", pid},
                            {"tid", 0},
                            {"ts", ts},
                            {"dur", dur},
                            {"args", {{"ident", e.ident}}}});
          break;
        case Kind::Flush:
          events.push_back({{"ph", "X"},
                            {"cat", "batch"},
                            {"name", fmt::format("send {} command{}", e.b, e.b == 1 ? "" : "s")},
                            {"pid", pid},
                            {"tid", 0},
                            {"ts", ts},
                            {"dur", dur},
                            {"args", {{"commands", e.b}, {"ranks", e.c}, {"bytes", e.a}}}});
          break;
        case Kind::Device: {
          const int tid = 16 + static_cast<int>(e.b);
          if (streams.insert(tid).second) {
            events.push_back(
                {{"ph", "M"},
                 {"name", "thread_name"},
                 {"pid", pid},
                 {"tid", tid},
                 {"args", {{"name", fmt::format("{}:{} stream {}", e.type == 1 ? "cuda" : "emulated", e.c, e.b)}}}});
          }
          const auto call = calls.find(e.ident);
          json args{{"ident", e.ident}, {"queued_us", static_cast<double>(e.start_ns - e.queued_ns) / 1000.0}};
          if (e.failed) args["failed"] = true;
          events.push_back({{"ph", "X"},
                            {"cat", "device"},
                            {"name", call != calls.end() ? "task: " + call->second : std::string("task")},
                            {"pid", pid},
                            {"tid", tid},
                            {"ts", ts},
                            {"dur", dur},
                            {"args", args}});
          break;
        }
        case Kind::Mark:
          events.push_back(
              {{"ph", "i"}, {"s", "p"}, {"cat", "mark"}, {"name", name_of(e.a)}, {"pid", pid}, {"tid", 0}, {"ts", ts}});
          break;
        case Kind::Command: {
          // "Reduce reduce sum over 'gpu'": the command's kind, and what the controller called it.
          std::string name(session.command ? session.command(e.type) : std::string_view("command"));
          const auto call = calls.find(e.ident);
          if (e.ident != 0 && call != calls.end()) name += " " + call->second;
          json args{{"ident", e.ident}, {"queued_us", static_cast<double>(e.start_ns - e.queued_ns) / 1000.0}};
          if (e.a) args["bytes"] = e.a;
          if (e.b) args["replay"] = e.b;
          if (e.failed) args["failed"] = true;
          if (e.unfinished) args["unfinished"] = true;
          events.push_back({{"ph", "X"},
                            {"cat", e.failed       ? "command,failed"
                                    : e.unfinished ? "command,unfinished"
                                                   : "command"},
                            {"name", name},
                            {"pid", pid},
                            {"tid", 1},
                            {"ts", ts},
                            {"dur", dur},
                            {"args", args}});
          if (e.ident != 0 && (absolute || call != calls.end())) {
            events.push_back({{"ph", "f"},
                              {"bp", "e"},
                              {"cat", "flow"},
                              {"name", "dispatch"},
                              {"id", e.ident},
                              {"pid", pid},
                              {"tid", 1},
                              {"ts", ts}});
          }
          break;
        }
      }
    }
  }
  return json{{"traceEvents", std::move(events)},
              {"displayTimeUnit", "ms"},
              {"otherData",
               {{"meshrt",
                 {{"ranks", absolute ? session.size : static_cast<int>(ranks.size())},
                  {"clock_residual_us", static_cast<double>(residual) / 1000.0},
                  {"dropped_events", dropped}}}}}};
}

void write_json(const std::string& path, const nlohmann::json& trace, std::string_view what) {
  std::ofstream out(path);
  if (out) out << trace.dump() << '\n';
  if (!out) {
    throw Error(fmt::format("{}: expected a file rank {} can write, found it cannot: {}", what, the_session().rank,
                            std::strerror(errno)));
  }
}

std::string rank_file() {
  const Session& s = the_session();
  return s.path.empty() ? "" : fmt::format("{}.rank{}.json", s.path, s.rank);
}

std::string dump_rank(std::string_view reason, const std::vector<Event>& running, bool in_signal) {
  const Session& s = the_session();
  if (s.path.empty()) return "";
  static std::atomic<bool> dumped{false};
  if (dumped.exchange(true)) return "";
  const std::string path = rank_file();
  try {
    RankEvents mine{.rank = s.rank, .host = s.host, .offset_ns = s.offset_ns, .residual_ns = s.residual_ns};
    std::vector<std::string> table;
    if (in_signal) {
      if (!try_snapshot(mine.events, &mine.dropped, table)) {
        return "its timeline was not written: the crashed thread may hold the timeline's table";
      }
    } else {
      mine.events = snapshot(&mine.dropped);
      table = names();
    }
    mine.events.insert(mine.events.end(), running.begin(), running.end());
    mine.calls_here = s.rank == 0;
    nlohmann::json trace = chrome_trace({mine}, table, true);
    trace["otherData"]["meshrt"]["rank"] = s.rank;
    trace["otherData"]["meshrt"]["reason"] = std::string(reason);
    write_json(path, trace, fmt::format("MESHRT_TRACE={} (this rank's file)", s.path));
    return fmt::format("its timeline so far ({} events): {} (meshrt-trace merge joins the ranks' files)",
                       mine.events.size(), path);
  } catch (const std::exception& e) {
    return fmt::format("its timeline was not written: {}", e.what());
  }
}

}  // namespace meshrt::detail::trace
