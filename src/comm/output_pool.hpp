// The CPU data plane's output pool. On these machines the first touch of fresh memory
// costs about ten times a copy into a warm buffer, and glibc serves every large block
// (the aligned ones included) with a fresh mmap, so an output allocated per operation
// would be cold every time. Outputs of kPoolMinBytes and more come from here instead:
// when the last handle of a pooled tensor goes, its buffer returns to the pool (up to
// MESHRT_COMM_POOL_BYTES cached, by default sized from the machine: default_pool_cap)
// and the next output of that size reuses it, warm.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "meshrt/internal/comm.hpp"
#include "meshrt/tensor.hpp"

namespace meshrt::detail {

// Below this, malloc reuses warm memory by itself (glibc's mmap threshold is 128 KiB, and
// rises to the largest block freed so far): smaller outputs pay no first-touch cost, and
// pooling them moves nothing beyond the noise (docs/benchmarks.md, "Older figures"), so the
// pool keeps to the sizes where it pays.
inline constexpr std::size_t kPoolMinBytes = std::size_t{256} << 10;

// Page-aligned buffers by size (rounded up to pages), kept for reuse up to `cap` bytes.
// A buffer returned when the cache is full evicts the buffers returned longest ago, of
// any size, to make room: it is what the program uses now. Dropping it instead would let
// buffers of an earlier phase (say, the sizes of a warm-up) hold the cap for good, and
// every output of the new phase would come fresh and cold.
class OutputPool {
 public:
  explicit OutputPool(std::size_t cap);
  OutputPool(const OutputPool&) = delete;
  OutputPool& operator=(const OutputPool&) = delete;
  ~OutputPool();  // frees what is cached; every buffer handed out must be back by then

  // A buffer of at least `bytes`, which returns here when its last handle goes.
  std::shared_ptr<void> get(std::size_t bytes);
  OutputPoolStats stats();
  // Frees every cached buffer (those handed out are untouched); returns the bytes freed.
  std::size_t release();

 private:
  void put(void* p, std::size_t rounded);
  struct Entry {
    void* p;
    std::uint64_t stamp;  // when it was returned
  };
  std::mutex mutex_;
  std::map<std::size_t, std::vector<Entry>> free_;  // per rounded size, oldest first; never empty
  std::size_t cached_ = 0;
  std::size_t cap_;
  std::uint64_t clock_ = 0;
  std::uint64_t hits_ = 0;
  std::uint64_t misses_ = 0;
};

// The cap when MESHRT_COMM_POOL_BYTES is unset: min(1 GiB, an eighth of one core's share
// of physical memory). A rank per core is the densest layout, so the ranks of a node
// together keep at most an eighth of its memory warm, and a small machine does not hold
// a gigabyte per rank for outputs nothing uses any more.
std::size_t default_pool_cap(std::size_t physical_bytes, unsigned cores);

// An uninitialised CPU tensor of `meta`: pooled at kPoolMinBytes and above, else
// meta.empty().
Tensor output_tensor(const TensorMeta& meta);

}  // namespace meshrt::detail
