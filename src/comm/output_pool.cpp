#include "comm/output_pool.hpp"

#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

#include "meshrt/comm.hpp"
#include "meshrt/settings.hpp"

namespace meshrt::detail {
namespace {

constexpr std::size_t kPage = 4096;

class OutputPool {
 public:
  explicit OutputPool(std::size_t cap) : cap_(cap) {}

  std::shared_ptr<void> get(std::size_t bytes) {
    const std::size_t rounded = (bytes + kPage - 1) / kPage * kPage;
    void* p = nullptr;
    {
      std::lock_guard lock(mutex_);
      auto it = free_.find(rounded);
      if (it != free_.end() && !it->second.empty()) {
        p = it->second.back();
        it->second.pop_back();
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

  void put(void* p, std::size_t rounded) {
    {
      std::lock_guard lock(mutex_);
      if (cached_ + rounded <= cap_) {
        free_[rounded].push_back(p);
        cached_ += rounded;
        return;
      }
    }
    ::operator delete(p, std::align_val_t(kPage));
  }

  OutputPoolStats stats() {
    std::lock_guard lock(mutex_);
    return {hits_, misses_, cached_};
  }

 private:
  std::mutex mutex_;
  std::unordered_map<std::size_t, std::vector<void*>> free_;  // by size rounded to pages
  std::size_t cached_ = 0;
  std::size_t cap_;
  std::uint64_t hits_ = 0;
  std::uint64_t misses_ = 0;
};

OutputPool& pool() {
  // Never destroyed: a pooled tensor may outlive main's locals and static destructors.
  static OutputPool* p = new OutputPool(static_cast<std::size_t>(settings::get_int("MESHRT_COMM_POOL_BYTES")));
  return *p;
}

}  // namespace

}  // namespace meshrt::detail

namespace meshrt {
OutputPoolStats output_pool_stats() {
  return detail::pool().stats();
}
}  // namespace meshrt

namespace meshrt::detail {

Tensor output_tensor(const TensorMeta& meta) {
  if (meta.nbytes() < kPoolMinBytes || !meta.device().is_cpu()) return meta.empty();
  return Tensor::adopt_host(meta, pool().get(meta.nbytes()));
}

}  // namespace meshrt::detail
