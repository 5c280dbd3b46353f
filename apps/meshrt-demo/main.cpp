// meshrt-demo: trains a two-layer MLP on a dp x tp mesh from one controller program, then
// checks the trained weights against the same training run in one process.
//
//   mpiexec -n 4 meshrt-demo --mesh 2x2
//
// Tensor parallelism over "tp" (Megatron-style): the first layer is column-parallel
// (each tp rank holds W1[:, block] and b1[block] and computes its block of hidden units),
// the second row-parallel (W2[block, :]); the partial outputs are summed with an
// all_reduce over "tp", and b2 is added once, after the sum. Data parallelism over "dp":
// each dp rank makes its own rows of the global batch, and the packed gradients are
// averaged with an all_reduce over "dp". All numerics are in model.cpp; the remote
// functions that wrap them are in functions.cpp.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "meshrt/meshrt.hpp"
#include "reference.hpp"

namespace {

using Clock = std::chrono::steady_clock;
using Coords = std::vector<std::pair<std::string, std::int64_t>>;

struct Options {
  std::string mesh = "2x2";
  demo::TrainOptions train;
  std::int64_t log_every = 50;
  // Record the step once and replay it (Controller::record), instead of issuing its
  // commands one by one each step.
  bool record = false;
  // Largest accepted |distributed - reference|, relative to the largest |weight|.
  // Measured (300 steps, seeds 1-6): float32 round-off of the partitioned sums leaves
  // about one ulp (6e-8 at a weight scale of 0.33); a relu input within round-off of 0
  // can take the other branch in one run, which moves a weight by up to ~2e-5 (6e-5
  // relative). Real bugs move the weights by 0.03-0.08 (about 0.1-0.2 relative): an
  // all_reduce over dp with Sum instead of Avg, or a forgotten all_reduce over tp. 1e-3
  // sits a factor 15 above the first and 100 below the second.
  double rtol = 1e-3;
};

// "DPxTP", e.g. "2x2"; both positive.
std::pair<std::int64_t, std::int64_t> parse_mesh(const std::string& text) {
  const auto x = text.find('x');
  std::size_t used_dp = 0, used_tp = 0;
  long long dp = 0, tp = 0;
  try {
    if (x == std::string::npos) throw std::invalid_argument("no x");
    dp = std::stoll(text.substr(0, x), &used_dp);
    tp = std::stoll(text.substr(x + 1), &used_tp);
  } catch (const std::exception&) {
    used_dp = 0;
  }
  if (used_dp != x || used_tp != text.size() - x - 1 || dp <= 0 || tp <= 0) {
    throw meshrt::UsageError("--mesh: expected DPxTP with two positive integers (e.g. 2x2), found '" + text + "'");
  }
  return {dp, tp};
}

// Copies a shard into rows [row0, row0 + rows) x columns [col0, col0 + cols) of a
// row-major matrix with `ld` columns (a vector is one row).
void place(const meshrt::Tensor& shard, std::vector<float>& full, std::int64_t row0, std::int64_t rows,
           std::int64_t col0, std::int64_t cols, std::int64_t ld) {
  const std::span<const float> got = shard.span<float>();
  if (static_cast<std::int64_t>(got.size()) != rows * cols) {
    throw meshrt::Error(
        fmt::format("expected a shard of {}x{} elements, found {}", rows, cols, shard.meta().to_string()));
  }
  for (std::int64_t i = 0; i < rows; ++i) {
    std::copy_n(got.begin() + i * cols, cols, full.begin() + (row0 + i) * ld + col0);
  }
}

struct Diff {
  double value = 0;
  std::string where = "-";
};

// Raises `worst` to the largest |a[i] - b[i]|, named what[row, column] for a matrix of
// `cols` columns, what[i] for a vector (cols = 0); stays "-" while all are 0.
void max_diff(std::span<const float> a, std::span<const float> b, const std::string& what, std::int64_t cols,
              Diff& worst) {
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i]));
    if (d > worst.value) {
      const auto c = static_cast<std::size_t>(cols);
      worst = {d, cols > 0 ? fmt::format("{}[{}, {}]", what, i / c, i % c) : fmt::format("{}[{}]", what, i)};
    }
  }
}

double max_abs(const demo::Params& p) {
  double m = 0;
  for (const auto* v : {&p.w1, &p.b1, &p.w2, &p.b2}) {
    for (float w : *v) m = std::max(m, static_cast<double>(std::abs(w)));
  }
  return m;
}

void train(meshrt::Controller& ctl, const Options& o) {
  const auto [dp, tp] = parse_mesh(o.mesh);
  const demo::TrainOptions& t = o.train;
  const demo::Sizes& s = t.sizes;
  if (dp * tp != ctl.worker_ranks().len()) {
    throw meshrt::UsageError(fmt::format("--mesh {}: expected dp * tp equal to the number of workers ({}), found {}",
                                         o.mesh, ctl.worker_ranks().len(), dp * tp));
  }
  if (t.batch % dp != 0) {
    throw meshrt::UsageError(fmt::format("--batch {}: expected a multiple of dp = {}", t.batch, dp));
  }
  if (s.hidden % tp != 0) {
    throw meshrt::UsageError(fmt::format("--hidden {}: expected a multiple of tp = {}", s.hidden, tp));
  }
  const std::int64_t rows = t.batch / dp, cols = s.hidden / tp;
  fmt::print(
      "meshrt-demo: MLP {} -> {} -> {} on a dp={} x tp={} mesh ({} ranks); global batch {} ({} per dp rank), "
      "{} steps, lr {}, seed {}{}\n",
      s.in, s.hidden, s.out, dp, tp, dp * tp, t.batch, rows, t.steps, t.lr, t.seed,
      o.record ? "; the step recorded once and replayed" : "");
  fmt::print("{:>6}  {:>10}  {:>9}\n", "step", "loss", "steps/s");
  std::fflush(stdout);

  // On the job's accelerator (MESHRT_ACCELERATOR=emulated runs it anywhere), else the CPU.
  meshrt::Mesh mesh = ctl.world_mesh({{"dp", dp}, {"tp", tp}}, ctl.accelerator());
  const auto seed = static_cast<std::int64_t>(t.seed);
  const std::vector<meshrt::DTensor> params = mesh.call_n("demo.init_params", {seed, s.in, s.hidden, s.out, tp});
  const meshrt::DTensor &w1 = params[0], &b1 = params[1], &w2 = params[2], &b2 = params[3];

  // Every call below returns at once; the controller only waits when it fetches a loss.
  const Clock::time_point start = Clock::now();
  Clock::time_point last = start;
  std::int64_t last_step = -1;
  double last_loss = 0;
  // One SGD step; returns this rank's loss shard. `step` is the step's number, or (for a
  // recorded step, whose commands are the same every time) a counter the workers advance.
  auto sgd_step = [&](const meshrt::Arg& step) {
    const auto batch = mesh.call_n("demo.make_batch", {seed, step, rows, s.in, s.out});  // x, t
    const auto fwd = mesh.call_n("demo.forward", {batch[0], w1, b1, w2});                // z, y_part
    const meshrt::DTensor y = fwd[1].reduce("tp", meshrt::Reduction::Sum);               // row-parallel sum
    const auto lg = mesh.call_n("demo.loss_grad", {y, b2, batch[1]});                    // dy, loss
    meshrt::DTensor grads = mesh.call("demo.backward", batch[0], fwd[0], w2, lg[0]);
    grads.reduce_("dp", meshrt::Reduction::Avg);
    mesh.call_n("demo.sgd_step", {w1, b1, w2, b2, grads, t.lr});
    return lg[1];
  };
  // Recorded: the parameters and the counter are captured, and every replay updates them.
  meshrt::Recording recorded;
  if (o.record) {
    const meshrt::DTensor counter = mesh.call("meshrt.full", std::vector<std::int64_t>{}, meshrt::DType::Int64, 0);
    recorded = ctl.record(
        {}, [&](const std::vector<meshrt::DTensor>&) { return std::vector<meshrt::DTensor>{sgd_step(counter)}; });
  }
  for (std::int64_t step = 0; step < t.steps; ++step) {
    const meshrt::DTensor loss_shard = o.record ? recorded({})[0] : sgd_step(step);

    if (step % o.log_every == 0 || step == t.steps - 1) {
      // The mean over dp of the shards' losses is the global batch's loss (equal shards).
      const meshrt::DTensor loss = loss_shard.reduce("dp", meshrt::Reduction::Avg);
      last_loss = ctl.fetch_shard(loss, {{"dp", 0}, {"tp", 0}}).get().item();
      const Clock::time_point now = Clock::now();
      const std::string rate = last_step < 0
                                   ? "-"
                                   : fmt::format("{:.1f}", static_cast<double>(step - last_step) /
                                                               std::chrono::duration<double>(now - last).count());
      fmt::print("{:>6}  {:>10.6f}  {:>9}\n", step, last_loss, rate);
      std::fflush(stdout);
      last = now;
      last_step = step;
    }
  }
  ctl.synchronize();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  fmt::print("trained {} steps in {:.2f} s: {:.1f} steps/s\n", t.steps, seconds,
             static_cast<double>(t.steps) / seconds);

  // The reference: the same data, initial weights and SGD in this process, unpartitioned.
  const Clock::time_point ref_start = Clock::now();
  const demo::ReferenceRun ref = demo::train_reference(t);
  fmt::print("reference (one process, full matrices): {} steps in {:.2f} s, final loss {:.6f} (distributed {:.6f})\n",
             t.steps, std::chrono::duration<double>(Clock::now() - ref_start).count(), ref.loss.back(), last_loss);

  // Fetch every shard from every rank. The dp=0 shards are assembled into full matrices,
  // as a checkpoint writer would; every other copy must equal them: W1, b1, W2 on the
  // other dp ranks, and b2 everywhere (it is replicated over tp too).
  demo::Params trained{std::vector<float>(ref.params.w1.size()), std::vector<float>(ref.params.b1.size()),
                       std::vector<float>(ref.params.w2.size()), std::vector<float>(ref.params.b2.size())};
  std::vector<std::array<meshrt::Tensor, 4>> dp0(static_cast<std::size_t>(tp));
  Diff replicas;
  for (std::int64_t d = 0; d < dp; ++d) {
    for (std::int64_t j = 0; j < tp; ++j) {
      const Coords at{{"dp", d}, {"tp", j}};
      std::array<meshrt::Future<meshrt::Tensor>, 4> f{ctl.fetch_shard(w1, at), ctl.fetch_shard(b1, at),
                                                      ctl.fetch_shard(w2, at), ctl.fetch_shard(b2, at)};
      const std::array<meshrt::Tensor, 4> got{f[0].get(), f[1].get(), f[2].get(), f[3].get()};
      auto& first = dp0[static_cast<std::size_t>(j)];
      if (d == 0) {
        place(got[0], trained.w1, 0, s.in, j * cols, cols, s.hidden);  // column block
        place(got[1], trained.b1, 0, 1, j * cols, cols, s.hidden);
        place(got[2], trained.w2, j * cols, cols, 0, s.out, s.out);  // row block
        place(got[3], trained.b2, 0, 1, 0, s.out, s.out);
        first = got;
      } else {
        const char* names[] = {"W1", "b1", "W2"};
        const std::int64_t widths[] = {cols, 0, s.out};
        for (std::size_t k = 0; k < 3; ++k) {
          max_diff(got[k].span<float>(), first[k].span<float>(), fmt::format("{} at dp={} tp={}", names[k], d, j),
                   widths[k], replicas);
        }
      }
      max_diff(got[3].span<float>(), dp0[0][3].span<float>(), fmt::format("b2 at dp={} tp={}", d, j), 0, replicas);
    }
  }
  Diff worst;
  max_diff(trained.w1, ref.params.w1, "W1", s.hidden, worst);
  max_diff(trained.b1, ref.params.b1, "b1", 0, worst);
  max_diff(trained.w2, ref.params.w2, "W2", s.out, worst);
  max_diff(trained.b2, ref.params.b2, "b2", 0, worst);
  fmt::print("replicas (W1, b1, W2 over dp; b2 everywhere): max |copy - dp=0 copy| = {:.3g} ({})\n", replicas.value,
             replicas.where);
  const double scale = max_abs(ref.params), tolerance = o.rtol * scale;
  const bool pass = worst.value <= tolerance && replicas.value <= tolerance;
  fmt::print(
      "max |distributed - reference| = {:.3g} ({}); weight scale max|w| = {:.3g}; tolerance {:g} x {:.3g} = "
      "{:.3g}: {}\n",
      worst.value, worst.where, scale, o.rtol, scale, tolerance, pass ? "PASS" : "FAIL");
  if (!pass) {
    throw meshrt::Error(
        fmt::format("verification failed: expected the trained weights within {:.3g} of the one-process "
                    "reference and replicas equal, found differences of {:.3g} ({}) and {:.3g} ({})",
                    tolerance, worst.value, worst.where, replicas.value, replicas.where));
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"meshrt-demo: data- and tensor-parallel MLP training driven by one controller"};
  app.add_option("--mesh", o.mesh, "DPxTP: data-parallel x tensor-parallel degrees; dp*tp = world size")
      ->capture_default_str();
  app.add_option("--steps", o.train.steps, "SGD steps")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--batch", o.train.batch, "global batch (a multiple of dp)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--in", o.train.sizes.in, "input features")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--hidden", o.train.sizes.hidden, "hidden units (a multiple of tp)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--out", o.train.sizes.out, "outputs")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--lr", o.train.lr, "learning rate")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--seed", o.train.seed, "seed of data and weights")->capture_default_str();
  app.add_option("--log-every", o.log_every, "print the loss every N steps")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_flag("--record", o.record,
               "record the step once (Controller::record) and replay it each step, instead of issuing its commands "
               "one by one");
  app.add_option("--rtol", o.rtol, "accepted max |distributed - reference| relative to max |weight|")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  // Every rank parses the same command line, so a bad flag stops every rank alike.
  CLI11_PARSE(app, argc, argv);
  return meshrt::run(argc, argv, [&](meshrt::Controller& ctl) { train(ctl, o); });
}
