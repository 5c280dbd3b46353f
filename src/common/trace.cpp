#include "common/trace.hpp"

#include <array>
#include <memory>
#include <mutex>

namespace meshrt::detail::trace {
namespace {

constexpr std::size_t kBlock = 4096;

// One thread's events, in blocks, kept by the registry after the thread ends.
struct Buffer {
  std::vector<std::unique_ptr<std::array<Event, kBlock>>> blocks;
  std::size_t used = kBlock;  // in the last block
};

struct Registry {
  std::mutex mutex;
  std::vector<std::shared_ptr<Buffer>> buffers;
};

Registry& registry() {
  static Registry r;
  return r;
}

Buffer& this_thread() {
  thread_local std::shared_ptr<Buffer> mine = [] {
    auto b = std::make_shared<Buffer>();
    std::lock_guard lock(registry().mutex);
    registry().buffers.push_back(b);
    return b;
  }();
  return *mine;
}

}  // namespace

void enable() noexcept {
  enabled_flag().store(true, std::memory_order_relaxed);
}

void record(const Event& e) {
  Buffer& b = this_thread();
  if (b.used == kBlock) {
    b.blocks.push_back(std::make_unique<std::array<Event, kBlock>>());
    b.used = 0;
  }
  (*b.blocks.back())[b.used++] = e;
}

std::vector<Event> take_all() {
  std::vector<Event> out;
  std::lock_guard lock(registry().mutex);
  for (auto& b : registry().buffers) {
    for (std::size_t i = 0; i < b->blocks.size(); ++i) {
      const std::size_t n = i + 1 == b->blocks.size() ? b->used : kBlock;
      out.insert(out.end(), b->blocks[i]->begin(), b->blocks[i]->begin() + static_cast<std::ptrdiff_t>(n));
    }
    b->blocks.clear();
    b->used = kBlock;
  }
  return out;
}

}  // namespace meshrt::detail::trace
