#include "worker/monitor.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include "common/trace.hpp"
#include "meshrt/internal/stacks.hpp"

namespace meshrt::detail {
namespace {

using Clock = std::chrono::steady_clock;

const char* state_name(CommandState s) {
  switch (s) {
    case CommandState::Queued:
      return "queued";
    case CommandState::Running:
      return "running";
    case CommandState::Done:
      return "done";
    case CommandState::Failed:
      return "failed";
  }
  return "?";
}

double seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

}  // namespace

Monitor::Monitor(int rank, std::size_t capacity) : rank_(rank), capacity_(std::max<std::size_t>(capacity, 1)) {
  char name[256] = {};
  host_ = gethostname(name, sizeof name - 1) == 0 ? name : "?";
  ring_.resize(capacity_);
}

CommandRecord& Monitor::claim_slot(Clock::time_point arrived) {
  const std::uint64_t seq = next_seq_++;
  CommandRecord& slot = ring_[seq % capacity_];
  // Field by field: the slot keeps its strings' and peers' buffers from one command to
  // the next, where assigning a fresh record would free and allocate them.
  slot.seq = seq;
  clear_command(slot);
  slot.replay = 0;
  slot.replay_step = 0;
  slot.replay_commands = 0;
  slot.keep = false;
  slot.at.queued = arrived;
  slot.at.started = slot.at.ended = {};
  slot.state = CommandState::Queued;
  return slot;
}

void Monitor::clear_command(CommandRecord& r) {
  r.ident = 0;
  r.kind = "";
  r.tag = 0;
  r.name.clear();
  r.result = 0;
  r.mesh = 0;
  r.stream = 0;
  r.dim.clear();
  r.bytes = 0;
  r.peers.clear();
}

void Monitor::running(std::uint64_t seq) {
  std::lock_guard lock(mutex_);
  running_locked(seq, Clock::now());
}

void Monitor::finished_then_running(std::uint64_t done, bool failed, std::uint64_t next) {
  std::lock_guard lock(mutex_);
  const Clock::time_point now = Clock::now();
  finished_locked(done, failed, now);
  running_locked(next, now);
}

void Monitor::running_locked(std::uint64_t seq, Clock::time_point now) {
  CommandRecord& r = ring_[seq % capacity_];
  if (r.seq != seq) return;  // overwritten: the recorder is smaller than the queue
  r.state = CommandState::Running;
  r.at.started = now;
  worker_thread_.store(this_thread_id(), std::memory_order_relaxed);
  current_.store(seq);
  trace::current_ident = r.ident;
}

void Monitor::describe(std::uint64_t seq, std::string_view name, std::span<const int> peers, std::uint64_t bytes) {
  std::lock_guard lock(mutex_);
  CommandRecord& r = ring_[seq % capacity_];
  if (r.seq != seq || r.keep) return;  // a replay's entry keeps naming its failed command
  r.name.assign(name);
  r.peers.assign(peers.begin(), peers.end());
  if (bytes) r.bytes = bytes;
}

trace::Event Monitor::trace_event(const CommandRecord& r) {
  trace::Event e;
  e.track = trace::Track::Worker;
  e.kind = trace::Kind::Command;
  e.start_ns = trace::ns(r.at.started);
  e.end_ns = trace::ns(r.at.ended);
  e.queued_ns = trace::ns(r.at.queued);
  e.ident = r.ident;
  e.a = r.bytes;
  e.b = r.replay;
  e.c = trace::encode_peers(r.peers);
  e.type = r.tag;
  e.failed = r.state == CommandState::Failed;
  return e;
}

std::vector<trace::Event> Monitor::running_events() const {
  std::lock_guard lock(mutex_);
  const auto now = Clock::now();
  std::vector<trace::Event> out;
  for (const CommandRecord& r : ring_) {
    if (r.seq == 0 || r.state != CommandState::Running) continue;
    CommandRecord open = r;
    open.at.ended = now;
    trace::Event e = trace_event(open);
    e.unfinished = true;
    out.push_back(e);
  }
  return out;
}

void Monitor::finished(std::uint64_t seq, bool failed) {
  std::lock_guard lock(mutex_);
  finished_locked(seq, failed, Clock::now());
}

void Monitor::replay_failed(std::uint64_t seq) {
  std::lock_guard lock(mutex_);
  CommandRecord& r = ring_[seq % capacity_];
  if (r.seq == seq) r.keep = true;
}

void Monitor::replay_finished(std::uint64_t seq, bool failed) {
  std::lock_guard lock(mutex_);
  CommandRecord& r = ring_[seq % capacity_];
  if (r.seq == seq && failed) r.keep = true;
  if (in_flight_.load() != seq) finished_locked(seq, failed, Clock::now());
}

void Monitor::finished_locked(std::uint64_t seq, bool failed, Clock::time_point now) {
  CommandRecord& r = ring_[seq % capacity_];
  if (r.seq == seq) {
    // A replay whose command failed stays failed when an operation of it ends later.
    if (failed) r.keep = true;
    r.state = failed || r.keep ? CommandState::Failed : CommandState::Done;
    r.at.ended = now;
    if (trace::enabled()) trace::record(trace_event(r));
  }
  std::erase(on_device_, seq);
  // The operation still in flight, if any, is current again (InFlight clears in_flight
  // before it finishes that operation itself, so this is never `seq`), else the oldest
  // call whose host tasks still run.
  std::uint64_t next = in_flight_.load();
  if (next == 0 && !on_device_.empty()) next = on_device_.front();
  std::uint64_t expected = seq;
  current_.compare_exchange_strong(expected, next);
}

void Monitor::on_device(std::uint64_t seq) {
  std::lock_guard lock(mutex_);
  on_device_.push_back(seq);
}

void Monitor::reset_queue() {
  std::lock_guard lock(mutex_);
  for (auto& r : ring_) {
    if (r.seq != 0 && (r.state == CommandState::Queued || r.state == CommandState::Running)) {
      r.state = CommandState::Failed;
      r.at.ended = Clock::now();
    }
  }
  current_.store(0);
  in_flight_.store(0);
  on_device_.clear();
  first_uncompleted_.store(0);
}

std::string Monitor::line(const CommandRecord& r, Clock::time_point now) {
  std::string what = r.kind;
  if (!r.name.empty()) what += " " + r.name;
  if (r.ident) what += fmt::format(" (invocation {})", r.ident);
  if (r.result) what += fmt::format(" [result ref {}]", r.result);
  if (!r.dim.empty()) what += fmt::format(" dim '{}'", r.dim);
  if (r.replay && r.replay_step == 0) {
    what += fmt::format(" (replay of recording {}, {} commands)", r.replay, r.replay_commands);
  } else if (r.replay) {
    what += fmt::format(" (replay of recording {}, command {} of {})", r.replay, r.replay_step, r.replay_commands);
  }
  const double age = seconds(now - r.at.queued);
  std::string timing;
  switch (r.state) {
    case CommandState::Queued:
      timing = fmt::format("queued {:.3f} s ago", age);
      break;
    case CommandState::Running:
      timing = fmt::format("running for {:.3f} s", seconds(now - r.at.started));
      break;
    default:
      timing = fmt::format("took {:.6f} s, ended {:.3f} s ago", seconds(r.at.ended - r.at.started),
                           seconds(now - r.at.ended));
  }
  return fmt::format("  #{:<8} {:<8} {}; {}", r.seq, state_name(r.state), what, timing);
}

nlohmann::json Monitor::state() const {
  std::lock_guard lock(mutex_);
  nlohmann::json j{{"rank", rank_}, {"first_uncompleted", first_uncompleted_.load()}};
  const auto now = Clock::now();
  std::size_t queued = 0;
  for (const auto& r : ring_) {
    if (r.seq != 0 && r.state == CommandState::Queued) ++queued;
  }
  j["queued"] = queued;
  const std::uint64_t cur = current_.load();
  const CommandRecord* r = cur ? &ring_[cur % capacity_] : nullptr;
  if (r && r->seq == cur) {
    j["current"] = {
        {"kind", r->kind}, {"name", r->name},   {"ident", r->ident}, {"result", r->result},
        {"dim", r->dim},   {"peers", r->peers}, {"bytes", r->bytes}, {"seconds", seconds(now - r->at.started)}};
    if (r->replay) {
      j["current"]["replay"] = {
          {"recording", r->replay}, {"command", r->replay_step}, {"commands", r->replay_commands}};
    }
  } else {
    j["current"] = nullptr;
  }
  return j;
}

std::string Monitor::dump(std::size_t limit) const {
  std::lock_guard lock(mutex_);
  const auto now = Clock::now();
  const std::size_t keep = std::min(limit, capacity_);
  std::string out =
      fmt::format("flight recorder of rank {} on {} (oldest first, the last {} commands):\n", rank_, host_, keep);
  const std::uint64_t first = next_seq_ > keep ? next_seq_ - keep : 1;
  for (std::uint64_t s = first; s < next_seq_; ++s) {
    const CommandRecord& r = ring_[s % capacity_];
    if (r.seq == s) out += line(r, now) + "\n";
  }
  return out;
}

std::string Monitor::recent(std::size_t limit) const {
  std::lock_guard lock(mutex_);
  const auto now = Clock::now();
  const std::uint64_t oldest = next_seq_ > capacity_ ? next_seq_ - capacity_ : 1;
  std::vector<const CommandRecord*> started;
  std::size_t queued = 0;
  for (std::uint64_t s = next_seq_; s-- > oldest && started.size() < limit;) {
    const CommandRecord& r = ring_[s % capacity_];
    if (r.seq != s) continue;
    if (r.state == CommandState::Queued) {
      ++queued;
    } else {
      started.push_back(&r);
    }
  }
  if (started.empty() && queued > 0) {
    return fmt::format(
        "flight recorder of rank {} on {}: all of its {} entries are queued commands; the one running, if any, came "
        "before them (MESHRT_FLIGHT_RECORDER keeps more)\n",
        rank_, host_, queued);
  }
  std::string out = fmt::format("flight recorder of rank {} on {} (the last {} commands that ran, oldest first", rank_,
                                host_, started.size());
  out += queued ? fmt::format("; {} more queued behind them):\n", queued) : "):\n";
  for (auto it = started.rbegin(); it != started.rend(); ++it) out += line(**it, now) + "\n";
  return out;
}

std::string Monitor::current_unlocked() const {
  const std::uint64_t cur = current_.load();
  if (cur == 0) return "no command (idle in the event loop)";
  const CommandRecord& r = ring_[cur % capacity_];
  return line(r, Clock::now());
}

}  // namespace meshrt::detail
