#include "comm/output_pool.hpp"

#include <unistd.h>

#include <algorithm>
#include <new>
#include <thread>

#include "meshrt/internal/comm.hpp"
#include "meshrt/internal/settings.hpp"

namespace meshrt::detail {
namespace {

constexpr std::size_t kPage = 4096;

}  // namespace

OutputPool::OutputPool(std::size_t cap) : cap_(cap) {}

OutputPool::~OutputPool() {
  for (auto& [rounded, entries] : free_) {
    for (const Entry& e : entries) ::operator delete(e.p, std::align_val_t(kPage));
  }
}

std::shared_ptr<void> OutputPool::get(std::size_t bytes) {
  const std::size_t rounded = (bytes + kPage - 1) / kPage * kPage;
  void* p = nullptr;
  {
    std::lock_guard lock(mutex_);
    auto it = free_.find(rounded);
    if (it != free_.end() && !it->second.empty()) {
      p = it->second.back().p;  // the most recently returned: the warmest
      it->second.pop_back();
      if (it->second.empty()) free_.erase(it);
      cached_ -= rounded;
      ++hits_;
    } else {
      ++misses_;
    }
  }
  if (!p) p = ::operator new(rounded, std::align_val_t(kPage));
  // The deleter runs on whichever thread drops the last handle: put() locks.
  return std::shared_ptr<void>(p, [this, rounded](void* q) { put(q, rounded); });
}

void OutputPool::put(void* p, std::size_t rounded) {
  std::vector<void*> evicted;
  {
    std::lock_guard lock(mutex_);
    if (rounded <= cap_) {
      // The buffer just freed belongs to what the program does now: evict the longest
      // unused buffers (of any size) to make room for it, rather than drop it.
      while (cached_ + rounded > cap_) {
        auto oldest = free_.end();
        for (auto it = free_.begin(); it != free_.end(); ++it) {
          if (oldest == free_.end() || it->second.front().stamp < oldest->second.front().stamp) oldest = it;
        }
        evicted.push_back(oldest->second.front().p);
        oldest->second.erase(oldest->second.begin());
        cached_ -= oldest->first;
        if (oldest->second.empty()) free_.erase(oldest);
      }
      free_[rounded].push_back({p, ++clock_});
      cached_ += rounded;
      p = nullptr;
    }
  }
  for (void* q : evicted) ::operator delete(q, std::align_val_t(kPage));
  if (p) ::operator delete(p, std::align_val_t(kPage));
}

std::size_t OutputPool::release() {
  std::map<std::size_t, std::vector<Entry>> freed;
  std::size_t bytes = 0;
  {
    std::lock_guard lock(mutex_);
    freed.swap(free_);
    bytes = cached_;
    cached_ = 0;
  }
  for (auto& [rounded, entries] : freed) {
    for (const Entry& e : entries) ::operator delete(e.p, std::align_val_t(kPage));
  }
  return bytes;
}

OutputPoolStats OutputPool::stats() {
  std::lock_guard lock(mutex_);
  return {hits_, misses_, cached_};
}

namespace {

std::size_t pool_cap() {
  if (const auto bytes = settings::kCommPoolBytes.from_environment()) return static_cast<std::size_t>(*bytes);
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page = ::sysconf(_SC_PAGESIZE);
  const std::size_t physical =
      pages > 0 && page > 0 ? static_cast<std::size_t>(pages) * static_cast<std::size_t>(page) : std::size_t{0};
  return default_pool_cap(physical, std::thread::hardware_concurrency());
}

OutputPool& pool() {
  // Never destroyed: a pooled tensor may outlive main's locals and static destructors.
  static OutputPool* p = new OutputPool(pool_cap());
  return *p;
}

}  // namespace

std::size_t default_pool_cap(std::size_t physical_bytes, unsigned cores) {
  constexpr std::size_t kMaxCap = std::size_t{1} << 30;
  // Unknown memory (sysconf failed): the old fixed default.
  if (physical_bytes == 0) return kMaxCap;
  return std::min(kMaxCap, physical_bytes / 8 / std::max(1U, cores));
}

}  // namespace meshrt::detail

namespace meshrt {
OutputPoolStats output_pool_stats() {
  return detail::pool().stats();
}
std::size_t release_output_pool() {
  return detail::pool().release();
}
}  // namespace meshrt

namespace meshrt::detail {

Tensor output_tensor(const TensorMeta& meta) {
  if (meta.nbytes() < kPoolMinBytes || !meta.device().is_cpu()) return meta.empty();
  return Tensor::adopt_host(meta, pool().get(meta.nbytes()));
}

}  // namespace meshrt::detail
