// meshrt-bench-group: StatelessGroup against the same transfer made with raw MPI, in the
// same run: send/recv (ping-pong, one-way time = round trip / 2), broadcast_obj vs
// MPI_Bcast, all_gather_obj vs MPI_Allgather, barrier vs MPI_Barrier, for
// std::vector<char> payloads. Each point: a warm-up, then `reps` repetitions of a fixed
// iteration count (the same on all ranks); a repetition's time is the max over ranks;
// the point's time is the median repetition. Prints a table and, with --json, one JSON
// line per point. (Standalone until the lead folds it into meshrt-bench.)
#include <mpi.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fmt/format.h>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "meshrt/group.hpp"

namespace {

struct Point {
  std::string op;
  std::size_t bytes;
  double meshrt_us;
  double mpi_us;
};

// Median over reps of the max over ranks of one iteration's time, in microseconds.
double measure(MPI_Comm comm, int iters, int reps, const std::function<void()>& once) {
  once();  // warm-up: connections, buffers, first touch
  std::vector<double> times;
  for (int r = 0; r < reps; ++r) {
    MPI_Barrier(comm);
    const double t0 = MPI_Wtime();
    for (int i = 0; i < iters; ++i) once();
    double mine = (MPI_Wtime() - t0) / iters, worst = 0;
    MPI_Allreduce(&mine, &worst, 1, MPI_DOUBLE, MPI_MAX, comm);
    times.push_back(worst * 1e6);
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  CLI::App app{"StatelessGroup vs raw MPI latency"};
  std::size_t max_bytes = std::size_t{64} << 20;
  int reps = 5;
  bool json = false;
  std::vector<std::string> ops{"send", "broadcast", "all_gather", "barrier"};
  app.add_option("--max-bytes", max_bytes, "Largest payload");
  app.add_option("--reps", reps, "Repetitions per point (median reported)");
  app.add_option("--ops", ops, "Operations: send broadcast all_gather barrier");
  app.add_flag("--json", json, "Also print one JSON line per point");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    MPI_Finalize();
    return rc;
  }
  MPI_Comm raw = MPI_COMM_NULL;  // the raw-MPI side gets its own communicator too
  MPI_Comm_dup(MPI_COMM_WORLD, &raw);
  int rank = 0, n = 0;
  MPI_Comm_rank(raw, &rank);
  MPI_Comm_size(raw, &n);
  auto g = meshrt::StatelessGroup::from_comm(MPI_COMM_WORLD);

  std::vector<std::size_t> sizes;
  for (std::size_t b = 8; b <= max_bytes; b *= 8) sizes.push_back(b);
  if (sizes.back() != max_bytes) sizes.push_back(max_bytes);
  std::vector<Point> points;
  auto iters_for = [](std::size_t bytes) {
    return static_cast<int>(std::clamp<std::size_t>((std::size_t{64} << 20) / std::max<std::size_t>(bytes, 1), 3, 300));
  };
  for (const std::string& op : ops) {
    for (std::size_t bytes : (op == "barrier" ? std::vector<std::size_t>{0} : sizes)) {
      if (op == "send" && n < 2) continue;
      const int iters = iters_for(bytes);
      std::vector<char> v(bytes, 'x'), buf(bytes, 'x'), all(bytes * static_cast<std::size_t>(n));
      std::vector<std::vector<char>> parts;
      std::function<void()> mine, theirs;
      if (op == "send") {
        mine = [&] {
          if (rank == 0) {
            g.send_obj(v, 1);
            g.recv_obj_into(v, 1);
          } else if (rank == 1) {
            g.recv_obj_into(v, 0);
            g.send_obj(v, 0);
          }
        };
        theirs = [&] {
          const int cnt = static_cast<int>(bytes);
          if (rank == 0) {
            MPI_Send(buf.data(), cnt, MPI_BYTE, 1, 0, raw);
            MPI_Recv(buf.data(), cnt, MPI_BYTE, 1, 0, raw, MPI_STATUS_IGNORE);
          } else if (rank == 1) {
            MPI_Recv(buf.data(), cnt, MPI_BYTE, 0, 0, raw, MPI_STATUS_IGNORE);
            MPI_Send(buf.data(), cnt, MPI_BYTE, 0, 0, raw);
          }
        };
      } else if (op == "broadcast") {
        mine = [&] { v = g.broadcast_obj(std::move(v), 0); };
        theirs = [&] { MPI_Bcast(buf.data(), static_cast<int>(bytes), MPI_BYTE, 0, raw); };
      } else if (op == "all_gather") {
        mine = [&] { g.all_gather_obj_into(v, parts); };
        theirs = [&] {
          MPI_Allgather(buf.data(), static_cast<int>(bytes), MPI_BYTE, all.data(), static_cast<int>(bytes), MPI_BYTE,
                        raw);
        };
      } else {
        mine = [&] { g.barrier(); };
        theirs = [&] { MPI_Barrier(raw); };
      }
      // Alternate the two sides so drift on a shared machine hits both alike.
      const double m = measure(raw, iters, reps, mine);
      const double r = measure(raw, iters, reps, theirs);
      double m2 = measure(raw, iters, reps, mine), r2 = measure(raw, iters, reps, theirs);
      Point p{op, bytes, std::min(m, m2), std::min(r, r2)};
      if (op == "send") {  // one-way
        p.meshrt_us /= 2;
        p.mpi_us /= 2;
      }
      points.push_back(p);
      if (rank == 0) {
        if (points.size() == 1) {
          std::printf("%-11s %10s %5s %12s %12s %7s\n", "op", "bytes", "ranks", "meshrt_us", "mpi_us", "ratio");
        }
        std::printf("%-11s %10zu %5d %12.2f %12.2f %7.2f\n", p.op.c_str(), p.bytes, n, p.meshrt_us, p.mpi_us,
                    p.meshrt_us / p.mpi_us);
        std::fflush(stdout);
      }
    }
  }
  if (rank == 0 && json) {
    for (const Point& p : points) {
      nlohmann::json j{{"bench", "group"}, {"op", p.op},         {"bytes", p.bytes},
                       {"ranks", n},       {"meshrt_us", p.meshrt_us}, {"mpi_us", p.mpi_us},
                       {"ratio", p.meshrt_us / p.mpi_us}};
      std::printf("%s\n", j.dump().c_str());
    }
  }
  g.disconnect();
  MPI_Comm_free(&raw);
  MPI_Finalize();
  return 0;
}
