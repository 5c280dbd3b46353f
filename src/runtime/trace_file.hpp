// The timeline's file (docs/running.md, "A timeline of the run"): the clock offsets of
// every rank measured at start, and at the end every rank's events gathered to rank 0 and
// written there as one Chrome-trace JSON file (Perfetto's UI and chrome://tracing open it
// as it is): a process per rank, a controller and a worker track, flow arrows from each
// controller call to every rank's execution of it.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "meshrt/call_site.hpp"

namespace meshrt::detail {

struct ClockOffsets {
  // On rank 0, per rank: its steady clock minus rank 0's (ns), and how far that may be
  // off (half the shortest round trip it was measured over).
  std::vector<std::int64_t> offset_ns, residual_ns;
  // On every rank: its own.
  std::int64_t own_offset_ns = 0, own_residual_ns = 0;
};

// Collective over `comm`: `rounds` round trips between rank 0 and each other rank (the
// shortest one counts), then each rank is told its own offset.
ClockOffsets measure_clock_offsets(MPI_Comm comm, int rounds);

// MESHRT_TRACE's `path`, checked on rank 0 at start: a file there can be created (and is
// removed again) or, when one is there, opened for writing without losing its content.
// Throws UsageError naming the setting, the path and the system's reason: found at the end,
// the timeline of the whole run would be lost.
void check_trace_path(const std::string& path);

// Collective over `comm`: gathers the events every thread recorded (trace::take_all) and
// rank 0 writes them to `path`; returns the number of events written on rank 0 (0
// elsewhere). Throws on rank 0 when the file cannot be written.
std::uint64_t write_trace_file(MPI_Comm comm, const std::string& path, const ClockOffsets& clocks);

}  // namespace meshrt::detail
