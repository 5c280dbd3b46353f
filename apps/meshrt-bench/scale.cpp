// scale: what the controller sends and receives per step as the job grows, and the time
// per step (docs/ARCHITECTURE.md section 8). One step is a call, a reduction over every rank
// and a fetch of the result; the counts come from the controller's own transport
// (Controller::control_traffic(), exact), so the rows show the shape directly: flat
// fan-out sends one batch message per rank, the tree at most MESHRT_FANOUT; flat fan-in
// hears a Status from every rank per completed fetch, the status tree one per top node.
//
// It runs at the job's size with the fan-out settings of the environment; scripts/bench-scale.sh
// runs it at N = 2..64 for flat (MESHRT_FANOUT=0) and tree fan-out and collects the rows.
#include <fmt/format.h>

#include <mpi.h>

#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench.hpp"
#include "meshrt/internal/settings.hpp"
#include "meshrt/meshrt.hpp"

namespace meshrt::bench {
namespace {

using Clock = std::chrono::steady_clock;

// The controller's cost per control message, raw MPI as the transport does it: rank 0
// posts `count` nonblocking sends of `bytes` to the other ranks in turn and completes them
// (the batch path; posting only), then takes `count` messages of `bytes` from any rank with a matched
// probe (the status path). Seconds per message, as rank 0 sees them.
std::pair<double, double> per_message_cost(const Context& ctx, int count, std::size_t bytes) {
  if (ctx.size < 2) return {0.0, 0.0};
  std::vector<char> buf(bytes);
  const int peers = ctx.size - 1;
  const int per_peer = count / peers;
  MPI_Barrier(ctx.comm);
  double send_s = 0, recv_s = 0;
  if (ctx.rank == 0) {
    std::vector<MPI_Request> reqs(static_cast<std::size_t>(per_peer * peers));
    const auto t0 = Clock::now();
    for (int i = 0; i < per_peer * peers; ++i) {
      MPI_Isend(buf.data(), static_cast<int>(bytes), MPI_BYTE, 1 + i % peers, 7, ctx.comm,
                &reqs[static_cast<std::size_t>(i)]);
    }
    // Rank 0's work: posting the sends (eager at this size). Completing them waits for
    // the receivers, which on an oversubscribed machine is their scheduling, not rank 0.
    send_s = std::chrono::duration<double>(Clock::now() - t0).count() / (per_peer * peers);
    MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE);
  } else {
    for (int i = 0; i < per_peer; ++i)
      MPI_Recv(buf.data(), static_cast<int>(bytes), MPI_BYTE, 0, 7, ctx.comm, MPI_STATUS_IGNORE);
  }
  MPI_Barrier(ctx.comm);
  if (ctx.rank == 0) {
    // Let the peers' messages arrive first: the time is rank 0's work per message, not
    // the peers' sending.
    const auto t_wait = Clock::now();
    int arrived = 0;
    while (arrived == 0 && Clock::now() - t_wait < std::chrono::seconds(5)) {
      MPI_Iprobe(MPI_ANY_SOURCE, 8, ctx.comm, &arrived, MPI_STATUS_IGNORE);
    }
    const auto t0 = Clock::now();
    for (int i = 0; i < per_peer * peers; ++i) {
      int flag = 0;
      MPI_Message m;
      MPI_Status st;
      while (!flag) MPI_Improbe(MPI_ANY_SOURCE, 8, ctx.comm, &flag, &m, &st);
      MPI_Mrecv(buf.data(), static_cast<int>(bytes), MPI_BYTE, &m, MPI_STATUS_IGNORE);
    }
    recv_s = std::chrono::duration<double>(Clock::now() - t0).count() / (per_peer * peers);
  } else {
    for (int i = 0; i < per_peer; ++i) MPI_Send(buf.data(), static_cast<int>(bytes), MPI_BYTE, 0, 8, ctx.comm);
  }
  MPI_Barrier(ctx.comm);
  return {send_s, recv_s};
}

int run_scale(Context& ctx, int argc, char** argv, const std::string& json_path) {
  const int steps = ctx.quick ? 20 : 200;
  // A batch of a call and a reduction is ~150 B; a Status ~20 B.
  const auto [send_cost, recv_cost] = per_message_cost(ctx, ctx.quick ? 2000 : 20000, 160);
  const std::int64_t fanout = settings::kFanout.get();
  const std::int64_t threshold = settings::kFanoutThreshold.get();
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
    // Each step completes one fetch, whose FetchResult is one reply (no step fails): the
    // rest are Status, one per worker flat, one per top node of the status tree.
    const double status_per_fetch = received - 1.0;
    fmt::print(
        "\nscale at {} worker ranks, fan-out {} (MESHRT_FANOUT={}, threshold {}), {} steps of call + reduce + "
        "fetch\n",
        n, tree ? "tree" : "flat", fanout, threshold, steps);
    fmt::print("{:>6} {:>5} {:>14} {:>14} {:>13} {:>12} {:>12} {:>12} {:>12} {:>12}\n", "ranks", "mode",
               "cmd msgs/step", "replies/step", "status/fetch", "B out/step", "B in/step", "us/step", "us/send",
               "us/recv");
    fmt::print("{:>6} {:>5} {:>14.2f} {:>14.2f} {:>13.2f} {:>12.0f} {:>12.0f} {:>12.1f} {:>12.3f} {:>12.3f}\n", n,
               tree ? "tree" : "flat", sent, received, status_per_fetch, bytes_out, bytes_in, seconds * 1e6,
               send_cost * 1e6, recv_cost * 1e6);
    nlohmann::json j{{"suite", "scale"},
                     {"ranks", n},
                     {"mode", tree ? "tree" : "flat"},
                     {"fanout", fanout},
                     {"threshold", threshold},
                     {"steps", steps},
                     {"command_messages_per_step", sent},
                     {"reply_messages_per_step", received},
                     {"status_messages_per_fetch", status_per_fetch},
                     {"command_bytes_per_step", bytes_out},
                     {"reply_bytes_per_step", bytes_in},
                     {"seconds_per_step", seconds},
                     {"raw_send_seconds_per_message", send_cost},
                     {"raw_receive_seconds_per_message", recv_cost}};
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
