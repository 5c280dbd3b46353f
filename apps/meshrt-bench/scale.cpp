// scale: what the controller sends and receives per step as the job grows, and the time
// per step (docs/ARCHITECTURE.md section 8). One step is a call, a reduction over every rank
// and a fetch of the result; the counts come from the controller's own transport
// (Controller::control_traffic(), exact), so the rows show the shape directly: flat
// fan-out sends one batch message per rank, the tree at most MESHRT_FANOUT.
//
// It runs at the job's size with the fan-out settings of the environment; scripts/bench_scale.sh
// runs it at N = 2..64 for flat (MESHRT_FANOUT=0) and tree fan-out and collects the rows.
#include <fmt/format.h>

#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench.hpp"
#include "meshrt/meshrt.hpp"
#include "meshrt/settings.hpp"

namespace meshrt::bench {
namespace {

using Clock = std::chrono::steady_clock;

int run_scale(Context& ctx, int argc, char** argv, const std::string& json_path) {
  const int steps = ctx.quick ? 20 : 200;
  const std::int64_t fanout = settings::get_int("MESHRT_FANOUT");
  const std::int64_t threshold = settings::get_int("MESHRT_FANOUT_THRESHOLD");
  Runtime runtime(argc, argv);
  runtime.session([&](Controller& ctl) {
    const int n = static_cast<int>(ctl.worker_ranks().len());
    Mesh mesh = ctl.world_mesh({{"rank", n}});
    const std::vector<std::pair<std::string, std::int64_t>> first{{"rank", 0}};
    auto step = [&] {
      DTensor x = mesh.call("bench.scalar");
      DTensor y = x.reduce("rank", Reduction::Sum);
      return ctl.fetch_shard(y, first).get();
    };
    for (int i = 0; i < 5; ++i) step();  // warm: streams, communicators, the reduction's plan
    ctl.synchronize();
    const ControlTraffic before = ctl.control_traffic();
    const auto t0 = Clock::now();
    for (int i = 0; i < steps; ++i) step();
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count() / steps;
    const ControlTraffic d = ctl.control_traffic().since(before);
    const bool tree = fanout > 0 && n > threshold;
    const double sent = static_cast<double>(d.sent_of(MessageKind::Command).messages) / steps;
    const double received = static_cast<double>(d.received_of(MessageKind::Reply).messages) / steps;
    const double bytes_out = static_cast<double>(d.sent_of(MessageKind::Command).bytes) / steps;
    const double bytes_in = static_cast<double>(d.received_of(MessageKind::Reply).bytes) / steps;
    fmt::print(
        "\nscale at {} worker ranks, fan-out {} (MESHRT_FANOUT={}, threshold {}), {} steps of call + reduce + "
        "fetch\n",
        n, tree ? "tree" : "flat", fanout, threshold, steps);
    fmt::print("{:>6} {:>5} {:>14} {:>14} {:>12} {:>12} {:>12}\n", "ranks", "mode", "cmd msgs/step", "replies/step",
               "B out/step", "B in/step", "us/step");
    fmt::print("{:>6} {:>5} {:>14.2f} {:>14.2f} {:>12.0f} {:>12.0f} {:>12.1f}\n", n, tree ? "tree" : "flat", sent,
               received, bytes_out, bytes_in, seconds * 1e6);
    nlohmann::json j{{"suite", "scale"},
                     {"ranks", n},
                     {"mode", tree ? "tree" : "flat"},
                     {"fanout", fanout},
                     {"threshold", threshold},
                     {"steps", steps},
                     {"command_messages_per_step", sent},
                     {"reply_messages_per_step", received},
                     {"command_bytes_per_step", bytes_out},
                     {"reply_bytes_per_step", bytes_in},
                     {"seconds_per_step", seconds}};
    if (!json_path.empty()) {
      std::ofstream(json_path, std::ios::app) << j.dump() << "\n";
    } else {
      fmt::print("{}\n", j.dump());
    }
  });
  return 0;
}

}  // namespace

MESHRT_BENCH_SUITE_RUN("scale", "controller messages and time per step (call + reduce + fetch) at the job's size",
                       run_scale);

}  // namespace meshrt::bench
