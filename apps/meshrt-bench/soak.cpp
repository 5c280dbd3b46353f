// soak: one long session that must not grow (issue 9). A ring of live DTensors on the
// world mesh; every step replaces one slot with a new call result (so each step is one
// CallFunction plus the deletion of the value it replaces), with a reduction, a fetch and
// a synchronize now and then. After a warm-up (every slot replaced twice, every lazy
// communicator made) and at the end it measures on every rank:
//   - resident memory (VmRSS; rank 0 holds the controller and worker 0),
//   - open file descriptors (/proc/self/fd), which also covers shared-memory segments
//     and sockets MPI would open for new communicators or connections,
//   - the values each worker holds (Status live_values),
// and fails (exit 1) if RSS grew by 5% or more, descriptors grew, or a worker holds more
// than the ring plus the mesh and streams. MPI has no portable counter of
// communicators: the comm module counts those its meshes hold
// (WorkerMesh::live_communicators), which the slice loop checks.
// Then the slice loop (issue 14): 10^5 steps (10^4 with --quick) of a sub-mesh, a
// reduction over it and a to_mesh, with values, memory and communicators checked flat.
//
//   mpiexec -n 4 meshrt-bench soak            # 10^6 commands, 10^4 live tensors
//   mpiexec -n 2 meshrt-bench soak --quick    # 10^5 commands (CI)
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>

#include <malloc.h>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "bench.hpp"
#include "meshrt/internal/comm.hpp"
#include "meshrt/internal/settings.hpp"
#include "meshrt/meshrt.hpp"

namespace meshrt::bench {
namespace {

using Clock = std::chrono::steady_clock;

// VmRSS in kB, from /proc/self/status (0 if unreadable: then the check reports it).
std::int64_t resident_kb() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
  }
  return 0;
}

std::int64_t open_fds() {
  std::int64_t n = 0;
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator("/proc/self/fd", ec); !ec && it != std::filesystem::end(it);
       it.increment(ec)) {
    n++;
  }
  return n - 1;  // the directory iterator's own descriptor
}

// bench.rss(): this rank's [VmRSS kB, open descriptors, MPI communicators its meshes
// hold] as an int64 [3] tensor.
Signature rss_shape(const ArgMetas& a) {
  a.expect_count(0, 0);
  return {{TensorMeta({3}, DType::Int64, a.device())}, {}};
}
std::vector<Tensor> rss_kernel(CallContext&, Args&) {
  Tensor t = Tensor::empty(TensorMeta({3}, DType::Int64));
  malloc_trim(0);  // count memory in use, not free memory the allocator still holds
  t.data<std::int64_t>()[0] = resident_kb();
  t.data<std::int64_t>()[1] = open_fds();
  t.data<std::int64_t>()[2] = WorkerMesh::live_communicators();
  return {t};
}

struct Sample {
  std::vector<std::int64_t> rss_kb, fds, comms;
  std::vector<std::uint64_t> live_values;
};

Sample sample(Controller& ctl, const Mesh& mesh) {
  ctl.synchronize();
  DTensor probe = mesh.call("bench.rss");
  Sample s;
  for (std::int64_t r = 0; r < ctl.world_size(); ++r) {
    const Tensor t = ctl.fetch_shard(probe, {{"rank", r}}).get();
    s.rss_kb.push_back(t.data<std::int64_t>()[0]);
    s.fds.push_back(t.data<std::int64_t>()[1]);
    s.comms.push_back(t.data<std::int64_t>()[2]);
  }
  ctl.synchronize();  // a fresh Status from every worker for live_values
  for (auto r : ctl.worker_ranks()) s.live_values.push_back(ctl.live_values(static_cast<int>(r)));
  return s;
}

int run_soak(Context& ctx, int argc, char** argv, const std::string& json_path) {
  const std::int64_t commands =
      settings::kSoakCommands.from_environment().value_or(ctx.quick ? 100'000 : 1'000'000);  // longer runs by hand
  const std::int64_t ring_size = 10'000;
  const bool trace = settings::kSoakTrace.get();  // RSS at every synchronize
  const double max_growth = 0.05;
  Runtime runtime(argc, argv);
  int rc = 0;
  runtime.session([&](Controller& ctl) {
    Mesh mesh = ctl.world_mesh({{"rank", ctl.world_size()}});
    const std::vector<std::pair<std::string, std::int64_t>> last{{"rank", ctl.world_size() - 1}};
    std::vector<DTensor> ring(static_cast<std::size_t>(ring_size));
    std::int64_t fetches = 0, reductions = 0, syncs = 0;
    // One step: slot i % ring_size gets a fresh value made from two other slots.
    auto step = [&](std::int64_t i) {
      const auto slot = static_cast<std::size_t>(i % ring_size);
      const auto a = static_cast<std::size_t>((i * 7 + 1) % ring_size);
      const auto b = static_cast<std::size_t>((i * 13 + 3) % ring_size);
      if (!ring[a].defined() || !ring[b].defined() || i % 5 == 0) {
        ring[slot] = mesh.call("meshrt.zeros", {4}, DType::Float32);
      } else if (i % 1000 == 1) {
        ring[slot] = ring[a].reduce("rank", Reduction::Sum);
        reductions++;
      } else {
        ring[slot] = mesh.call("meshrt.add", ring[a], ring[b]);
      }
      if (i % 10'000 == 7) {
        // Zeros added to zeros: any other value means a command ran wrongly.
        const Tensor t = ctl.fetch_shard(ring[slot], last).get();
        if (t.data<float>()[0] != 0.0f)
          throw Error(fmt::format("soak: step {}: fetched {}, expected 0", i, t.data<float>()[0]));
        fetches++;
      }
      if (i % 100'000 == 99'999) {
        ctl.synchronize();
        syncs++;
        if (trace) {
          const Sample now = sample(ctl, mesh);
          fmt::print("soak trace: step {:>8}: rss kB", i + 1);
          for (auto kb : now.rss_kb) fmt::print(" {}", kb);
          fmt::print("\n");
        }
      }
    };
    // Warm-up: every slot filled and replaced once, so the ring, the controller's tables
    // and the workers' maps are at their steady size before the first sample; and one
    // whole synchronize period, so the deepest backlog of work in flight (commands queued
    // in MPI and on the workers, invocations the controller tracks) has been reached
    // once: memory it used stays with the allocator and is not growth. Measured here
    // (MESHRT_SOAK_TRACE=1): resident memory rises by about 2 MB over the first ~4 x 10^5
    // commands while Open MPI's free lists and the allocator settle, then stays flat.
    const std::int64_t warmup = 2 * ring_size + 400'000;
    for (std::int64_t i = 0; i < warmup; ++i) step(i);
    const Sample start = sample(ctl, mesh);
    const auto t0 = Clock::now();
    for (std::int64_t i = warmup; i < warmup + commands; ++i) step(i);
    ctl.synchronize();
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    const Sample end = sample(ctl, mesh);

    // The checks: every violation names the rank, the quantity and both figures.
    std::vector<std::string> violations;
    double worst_growth = 0;
    for (std::size_t r = 0; r < start.rss_kb.size(); ++r) {
      const double growth = start.rss_kb[r] > 0 ? static_cast<double>(end.rss_kb[r] - start.rss_kb[r]) /
                                                      static_cast<double>(start.rss_kb[r])
                                                : 1.0;
      worst_growth = std::max(worst_growth, growth);
      if (start.rss_kb[r] <= 0 || growth >= max_growth) {
        violations.push_back(
            fmt::format("rank {}: resident memory grew from {} kB to {} kB ({:+.1f}%), expected < {:.0f}%", r,
                        start.rss_kb[r], end.rss_kb[r], growth * 100, max_growth * 100));
      }
      if (end.fds[r] > start.fds[r]) {
        violations.push_back(fmt::format("rank {}: open descriptors grew from {} to {}, expected no growth", r,
                                         start.fds[r], end.fds[r]));
      }
    }
    // The ring, plus the mesh, the default stream and the probe's output.
    const auto bound = static_cast<std::uint64_t>(ring_size) + 8;
    for (std::size_t k = 0; k < end.live_values.size(); ++k) {
      if (end.live_values[k] > bound) {
        violations.push_back(
            fmt::format("worker {}: holds {} values after the run, expected at most {} (the ring of {} "
                        "and the mesh, stream and probe)",
                        ctl.worker_ranks()[static_cast<std::int64_t>(k)], end.live_values[k], bound, ring_size));
      }
    }

    fmt::print(
        "\nsoak at {} ranks: {} commands ({} reductions, {} fetches, {} synchronizes) with {} live tensors in "
        "{:.1f} s ({:.0f} commands/s)\n",
        ctl.world_size(), commands, reductions, fetches, syncs, ring_size, seconds,
        static_cast<double>(commands) / seconds);
    fmt::print("{:<6} {:>14} {:>14} {:>8} {:>10} {:>8} {:>12} {:>12}\n", "rank", "rss start kB", "rss end kB", "growth",
               "fds start", "fds end", "live start", "live end");
    for (std::size_t r = 0; r < start.rss_kb.size(); ++r) {
      const bool worker = r < start.live_values.size();
      fmt::print("{:<6} {:>14} {:>14} {:>7.2f}% {:>10} {:>8} {:>12} {:>12}\n", r, start.rss_kb[r], end.rss_kb[r],
                 100.0 * static_cast<double>(end.rss_kb[r] - start.rss_kb[r]) /
                     static_cast<double>(std::max<std::int64_t>(1, start.rss_kb[r])),
                 start.fds[r], end.fds[r], worker ? std::to_string(start.live_values[r]) : "-",
                 worker ? std::to_string(end.live_values[r]) : "-");
    }
    fmt::print("(rank 0 holds the controller and worker 0; communicators are counted in the slice loop below)\n");
    nlohmann::json j{{"suite", "soak"},
                     {"ranks", ctl.world_size()},
                     {"commands", commands},
                     {"live_tensors", ring_size},
                     {"seconds", seconds},
                     {"commands_per_s", static_cast<double>(commands) / seconds},
                     {"rss_kb_start", start.rss_kb},
                     {"rss_kb_end", end.rss_kb},
                     {"rss_growth_max", worst_growth},
                     {"fds_start", start.fds},
                     {"fds_end", end.fds},
                     {"live_values_start", start.live_values},
                     {"live_values_end", end.live_values},
                     {"ok", violations.empty()}};
    if (!json_path.empty())
      std::ofstream(json_path, std::ios::app) << j.dump() << "\n";
    else
      fmt::print("{}\n", j.dump());

    // The slice loop (issue 14): meshes are values with a lifetime. Each step makes a
    // sub-mesh (one of 64 names, more than the session keeps alive, so meshes are made
    // and freed all along), reduces over it, and sends a slice of the result to another
    // rank's sub-mesh: values, memory and communicators must stay flat.
    const std::int64_t slice_steps = ctx.quick ? 10'000 : 100'000;
    const std::int64_t n = ctl.world_size();
    constexpr std::int64_t slice_names = 64;
    DTensor base = mesh.call("meshrt.zeros", {4}, DType::Float32);
    DTensor kept;
    std::int64_t slice_fetches = 0;
    auto slice_step = [&](std::int64_t i) {
      const std::string dim = fmt::format("r{}", i % slice_names);
      Mesh named = mesh.rename("rank", dim);
      Mesh part = named.slice(dim, i % n, i % n + 1);
      DTensor r = part.call("meshrt.copy", base).reduce(dim, Reduction::Sum);
      kept = r.slice_mesh(dim, 0).to_mesh(named.slice(dim, (i + 1) % n));
      if (i % 10'000 == 9'999) {
        const Tensor t = ctl.fetch_shard(kept).get();
        if (t.data<float>()[0] != 0.0f)
          throw Error(fmt::format("soak: slice step {}: fetched {}, expected 0", i, t.data<float>()[0]));
        slice_fetches++;
      }
    };
    // Warm-up, as the ring's: measured at 2 ranks, resident memory rises by 4-6 MB over
    // the first ~10^5 steps with the same number of values and communicators (the
    // allocator and Open MPI's free lists settling to the sends' pattern), then stays
    // flat (+0.2% / -1.0% over the next 10^5). Under MPICH it rises by ~11 MB on rank 0
    // and may still be rising after the quick run's 2 x 10^4 (+10.5 MB over the measured
    // 10^4 in a CI run; +0.4 MB over 10^5 after a warm-up of 2 x 10^5): so after 2 x steps
    // the warm-up goes on a quarter of `slice_steps` at a time until no rank grew by 1 MiB
    // in one, at most 16 more. A mesh leaked per step (17 kB) grows 40 MB a quarter of the
    // quick run and is never settled.
    std::int64_t slice_warmup = 2 * slice_steps;
    for (std::int64_t i = 0; i < slice_warmup; ++i) slice_step(i);
    Sample slice_start = sample(ctl, mesh);
    for (int more = 0; more < 16; ++more) {
      for (std::int64_t k = 0; k < slice_steps / 4; ++k) slice_step(slice_warmup++);
      Sample now = sample(ctl, mesh);
      bool settled = true;
      for (std::size_t r = 0; r < now.rss_kb.size(); ++r) settled &= now.rss_kb[r] - slice_start.rss_kb[r] < 1024;
      slice_start = std::move(now);
      if (settled) break;
    }
    const auto t1 = Clock::now();
    for (std::int64_t i = slice_warmup; i < slice_warmup + slice_steps; ++i) slice_step(i);
    ctl.synchronize();
    const double slice_seconds = std::chrono::duration<double>(Clock::now() - t1).count();
    const Sample slice_end = sample(ctl, mesh);
    std::vector<std::string> slice_violations;
    for (std::size_t r = 0; r < slice_start.rss_kb.size(); ++r) {
      const double growth = slice_start.rss_kb[r] > 0
                                ? static_cast<double>(slice_end.rss_kb[r] - slice_start.rss_kb[r]) /
                                      static_cast<double>(slice_start.rss_kb[r])
                                : 1.0;
      // The leak this loop exists for is a mesh per step (two communicators and ~17 kB on
      // every member): 170 MB over the quick run's 10^4 steps. The settling above goes on
      // past the quick run's shorter warm-up (+1.3 MB, 5.1-5.3% on rank 1 in 2 of 6 quick
      // runs, flat over the full run), so growth fails the run only past both 5% and
      // 8 MiB (800 B a step in the quick run, 80 B in the full one).
      const std::int64_t grown_kb = slice_end.rss_kb[r] - slice_start.rss_kb[r];
      if (growth >= max_growth && grown_kb >= 8 * 1024) {
        slice_violations.push_back(fmt::format(
            "slice loop: rank {}: resident memory grew from {} kB to {} kB ({:+.1f}%), expected < {:.0f}% or < 8 MiB",
            r, slice_start.rss_kb[r], slice_end.rss_kb[r], growth * 100, max_growth * 100));
      }
      // The session keeps its recent meshes (two communicators each at most here): a
      // count that follows the steps is a leak.
      const std::int64_t comm_bound = slice_start.comms[r] + 2 * 17;
      if (slice_end.comms[r] > comm_bound) {
        slice_violations.push_back(
            fmt::format("slice loop: rank {}: holds {} MPI communicators after {} steps, expected at most {}", r,
                        slice_end.comms[r], slice_steps, comm_bound));
      }
      if (slice_end.fds[r] > slice_start.fds[r]) {
        slice_violations.push_back(fmt::format("slice loop: rank {}: open descriptors grew from {} to {}", r,
                                               slice_start.fds[r], slice_end.fds[r]));
      }
    }
    for (std::size_t k = 0; k < slice_end.live_values.size(); ++k) {
      const std::uint64_t value_bound = slice_start.live_values[k] + 17;
      if (slice_end.live_values[k] > value_bound) {
        slice_violations.push_back(fmt::format(
            "slice loop: worker {}: holds {} values after {} steps, expected at most {}",
            ctl.worker_ranks()[static_cast<std::int64_t>(k)], slice_end.live_values[k], slice_steps, value_bound));
      }
    }
    fmt::print(
        "\nsoak slice loop at {} ranks: {} steps (slice + reduce + to_mesh, {} fetches) in {:.1f} s ({:.0f} steps/s)\n",
        n, slice_steps, slice_fetches, slice_seconds, static_cast<double>(slice_steps) / slice_seconds);
    fmt::print("{:<6} {:>14} {:>14} {:>11} {:>9} {:>12} {:>12}\n", "rank", "rss start kB", "rss end kB", "comms start",
               "comms end", "live start", "live end");
    for (std::size_t r = 0; r < slice_start.rss_kb.size(); ++r) {
      const bool worker = r < slice_start.live_values.size();
      fmt::print("{:<6} {:>14} {:>14} {:>11} {:>9} {:>12} {:>12}\n", r, slice_start.rss_kb[r], slice_end.rss_kb[r],
                 slice_start.comms[r], slice_end.comms[r], worker ? std::to_string(slice_start.live_values[r]) : "-",
                 worker ? std::to_string(slice_end.live_values[r]) : "-");
    }
    nlohmann::json sj{{"suite", "soak_slices"},
                      {"ranks", n},
                      {"steps", slice_steps},
                      {"seconds", slice_seconds},
                      {"rss_kb_start", slice_start.rss_kb},
                      {"rss_kb_end", slice_end.rss_kb},
                      {"comms_start", slice_start.comms},
                      {"comms_end", slice_end.comms},
                      {"live_values_start", slice_start.live_values},
                      {"live_values_end", slice_end.live_values},
                      {"ok", slice_violations.empty()}};
    if (!json_path.empty())
      std::ofstream(json_path, std::ios::app) << sj.dump() << "\n";
    else
      fmt::print("{}\n", sj.dump());
    violations.insert(violations.end(), slice_violations.begin(), slice_violations.end());
    for (const std::string& v : violations) fmt::print(stderr, "soak: FAILED: {}\n", v);
    if (!violations.empty()) rc = 1;
  });
  return rc;
}

}  // namespace

MESHRT_BENCH_SUITE_RUN("soak", "10^6 commands with 10^4 live tensors: memory, descriptors and values must not grow",
                       run_soak);

}  // namespace meshrt::bench

MESHRT_REGISTER_FUNCTION("bench.rss", meshrt::bench::rss_kernel, meshrt::bench::rss_shape);
