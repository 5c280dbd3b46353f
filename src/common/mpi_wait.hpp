// Waiting for one MPI request with a deadline, for the set-up steps (a communicator's
// init) where a member that never joins must give a TimeoutError, not a hang.
#pragma once

#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <string_view>

#include "common/backoff.hpp"
#include "common/checks.hpp"
#include "meshrt/error.hpp"

namespace meshrt::detail {

// The time point `timeout` from now; a timeout past a year (Seconds::max(): none) waits a
// year, so that the sum cannot overflow.
inline std::chrono::steady_clock::time_point deadline_after(std::chrono::duration<double> timeout) {
  const std::chrono::duration<double> year = std::chrono::hours(24 * 365);
  return std::chrono::steady_clock::now() +
         std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::min(timeout, year));
}

// Tests `request` until it completes, backing off as the control plane does between
// tests; at `deadline` raises TimeoutError: "<what>: expected every member to join <step>
// in time, found it still incomplete at the deadline".
inline void wait_request(MPI_Request& request, std::chrono::steady_clock::time_point deadline, std::string_view what,
                         std::string_view step) {
  const bool done = Backoff(kControl).poll_until(
      [&] {
        int complete = 0;
        MESHRT_MPI_CHECK(MPI_Test(&request, &complete, MPI_STATUS_IGNORE));
        return complete != 0;
      },
      deadline);
  if (!done) {
    throw TimeoutError(fmt::format(
        "{}: expected every member to join {} in time, found it still incomplete at the deadline", what, step));
  }
}

// wait_request for a request that writes into (or reads from) `buffers`: past the deadline
// they are left to the request, which stays posted (a collective cannot be cancelled) and
// which a member that joins late still completes, then TimeoutError as wait_request's.
template <class T>
void wait_request_owning(MPI_Request& request, std::unique_ptr<T>& buffers,
                         std::chrono::steady_clock::time_point deadline, std::string_view what, std::string_view step) {
  try {
    wait_request(request, deadline, what, step);
  } catch (const TimeoutError&) {
    (void)buffers.release();
    throw;
  }
}

}  // namespace meshrt::detail
