#include "runtime/trace_file.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>

#include <nlohmann/json.hpp>

#include "common/checks.hpp"
#include "common/timeline.hpp"
#include "common/trace.hpp"
#include "meshrt/error.hpp"
#include "meshrt/internal/device.hpp"
#include "meshrt/internal/protocol.hpp"

namespace meshrt::detail {

namespace {
constexpr int kTag = 17;
constexpr std::size_t kHost = 64;
}  // namespace

ClockOffsets measure_clock_offsets(MPI_Comm comm, int rounds) {
  int rank = 0, size = 1;
  MESHRT_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  MESHRT_MPI_CHECK(MPI_Comm_size(comm, &size));
  ClockOffsets c;
  if (rank == 0) {
    c.offset_ns.assign(static_cast<std::size_t>(size), 0);
    c.residual_ns.assign(static_cast<std::size_t>(size), 0);
    for (int r = 1; r < size; ++r) {
      std::int64_t best = std::numeric_limits<std::int64_t>::max();
      for (int k = 0; k < rounds; ++k) {
        const std::int64_t t0 = trace::now_ns();
        std::int64_t t1 = 0;
        MESHRT_MPI_CHECK(MPI_Send(&t0, 1, MPI_INT64_T, r, kTag, comm));
        MESHRT_MPI_CHECK(MPI_Recv(&t1, 1, MPI_INT64_T, r, kTag, comm, MPI_STATUS_IGNORE));
        const std::int64_t t2 = trace::now_ns();
        if (t2 - t0 < best) {
          best = t2 - t0;
          c.offset_ns[static_cast<std::size_t>(r)] = t1 - (t0 + t2) / 2;
          c.residual_ns[static_cast<std::size_t>(r)] = (t2 - t0) / 2;
        }
      }
    }
  } else {
    for (int k = 0; k < rounds; ++k) {
      std::int64_t t0 = 0;
      MESHRT_MPI_CHECK(MPI_Recv(&t0, 1, MPI_INT64_T, 0, kTag, comm, MPI_STATUS_IGNORE));
      const std::int64_t t1 = trace::now_ns();
      MESHRT_MPI_CHECK(MPI_Send(&t1, 1, MPI_INT64_T, 0, kTag, comm));
    }
  }
  MESHRT_MPI_CHECK(MPI_Scatter(c.offset_ns.data(), 1, MPI_INT64_T, &c.own_offset_ns, 1, MPI_INT64_T, 0, comm));
  MESHRT_MPI_CHECK(MPI_Scatter(c.residual_ns.data(), 1, MPI_INT64_T, &c.own_residual_ns, 1, MPI_INT64_T, 0, comm));
  return c;
}

void check_trace_path(const std::string& path) {
  // O_EXCL tells a file this check creates (removed again) from one already there (kept,
  // not truncated: the run overwrites it only at its end).
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  const bool created = fd >= 0;
  if (!created && errno == EEXIST) fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  if (fd < 0) {
    const int error = errno;
    throw UsageError(
        fmt::format("setting MESHRT_TRACE: expected a file rank 0 can write at the end of the run, found "
                    "{} cannot be written: {} (a folder that exists and is writable, on rank 0's node)",
                    path, std::strerror(error)));
  }
  ::close(fd);
  if (created) ::unlink(path.c_str());
}

std::uint64_t write_trace_file(MPI_Comm comm, const std::string& path, const ClockOffsets& clocks) {
  int rank = 0, size = 1;
  MESHRT_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  MESHRT_MPI_CHECK(MPI_Comm_size(comm, &size));
  std::uint64_t dropped = 0;
  device::trace_flush(true);  // the CUDA streams' spans of work that has run by now
  std::vector<trace::Event> mine = trace::take_all(&dropped);
  // What one gather can carry (MPI counts its bytes in an int), shared among the ranks, so
  // that rank 0 never finds more than it can receive: the newest events beyond a rank's
  // share are dropped, and counted.
  const std::size_t limit = static_cast<std::size_t>(INT_MAX) / sizeof(trace::Event) / static_cast<std::size_t>(size);
  if (mine.size() > limit) {
    dropped += mine.size() - limit;
    mine.resize(limit);
  }
  std::uint64_t all_dropped = 0;
  MESHRT_MPI_CHECK(MPI_Reduce(&dropped, &all_dropped, 1, MPI_UINT64_T, MPI_SUM, 0, comm));
  const int bytes = static_cast<int>(mine.size() * sizeof(trace::Event));
  char host[kHost] = {};
  gethostname(host, kHost - 1);
  std::vector<int> counts(static_cast<std::size_t>(size)), displs(static_cast<std::size_t>(size));
  std::vector<char> hosts(rank == 0 ? kHost * static_cast<std::size_t>(size) : 0);
  MESHRT_MPI_CHECK(MPI_Gather(&bytes, 1, MPI_INT, counts.data(), 1, MPI_INT, 0, comm));
  MESHRT_MPI_CHECK(MPI_Gather(host, kHost, MPI_CHAR, hosts.data(), kHost, MPI_CHAR, 0, comm));
  std::vector<trace::Event> all;
  if (rank == 0) {
    std::size_t total = 0;
    for (int r = 0; r < size; ++r) {
      displs[static_cast<std::size_t>(r)] = static_cast<int>(total);
      total += static_cast<std::size_t>(counts[static_cast<std::size_t>(r)]);
      if (total > static_cast<std::size_t>(INT_MAX))
        throw Error(
            fmt::format("MESHRT_TRACE: the ranks recorded {} bytes of events, more than one gather carries", total));
    }
    all.resize(total / sizeof(trace::Event));
  }
  MESHRT_MPI_CHECK(
      MPI_Gatherv(mine.data(), bytes, MPI_BYTE, all.data(), counts.data(), displs.data(), MPI_BYTE, 0, comm));
  if (rank != 0) return 0;
  std::vector<trace::RankEvents> ranks(static_cast<std::size_t>(size));
  std::uint64_t n = 0;
  for (int r = 0; r < size; ++r) {
    trace::RankEvents& re = ranks[static_cast<std::size_t>(r)];
    re.rank = r;
    re.host = std::string(&hosts[kHost * static_cast<std::size_t>(r)]);
    re.offset_ns = clocks.offset_ns[static_cast<std::size_t>(r)];
    re.residual_ns = clocks.residual_ns[static_cast<std::size_t>(r)];
    re.calls_here = r == 0;  // rank 0's own events keep their call sites (pointers into this process)
    if (r == 0) {
      re.events = std::move(mine);
    } else {
      const auto first = all.begin() + displs[static_cast<std::size_t>(r)] / static_cast<int>(sizeof(trace::Event));
      re.events.assign(first, first + counts[static_cast<std::size_t>(r)] / static_cast<int>(sizeof(trace::Event)));
    }
    n += re.events.size();
  }
  ranks[0].dropped = all_dropped;
  trace::write_chrome_trace(path, ranks, trace::names(), false, fmt::format("MESHRT_TRACE={}", path));
  return n;
}

}  // namespace meshrt::detail
