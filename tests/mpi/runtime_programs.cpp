// Whole programs around meshrt::run, chosen by argv[1]:
//   dedicated   a dedicated controller on rank 0 drives workers on ranks 1..N-1
//   throws      the controller function throws: run() returns non-zero, nothing hangs
//   plain       does a little work (with MESHRT_EXTRA_FUNCTION defined at compile time
//               the binary has one more function: the handshake must refuse to start)
#include <cstdio>
#include <cstring>
#include <string>

#include "meshrt/meshrt.hpp"

using namespace meshrt;

#ifdef MESHRT_EXTRA_FUNCTION
namespace {
Signature extra_shape(const ArgMetas&) { return {}; }
std::vector<Tensor> extra_kernel(CallContext&, Args&) { return {}; }
}  // namespace
MESHRT_REGISTER_FUNCTION("test.only_in_one_binary", extra_kernel, extra_shape);
#endif

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "plain";
  RuntimeOptions options;
  options.dedicated_controller = mode == "dedicated";
  return run(
      argc, argv,
      [&](Controller& ctl) {
        const auto n = ctl.worker_ranks().len();
        Mesh mesh = ctl.world_mesh({{"w", n}});
        DTensor x = mesh.call("meshrt.full", {2}, DType::Float64, 1.5);
        const double got = ctl.fetch_shard(x.reduce("w", Reduction::Sum), {{"w", 0}}).get().span<double>()[0];
        if (got != 1.5 * static_cast<double>(n)) throw Error("expected " + std::to_string(1.5 * n) + ", found " + std::to_string(got));
        if (mode == "dedicated") {
          if (ctl.worker_ranks().offset() != 1) throw Error("a dedicated controller's workers start at rank 1");
          std::printf("dedicated controller: %lld workers, sum %.1f\n", static_cast<long long>(n), got);
        }
        if (mode == "throws") throw std::runtime_error("the controller gave up on purpose");
      },
      options);
}
