// The timeline's files (docs/running.md, "A timeline of the run"): Chrome-trace JSON made
// from the events of common/trace.hpp, whichever module writes it: the runtime at the end
// of a run (every rank's events gathered to rank 0), the controller at write_trace() (every
// rank's answer to a trace query), and a rank on its own when the job is being ended (a
// SIGTERM, a fatal signal, an abort): one file per rank, `meshrt-trace merge` joins them.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/trace.hpp"
#include "meshrt/call_site.hpp"

namespace meshrt::detail::trace {

// Formats a call's line (and its replay's) as the controller's errors do.
using SiteWords = std::function<std::string(const CallSite&, const CallSite&)>;

// What this process knows of the job's timeline, set once at start before any thread
// reads it (Runtime), read-only after.
struct Session {
  int rank = 0;
  int size = 1;
  std::string host;
  std::string path;  // MESHRT_TRACE (every rank's copy of rank 0's); empty: none
  // This rank's steady clock minus rank 0's, and how far that may be off; on rank 0 the
  // same for every rank (write_trace aligns them all).
  std::int64_t offset_ns = 0, residual_ns = 0;
  std::vector<std::int64_t> offsets_ns, residuals_ns;
  std::size_t capacity = 0;  // MESHRT_TRACE_EVENTS
  SiteWords site;
  std::function<std::string_view(std::uint8_t)> command;  // a protocol tag's name
};
void set_session(Session s);
const Session& session();

// One rank's events for a file.
struct RankEvents {
  int rank = 0;
  std::string host;
  std::vector<Event> events;
  std::int64_t offset_ns = 0, residual_ns = 0;
  std::uint64_t dropped = 0;
  bool calls_here = false;  // rank 0's process: its Call and Wait events are the controller's
};

// Writes Chrome's trace event format to `path`: X spans, s/f flows, M names; a process
// per rank. `names`: the controller's table of call names (trace::names() on rank 0).
// Times are microseconds of rank 0's clock: from the first event, or (`absolute`, a rank's
// own file) from rank 0's clock's zero, so that the files of several ranks line up when
// merged. `extra`: more fields of otherData.meshrt. Streamed as text (no document in
// memory); throws Error beginning with `what` (the setting or the call) when it cannot
// write the file.
void write_chrome_trace(const std::string& path, const std::vector<RankEvents>& ranks,
                        const std::vector<std::string>& names, bool absolute, std::string_view what,
                        const nlohmann::json& extra = nlohmann::json::object());

// This rank's own file, `<MESHRT_TRACE>.rank<N>.json` ("" when there is no timeline).
std::string rank_file();

// Writes rank_file() while the process is being ended:
// its events so far, and `running` (commands that had not finished, marked unfinished).
// Once per process; returns a line for the rank's report ("" when there is no timeline).
// `in_signal`: from a fatal signal's handler, which gives up rather than wait for a lock.
std::string dump_rank(std::string_view reason, const std::vector<Event>& running, bool in_signal = false);

}  // namespace meshrt::detail::trace
