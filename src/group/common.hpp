// What every file of the group module shares: its clock, how its waits poll, and the
// words for a list of ranks. Private to src/group/.
#pragma once

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <string>
#include <vector>

#include "common/backoff.hpp"

namespace meshrt::group_internal {

using Clock = std::chrono::steady_clock;
using Seconds = std::chrono::duration<double>;
using Backoff = detail::Backoff;

inline Clock::time_point deadline_after(Seconds t) {
  // A "no limit" timeout is duration::max(), which overflows any time_point arithmetic.
  if (t >= Seconds(1e9)) return Clock::time_point::max();
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(t);
}

// Waits: non-blocking MPI progressed with MPI_Test/MPI_Testsome in a loop that polls back
// to back for a few dozen tries and 20 us, then yields between polls for a while and then
// sleeps with growing intervals (up to 1 ms), so a waiting rank does not burn a core on an
// oversubscribed machine. The common back-off with kGroup's parameters
// (src/common/backoff.hpp says why); the yielding phase grows with the bytes in flight
// (2 ms, or about twice a transfer's time at 1 GB/s): shared-memory transfers only
// advance while both ranks call into MPI, and a sleeping sender stalls its receiver.
inline Clock::duration spin_for(std::size_t bytes) {
  // About twice as long as the bytes take at 1 GB/s.
  return std::max<Clock::duration>(detail::kGroup.yield, std::chrono::nanoseconds(2 * bytes));
}
inline detail::BackoffPolicy group_wait(std::size_t bytes = 0) {
  return detail::kGroup.yielding_until(spin_for(bytes));
}

inline std::string int_list(const std::vector<int>& v) {
  return fmt::format("[{}]", fmt::join(v, ", "));
}

}  // namespace meshrt::group_internal
