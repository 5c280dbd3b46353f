// The stream-ordered caching pool both backends allocate device memory from (after
// PyTorch's caching allocator and cudaMallocAsync's pools): a freed block goes back to
// the free list of the stream it was allocated on, and only that stream reuses it, so
// work still queued on the block always runs before its next user. Reuse is best fit (the
// smallest cached block of the stream that is large enough, up to twice the request), so
// varying sizes reuse each other's blocks. Blocks allocated without a stream (key 0) are
// not cached.
//
// A block the cache does not keep (over its limit, its stream gone, no stream) is freed in
// stream order: the backend's free is ordered after the work enqueued on the block's
// stream so far (cuda: cudaFreeAsync on that stream; emulated: a task on it), and never
// waits for the device, so an allocation never stalls behind a collective that waits for
// a peer. Release never calls the backend's free (it may run on a stream's thread, or in
// a CUDA host function where CUDA calls are not allowed): such blocks wait in a list that
// the next allocate(), empty_cache() or collect() frees, outside the pool's lock. An
// allocation that fails while blocks are cached empties the cache and tries once more.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

#include "meshrt/internal/device.hpp"

namespace meshrt::device {

class CachingPool {
 public:
  // At least `bytes` for work on the stream `stream_key`; throws on failure.
  using RawAllocate = std::function<void*(std::size_t bytes, std::uint64_t stream_key)>;
  // Frees a block after the work enqueued so far on stream `stream_key` (a stream that is
  // gone: after all of its work; key 0: after the work of every stream); never blocks.
  using RawFree = std::function<void(void*, std::uint64_t stream_key)>;
  // `limit`: most bytes kept cached across all streams.
  CachingPool(RawAllocate allocate, RawFree free, std::size_t limit);
  ~CachingPool();
  CachingPool(const CachingPool&) = delete;
  CachingPool& operator=(const CachingPool&) = delete;

  // At least `bytes` (rounded up to kGranule), for work on the stream `stream_key`.
  std::shared_ptr<void> allocate(std::size_t bytes, std::uint64_t stream_key);
  // The stream is going: its cached blocks are freed (in its order), and so is every block
  // of it released from now on.
  void forget_stream(std::uint64_t stream_key);
  void empty_cache();
  // Frees the blocks waiting to be freed. Never blocks.
  void collect();
  // collect() of every pool of the process; cheap when none has a block waiting.
  static void collect_all();
  PoolStats stats() const;
  // Whether [p, p + bytes) lies inside one live (allocated, not freed) block.
  bool contains(const void* p, std::size_t bytes) const;

  static constexpr std::size_t kGranule = 512;

 private:
  using Doomed = std::vector<std::pair<void*, std::uint64_t>>;  // block, its stream key
  void release(void* p, std::size_t bytes, std::uint64_t stream_key) noexcept;
  void free_blocks(Doomed& blocks);

  RawAllocate raw_allocate_;
  RawFree raw_free_;
  std::size_t limit_;
  mutable std::mutex mutex_;
  // stream key -> (block size -> blocks)
  std::map<std::uint64_t, std::multimap<std::size_t, void*>> free_;
  std::map<std::uintptr_t, std::size_t> live_;  // start -> block size
  Doomed to_free_;
  std::set<std::uint64_t> forgotten_;  // streams gone: their blocks are freed on release
  PoolStats stats_;
};

}  // namespace meshrt::device
