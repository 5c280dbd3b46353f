// The timeline's records (docs/running.md, "A timeline of the run"): with MESHRT_TRACE
// set, each thread appends fixed-size events to a buffer of its own (no lock, no
// allocation but one block per 4096 events, no formatting); at the end of the run the
// runtime gathers every rank's events to rank 0, which writes one Chrome-trace file
// (runtime/trace_file.cpp). Off, recording costs one load of a flag and a branch.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <source_location>
#include <string_view>
#include <vector>

namespace meshrt::detail::trace {

enum class Track : std::uint8_t { Controller = 0, Worker = 1 };
enum class Kind : std::uint8_t { Call = 0, Wait = 1, Command = 2 };

struct Event {
  std::int64_t start_ns = 0;  // steady_clock, this rank's
  std::int64_t end_ns = 0;
  std::int64_t queued_ns = 0;  // a command: when it was queued
  std::uint64_t ident = 0;     // a call and the commands that run it share it (the flow)
  std::uint64_t bytes = 0;
  std::uint64_t replay = 0;      // a command run by a replay: the recording's ref
  std::source_location where{};  // a call: its line (meaningful on rank 0 only)
  std::source_location replayed_at{};
  Track track = Track::Controller;
  Kind kind = Kind::Call;
  bool failed = false;
  char type[20] = {};  // a command's kind: "CallFunction", "Reduce", ...
  char name[64] = {};  // truncated
  char dim[24] = {};

  static void copy(char* to, std::size_t size, std::string_view from) noexcept {
    const std::size_t n = from.size() < size - 1 ? from.size() : size - 1;
    std::memcpy(to, from.data(), n);
    to[n] = '\0';
  }
};

inline std::atomic<bool>& enabled_flag() noexcept {
  static std::atomic<bool> on{false};
  return on;
}
inline bool enabled() noexcept {
  return enabled_flag().load(std::memory_order_relaxed);
}
void enable() noexcept;

inline std::int64_t now_ns() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
inline std::int64_t ns(std::chrono::steady_clock::time_point t) noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

// Appends to this thread's buffer.
void record(const Event& e);
// Every thread's events so far, and empties the buffers; call once the threads that
// record have stopped (the end of a run).
std::vector<Event> take_all();

}  // namespace meshrt::detail::trace
