// Counts of control messages (docs/ARCHITECTURE.md section 8): how many messages and bytes a
// rank's control transport sent and received, by kind. Plain numbers, exact (every send
// and receive of the transport is counted once per destination), so a test can assert
// them and `meshrt-bench scale` can divide them by the batches it sent.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace meshrt {

// The kinds of control message, in the order of the arrays below.
enum class MessageKind : std::uint8_t { Command = 0, Reply = 1, Query = 2, Answer = 3 };
inline constexpr int kNumMessageKinds = 4;

struct MessageCount {
  std::uint64_t messages = 0;
  std::uint64_t bytes = 0;
  friend bool operator==(const MessageCount&, const MessageCount&) = default;
};

struct ControlTraffic {
  std::array<MessageCount, kNumMessageKinds> sent{};
  std::array<MessageCount, kNumMessageKinds> received{};

  const MessageCount& sent_of(MessageKind k) const { return sent[static_cast<std::size_t>(k)]; }
  const MessageCount& received_of(MessageKind k) const { return received[static_cast<std::size_t>(k)]; }
  MessageCount sent_total() const;
  MessageCount received_total() const;
  // What happened between `before` and this snapshot.
  ControlTraffic since(const ControlTraffic& before) const;
  // {"sent":{"Command":{"messages":..,"bytes":..},...},"received":{...}}
  std::string to_json() const;
  friend bool operator==(const ControlTraffic&, const ControlTraffic&) = default;
};

std::string_view name(MessageKind k) noexcept;

}  // namespace meshrt
