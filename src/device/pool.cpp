#include "device/pool.hpp"

namespace meshrt::device {

CachingPool::CachingPool(RawAllocate allocate, RawFree free, std::size_t limit)
    : raw_allocate_(std::move(allocate)), raw_free_(std::move(free)), limit_(limit) {}

CachingPool::~CachingPool() {
  empty_cache();
}

std::shared_ptr<void> CachingPool::allocate(std::size_t bytes, std::uint64_t stream_key) {
  const std::size_t rounded = std::max(kGranule, (bytes + kGranule - 1) / kGranule * kGranule);
  void* p = nullptr;
  std::vector<void*> doomed;
  {
    std::lock_guard lock(mutex_);
    doomed.swap(to_free_);
    if (stream_key != 0) {
      auto list = free_.find(stream_key);
      if (list != free_.end()) {
        auto it = list->second.find(rounded);
        if (it != list->second.end()) {
          p = it->second;
          list->second.erase(it);
          stats_.cached_bytes -= rounded;
          ++stats_.hits;
        }
      }
    }
  }
  free_blocks(doomed);
  if (p == nullptr) {
    try {
      p = raw_allocate_(rounded);
    } catch (...) {
      // Out of memory with blocks cached: free them all and try once more.
      if (stats().cached_bytes == 0) throw;
      empty_cache();
      p = raw_allocate_(rounded);
    }
    std::lock_guard lock(mutex_);
    ++stats_.misses;
  }
  {
    std::lock_guard lock(mutex_);
    live_[reinterpret_cast<std::uintptr_t>(p)] = rounded;
    stats_.live_bytes += rounded;
  }
  return std::shared_ptr<void>(p, [this, rounded, stream_key](void* q) { release(q, rounded, stream_key); });
}

void CachingPool::release(void* p, std::size_t rounded, std::uint64_t stream_key) noexcept {
  std::lock_guard lock(mutex_);
  live_.erase(reinterpret_cast<std::uintptr_t>(p));
  stats_.live_bytes -= rounded;
  if (stream_key == 0 || stats_.cached_bytes + rounded > limit_ || forgotten_.count(stream_key) != 0) {
    to_free_.push_back(p);
    return;
  }
  free_[stream_key].emplace(rounded, p);
  stats_.cached_bytes += rounded;
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
    to_free_.push_back(p);
  }
  free_.erase(list);
}

void CachingPool::empty_cache() {
  std::vector<void*> doomed;
  {
    std::lock_guard lock(mutex_);
    doomed.swap(to_free_);
    for (auto& [key, list] : free_) {
      for (auto& [size, p] : list) doomed.push_back(p);
    }
    free_.clear();
    stats_.cached_bytes = 0;
  }
  free_blocks(doomed);
}

// Outside the lock: a backend's free may wait for the device's streams (cudaFree does),
// and their work may release blocks into this pool, which takes the lock.
void CachingPool::free_blocks(std::vector<void*>& blocks) {
  for (void* p : blocks) raw_free_(p);
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
