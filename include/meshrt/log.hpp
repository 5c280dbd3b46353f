// meshrt's logging. Records carry the rank and the thread's role ("controller",
// "worker 3"); the level comes from MESHRT_LOG_LEVEL (default warning) and each rank can
// also write to <MESHRT_LOG_DIR>/meshrt.rank<N>.<host>.log. Boost.Log stays inside log.cpp.
//
//   MESHRT_LOG(info) << "mesh " << id << " created";
#pragma once

#include <atomic>
#include <sstream>
#include <string>
#include <string_view>

namespace meshrt::log {

enum class Level : int { trace = 0, debug, info, warning, error, fatal, off };

// Parses "trace".."fatal"/"off" (case-insensitive); throws UsageError otherwise.
Level parse_level(std::string_view text);
std::string_view to_string(Level level);

// Sets up the sinks for this process. Safe to call again (e.g. once the rank is known);
// `rank` < 0 means "not known yet". Reads MESHRT_LOG_LEVEL and MESHRT_LOG_DIR.
void init(int rank);
// The name of rank `rank`'s file in MESHRT_LOG_DIR on this node: meshrt.rank<N>.<host>.log
// (the host name up to its first '.'), so the files of a job on many nodes name both.
std::string file_name(int rank);

// The role recorded on every record this thread writes.
void set_thread_role(std::string role);

void set_level(Level level);
Level level() noexcept;

namespace detail {
extern std::atomic<int> g_level;
void write(Level level, const char* file, int line, const std::string& message);
}  // namespace detail

inline bool enabled(Level l) noexcept {
  return static_cast<int>(l) >= detail::g_level.load(std::memory_order_relaxed);
}

// One record; written when it goes out of scope.
class Line {
 public:
  Line(Level level, const char* file, int line) : level_(level), file_(file), line_(line) {}
  Line(const Line&) = delete;
  Line& operator=(const Line&) = delete;
  ~Line() { detail::write(level_, file_, line_, stream_.str()); }
  std::ostream& stream() { return stream_; }

 private:
  Level level_;
  const char* file_;
  int line_;
  std::ostringstream stream_;
};

}  // namespace meshrt::log

#define MESHRT_LOG(lvl)                                     \
  if (!::meshrt::log::enabled(::meshrt::log::Level::lvl)) { \
  } else                                                    \
    ::meshrt::log::Line(::meshrt::log::Level::lvl, __FILE__, __LINE__).stream()
