// Counting control messages: the Transport's non-virtual send and receive, and the
// snapshot arithmetic of ControlTraffic.
#include <fmt/format.h>

#include <thread>

#include "meshrt/internal/control.hpp"
#include "meshrt/traffic.hpp"

namespace meshrt {

std::string_view name(MessageKind k) noexcept {
  switch (k) {
    case MessageKind::Command:
      return "Command";
    case MessageKind::Reply:
      return "Reply";
    case MessageKind::Query:
      return "Query";
    case MessageKind::Answer:
      return "Answer";
  }
  return "unknown";
}

namespace {
MessageCount total(const std::array<MessageCount, kNumMessageKinds>& counts) {
  MessageCount t;
  for (const auto& c : counts) {
    t.messages += c.messages;
    t.bytes += c.bytes;
  }
  return t;
}
}  // namespace

MessageCount ControlTraffic::sent_total() const {
  return total(sent);
}
MessageCount ControlTraffic::received_total() const {
  return total(received);
}

ControlTraffic ControlTraffic::since(const ControlTraffic& before) const {
  ControlTraffic d;
  for (std::size_t k = 0; k < sent.size(); ++k) {
    d.sent[k] = {sent[k].messages - before.sent[k].messages, sent[k].bytes - before.sent[k].bytes};
    d.received[k] = {received[k].messages - before.received[k].messages, received[k].bytes - before.received[k].bytes};
  }
  return d;
}

std::string ControlTraffic::to_json() const {
  auto side = [](const std::array<MessageCount, kNumMessageKinds>& counts) {
    std::string out = "{";
    for (std::size_t k = 0; k < counts.size(); ++k) {
      out += fmt::format(R"({}"{}":{{"messages":{},"bytes":{}}})", k == 0 ? "" : ",", name(static_cast<MessageKind>(k)),
                         counts[k].messages, counts[k].bytes);
    }
    return out + "}";
  };
  return R"({"sent":)" + side(sent) + R"(,"received":)" + side(received) + "}";
}

namespace control {

namespace {
// The process-wide sums behind process_traffic(); relaxed: they are statistics, read
// after the fact, and order nothing.
struct ProcessCounters {
  std::array<std::atomic<std::uint64_t>, kNumMessageKinds> sent_messages{}, sent_bytes{}, received_messages{},
      received_bytes{};
};
ProcessCounters& process_counters() {
  static ProcessCounters counters;
  return counters;
}

std::size_t index_of(Tag tag) {
  const int k = static_cast<int>(kind_of(tag));
  return k >= 0 && k < kNumMessageKinds ? static_cast<std::size_t>(k) : 0;
}
}  // namespace

void Transport::send(const std::vector<int>& dests, Tag tag, std::shared_ptr<const Bytes> bytes) {
  const std::size_t k = index_of(tag);
  const std::uint64_t n = dests.size();
  const std::uint64_t size = bytes->size();
  do_send(dests, tag, std::move(bytes));
  // Counted once the implementation accepted the sends (it throws for a message too big).
  sent_[k].messages.fetch_add(n, std::memory_order_relaxed);
  sent_[k].bytes.fetch_add(n * size, std::memory_order_relaxed);
  auto& p = process_counters();
  p.sent_messages[k].fetch_add(n, std::memory_order_relaxed);
  p.sent_bytes[k].fetch_add(n * size, std::memory_order_relaxed);
}

void Transport::wait_ring(Tag, std::uint64_t, std::chrono::microseconds d) {
  std::this_thread::sleep_for(d);
}

bool Transport::try_receive(int source, Tag tag, Bytes& out, int* from) {
  if (!do_try_receive(source, tag, out, from)) return false;
  const std::size_t k = index_of(tag);
  received_[k].messages.fetch_add(1, std::memory_order_relaxed);
  received_[k].bytes.fetch_add(out.size(), std::memory_order_relaxed);
  auto& p = process_counters();
  p.received_messages[k].fetch_add(1, std::memory_order_relaxed);
  p.received_bytes[k].fetch_add(out.size(), std::memory_order_relaxed);
  return true;
}

ControlTraffic Transport::traffic() const {
  ControlTraffic t;
  for (std::size_t k = 0; k < t.sent.size(); ++k) {
    t.sent[k] = {sent_[k].messages.load(std::memory_order_relaxed), sent_[k].bytes.load(std::memory_order_relaxed)};
    t.received[k] = {received_[k].messages.load(std::memory_order_relaxed),
                     received_[k].bytes.load(std::memory_order_relaxed)};
  }
  return t;
}

ControlTraffic process_traffic() {
  const auto& p = process_counters();
  ControlTraffic t;
  for (std::size_t k = 0; k < t.sent.size(); ++k) {
    t.sent[k] = {p.sent_messages[k].load(std::memory_order_relaxed), p.sent_bytes[k].load(std::memory_order_relaxed)};
    t.received[k] = {p.received_messages[k].load(std::memory_order_relaxed),
                     p.received_bytes[k].load(std::memory_order_relaxed)};
  }
  return t;
}

}  // namespace control
}  // namespace meshrt
