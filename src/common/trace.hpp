// The timeline's records (docs/running.md, "A timeline of the run"): with MESHRT_TRACE
// set (or after Controller::start_trace), each thread appends one-cache-line events to a
// ring of its own (no lock, no allocation once its ring is mapped, no formatting; a call's
// name is a number in a table of names, looked up once per name); a thread that ends
// leaves its ring, events and all, to the next new thread. The files are written by
// common/timeline.hpp. Off, recording costs one load of a flag and a branch.
#pragma once

#include <atomic>
#include <bit>
#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "meshrt/call_site.hpp"

namespace meshrt::detail::trace {

enum class Track : std::uint8_t { Controller = 0, Worker = 1 };
// Call: a controller call that issued an invocation; Wait: a wait on the controller;
// Command: a worker's command; Flush: a batch of commands the controller sent; Mark: an
// instant on the controller (a restart); Device: a task a device stream ran (emulated), or
// a command's work on a CUDA stream (device::trace_command_begin).
enum class Kind : std::uint8_t { Call = 0, Wait = 1, Command = 2, Flush = 3, Mark = 4, Device = 5 };

// One cache line: writing an event costs one line, not three.
struct alignas(64) Event {
  std::int64_t start_ns = 0;  // steady_clock, this rank's
  std::int64_t end_ns = 0;
  std::uint64_t ident = 0;     // a call and the commands that run it share it (the flow)
  std::int64_t queued_ns = 0;  // a command: when it was queued
  std::uint64_t a = 0;         // a command, a flush: its bytes; a call, a wait, a mark: its name (intern())
  std::uint64_t b = 0;  // a command: the recording a replay ran it from; a call: its site (intern_site); a flush:
                        // commands; a device task: its stream
  std::uint64_t c = 0;  // a call: the replay's line; a flush: destinations; a device task: its device;
                        // a command: its peers (encode_peers)
  Track track = Track::Controller;
  Kind kind = Kind::Call;
  std::uint8_t type = 0;  // a command: its protocol tag; a device task: 0 emulated, 1 cuda
  bool failed = false;
  bool unfinished = false;  // a command still running when its rank's timeline was dumped
};
static_assert(sizeof(Event) == 64 && std::is_trivially_copyable_v<Event>);

inline std::atomic<bool>& enabled_flag() noexcept {
  static std::atomic<bool> on{false};
  return on;
}
inline bool enabled() noexcept {
  return enabled_flag().load(std::memory_order_relaxed);
}
// Starts recording, each thread keeping at most `capacity` events (the newest).
void enable(std::size_t capacity) noexcept;
// Stops recording; what was recorded stays until take_all.
void disable() noexcept;

// The ident of the command this thread runs now (the worker's), which the device work it
// enqueues is recorded with.
// Initial-exec: the worker writes it for every command, and a shared library's
// thread-local otherwise costs a __tls_get_addr call; 8 bytes of the static TLS block.
[[gnu::tls_model("initial-exec")]] inline thread_local std::uint64_t current_ident = 0;

inline std::int64_t now_ns() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
inline std::int64_t ns(std::chrono::steady_clock::time_point t) noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

// A command's peers (the world ranks of a collective's line, a send's partners) in one
// word, for Event::c without allocating: an arithmetic run (first, step, count) when they
// form one, else the set of them when all are below 62, else their count alone; 0: none.
std::uint64_t encode_peers(std::span<const int> peers) noexcept;
struct Peers {
  std::vector<int> ranks;  // in the order recorded (a set: ascending); empty when only counted
  std::size_t count = 0;
};
Peers decode_peers(std::uint64_t word);

// The number of `name` in this process's table of names (a hash lookup; the name is
// copied the first time only).
std::uint64_t intern(std::string_view name);
// A call site as a number in this process's table of sites, which keeps its text's
// pointers (a site's text outlives the site: call_site.hpp); 0 is the unknown site.
std::uint64_t intern_site(const CallSite& where);
CallSite site_of(std::uint64_t id);
// The table, by number.
std::vector<std::string> names();

// Appends to this thread's ring.
void record(const Event& e);
// Every thread's events so far, oldest first per thread, and empties the rings; call once
// the threads that record have stopped (the end of a run). `dropped`: the events the
// rings overwrote.
std::vector<Event> take_all(std::uint64_t* dropped = nullptr);
// A copy of every thread's events so far, while the threads may still record: the
// rings stay. An event written during the copy may be left out.
std::vector<Event> snapshot(std::uint64_t* dropped = nullptr);
// snapshot() and names() together, for a signal handler: false, and nothing copied, when
// another thread holds the table (the handler must not wait for the thread it stopped).
bool try_snapshot(std::vector<Event>& events, std::uint64_t* dropped, std::vector<std::string>& names);

}  // namespace meshrt::detail::trace
