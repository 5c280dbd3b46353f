#include "worker/inbox.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "meshrt/error.hpp"
#include "meshrt/log.hpp"
#include "worker/monitor.hpp"
#include "worker/recorder_words.hpp"
#include "worker/reporter.hpp"

namespace meshrt::detail {

using namespace protocol;

Inbox::Inbox(control::Transport& channel, Monitor& monitor, int rank)
    : channel_(channel), monitor_(monitor), rank_(rank) {}

bool Inbox::receive(Reporter& reporter) {
  bool any = false;
  // From any rank: with fan-out on, batches come from the controller or a parent.
  // Everything queued here was already forwarded to this rank's fan-out children, so none
  // of them waits on what kMaxQueued leaves in the transport.
  int from = -1;
  while (queue_.size() < kMaxQueued && channel_.try_receive(control::kAnySource, control::Tag::Command, rx_, &from)) {
    any = true;
    arrived_ = std::chrono::steady_clock::now();
    try {
      if (is_envelope(rx_)) {
        route(rx_, reporter);
      } else {
        // A bare batch comes straight from the controller, as the next number (the
        // controller envelopes every batch to a rank once one reached it through a
        // parent), so it never waits and may release envelopes that overtook it.
        ++next_envelope_;
        take(rx_);
        if (!early_.empty()) run_early(reporter);
      }
    } catch (const ProtocolError& e) {
      undecodable(e, rx_.size(), from, reporter);
    }
  }
  return any;
}

Inbox::Queued Inbox::pop() {
  Queued q = std::move(queue_.front());
  queue_.pop_front();
  return q;
}

void Inbox::route(const control::Bytes& frame, Reporter& reporter) {
  Envelope e = decode_envelope(frame);
  const auto self = std::find(e.ranks.begin(), e.ranks.end(), rank_);
  if (self == e.ranks.end()) {
    throw ProtocolError(
        fmt::format("envelope for ranks {} reached rank {}, which is not one of them", fmt::join(e.ranks, ","), rank_));
  }
  const auto position = self - e.ranks.begin();
  const auto [first, end] = tree_children(e.ranks.size(), e.fanout, position);
  if (first < end) {
    channel_.send(std::vector<int>(e.ranks.begin() + static_cast<std::ptrdiff_t>(first),
                                   e.ranks.begin() + static_cast<std::ptrdiff_t>(end)),
                  control::Tag::Command, std::make_shared<control::Bytes>(frame));
  }
  const std::uint64_t seq = e.seqs[static_cast<std::size_t>(position)];
  if (seq < next_envelope_) {
    throw ProtocolError(
        fmt::format("envelope number {} reached rank {} after number {} ran", seq, rank_, next_envelope_ - 1));
  }
  early_.emplace(seq, std::move(e.payload));
  run_early(reporter);
}

void Inbox::run_early(Reporter& reporter) {
  while (!early_.empty() && early_.begin()->first == next_envelope_) {
    const control::Bytes payload = std::move(early_.begin()->second);
    early_.erase(early_.begin());
    ++next_envelope_;
    try {
      take(payload);
    } catch (const ProtocolError& error) {
      undecodable(error, payload.size(), -1, reporter);  // the next envelopes still run
    }
  }
}

void Inbox::undecodable(const ProtocolError& e, std::size_t size, int from, Reporter& reporter) {
  MESHRT_LOG(error) << "rank " << rank_ << ": dropped an undecodable command of " << size << " bytes"
                    << (from >= 0 ? fmt::format(" from rank {}", from) : std::string()) << ": " << e.what();
  reporter.reply(RemoteFunctionFailed{.ident = 0,
                                      .error = fmt::format("undecodable command: {}", e.what()),
                                      .rank = rank_,
                                      .function = "<protocol>",
                                      .exception_type = "meshrt::ProtocolError"});
}

void Inbox::take(std::span<const std::byte> frame) {
  // Decoded straight into the queue; a frame that does not decode leaves none of its
  // commands there.
  const std::size_t first = queue_.size();
  try {
    decode_commands(frame, [&]() -> Command& {
      return queue_.emplace_back(0, Command(std::in_place_type<RequestStatus>)).command;
    });
  } catch (...) {
    queue_.erase(queue_.begin() + static_cast<std::ptrdiff_t>(first), queue_.end());
    throw;
  }
  // One take of the recorder's lock for the frame's commands.
  Monitor::Queuing recorder(monitor_, arrived_);
  std::size_t i = first;
  try {
    while (i < queue_.size()) {
      if (admit(queue_[i], recorder)) {
        ++i;
      } else {
        queue_.erase(queue_.begin() + static_cast<std::ptrdiff_t>(i));
      }
    }
  } catch (...) {
    // As if the frame's commands were queued one by one: the one refused and those after
    // it are not.
    queue_.erase(queue_.begin() + static_cast<std::ptrdiff_t>(i), queue_.end());
    throw;
  }
}

bool Inbox::admit(Queued& q, Monitor::Queuing& recorder) {
  Command& command = q.command;
  if (auto* define = std::get_if<DefineRecording>(&command)) {
    recordings_.define(std::move(*define));
    return false;
  }
  if (const auto* call = std::get_if<CallRecording>(&command)) {
    std::shared_ptr<Recording> recording = recordings_.find(*call);
    q.seq = recorder.queued([&](CommandRecord& slot) {
      record(command, slot);
      slot.replay = recording->id();
      slot.replay_commands = static_cast<std::uint32_t>(recording->commands());
    });
    q.recording = std::move(recording);
    return true;
  }
  // A recording is freed with the last handle: the replays queued before hold it.
  if (const auto* deletes = std::get_if<DeleteRefs>(&command); deletes && !recordings_.empty())
    recordings_.forget(deletes->refs);
  // Deletes are not recorded (seq 0): they can neither hang nor fail, and a loop of
  // collectives sends one per output, which would fill the recorder's ring.
  q.seq = std::holds_alternative<DeleteRefs>(command)
              ? 0
              : recorder.queued([&](CommandRecord& slot) { record(command, slot); });
  return true;
}

}  // namespace meshrt::detail
