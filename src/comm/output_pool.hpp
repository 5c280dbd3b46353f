// The CPU data plane's output pool. On these machines the first touch of fresh memory
// costs about ten times a copy into a warm buffer, and glibc serves every large block
// (the aligned ones included) with a fresh mmap, so an output allocated per operation
// would be cold every time. Outputs of kPoolMinBytes and more come from here instead:
// when the last handle of a pooled tensor goes, its buffer returns to the pool (up to
// MESHRT_COMM_POOL_BYTES cached) and the next output of that size reuses it, warm.
#pragma once

#include <cstddef>

#include "meshrt/tensor.hpp"

namespace meshrt::detail {

// Below this, malloc reuses warm memory by itself (glibc's mmap threshold is 128 KiB).
inline constexpr std::size_t kPoolMinBytes = std::size_t{256} << 10;

// An uninitialised CPU tensor of `meta`: pooled at kPoolMinBytes and above, else
// meta.empty().
Tensor output_tensor(const TensorMeta& meta);

}  // namespace meshrt::detail
