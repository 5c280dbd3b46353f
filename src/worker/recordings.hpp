// A worker's recorded steps (docs/ARCHITECTURE.md section 3.9): the commands of each
// DefineRecording, decoded and checked once, and their instances for a replay. A replay
// runs the recorded commands in place: each Recording keeps one instance of its commands
// whose refs and idents a replay rewrites (Recording::step), every other field being the
// recorded one, so a replay copies, queues and records no command of its own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "meshrt/internal/protocol.hpp"

namespace meshrt::detail {

class Recording {
 public:
  explicit Recording(protocol::DefineRecording&& d);

  std::uint64_t id() const noexcept { return define_.recording.id; }
  std::uint32_t formals() const noexcept { return define_.formals; }
  // The recorded commands (the flight recorder's count of a replay).
  std::size_t commands() const noexcept { return instance_.size(); }
  // The recorded commands, and a DeleteRefs of the step's temporaries at its end when it
  // has any.
  std::size_t steps() const noexcept { return instance_.size() + (define_.temporaries.empty() ? 0 : 1); }
  // Step `i` (from 0) as replay `call` runs it: the recorded command with the replay's refs
  // and idents. Valid until the next call of step(); a replay runs only while no other
  // replay of this recording runs (a worker runs them in order).
  protocol::Command& step(std::size_t i, const protocol::CallRecording& call);
  // Where step `i` is in the recording as the flight recorder says it: from 1, 0 for the
  // closing delete.
  std::uint32_t place(std::size_t i) const noexcept {
    return i < instance_.size() ? static_cast<std::uint32_t>(i + 1) : 0;
  }

 private:
  const protocol::DefineRecording define_;
  std::vector<protocol::Command> instance_;  // define_.commands with the last replay's refs
  protocol::Command deletes_;                // the closing DeleteRefs
};

class Recordings {
 public:
  explicit Recordings(int rank) : rank_(rank) {}

  bool empty() const noexcept { return recordings_.empty(); }
  std::size_t size() const noexcept { return recordings_.size(); }
  // Keeps `d` under its ref; ProtocolError (naming the command) when a command's local ref
  // or ident offset is outside the recording's ranges, or the ref is taken.
  void define(protocol::DefineRecording&& d);
  // The recording `call` replays, checked against it: a replay queued before the last
  // handle is dropped keeps it. ProtocolError for an unknown recording or a wrong number of
  // actuals.
  std::shared_ptr<Recording> find(const protocol::CallRecording& call) const;
  // Forgets the recordings among `refs` (a DeleteRefs: the controller dropped the last handle).
  void forget(const std::vector<Ref>& refs);

 private:
  int rank_;
  std::unordered_map<std::uint64_t, std::shared_ptr<Recording>> recordings_;
};

}  // namespace meshrt::detail
