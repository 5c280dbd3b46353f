#include "common/timeline.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <limits>
#include <map>
#include <set>
#include <utility>

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

namespace {

// JSON text of `s` without its quotes (invalid UTF-8 replaced, never thrown).
std::string escaped(std::string_view s) {
  std::string q = nlohmann::json(std::string(s)).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return q.substr(1, q.size() - 2);
}

// The file, written through a buffer of a few MiB: formatting goes straight to text, with
// no document in memory (a DOM of 2^18 events took seconds, more than a launcher waits
// after its SIGTERM).
class Out {
 public:
  Out(const std::string& path, std::string what) : what_(std::move(what)), file_(std::fopen(path.c_str(), "w")) {
    if (!file_) fail();
  }
  ~Out() {
    if (file_) std::fclose(file_);
  }
  Out(const Out&) = delete;
  Out& operator=(const Out&) = delete;

  template <class... Args>
  void event(fmt::format_string<Args...> format, Args&&... args) {
    buf_.append(std::string_view(first_ ? "\n" : ",\n"));
    first_ = false;
    fmt::format_to(std::back_inserter(buf_), format, std::forward<Args>(args)...);
    if (buf_.size() >= kFlush) flush();
  }
  void text(std::string_view s) { buf_.append(s); }
  void close() {
    flush();
    std::FILE* f = std::exchange(file_, nullptr);
    if (std::fclose(f) != 0) fail();
  }

 private:
  static constexpr std::size_t kFlush = std::size_t{4} << 20;
  void flush() {
    if (buf_.size() != 0 && std::fwrite(buf_.data(), 1, buf_.size(), file_) != buf_.size()) fail();
    buf_.clear();
  }
  [[noreturn]] void fail() {
    throw Error(fmt::format("{}: expected a file rank {} can write, found it cannot: {}", what_, the_session().rank,
                            std::strerror(errno)));
  }
  std::string what_;
  std::FILE* file_;
  fmt::memory_buffer buf_;
  bool first_ = true;
};

}  // namespace

void write_chrome_trace(const std::string& path, const std::vector<RankEvents>& ranks,
                        const std::vector<std::string>& names, bool absolute, std::string_view what,
                        const nlohmann::json& extra) {
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
  // The names, escaped once.
  std::vector<std::string> name_text;
  name_text.reserve(names.size());
  for (const std::string& n : names) name_text.push_back(escaped(n));
  const std::string unknown = "?";
  auto name_of = [&](std::uint64_t i) -> const std::string& { return i < name_text.size() ? name_text[i] : unknown; };
  // Idents the controller issued (flows start there), by name. A rank's own file holds
  // no calls but rank 0's: its flows end at every ident, and a merge keeps those whose
  // call it finds.
  std::map<std::uint64_t, const std::string*> calls;
  for (const RankEvents& r : ranks) {
    if (!r.calls_here) continue;
    for (const Event& e : r.events) {
      if (e.track == Track::Controller && e.kind == Kind::Call) calls[e.ident] = &name_of(e.a);
    }
  }
  std::vector<std::string> command_text(256);  // a protocol tag's name, escaped once
  for (std::size_t t = 0; t < command_text.size(); ++t) {
    command_text[t] =
        escaped(session.command ? session.command(static_cast<std::uint8_t>(t)) : std::string_view("command"));
  }

  Out out(path, std::string(what));
  out.text("{\"displayTimeUnit\":\"ms\",\"traceEvents\":[");
  std::int64_t residual = 0;
  std::uint64_t dropped = 0;
  for (const RankEvents& r : ranks) {
    residual = std::max(residual, r.residual_ns);
    dropped += r.dropped;
    const int pid = r.rank;
    out.event(R"({{"ph":"M","name":"process_name","pid":{},"args":{{"name":"rank {} on {}"}}}})", pid, r.rank,
              escaped(r.host));
    out.event(R"({{"ph":"M","name":"process_sort_index","pid":{},"args":{{"sort_index":{}}}}})", pid, pid);
    out.event(R"({{"ph":"M","name":"thread_name","pid":{},"tid":1,"args":{{"name":"worker"}}}})", pid);
    if (r.calls_here)
      out.event(R"({{"ph":"M","name":"thread_name","pid":{},"tid":0,"args":{{"name":"controller"}}}})", pid);
    std::set<int> streams;  // device stream tracks named so far
    for (const Event& e : r.events) {
      const double ts = us(r, e.start_ns);
      const double dur = std::max(us(r, e.end_ns) - ts, 0.0);
      const double queued_us = static_cast<double>(e.start_ns - e.queued_ns) / 1000.0;
      switch (e.kind) {
        case Kind::Call: {
          std::string site;
          const CallSite where = site_of(e.b);
          if (r.calls_here && where.line() != 0 && session.site) {
            site = fmt::format(R"(,"site":"{}")", escaped(session.site(where, site_of(e.c))));
          }
          out.event(
              R"({{"ph":"X","cat":"call","name":"{}","pid":{},"tid":0,"ts":{},"dur":1.0,"args":{{"ident":{}{}}}}})",
              name_of(e.a), pid, ts, e.ident, site);
          out.event(R"({{"ph":"s","cat":"flow","name":"dispatch","id":{},"pid":{},"tid":0,"ts":{}}})", e.ident, pid,
                    ts);
          break;
        }
        case Kind::Wait:
          out.event(
              R"({{"ph":"X","cat":"wait","name":"wait: {}","pid":{},"tid":0,"ts":{},"dur":{},"args":{{"ident":{}}}}})",
              name_of(e.a), pid, ts, dur, e.ident);
          break;
        case Kind::Flush:
          out.event(
              R"({{"ph":"X","cat":"batch","name":"send {} command{}","pid":{},"tid":0,"ts":{},"dur":{},"args":{{"commands":{},"ranks":{},"bytes":{}}}}})",
              e.b, e.b == 1 ? "" : "s", pid, ts, dur, e.b, e.c, e.a);
          break;
        case Kind::Device: {
          const int tid = 16 + static_cast<int>(e.b);
          if (streams.insert(tid).second) {
            out.event(R"({{"ph":"M","name":"thread_name","pid":{},"tid":{},"args":{{"name":"{}:{} stream {}"}}}})", pid,
                      tid, e.type == 1 ? "cuda" : "emulated", e.c, e.b);
          }
          const auto call = calls.find(e.ident);
          out.event(
              R"({{"ph":"X","cat":"device","name":"task{}{}","pid":{},"tid":{},"ts":{},"dur":{},"args":{{"ident":{},"queued_us":{}{}}}}})",
              call != calls.end() ? ": " : "", call != calls.end() ? *call->second : std::string(), pid, tid, ts, dur,
              e.ident, queued_us, e.failed ? R"(,"failed":true)" : "");
          break;
        }
        case Kind::Mark:
          out.event(R"({{"ph":"i","s":"p","cat":"mark","name":"{}","pid":{},"tid":0,"ts":{}}})", name_of(e.a), pid, ts);
          break;
        case Kind::Command: {
          // "Reduce reduce sum over 'gpu'": the command's kind, and what the controller called it.
          const auto call = calls.find(e.ident);
          const bool named = e.ident != 0 && call != calls.end();
          std::string extras;
          if (e.a) extras += fmt::format(R"(,"bytes":{})", e.a);
          if (e.b) extras += fmt::format(R"(,"replay":{})", e.b);
          if (e.c) {
            const Peers peers = decode_peers(e.c);
            extras += peers.ranks.empty() ? fmt::format(R"(,"peer_count":{})", peers.count)
                                          : fmt::format(R"(,"peers":[{}])", fmt::join(peers.ranks, ","));
          }
          if (e.failed) extras += R"(,"failed":true)";
          if (e.unfinished) extras += R"(,"unfinished":true)";
          out.event(
              R"({{"ph":"X","cat":"{}","name":"{}{}{}","pid":{},"tid":1,"ts":{},"dur":{},"args":{{"ident":{},"queued_us":{}{}}}}})",
              e.failed       ? "command,failed"
              : e.unfinished ? "command,unfinished"
                             : "command",
              command_text[e.type], named ? " " : "", named ? *call->second : std::string(), pid, ts, dur, e.ident,
              queued_us, extras);
          if (e.ident != 0 && (absolute || named)) {
            out.event(R"({{"ph":"f","bp":"e","cat":"flow","name":"dispatch","id":{},"pid":{},"tid":1,"ts":{}}})",
                      e.ident, pid, ts);
          }
          break;
        }
      }
    }
  }
  nlohmann::json meshrt{{"ranks", absolute ? session.size : static_cast<int>(ranks.size())},
                        {"clock_residual_us", static_cast<double>(residual) / 1000.0},
                        {"dropped_events", dropped}};
  for (const auto& [key, value] : extra.items()) meshrt[key] = value;
  out.text(fmt::format("\n],\"otherData\":{}}}\n", nlohmann::json{{"meshrt", meshrt}}.dump(
                                                       -1, ' ', false, nlohmann::json::error_handler_t::replace)));
  out.close();
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
    write_chrome_trace(path, {mine}, table, true, fmt::format("MESHRT_TRACE={} (this rank's file)", s.path),
                       {{"rank", s.rank}, {"reason", std::string(reason)}});
    return fmt::format("its timeline so far ({} events): {} (meshrt-trace merge joins the ranks' files)",
                       mine.events.size(), path);
  } catch (const std::exception& e) {
    return fmt::format("its timeline was not written: {}", e.what());
  }
}

}  // namespace meshrt::detail::trace
