// The stream-ordered caching pool both backends allocate device memory from (after
// PyTorch's caching allocator and cudaMallocAsync's pools): a freed block goes back to
// the free list of the stream it was allocated on, and only that stream reuses it, so
// work still queued on the block always runs before its next user. Blocks allocated
// without a stream (key 0) are not cached.
//
// Release never calls the backend's free (a release may run inside a CUDA host function,
// where CUDA calls are not allowed): blocks over the cache limit wait in a list that the
// next allocate() or empty_cache() frees, outside the pool's lock, since the backend's
// free first waits for the device's streams to finish their work (as cudaFree may), and
// that work may release blocks into the pool. An allocation that fails while blocks are
// cached empties the cache and tries once more.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <vector>

#include "meshrt/internal/device.hpp"

namespace meshrt::device {

class CachingPool {
 public:
  using RawAllocate = std::function<void*(std::size_t)>;  // throws on failure
  // Frees a block once the work of every stream that may use it is done (cudaFree
  // synchronizes the device first; the emulated backend waits for its streams).
  using RawFree = std::function<void(void*)>;
  // `limit`: most bytes kept cached across all streams.
  CachingPool(RawAllocate allocate, RawFree free, std::size_t limit);
  ~CachingPool();
  CachingPool(const CachingPool&) = delete;
  CachingPool& operator=(const CachingPool&) = delete;

  // At least `bytes` (rounded up to kGranule), for work on the stream `stream_key`.
  std::shared_ptr<void> allocate(std::size_t bytes, std::uint64_t stream_key);
  // The stream is gone and its work done: its cached blocks are safe for every stream.
  void forget_stream(std::uint64_t stream_key);
  void empty_cache();
  PoolStats stats() const;
  // Whether [p, p + bytes) lies inside one live (allocated, not freed) block.
  bool contains(const void* p, std::size_t bytes) const;

  static constexpr std::size_t kGranule = 512;

 private:
  void release(void* p, std::size_t bytes, std::uint64_t stream_key) noexcept;
  void free_blocks(std::vector<void*>& blocks);

  RawAllocate raw_allocate_;
  RawFree raw_free_;
  std::size_t limit_;
  mutable std::mutex mutex_;
  // stream key -> (rounded size -> blocks)
  std::map<std::uint64_t, std::multimap<std::size_t, void*>> free_;
  std::map<std::uintptr_t, std::size_t> live_;  // start -> rounded size
  std::vector<void*> to_free_;
  std::set<std::uint64_t> forgotten_;  // streams gone: their blocks are freed on release
  PoolStats stats_;
};

}  // namespace meshrt::device
