#include "common/trace.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <unordered_map>

namespace meshrt::detail::trace {
namespace {

std::atomic<std::size_t> capacity{std::size_t{1} << 18};

// One thread's ring: mapped whole, with its pages present (MAP_POPULATE), at the thread's
// first event. Touching fresh memory as it fills cost a page fault every 64 events, which
// on a virtual machine was most of what recording cost.
struct Ring {
  Event* events = nullptr;
  std::size_t slots = 0;
  // The slot the next event goes to, and how many were ever written: atomics only so
  // that snapshot() may read them while the thread records (relaxed stores cost nothing more).
  std::atomic<std::size_t> next{0};
  std::atomic<std::uint64_t> written{0};
  ~Ring() { release(); }
  void map(std::size_t n) {
    void* p =
        mmap(nullptr, n * sizeof(Event), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    events = static_cast<Event*>(p);
    slots = n;
  }
  void release() {
    if (events != nullptr) munmap(events, slots * sizeof(Event));
    events = nullptr;
    slots = 0;
    next.store(0);
    written.store(0);
  }
};

// Looked up by string_view: a name already in the table costs a hash, no allocation.
struct NameHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
};

struct Registry {
  std::mutex mutex;
  std::vector<std::shared_ptr<Ring>> rings;
  std::unordered_map<std::string, std::uint64_t, NameHash, std::equal_to<>> by_name;
  std::vector<std::string> names;
};

Registry& registry() {
  static Registry r;
  return r;
}

Ring& this_thread() {
  thread_local std::shared_ptr<Ring> mine = [] {
    auto r = std::make_shared<Ring>();
    std::lock_guard lock(registry().mutex);
    registry().rings.push_back(r);
    return r;
  }();
  return *mine;
}

}  // namespace

void enable(std::size_t events) noexcept {
  capacity.store(events < 4096 ? 4096 : events);
  enabled_flag().store(true, std::memory_order_relaxed);
}

std::uint64_t intern(std::string_view name) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  if (const auto it = r.by_name.find(name); it != r.by_name.end()) return it->second;
  r.by_name.emplace(std::string(name), r.names.size());
  r.names.emplace_back(name);
  return r.names.size() - 1;
}

std::vector<std::string> names() {
  std::lock_guard lock(registry().mutex);
  return registry().names;
}

void disable() noexcept {
  enabled_flag().store(false, std::memory_order_relaxed);
}

void record(const Event& e) {
  Ring& r = this_thread();
  if (r.events == nullptr) {
    // The ring is mapped before the registry's readers may see it as non-empty.
    std::lock_guard lock(registry().mutex);
    r.map(capacity.load(std::memory_order_relaxed));
  }
  std::size_t next = r.next.load(std::memory_order_relaxed);
  if (next == r.slots) next = 0;  // full: the oldest go
  std::memcpy(static_cast<void*>(&r.events[next]), &e, sizeof(Event));
  r.next.store(next + 1, std::memory_order_release);
  r.written.store(r.written.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
}

namespace {

// Every ring's events, oldest first per ring; `release` empties the rings (take_all).
// A copy while threads record skips the oldest `margin` of a wrapped ring, which its
// writer may be overwriting.
std::vector<Event> collect(std::uint64_t* dropped, bool release, std::size_t margin) {
  std::vector<Event> out;
  std::uint64_t lost = 0;
  std::lock_guard lock(registry().mutex);
  for (auto& r : registry().rings) {
    if (r->events == nullptr) continue;
    const std::size_t next = r->next.load(std::memory_order_acquire);
    const std::uint64_t written = r->written.load(std::memory_order_relaxed);
    if (written > r->slots) {  // wrapped: the oldest kept start at `next`
      const std::size_t skip = std::min(margin, r->slots - next);
      lost += written - r->slots + skip;
      out.insert(out.end(), r->events + next + skip, r->events + r->slots);
    }
    out.insert(out.end(), r->events, r->events + next);
    if (release) r->release();
  }
  if (dropped != nullptr) *dropped = lost;
  return out;
}

}  // namespace

std::vector<Event> take_all(std::uint64_t* dropped) {
  return collect(dropped, true, 0);
}

std::vector<Event> snapshot(std::uint64_t* dropped) {
  return collect(dropped, false, 64);
}

}  // namespace meshrt::detail::trace
