// dispatch: how fast the controller drives the workers.
//   - trivial CallFunctions per second, batched (the controller issues N, then waits for
//     every worker to finish them), per worker;
//   - the round trip of a fetch, and of a call plus a fetch;
// against the same message pattern with raw MPI in the same run: the command bytes sent
// in the same batches, and a ping-pong of the fetch's request and reply sizes.
#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <vector>

#include "bench.hpp"
#include "meshrt/internal/protocol.hpp"
#include "meshrt/meshrt.hpp"

namespace meshrt::bench {
namespace {

using Clock = std::chrono::steady_clock;

Signature noop_shape(const ArgMetas&) {
  return {};
}
std::vector<Tensor> noop_kernel(CallContext&, Args&) {
  return {};
}
Signature scalar_shape(const ArgMetas& a) {
  return {{TensorMeta({}, DType::Float32, a.device())}, {}};
}
std::vector<Tensor> scalar_kernel(CallContext&, Args&) {
  return {Tensor::zeros(TensorMeta({}, DType::Float32))};
}

constexpr int kBatch = 256;  // the controller's batch bound

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Raw MPI: rank 0 sends `commands` commands of `bytes` each to every other rank, packed
// kBatch to a message as the controller packs a CommandGroup; each rank answers once.
double raw_batched(MPI_Comm comm, int rank, int size, int commands, std::size_t bytes) {
  const int messages = commands / kBatch;
  std::vector<char> buf(bytes * kBatch);
  std::vector<MPI_Request> reqs;
  MPI_Barrier(comm);
  const auto t0 = Clock::now();
  if (rank == 0) {
    for (int m = 0; m < messages; ++m) {
      for (int r = 1; r < size; ++r) {
        reqs.emplace_back();
        MPI_Isend(buf.data(), static_cast<int>(buf.size()), MPI_BYTE, r, 1, comm, &reqs.back());
      }
    }
    MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE);
    for (int r = 1; r < size; ++r) MPI_Recv(nullptr, 0, MPI_BYTE, r, 2, comm, MPI_STATUS_IGNORE);
  } else {
    for (int m = 0; m < messages; ++m)
      MPI_Recv(buf.data(), static_cast<int>(buf.size()), MPI_BYTE, 0, 1, comm, MPI_STATUS_IGNORE);
    MPI_Send(nullptr, 0, MPI_BYTE, 0, 2, comm);
  }
  const double t = std::chrono::duration<double>(Clock::now() - t0).count();
  double slowest = 0;
  MPI_Allreduce(&t, &slowest, 1, MPI_DOUBLE, MPI_MAX, comm);
  return slowest / commands;
}

// Raw MPI: ping-pong between rank 0 and rank `peer` of `request` then `reply` bytes.
double raw_pingpong(MPI_Comm comm, int rank, int peer, int iters, std::size_t request, std::size_t reply) {
  std::vector<char> a(request), b(reply);
  MPI_Barrier(comm);
  const auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) {
    if (rank == 0) {
      MPI_Send(a.data(), static_cast<int>(request), MPI_BYTE, peer, 3, comm);
      MPI_Recv(b.data(), static_cast<int>(reply), MPI_BYTE, peer, 4, comm, MPI_STATUS_IGNORE);
    } else if (rank == peer) {
      MPI_Recv(a.data(), static_cast<int>(request), MPI_BYTE, 0, 3, comm, MPI_STATUS_IGNORE);
      MPI_Send(b.data(), static_cast<int>(reply), MPI_BYTE, 0, 4, comm);
    }
  }
  double t = std::chrono::duration<double>(Clock::now() - t0).count() / iters;
  MPI_Bcast(&t, 1, MPI_DOUBLE, 0, comm);
  return t;
}

class Collect : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& r : runs) {
      if (r.run_type == Run::RT_Aggregate && r.aggregate_name != "median") continue;
      seconds[r.run_name.function_name] = r.GetAdjustedRealTime() * 1e-9;  // kNanosecond
      if (r.counters.count("per_command")) per_command[r.run_name.function_name] = r.counters.at("per_command");
    }
  }
  std::map<std::string, double> seconds;
  std::map<std::string, double> per_command;
};

int run_dispatch(Context& ctx, int argc, char** argv, const std::string& json_path) {
  // Google Benchmark's own flags (--benchmark_filter to run one of the three).
  benchmark::Initialize(&argc, argv);
  const int commands = ctx.quick ? 20 * kBatch : 200 * kBatch;
  const int pings = ctx.quick ? 200 : 2000;
  // Sizes of what meshrt sends: a trivial CallFunction, a FetchValue and a scalar's FetchResult.
  const std::size_t call_bytes =
      protocol::encode(protocol::Command{protocol::CallFunction{1, {}, {}, "bench.noop", {}, Ref{2}, Ref{3}}}).size();
  const std::size_t fetch_bytes =
      protocol::encode(protocol::Command{protocol::FetchValue{1, {}, std::nullopt, Value(Ref{4}), Ref{2}}}).size();
  const std::size_t result_bytes =
      protocol::encode(protocol::Reply{protocol::FetchResult{1, Value(Tensor::zeros(TensorMeta({}, DType::Float32)))}})
          .size();

  std::vector<double> raw_cmd, raw_rt;
  for (int rep = 0; rep < 5; ++rep) {
    raw_cmd.push_back(ctx.size > 1 ? raw_batched(ctx.comm, ctx.rank, ctx.size, commands, call_bytes) : 0.0);
    raw_rt.push_back(ctx.size > 1 ? raw_pingpong(ctx.comm, ctx.rank, ctx.size - 1, pings, fetch_bytes, result_bytes)
                                  : 0.0);
  }

  Runtime runtime(argc, argv);
  int rc = 0;
  runtime.session([&](Controller& ctl) {
    Mesh mesh = ctl.world_mesh({{"rank", ctl.world_size()}});
    DTensor scalar = mesh.call("bench.scalar");
    ctl.synchronize();
    const std::vector<std::pair<std::string, std::int64_t>> last{{"rank", ctl.world_size() - 1}};
    benchmark::RegisterBenchmark("dispatch/batched_calls",
                                 [&](benchmark::State& state) {
                                   for (auto _ : state) {
                                     for (int i = 0; i < commands; ++i) mesh.call("bench.noop");
                                     ctl.synchronize();
                                   }
                                   state.counters["per_command"] = 0;
                                 })
        ->Unit(benchmark::kNanosecond)
        ->Iterations(ctx.quick ? 2 : 5);
    benchmark::RegisterBenchmark("dispatch/fetch",
                                 [&](benchmark::State& state) {
                                   for (auto _ : state) benchmark::DoNotOptimize(ctl.fetch_shard(scalar, last).get());
                                 })
        ->Unit(benchmark::kNanosecond)
        ->Iterations(pings);
    benchmark::RegisterBenchmark("dispatch/call_and_fetch",
                                 [&](benchmark::State& state) {
                                   for (auto _ : state)
                                     benchmark::DoNotOptimize(ctl.fetch_shard(mesh.call("bench.scalar"), last).get());
                                 })
        ->Unit(benchmark::kNanosecond)
        ->Iterations(pings);
    Collect reporter;
    benchmark::RunSpecifiedBenchmarks(&reporter);
    const double per_command = reporter.seconds["dispatch/batched_calls"] / commands;
    fmt::print("\ndispatch at {} ranks: {:.0f} trivial commands per second per worker ({:.2f} us each, batched {})\n",
               ctl.world_size(), 1.0 / per_command, per_command * 1e6, kBatch);
    std::vector<Row> rows{
        {"dispatch", "batched CallFunction", call_bytes, per_command, median(raw_cmd), "per command, every worker"},
        {"dispatch", "fetch round trip", fetch_bytes + result_bytes, reporter.seconds["dispatch/fetch"], median(raw_rt),
         "vs ping-pong of the same bytes"},
        {"dispatch", "call + fetch round trip", call_bytes + fetch_bytes + result_bytes,
         reporter.seconds["dispatch/call_and_fetch"], median(raw_rt), "vs the same ping-pong"},
    };
    if (ctl.world_size() == 1) {
      fmt::print("(1 rank: no raw MPI peer to compare with)\n");
      for (const Row& r : rows) fmt::print("{:<34} {:>10} {:>12.3f} us\n", r.op, r.bytes, r.meshrt_seconds * 1e6);
    } else {
      print_rows(rows, ctl.world_size(), json_path);
    }
  });
  return rc;
}

}  // namespace

MESHRT_BENCH_SUITE_RUN("dispatch", "controller -> worker command rate and fetch round trip", run_dispatch);

}  // namespace meshrt::bench

MESHRT_REGISTER_FUNCTION("bench.noop", meshrt::bench::noop_kernel, meshrt::bench::noop_shape);
MESHRT_REGISTER_FUNCTION("bench.scalar", meshrt::bench::scalar_kernel, meshrt::bench::scalar_shape);
