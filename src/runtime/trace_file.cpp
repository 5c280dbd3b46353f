#include "runtime/trace_file.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>

#include <nlohmann/json.hpp>

#include "common/checks.hpp"
#include "common/trace.hpp"
#include "meshrt/error.hpp"
#include "meshrt/internal/protocol.hpp"

namespace meshrt::detail {

namespace {
constexpr int kTag = 17;
constexpr int kRounds = 16;
constexpr std::size_t kHost = 64;
}  // namespace

ClockOffsets measure_clock_offsets(MPI_Comm comm) {
  int rank = 0, size = 1;
  MESHRT_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  MESHRT_MPI_CHECK(MPI_Comm_size(comm, &size));
  ClockOffsets c;
  if (rank == 0) {
    c.offset_ns.assign(static_cast<std::size_t>(size), 0);
    c.residual_ns.assign(static_cast<std::size_t>(size), 0);
    for (int r = 1; r < size; ++r) {
      std::int64_t best = std::numeric_limits<std::int64_t>::max();
      for (int k = 0; k < kRounds; ++k) {
        const std::int64_t t0 = trace::now_ns();
        std::int64_t t1 = 0;
        MESHRT_MPI_CHECK(MPI_Send(&t0, 1, MPI_INT64_T, r, kTag, comm));
        MESHRT_MPI_CHECK(MPI_Recv(&t1, 1, MPI_INT64_T, r, kTag, comm, MPI_STATUS_IGNORE));
        const std::int64_t t2 = trace::now_ns();
        if (t2 - t0 < best) {
          best = t2 - t0;
          c.offset_ns[static_cast<std::size_t>(r)] = t1 - (t0 + t2) / 2;
          c.residual_ns[static_cast<std::size_t>(r)] = (t2 - t0) / 2;
        }
      }
    }
  } else {
    for (int k = 0; k < kRounds; ++k) {
      std::int64_t t0 = 0;
      MESHRT_MPI_CHECK(MPI_Recv(&t0, 1, MPI_INT64_T, 0, kTag, comm, MPI_STATUS_IGNORE));
      const std::int64_t t1 = trace::now_ns();
      MESHRT_MPI_CHECK(MPI_Send(&t1, 1, MPI_INT64_T, 0, kTag, comm));
    }
  }
  return c;
}

namespace {

// "Reduce reduce sum over 'gpu'": the command's kind, and what the controller called it.
std::string command_name(const trace::Event& e, const std::map<std::uint64_t, std::string>& calls) {
  std::string n(protocol::command_name(e.type));
  if (const auto it = calls.find(e.ident); e.ident != 0 && it != calls.end()) n += " " + it->second;
  return n;
}

// The events of every rank, as Chrome's trace event format: X spans, s/f flows, M names.
nlohmann::json chrome_trace(const std::vector<std::vector<trace::Event>>& ranks, const std::vector<std::string>& hosts,
                            const std::vector<std::string>& names, const ClockOffsets& clocks, std::uint64_t dropped,
                            const SiteWords& site) {
  using nlohmann::json;
  // Aligned to rank 0's clock, from the first event.
  auto aligned = [&](std::size_t r, std::int64_t t) { return t - clocks.offset_ns[r]; };
  std::int64_t base = std::numeric_limits<std::int64_t>::max();
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    for (const trace::Event& e : ranks[r]) {
      base = std::min(base, aligned(r, e.kind == trace::Kind::Command ? e.queued_ns : e.start_ns));
    }
  }
  auto us = [&](std::size_t r, std::int64_t t) { return static_cast<double>(aligned(r, t) - base) / 1000.0; };
  json events = json::array();
  auto name_of = [&](std::uint64_t i) { return i < names.size() ? names[i] : std::string("?"); };
  std::map<std::uint64_t, std::string> calls;  // idents the controller issued (flows start there), by name
  for (const trace::Event& e : ranks[0]) {
    if (e.track == trace::Track::Controller && e.kind == trace::Kind::Call) calls[e.ident] = name_of(e.a);
  }
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    const int pid = static_cast<int>(r);
    events.push_back({{"ph", "M"},
                      {"name", "process_name"},
                      {"pid", pid},
                      {"args", {{"name", fmt::format("rank {} on {}", r, hosts[r])}}}});
    events.push_back({{"ph", "M"}, {"name", "process_sort_index"}, {"pid", pid}, {"args", {{"sort_index", pid}}}});
    events.push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", pid}, {"tid", 1}, {"args", {{"name", "worker"}}}});
    if (r == 0) {
      events.push_back(
          {{"ph", "M"}, {"name", "thread_name"}, {"pid", pid}, {"tid", 0}, {"args", {{"name", "controller"}}}});
    }
    for (const trace::Event& e : ranks[r]) {
      const double ts = us(r, e.start_ns);
      const double dur = std::max(us(r, e.end_ns) - ts, 0.0);
      switch (e.kind) {
        case trace::Kind::Call: {
          json args{{"ident", e.ident}};
          const std::source_location where = trace::Event::site(e.b);
          if (r == 0 && where.line() != 0) args["site"] = site(where, trace::Event::site(e.c));
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
        case trace::Kind::Wait:
          events.push_back({{"ph", "X"},
                            {"cat", "wait"},
                            {"name", "wait: " + name_of(e.a)},
                            {"pid", pid},
                            {"tid", 0},
                            {"ts", ts},
                            {"dur", dur},
                            {"args", {{"ident", e.ident}}}});
          break;
        case trace::Kind::Command: {
          json args{{"ident", e.ident}, {"queued_us", static_cast<double>(e.start_ns - e.queued_ns) / 1000.0}};
          if (e.a) args["bytes"] = e.a;
          if (e.b) args["replay"] = e.b;
          if (e.failed) args["failed"] = true;
          events.push_back({{"ph", "X"},
                            {"cat", e.failed ? "command,failed" : "command"},
                            {"name", command_name(e, calls)},
                            {"pid", pid},
                            {"tid", 1},
                            {"ts", ts},
                            {"dur", dur},
                            {"args", args}});
          if (e.ident != 0 && calls.count(e.ident)) {
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
  const std::int64_t residual =
      clocks.residual_ns.empty() ? 0 : *std::max_element(clocks.residual_ns.begin(), clocks.residual_ns.end());
  return json{{"traceEvents", std::move(events)},
              {"displayTimeUnit", "ms"},
              {"otherData",
               {{"meshrt",
                 {{"ranks", ranks.size()},
                  {"clock_residual_us", static_cast<double>(residual) / 1000.0},
                  {"dropped_events", dropped}}}}}};
}

}  // namespace

std::uint64_t write_trace_file(MPI_Comm comm, const std::string& path, const ClockOffsets& clocks,
                               const SiteWords& site) {
  int rank = 0, size = 1;
  MESHRT_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  MESHRT_MPI_CHECK(MPI_Comm_size(comm, &size));
  std::uint64_t dropped = 0;
  std::vector<trace::Event> mine = trace::take_all(&dropped);
  std::uint64_t all_dropped = 0;
  MESHRT_MPI_CHECK(MPI_Reduce(&dropped, &all_dropped, 1, MPI_UINT64_T, MPI_SUM, 0, comm));
  // What MPI can count in an int: the newest events beyond it are dropped.
  const std::size_t limit = static_cast<std::size_t>(INT_MAX) / sizeof(trace::Event);
  if (mine.size() > limit) mine.resize(limit);
  const int bytes = static_cast<int>(mine.size() * sizeof(trace::Event));
  char host[kHost] = {};
  gethostname(host, kHost - 1);
  std::vector<int> counts(static_cast<std::size_t>(size)), displs(static_cast<std::size_t>(size));
  std::vector<char> hosts(rank == 0 ? kHost * static_cast<std::size_t>(size) : 0);
  MESHRT_MPI_CHECK(MPI_Gather(&bytes, 1, MPI_INT, counts.data(), 1, MPI_INT, 0, comm));
  MESHRT_MPI_CHECK(MPI_Gather(host, kHost, MPI_CHAR, hosts.data(), kHost, MPI_CHAR, 0, comm));
  std::vector<trace::Event> all;
  if (rank == 0) {
    std::size_t total = 0;
    for (int r = 0; r < size; ++r) {
      displs[static_cast<std::size_t>(r)] = static_cast<int>(total);
      total += static_cast<std::size_t>(counts[static_cast<std::size_t>(r)]);
      if (total > static_cast<std::size_t>(INT_MAX))
        throw Error(
            fmt::format("MESHRT_TRACE: the ranks recorded {} bytes of events, more than one gather carries", total));
    }
    all.resize(total / sizeof(trace::Event));
  }
  MESHRT_MPI_CHECK(
      MPI_Gatherv(mine.data(), bytes, MPI_BYTE, all.data(), counts.data(), displs.data(), MPI_BYTE, 0, comm));
  if (rank != 0) return 0;
  // Rank 0's own events keep their call sites (pointers into this process).
  std::vector<std::vector<trace::Event>> ranks(static_cast<std::size_t>(size));
  ranks[0] = std::move(mine);
  std::vector<std::string> names(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) {
    names[static_cast<std::size_t>(r)] = std::string(&hosts[kHost * static_cast<std::size_t>(r)]);
    if (r == 0) continue;
    const auto first = all.begin() + displs[static_cast<std::size_t>(r)] / static_cast<int>(sizeof(trace::Event));
    ranks[static_cast<std::size_t>(r)].assign(
        first, first + counts[static_cast<std::size_t>(r)] / static_cast<int>(sizeof(trace::Event)));
    for (trace::Event& e : ranks[static_cast<std::size_t>(r)]) {
      if (e.kind != trace::Kind::Command) e.b = e.c = 0;  // call sites are rank 0's pointers
    }
  }
  std::uint64_t n = 0;
  for (const auto& r : ranks) n += r.size();
  std::ofstream out(path);
  out << chrome_trace(ranks, names, trace::names(), clocks, all_dropped, site).dump() << '\n';
  if (!out) {
    throw Error(fmt::format("MESHRT_TRACE={}: expected a file rank 0 can write, found it cannot: {}", path,
                            std::strerror(errno)));
  }
  return n;
}

}  // namespace meshrt::detail
