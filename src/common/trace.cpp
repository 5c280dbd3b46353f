#include "common/trace.hpp"

#include <sys/mman.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <tuple>
#include <unordered_map>

namespace meshrt::detail::trace {
namespace {

std::atomic<std::size_t> capacity{std::size_t{1} << 18};

// One thread's ring: mapped whole, with its pages present, at the thread's first event.
// Events are written into a small staging buffer of the thread's own, which stays in the
// caches, and go to the ring a block at a time with stores that bypass the caches: a ring
// far larger than the caches, written a line per event, had every event miss and evicted
// the program's own data (the cost per traced operation grew with the ring's size).
struct Ring {
  static constexpr std::size_t kStage = 128;  // 8 KiB
  alignas(64) Event stage[kStage];
  Event* events = nullptr;
  std::size_t slots = 0;  // a multiple of kStage
  // Events in `stage`; the slot the next block goes to; how many went to the ring: atomics
  // only so that snapshot() may read them while the thread records.
  std::atomic<std::size_t> staged{0};
  std::atomic<std::size_t> next{0};
  std::atomic<std::uint64_t> written{0};
  ~Ring() { release(); }
  void map(std::size_t n) {
    n = (std::max(n, 2 * kStage) + kStage - 1) / kStage * kStage;
    void* p =
        mmap(nullptr, n * sizeof(Event), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    // A write to every page now: under a hypervisor that shadows the page tables, a page
    // the kernel populated still faults at this process's first touch (about 2 us each on
    // the project's machine), which the events would otherwise pay as they fill the ring.
    const long page = sysconf(_SC_PAGESIZE);
    for (std::size_t at = 0; at < n * sizeof(Event); at += static_cast<std::size_t>(page)) {
      static_cast<volatile char*>(p)[at] = 0;
    }
    events = static_cast<Event*>(p);
    slots = n;
  }
  // The staged block to the ring (the oldest block goes when it is full).
  void spill() {
    std::size_t at = next.load(std::memory_order_relaxed);
    if (at == slots) at = 0;
#if defined(__SSE2__)
    const auto* from = reinterpret_cast<const __m128i*>(stage);
    auto* to = reinterpret_cast<__m128i*>(events + at);
    constexpr std::size_t kVectors = kStage * sizeof(Event) / sizeof(__m128i);
    for (std::size_t i = 0; i < kVectors; ++i) _mm_stream_si128(to + i, _mm_load_si128(from + i));
    _mm_sfence();  // the streamed lines are visible before `next` says so
#else
    std::memcpy(static_cast<void*>(events + at), stage, sizeof stage);
#endif
    next.store(at + kStage, std::memory_order_release);
    written.store(written.load(std::memory_order_relaxed) + kStage, std::memory_order_relaxed);
  }
  void release() {
    if (events != nullptr) munmap(events, slots * sizeof(Event));
    events = nullptr;
    slots = 0;
    staged.store(0);
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
  // Rings whose threads have ended, events kept: the next new thread records on in one
  // (a Runtime's sessions each start a worker thread, Python's threads come and go), so a
  // process maps as many rings as it ever had threads at once, not one per thread.
  std::vector<std::shared_ptr<Ring>> retired;
  std::unordered_map<std::string, std::uint64_t, NameHash, std::equal_to<>> by_name;
  std::vector<std::string> names;
  std::map<std::tuple<const char*, const char*, std::uint32_t>, std::uint64_t> by_site;
  std::vector<CallSite> sites{CallSite()};
};

// Never destroyed: a thread that ends after the process's statics (a detached stream
// thread at exit) still gives its ring back.
Registry& registry() {
  static Registry* r = new Registry;
  return *r;
}

// A thread's hold on its ring: taken at its first event, given back when it ends.
struct Hold {
  std::shared_ptr<Ring> ring;
  Hold() {
    std::lock_guard lock(registry().mutex);
    Registry& g = registry();
    if (!g.retired.empty()) {
      ring = std::move(g.retired.back());
      g.retired.pop_back();
    } else {
      ring = std::make_shared<Ring>();
      g.rings.push_back(ring);
    }
  }
  ~Hold() {
    std::lock_guard lock(registry().mutex);
    registry().retired.push_back(std::move(ring));
  }
  Hold(const Hold&) = delete;
  Hold& operator=(const Hold&) = delete;
};

Ring& this_thread() {
  thread_local Hold mine;
  return *mine.ring;
}

}  // namespace

void enable(std::size_t events) noexcept {
  capacity.store(events < 4096 ? 4096 : events);
  enabled_flag().store(true, std::memory_order_relaxed);
}

namespace {
// encode_peers' word: the form in the top two bits.
constexpr std::uint64_t kRun = 1, kSet = 2, kCounted = 3;
constexpr int kFirstBits = 20, kStepBits = 21, kCountBits = 21;
constexpr std::int64_t field_max(int bits) {
  return (std::int64_t{1} << bits) - 1;
}
}  // namespace

std::uint64_t encode_peers(std::span<const int> peers) noexcept {
  if (peers.empty()) return 0;
  const auto n = static_cast<std::int64_t>(peers.size());
  const std::int64_t first = peers[0];
  const std::int64_t step = n > 1 ? std::int64_t{peers[1]} - first : 0;
  bool run = first >= 0 && first <= field_max(kFirstBits) && n <= field_max(kCountBits) &&
             std::abs(step) <= field_max(kStepBits - 1);
  for (std::int64_t i = 1; run && i < n; ++i)
    run = std::int64_t{peers[static_cast<std::size_t>(i)]} == first + i * step;
  if (run) {
    const auto step_bits = static_cast<std::uint64_t>(step) & static_cast<std::uint64_t>(field_max(kStepBits));
    return kRun << 62 | static_cast<std::uint64_t>(first) << (kStepBits + kCountBits) | step_bits << kCountBits |
           static_cast<std::uint64_t>(n);
  }
  std::uint64_t set = 0;
  for (const int r : peers) {
    if (r < 0 || r >= 62) return kCounted << 62 | static_cast<std::uint64_t>(std::min<std::int64_t>(n, field_max(62)));
    set |= std::uint64_t{1} << r;
  }
  return kSet << 62 | set;
}

Peers decode_peers(std::uint64_t word) {
  Peers out;
  const std::uint64_t body = word & ((std::uint64_t{1} << 62) - 1);
  switch (word >> 62) {
    case kRun: {
      const auto first = static_cast<std::int64_t>(body >> (kStepBits + kCountBits));
      std::int64_t step = static_cast<std::int64_t>(body >> kCountBits) & field_max(kStepBits);
      if (step > field_max(kStepBits - 1)) step -= std::int64_t{1} << kStepBits;  // the sign
      out.count = static_cast<std::size_t>(body & static_cast<std::uint64_t>(field_max(kCountBits)));
      for (std::size_t i = 0; i < out.count; ++i)
        out.ranks.push_back(static_cast<int>(first + static_cast<std::int64_t>(i) * step));
      break;
    }
    case kSet:
      for (int r = 0; r < 62; ++r) {
        if (body >> r & 1) out.ranks.push_back(r);
      }
      out.count = out.ranks.size();
      break;
    case kCounted:
      out.count = static_cast<std::size_t>(body);
      break;
    default:
      break;
  }
  return out;
}

std::uint64_t intern(std::string_view name) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  if (const auto it = r.by_name.find(name); it != r.by_name.end()) return it->second;
  r.by_name.emplace(std::string(name), r.names.size());
  r.names.emplace_back(name);
  return r.names.size() - 1;
}

std::uint64_t intern_site(const CallSite& where) {
  if (!where.known()) return 0;
  // The controller issues from one thread, mostly from a few lines in a loop.
  thread_local CallSite last;
  thread_local std::uint64_t last_id = 0;
  if (last_id != 0 && last.file_name() == where.file_name() && last.function_name() == where.function_name() &&
      last.line() == where.line()) {
    return last_id;
  }
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  const auto key = std::make_tuple(where.file_name(), where.function_name(), where.line());
  auto [it, added] = r.by_site.emplace(key, r.sites.size());
  if (added) r.sites.push_back(where);
  last = where;
  last_id = it->second;
  return last_id;
}

CallSite site_of(std::uint64_t id) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  return id < r.sites.size() ? r.sites[id] : CallSite();
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
  const std::size_t s = r.staged.load(std::memory_order_relaxed);
  std::memcpy(static_cast<void*>(&r.stage[s]), &e, sizeof(Event));
  if (s + 1 < Ring::kStage) {
    r.staged.store(s + 1, std::memory_order_release);
  } else {
    r.spill();
    r.staged.store(0, std::memory_order_release);
  }
}

namespace {

// Every ring's events, oldest first per ring; `release` empties the rings (take_all).
// Under the registry's lock.
// A copy while threads record skips the oldest `margin` of a wrapped ring, which its
// writer may be overwriting.
std::vector<Event> collect_locked(std::uint64_t* dropped, bool release, std::size_t margin) {
  std::vector<Event> out;
  std::uint64_t lost = 0;
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
    out.insert(out.end(), r->stage, r->stage + r->staged.load(std::memory_order_acquire));
    if (release) r->release();
  }
  if (dropped != nullptr) *dropped = lost;
  return out;
}

}  // namespace

std::vector<Event> take_all(std::uint64_t* dropped) {
  std::lock_guard lock(registry().mutex);
  return collect_locked(dropped, true, 0);
}

std::vector<Event> snapshot(std::uint64_t* dropped) {
  std::lock_guard lock(registry().mutex);
  return collect_locked(dropped, false, Ring::kStage);
}

bool try_snapshot(std::vector<Event>& events, std::uint64_t* dropped, std::vector<std::string>& names) {
  std::unique_lock lock(registry().mutex, std::try_to_lock);
  if (!lock.owns_lock()) return false;
  events = collect_locked(dropped, false, Ring::kStage);
  names = registry().names;
  return true;
}

}  // namespace meshrt::detail::trace
