#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <mpi.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "bench.hpp"
#include "meshrt/version.hpp"

namespace meshrt::bench {
namespace {

std::vector<Suite>& suites() {
  static std::vector<Suite> s;
  return s;
}

struct PairInfo {
  std::string suite, op;
  std::size_t bytes;
  BusFactor bus;
  int ranks;
};
// In registration order, keyed by "<suite>/<op>/<bytes>".
std::vector<std::pair<std::string, PairInfo>>& pair_infos() {
  static std::vector<std::pair<std::string, PairInfo>> m;
  return m;
}

void run_pair_side(benchmark::State& state, MPI_Comm comm, int inner, const std::function<void()>& op) {
  op();  // warm-up: first touch of buffers, lazy communicators
  MPI_Barrier(comm);
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < inner; ++i) op();
    double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    double slowest = 0;
    MPI_Allreduce(&elapsed, &slowest, 1, MPI_DOUBLE, MPI_MAX, comm);
    state.SetIterationTime(slowest / inner);
  }
}

// Prints Google Benchmark's console output, then the side-by-side table and JSON lines.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  explicit RatioReporter(std::optional<std::string> json_path) : json_path_(std::move(json_path)) {}

  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& r : runs) {
      if (r.run_type == Run::RT_Aggregate && r.aggregate_name != "median") continue;
      const std::string name = r.run_name.function_name;
      times_[name] = r.GetAdjustedRealTime() * time_unit_seconds(r.time_unit);
      if (r.run_type == Run::RT_Aggregate) aggregated_.insert(name);
    }
  }

  void Finalize() override {
    ConsoleReporter::Finalize();
    print_pairs();
  }

 private:
  static double time_unit_seconds(benchmark::TimeUnit u) {
    switch (u) {
      case benchmark::kNanosecond:
        return 1e-9;
      case benchmark::kMicrosecond:
        return 1e-6;
      case benchmark::kMillisecond:
        return 1e-3;
      case benchmark::kSecond:
        return 1;
    }
    return 1;
  }

  void print_pairs() {
    std::vector<CollectiveRow> rows;
    for (const auto& [key, info] : pair_infos()) {
      auto m = times_.find(key + "/meshrt");
      auto r = times_.find(key + "/mpi");
      if (m == times_.end() || r == times_.end()) continue;
      rows.push_back({info.suite, info.op, info.bytes, info.bus, m->second, r->second});
    }
    const int ranks = pair_infos().empty() ? 1 : pair_infos().front().second.ranks;
    print_collective_rows(rows, ranks, json_path_.value_or(""));
  }

  std::optional<std::string> json_path_;
  std::map<std::string, double> times_;
  std::set<std::string> aggregated_;
};

class NullReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

void usage() {
  std::printf(
      "usage: mpiexec -n <ranks> meshrt-bench <suite> [--quick] [--json FILE] [Google Benchmark flags]\nsuites:\n");
  for (const Suite& s : suites()) std::printf("  %-20s %s\n", s.name, s.description);
}

}  // namespace

double bus_factor(BusFactor f, int n) {
  switch (f) {
    case BusFactor::one:
      return 1;
    case BusFactor::all_reduce:
      return 2.0 * (n - 1) / n;
    case BusFactor::gather_like:
      return static_cast<double>(n - 1) / n;
  }
  return 1;
}

SuiteRegistrar::SuiteRegistrar(Suite suite) {
  suites().push_back(suite);
}

void print_rows(const std::vector<Row>& rows, int ranks, const std::string& json_path) {
  std::ofstream file;
  if (!json_path.empty()) file.open(json_path, std::ios::app);
  std::string suite;
  for (const Row& r : rows) {
    if (r.suite != suite) {
      suite = r.suite;
      fmt::print("\n{} at {} ranks: meshrt against the same message pattern with raw MPI in the same run\n", suite,
                 ranks);
      fmt::print("{:<34} {:>10} {:>12} {:>12} {:>7}  {}\n", "op", "bytes", "meshrt us", "mpi us", "ratio", "");
    }
    fmt::print("{:<34} {:>10} {:>12.3f} {:>12.3f} {:>7.2f}  {}\n", r.op, r.bytes, r.meshrt_seconds * 1e6,
               r.mpi_seconds * 1e6, r.meshrt_seconds / r.mpi_seconds, r.unit_note);
    nlohmann::json j{{"suite", r.suite},
                     {"op", r.op},
                     {"bytes", r.bytes},
                     {"ranks", ranks},
                     {"meshrt_us", r.meshrt_seconds * 1e6},
                     {"mpi_us", r.mpi_seconds * 1e6},
                     {"ratio", r.meshrt_seconds / r.mpi_seconds},
                     {"note", r.unit_note}};
    if (file.is_open())
      file << j.dump() << "\n";
    else
      std::printf("%s\n", j.dump().c_str());
  }
  std::fflush(stdout);
}

void print_collective_rows(const std::vector<CollectiveRow>& rows, int ranks, const std::string& json_path) {
  std::ofstream file;
  if (!json_path.empty()) file.open(json_path, std::ios::app);
  std::vector<nlohmann::json> lines;
  std::string block;
  for (const CollectiveRow& row : rows) {
    if (row.suite + "/" + row.op != block) {
      block = row.suite + "/" + row.op;
      fmt::print("\n{} {} at {} ranks: meshrt against the same MPI call in the same run\n", row.suite, row.op, ranks);
      fmt::print("{:<16} {:>10} {:>12} {:>12} {:>10} {:>10} {:>10} {:>10} {:>7}\n", "op", "bytes", "meshrt us",
                 "mpi us", "algbw GB/s", "busbw GB/s", "mpi algbw", "mpi busbw", "ratio");
    }
    const double factor = bus_factor(row.bus, ranks);
    const double alg_m = static_cast<double>(row.bytes) / row.meshrt_seconds / 1e9;
    const double alg_r = static_cast<double>(row.bytes) / row.mpi_seconds / 1e9;
    const double ratio = row.meshrt_seconds / row.mpi_seconds;
    fmt::print("{:<16} {:>10} {:>12.2f} {:>12.2f} {:>10.3f} {:>10.3f} {:>10.3f} {:>10.3f} {:>7.2f}\n", row.op,
               row.bytes, row.meshrt_seconds * 1e6, row.mpi_seconds * 1e6, alg_m, alg_m * factor, alg_r, alg_r * factor,
               ratio);
    lines.push_back({{"suite", row.suite},
                     {"op", row.op},
                     {"bytes", row.bytes},
                     {"ranks", ranks},
                     {"meshrt_us", row.meshrt_seconds * 1e6},
                     {"mpi_us", row.mpi_seconds * 1e6},
                     {"meshrt_algbw_gbs", alg_m},
                     {"meshrt_busbw_gbs", alg_m * factor},
                     {"mpi_algbw_gbs", alg_r},
                     {"mpi_busbw_gbs", alg_r * factor},
                     {"ratio", ratio}});
  }
  // All JSON lines after the tables, as the suites always printed them.
  for (const auto& j : lines) {
    if (file.is_open())
      file << j.dump() << "\n";
    else
      std::printf("%s\n", j.dump().c_str());
  }
  std::fflush(stdout);
}

std::string flag(int argc, char** argv, const std::string& name) {
  const std::string prefix = "--" + name + "=";
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], prefix.c_str(), prefix.size()) == 0) return argv[i] + prefix.size();
  }
  return "";
}

std::vector<std::size_t> sizes_up_to(std::size_t max_bytes, bool quick) {
  std::vector<std::size_t> out;
  for (std::size_t b = 8; b <= max_bytes; b *= quick ? 64 : 8) out.push_back(b);
  if (max_bytes >= (1u << 20) && std::find(out.begin(), out.end(), std::size_t{1} << 20) == out.end()) {
    out.push_back(std::size_t{1} << 20);
  }
  std::sort(out.begin(), out.end());
  return out;
}

void add_pair(const Context& ctx, Pair p) {
  const std::string key = fmt::format("{}/{}/{}", p.suite, p.op, p.bytes);
  pair_infos().emplace_back(key, PairInfo{p.suite, p.op, p.bytes, p.bus, ctx.size});
  const int iterations = ctx.quick ? std::max(2, p.iterations / 5) : p.iterations;
  const MPI_Comm comm = ctx.comm;
  const int inner = p.inner;
  for (auto [side, fn] : {std::pair{"meshrt", p.meshrt}, std::pair{"mpi", p.mpi}}) {
    benchmark::RegisterBenchmark((key + "/" + side).c_str(),
                                 [comm, inner, fn = fn](benchmark::State& s) { run_pair_side(s, comm, inner, fn); })
        ->Iterations(iterations)
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
  }
}

}  // namespace meshrt::bench

int main(int argc, char** argv) {
  using namespace meshrt::bench;
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  Context ctx;
  MPI_Comm_dup(MPI_COMM_WORLD, &ctx.comm);
  MPI_Comm_rank(ctx.comm, &ctx.rank);
  MPI_Comm_size(ctx.comm, &ctx.size);

  std::optional<std::string> json_path;
  std::vector<char*> bench_args{argv[0]};
  const Suite* suite = nullptr;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      ctx.quick = true;
    } else if (a == "--json" && i + 1 < argc) {
      json_path = argv[++i];
    } else if (a == "-h" || a == "--help") {
      if (ctx.rank == 0) usage();
      MPI_Finalize();
      return 0;
    } else if (a.rfind("--", 0) == 0) {
      bench_args.push_back(argv[i]);
    } else {
      for (const Suite& s : suites()) {
        if (a == s.name) suite = &s;
      }
      if (!suite) {
        if (ctx.rank == 0) {
          std::fprintf(stderr, "meshrt-bench: unknown suite \"%s\"\n", a.c_str());
          usage();
        }
        MPI_Finalize();
        return 2;
      }
    }
  }
  if (!suite) {
    if (ctx.rank == 0) usage();
    MPI_Finalize();
    return 2;
  }
  if (ctx.rank == 0) {
    const auto info = meshrt::build_info();
    std::printf("meshrt-bench %s: meshrt %s (%s), %s, %d ranks\n", suite->name, info.meshrt_version.c_str(),
                info.build_type.c_str(), info.mpi_library.c_str(), ctx.size);
  }
  int bargc = static_cast<int>(bench_args.size());
  if (suite->run) {
    const int rc = suite->run(ctx, bargc, bench_args.data(), json_path.value_or(""));
    MPI_Comm_free(&ctx.comm);
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
    return rc;
  }
  suite->register_benchmarks(ctx);
  benchmark::Initialize(&bargc, bench_args.data());
  if (ctx.rank == 0) {
    RatioReporter reporter(json_path);
    benchmark::RunSpecifiedBenchmarks(&reporter);
  } else {
    NullReporter reporter;
    benchmark::RunSpecifiedBenchmarks(&reporter);
  }
  benchmark::Shutdown();
  MPI_Comm_free(&ctx.comm);
  MPI_Finalize();
  return 0;
}
