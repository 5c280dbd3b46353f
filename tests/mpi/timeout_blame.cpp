// A timeout names the ranks actually behind (issue 24, items 1 and 12):
//
//   timeout_blame <slow rank> [alone] [uncaught]
//
// The kernel on <slow rank> blocks until the controller releases it (it waits for a file
// to exist) while every other rank goes on into the all_reduce after it. A fetch of the
// all_reduce's result with a timeout must raise a TimeoutError whose headline names the
// slow rank as behind, in that kernel, and the others as waiting for it, with
// missing_ranks() == {slow rank}: with the status tree on or off. With `alone` there is
// no all_reduce: the others go idle and the fetch is of the slow rank's own value. The
// program catches the error, releases the kernel and fetches the value; it exits 0 only
// if all of that held. With `uncaught` it lets the TimeoutError escape instead (after
// releasing the kernel).
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "meshrt/meshrt.hpp"

namespace {

using namespace meshrt;

// blame.block(path, rank) -> float32 scalar 1: on world rank `rank`, waits until `path`
// exists (the controller creates it once it has seen the timeout).
Signature block_shape(const ArgMetas& args) {
  args.expect_count(2, 2);
  return {.outputs = {TensorMeta({}, DType::Float32, args.device())}, .mutates = {}};
}
std::vector<Tensor> block_kernel(CallContext& ctx, Args& args) {
  if (ctx.rank() == args.integer(1)) {
    while (!std::filesystem::exists(args.string(0))) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return {Tensor::from<float>({}, {1.0f})};
}
MESHRT_REGISTER_FUNCTION("blame.block", block_kernel, block_shape);

}  // namespace

int main(int argc, char** argv) {
  const int slow = argc > 1 ? std::stoi(argv[1]) : 2;
  bool alone = false, uncaught = false;
  for (int i = 2; i < argc; ++i) {
    alone = alone || std::string(argv[i]) == "alone";
    uncaught = uncaught || std::string(argv[i]) == "uncaught";
  }
  // Only the controller's path counts: it travels to the kernels as an argument.
  const std::string release = fmt::format("{}/meshrt-timeout-blame-{}", std::filesystem::temp_directory_path().string(),
                                          static_cast<long>(::getpid()));
  std::vector<std::string> failed;
  const int rc = run(argc, argv, [&](Controller& ctl) {
    const auto n = ctl.worker_ranks().len();
    Mesh mesh = ctl.world_mesh({{"x", n}});
    // However the body ends, the kernel is released: the job must not hang on a failed check.
    struct Release {
      const std::string& path;
      ~Release() { std::ofstream(path).put('\n'); }
    } guard{release};
    const DTensor before = mesh.call("meshrt.full", std::vector<std::int64_t>{}, DType::Float32, 1.0);
    // The mesh's communicators exist before the timed part: under load their creation
    // alone can outlast the timeout, and then it is what the report names.
    (void)before.reduce("x", Reduction::Sum);
    ctl.synchronize();
    const DTensor blocked = mesh.call("blame.block", release, slow);
    const DTensor sum = mesh.call("meshrt.add", blocked, before);
    Future<Tensor> f = alone ? ctl.fetch_shard(sum, {{"x", slow - ctl.worker_ranks().offset()}})
                             : ctl.fetch_shard(sum.reduce("x", Reduction::Sum), {{"x", 0}});
    auto expect = [&](bool ok, const std::string& what) {
      std::printf("  [%s] %s\n", ok ? "ok" : "FAILED", what.c_str());
      if (!ok) failed.push_back(what);
    };
    try {
      (void)f.get(std::chrono::milliseconds(500));
      expect(false, "get(0.5 s) raises TimeoutError");
    } catch (const TimeoutError& e) {
      std::ofstream(release).put('\n');
      if (uncaught) throw;
      const std::string what = e.what();
      const std::string head = what.substr(0, what.find('\n'));
      std::printf("TimeoutError: %s\nmissing_ranks(): [%s]\n", what.c_str(),
                  fmt::format("{}", fmt::join(e.missing_ranks(), ", ")).c_str());
      expect(e.missing_ranks() == std::vector<int>{slow}, fmt::format("missing_ranks() is [{}]", slow));
      expect(head.find(fmt::format("rank {} is behind: running blame.block (invocation", slow)) != std::string::npos,
             fmt::format("the headline names rank {} behind in blame.block", slow));
      const auto waiting = head.find("are waiting for it in ");
      if (alone) {
        expect(head.find("waiting") == std::string::npos, "the headline names no rank waiting");
      } else {
        expect(waiting != std::string::npos && head.find("over 'x'", waiting) != std::string::npos,
               "the headline names the others as waiting for it in the all_reduce over 'x'");
      }
      expect(head.find("has not reported") == std::string::npos, "the headline blames no rank for a report");
    }
    const float expected = alone ? 2.0f : 2.0f * static_cast<float>(n);
    expect(f.get().span<float>()[0] == expected, "the value arrives once the kernel returns");
  });
  std::filesystem::remove(release);
  if (rc != 0) return rc;
  if (!failed.empty()) {
    std::fprintf(stderr, "timeout_blame: %zu expectation(s) did not hold, first: %s\n", failed.size(),
                 failed[0].c_str());
    return 1;
  }
  return 0;
}
