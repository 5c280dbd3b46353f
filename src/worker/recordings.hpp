// A worker's recorded steps (docs/ARCHITECTURE.md section 3.9): the commands of each
// DefineRecording, decoded and checked once, and their instantiation for a replay. A
// CallRecording becomes the recorded commands with the replay's refs and idents, and a
// DeleteRefs of the step's temporaries at its end: queued as if the controller had sent
// them, without decoding anything.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <unordered_map>
#include <vector>

#include "meshrt/internal/protocol.hpp"

namespace meshrt::detail {

class Recordings {
 public:
  explicit Recordings(int rank) : rank_(rank) {}

  bool empty() const noexcept { return recordings_.empty(); }
  std::size_t size() const noexcept { return recordings_.size(); }
  // Keeps `d` under its ref; ProtocolError (naming the command) when a command's local ref
  // or ident offset is outside the recording's ranges, or the ref is taken.
  void define(protocol::DefineRecording&& d);
  // Passes each command of the replay to `queue` in order, with its place in the
  // recording (from 1; 0 for the closing delete). ProtocolError for an unknown recording
  // or a wrong number of actuals.
  void expand(const protocol::CallRecording& call,
              const std::function<void(protocol::Command&&, std::uint32_t step)>& queue) const;
  // Forgets the recordings among `refs` (a DeleteRefs: the controller dropped the last handle).
  void forget(const std::vector<Ref>& refs);

 private:
  int rank_;
  std::unordered_map<std::uint64_t, std::shared_ptr<const protocol::DefineRecording>> recordings_;
};

}  // namespace meshrt::detail
