#include "device/pool.hpp"

#include <algorithm>

namespace meshrt::device {
namespace {

// Every pool of the process, for collect_all, and how many blocks wait to be freed in all
// of them (so that the worker's every turn costs one atomic load when none does).
std::mutex g_pools_mutex;
std::vector<CachingPool*>& pools() {
  static auto* all = new std::vector<CachingPool*>();
  return *all;
}
std::atomic<std::size_t> g_waiting{0};

}  // namespace

CachingPool::CachingPool(RawAllocate allocate, RawFree free, std::size_t limit)
    : raw_allocate_(std::move(allocate)), raw_free_(std::move(free)), limit_(limit) {
  std::lock_guard lock(g_pools_mutex);
  pools().push_back(this);
}

CachingPool::~CachingPool() {
  {
    std::lock_guard lock(g_pools_mutex);
    std::erase(pools(), this);
  }
  empty_cache();
}

std::shared_ptr<void> CachingPool::allocate(std::size_t bytes, std::uint64_t stream_key) {
  const std::size_t rounded = std::max(kGranule, (bytes + kGranule - 1) / kGranule * kGranule);
  void* p = nullptr;
  std::size_t size = rounded;
  Doomed doomed;
  {
    std::lock_guard lock(mutex_);
    doomed.swap(to_free_);
    g_waiting -= doomed.size();
    if (stream_key != 0) {
      auto list = free_.find(stream_key);
      if (list != free_.end()) {
        // Best fit, but never a block more than twice the size: a small request must not
        // pin a large block the stream may need next.
        auto it = list->second.lower_bound(rounded);
        if (it != list->second.end() && it->first / 2 <= rounded) {
          size = it->first;
          p = it->second;
          list->second.erase(it);
          stats_.cached_bytes -= size;
          ++stats_.hits;
        }
      }
    }
  }
  free_blocks(doomed);
  if (p == nullptr) {
    try {
      p = raw_allocate_(rounded, stream_key);
    } catch (...) {
      // Out of memory with blocks cached: free them all and try once more (on cuda the
      // frees are stream-ordered, so memory still in use by queued work stays unavailable).
      if (stats().cached_bytes == 0) throw;
      empty_cache();
      p = raw_allocate_(rounded, stream_key);
    }
    std::lock_guard lock(mutex_);
    ++stats_.misses;
  }
  {
    std::lock_guard lock(mutex_);
    live_[reinterpret_cast<std::uintptr_t>(p)] = size;
    stats_.live_bytes += size;
  }
  return std::shared_ptr<void>(p, [this, size, stream_key](void* q) { release(q, size, stream_key); });
}

void CachingPool::release(void* p, std::size_t size, std::uint64_t stream_key) noexcept {
  std::lock_guard lock(mutex_);
  live_.erase(reinterpret_cast<std::uintptr_t>(p));
  stats_.live_bytes -= size;
  if (stream_key == 0 || stats_.cached_bytes + size > limit_ || forgotten_.count(stream_key) != 0) {
    to_free_.emplace_back(p, stream_key);
    ++g_waiting;
    return;
  }
  free_[stream_key].emplace(size, p);
  stats_.cached_bytes += size;
}

void CachingPool::forget_stream(std::uint64_t stream_key) {
  std::lock_guard lock(mutex_);
  forgotten_.insert(stream_key);
  auto list = free_.find(stream_key);
  if (list == free_.end()) return;
  // No other stream may take a stream's blocks (their next use would not be ordered
  // after its work), so a dead stream's cache is freed rather than shared.
  for (auto& [size, p] : list->second) {
    stats_.cached_bytes -= size;
    to_free_.emplace_back(p, stream_key);
    ++g_waiting;
  }
  free_.erase(list);
}

void CachingPool::empty_cache() {
  Doomed doomed;
  {
    std::lock_guard lock(mutex_);
    doomed.swap(to_free_);
    g_waiting -= doomed.size();
    for (auto& [key, list] : free_) {
      for (auto& [size, p] : list) doomed.emplace_back(p, key);
    }
    free_.clear();
    stats_.cached_bytes = 0;
  }
  free_blocks(doomed);
}

void CachingPool::collect() {
  Doomed doomed;
  {
    std::lock_guard lock(mutex_);
    doomed.swap(to_free_);
    g_waiting -= doomed.size();
  }
  free_blocks(doomed);
}

void CachingPool::collect_all() {
  if (g_waiting.load() == 0) return;
  std::lock_guard lock(g_pools_mutex);
  for (CachingPool* pool : pools()) pool->collect();
}

// Outside the lock: a backend's free may take a stream's lock, and a task of that stream
// may release a block into this pool, which takes the lock.
void CachingPool::free_blocks(Doomed& blocks) {
  for (auto& [p, key] : blocks) raw_free_(p, key);
  blocks.clear();
}

PoolStats CachingPool::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

bool CachingPool::contains(const void* p, std::size_t bytes) const {
  const auto at = reinterpret_cast<std::uintptr_t>(p);
  std::lock_guard lock(mutex_);
  auto it = live_.upper_bound(at);
  if (it == live_.begin()) return false;
  --it;
  return at >= it->first && at + bytes <= it->first + it->second;
}

}  // namespace meshrt::device
