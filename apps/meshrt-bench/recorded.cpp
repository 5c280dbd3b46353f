// recorded: what recording a step saves (Controller::record, docs/guide.md "Recorded
// steps"). Side by side in one job, medians over repetitions:
//   - an 8 B all_reduce (in place, over every rank) issued one by one, recorded 100 to a
//     replay, and MPI_Allreduce by hand on the same ranks: microseconds per all_reduce;
//   - a small step shaped like meshrt-demo's (6 calls and 2 all_reduces on 8 B tensors)
//     issued one by one and replayed: steps per second;
//   - the command messages the controller sends per step either way.
//
//   mpiexec -n 4 meshrt-bench recorded [--quick] [--reps=N]
#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "bench.hpp"
#include "meshrt/meshrt.hpp"

namespace meshrt::bench {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kOps = 1000;       // all_reduces per sample
constexpr int kPerReplay = 100;  // all_reduces in the recorded loop
constexpr int kSteps = 500;      // steps per sample

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct Sample {
  std::vector<double> one_by_one, recorded, mpi;      // seconds per all_reduce
  std::vector<double> step_issued, step_recorded;     // seconds per step
  double messages_issued = 0, messages_recorded = 0;  // command messages per step
  double step_messages_issued = 0, step_messages_recorded = 0;
};

std::uint64_t commands_sent(const Controller& ctl) {
  return ctl.control_traffic().sent_of(MessageKind::Command).messages;
}

// The demo's shape: 6 calls and 2 all_reduces, the parameters captured and updated.
std::vector<DTensor> small_step(Mesh& mesh, DTensor& w, const DTensor& x) {
  DTensor a = mesh.call("meshrt.scale", x, 1.0);
  DTensor b = mesh.call("meshrt.scale", a, 0.5).reduce("x", Reduction::Sum);
  DTensor c = mesh.call("meshrt.scale", b, 0.5);
  DTensor d = mesh.call("meshrt.copy", c);
  DTensor g = mesh.call("meshrt.scale", d, 0.0);
  g.reduce_("x", Reduction::Avg);
  mesh.call("meshrt.add_", w, g);
  return {c};
}

void run_meshrt(Controller& ctl, Sample& s) {
  Mesh mesh = ctl.world_mesh({{"x", ctl.worker_ranks().len()}});
  DTensor x = mesh.call("meshrt.zeros", {2}, DType::Float32);
  DTensor w = mesh.call("meshrt.zeros", {2}, DType::Float32);
  for (int i = 0; i < 10; ++i) x.reduce_("x", Reduction::Sum);
  ctl.synchronize();

  std::uint64_t m0 = commands_sent(ctl);
  auto t0 = Clock::now();
  for (int i = 0; i < kOps; ++i) x.reduce_("x", Reduction::Sum);
  ctl.synchronize();
  s.one_by_one.push_back(seconds_since(t0) / kOps);
  s.messages_issued = static_cast<double>(commands_sent(ctl) - m0) / kOps;

  Recording loop = ctl.record({}, [&](const std::vector<DTensor>&) {
    for (int i = 0; i < kPerReplay; ++i) x.reduce_("x", Reduction::Sum);
    return std::vector<DTensor>{};
  });
  loop({});
  ctl.synchronize();
  m0 = commands_sent(ctl);
  t0 = Clock::now();
  for (int i = 0; i < kOps / kPerReplay; ++i) loop({});
  ctl.synchronize();
  s.recorded.push_back(seconds_since(t0) / kOps);
  s.messages_recorded = static_cast<double>(commands_sent(ctl) - m0) / (kOps / kPerReplay);

  DTensor in = mesh.call("meshrt.zeros", {2}, DType::Float32);
  (void)small_step(mesh, w, in);
  ctl.synchronize();
  m0 = commands_sent(ctl);
  t0 = Clock::now();
  for (int i = 0; i < kSteps; ++i) in = small_step(mesh, w, in)[0];
  ctl.synchronize();
  s.step_issued.push_back(seconds_since(t0) / kSteps);
  s.step_messages_issued = static_cast<double>(commands_sent(ctl) - m0) / kSteps;

  Recording step = ctl.record({in}, [&](const std::vector<DTensor>& v) { return small_step(mesh, w, v[0]); });
  in = step({in})[0];
  ctl.synchronize();
  m0 = commands_sent(ctl);
  t0 = Clock::now();
  for (int i = 0; i < kSteps; ++i) in = step({in})[0];
  ctl.synchronize();
  s.step_recorded.push_back(seconds_since(t0) / kSteps);
  s.step_messages_recorded = static_cast<double>(commands_sent(ctl) - m0) / kSteps;
}

double run_mpi(MPI_Comm comm) {
  float v[2] = {0, 0};
  for (int i = 0; i < 10; ++i) MPI_Allreduce(MPI_IN_PLACE, v, 2, MPI_FLOAT, MPI_SUM, comm);
  MPI_Barrier(comm);
  const auto t0 = Clock::now();
  for (int i = 0; i < kOps; ++i) MPI_Allreduce(MPI_IN_PLACE, v, 2, MPI_FLOAT, MPI_SUM, comm);
  const double t = seconds_since(t0);
  double slowest = 0;
  MPI_Allreduce(&t, &slowest, 1, MPI_DOUBLE, MPI_MAX, comm);
  return slowest / kOps;
}

int run_recorded(Context& ctx, int argc, char** argv, const std::string&) {
  const std::string reps_flag = flag(argc, argv, "reps");
  const int reps = reps_flag.empty() ? (ctx.quick ? 1 : 5) : std::max(1, std::stoi(reps_flag));
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Comm_dup(ctx.comm, &comm);
  Sample s;
  Runtime runtime(argc, argv);
  for (int rep = 0; rep < reps; ++rep) {
    runtime.session([&](Controller& ctl) { run_meshrt(ctl, s); });
    s.mpi.push_back(run_mpi(comm));
  }
  MPI_Comm_free(&comm);
  if (ctx.rank != 0) return 0;
  const double mpi = median(s.mpi), one = median(s.one_by_one), rec = median(s.recorded);
  const double issued = median(s.step_issued), recorded = median(s.step_recorded);
  fmt::print("recorded steps on {} ranks (medians of {} repetition{})\n", ctx.size, reps, reps == 1 ? "" : "s");
  fmt::print("  {:<52} {:>10} {:>10}\n", "8 B all_reduce (in place, every rank)", "us/op", "vs MPI");
  fmt::print("  {:<52} {:>10.2f} {:>9.2f}x\n", "issued one by one", one * 1e6, one / mpi);
  fmt::print("  {:<52} {:>10.2f} {:>9.2f}x\n", fmt::format("recorded, {} per replay", kPerReplay), rec * 1e6,
             rec / mpi);
  fmt::print("  {:<52} {:>10.2f} {:>9.2f}x\n", "MPI_Allreduce by hand", mpi * 1e6, 1.0);
  fmt::print("  {:<52} {:>10} {:>10}\n", "small step (6 calls, 2 all_reduces)", "steps/s", "speed-up");
  fmt::print("  {:<52} {:>10.0f} {:>9.2f}x\n", "issued one by one", 1 / issued, 1.0);
  fmt::print("  {:<52} {:>10.0f} {:>9.2f}x\n", "recorded, one replay per step", 1 / recorded, issued / recorded);
  fmt::print(
      "  command messages the controller sent per step: {:.3f} issued, {:.3f} replayed "
      "(per 100 all_reduces: {:.2f} issued, {:.2f} replayed)\n",
      s.step_messages_issued, s.step_messages_recorded, s.messages_issued * kPerReplay, s.messages_recorded);
  return 0;
}

}  // namespace

MESHRT_BENCH_SUITE_RUN("recorded",
                       "recorded steps replayed against the same commands issued one by one and MPI by hand",
                       run_recorded);

}  // namespace meshrt::bench
