// What a user sees when things go wrong, and that the job carries on.
//
//   mpiexec -n 4 errors
//
// 1. A function fails on one rank: fetching its value raises meshrt::RemoteError naming
//    the function, the rank, the worker's message and the controller line that issued it.
// 2. Values computed from it (a reduce, a call) fail with the same root cause, although
//    the other ranks' kernels ran fine: the reduce still ran on every rank (the failed
//    rank joined it with zeros), so no rank hangs.
// 3. Unrelated work issued before and after still computes and fetches.
// 4. Mistakes the controller can see (an unknown mesh dimension, mismatched shapes) raise
//    meshrt::UsageError at the call, before anything is sent.
// 5. A fetch with a timeout raises meshrt::TimeoutError naming the ranks not there yet;
//    the same future can be waited on again.
// 6. synchronize() raises a failure that no Future reported, once.
// Exits 0 only if every one of these held.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <thread>
#include <vector>

#include "meshrt/meshrt.hpp"

namespace {

using namespace meshrt;
using namespace std::chrono_literals;

// errors.sleep(seconds, rank) -> float32 scalar 1: sleeps on world rank `rank` only.
Signature sleep_shape(const ArgMetas& args) {
  args.expect_count(2, 2);
  (void)args.number(0);
  (void)args.integer(1);
  return {.outputs = {TensorMeta({}, DType::Float32, args.device())}, .mutates = {}};
}
std::vector<Tensor> sleep_kernel(CallContext& ctx, Args& args) {
  if (ctx.rank() == args.integer(1)) std::this_thread::sleep_for(std::chrono::duration<double>(args.number(0)));
  return {Tensor::from<float>({}, {1.0f})};
}
MESHRT_REGISTER_FUNCTION("errors.sleep", sleep_kernel, sleep_shape);

class Checks {
 public:
  void expect(bool ok, const std::string& what) {
    fmt::print("  [{}] {}\n", ok ? "ok" : "FAILED", what);
    if (!ok) failed_.push_back(what);
  }
  void done() const {
    if (!failed_.empty()) {
      throw Error(fmt::format("errors example: {} expectation(s) did not hold, first: {}", failed_.size(), failed_[0]));
    }
    fmt::print("errors example: every expectation held\n");
  }

 private:
  std::vector<std::string> failed_;
};

void print_remote_error(const RemoteError& e) {
  fmt::print("  what():           {}\n", e.what());
  fmt::print("  function():       {}\n", e.function());
  fmt::print("  ranks():          [{}]\n", fmt::join(e.ranks(), ", "));
  fmt::print("  worker_message(): {}\n", e.worker_message());
  fmt::print("  issued_at():      {}\n", e.issued_at());
  fmt::print("  ident():          {}\n", e.ident());
}

void errors(Controller& ctl) {
  Checks checks;
  const std::int64_t n = ctl.worker_ranks().len();
  // The failing rank: the last worker, so that it is not the controller's own worker.
  const int bad_rank = static_cast<int>(ctl.worker_ranks()[n - 1]);
  Mesh mesh = ctl.world_mesh({{"x", n}});

  const DTensor before = mesh.call("meshrt.full", {4}, DType::Float32, 2.0);
  const DTensor failed = mesh.call("meshrt.fail", "out of memory (on purpose)", {bad_rank});
  const std::string fail_site = fmt::format("main.cpp:{}", __LINE__ - 1);
  const DTensor reduced = failed.reduce("x", Reduction::Sum);      // all ranks join; poisoned
  const DTensor scaled = mesh.call("meshrt.scale", reduced, 3.0);  // a dependent of a dependent
  const DTensor after = before.reduce("x", Reduction::Sum);

  fmt::print("1. meshrt.fail on rank {} only; fetching its value from rank {}:\n", bad_rank, bad_rank);
  std::uint64_t root = 0;
  try {
    (void)ctl.fetch_shard(failed, {{"x", n - 1}}).get();
    checks.expect(false, "fetching the failed value raises RemoteError");
  } catch (const RemoteError& e) {
    print_remote_error(e);
    root = e.ident();
    checks.expect(e.function() == "meshrt.fail", "function() names meshrt.fail");
    checks.expect(e.ranks() == std::vector<int>{bad_rank}, fmt::format("ranks() is [{}]", bad_rank));
    checks.expect(e.worker_message().find("out of memory (on purpose)") != std::string::npos,
                  "worker_message() carries the kernel's exception text");
    checks.expect(e.issued_at().find(fail_site) != std::string::npos, "issued_at() names the line of the call");
  }

  fmt::print("2. its dependents, fetched from rank 0 (whose own kernel did not fail):\n");
  for (const auto& [what, t] : {std::pair<const char*, const DTensor&>{"the reduce", reduced}, {"the scale", scaled}}) {
    try {
      (void)ctl.fetch_shard(t, {{"x", 0}}).get();
      checks.expect(false, fmt::format("fetching {} raises RemoteError", what));
    } catch (const RemoteError& e) {
      fmt::print("  {}: {}\n", what, e.what());
      checks.expect(e.ident() == root && e.function() == "meshrt.fail",
                    fmt::format("{} fails with the same root cause (ident {}, meshrt.fail)", what, root));
    }
  }

  fmt::print("3. unrelated work, issued before and after the failure:\n");
  const double sum = ctl.fetch_shard(after, {{"x", 0}}).get().span<float>()[0];
  checks.expect(sum == 2.0 * static_cast<double>(n), fmt::format("sum over x of 2.0 is {} (expected {})", sum, 2 * n));
  const DTensor later = mesh.call("meshrt.full", {2}, DType::Float64, 0.5).reduce("x", Reduction::Max);
  checks.expect(ctl.fetch_shard(later, {{"x", n - 1}}).get().span<double>()[1] == 0.5,
                fmt::format("a new computation on the failed rank {} succeeds", bad_rank));

  fmt::print("4. mistakes the controller sees at the call site:\n");
  try {
    (void)before.reduce("y", Reduction::Sum);
    checks.expect(false, "reducing over an unknown dimension raises UsageError");
  } catch (const UsageError& e) {
    fmt::print("  UsageError: {}\n", e.what());
    checks.expect(true, "reducing over an unknown dimension raises UsageError");
  }
  try {
    (void)mesh.call("meshrt.add", before, mesh.call("meshrt.full", {3}, DType::Float32, 1.0));
    checks.expect(false, "adding [4] and [3] raises UsageError");
  } catch (const UsageError& e) {
    fmt::print("  UsageError: {}\n", e.what());
    checks.expect(true, "adding [4] and [3] raises UsageError");
  }

  fmt::print("5. a fetch that takes longer than its timeout:\n");
  const DTensor slow = mesh.call("errors.sleep", 1.5, bad_rank);
  Future<Tensor> f = ctl.fetch_shard(slow, {{"x", 0}});
  try {
    (void)f.get(0.2s);
    checks.expect(false, "get(0.2 s) raises TimeoutError");
  } catch (const TimeoutError& e) {
    fmt::print("  TimeoutError: {}\n", e.what());
    fmt::print("  missing_ranks(): [{}]\n", fmt::join(e.missing_ranks(), ", "));
    checks.expect(true, "get(0.2 s) raises TimeoutError");
  }
  checks.expect(f.get().item() == 1.0, "waiting again without a timeout returns the value");

  fmt::print("6. synchronize() and errors nobody fetched:\n");
  // Every error so far was observed through a Future: synchronize() has nothing to raise.
  try {
    ctl.synchronize();
    checks.expect(true, "synchronize() after the failures were observed returns");
  } catch (const RemoteError& e) {
    fmt::print("  synchronize(): {}\n", e.what());
    checks.expect(false, "synchronize() after the failures were observed returns");
  }
  // A failure no Future reports is raised by the next synchronize(), once.
  (void)mesh.call("meshrt.fail", "nobody fetches this", {bad_rank});
  try {
    ctl.synchronize();
    checks.expect(false, "synchronize() raises the failure nobody fetched");
  } catch (const RemoteError& e) {
    fmt::print("  synchronize(): {}\n", e.what());
    checks.expect(e.worker_message() == "nobody fetches this", "synchronize() raises the failure nobody fetched");
  }
  try {
    ctl.synchronize();
    checks.expect(true, "the next synchronize() returns");
  } catch (const RemoteError& e) {
    fmt::print("  synchronize(): {}\n", e.what());
    checks.expect(false, "the next synchronize() returns");
  }
  checks.done();
}

}  // namespace

int main(int argc, char** argv) {
  return run(argc, argv, errors);
}
