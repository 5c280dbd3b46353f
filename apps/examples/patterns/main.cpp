// What users of the single-controller model write, each checked against a closed form:
// docs/guide.md documents each (its table of examples lists this one).
//   mpiexec -n 4 example-patterns
//   MESHRT_ACCELERATOR=emulated mpiexec -n 4 example-patterns --kind emulated
#include <fmt/format.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "meshrt/meshrt.hpp"

using namespace meshrt;

namespace {

// The local tensor of x on (host = h, gpu = g).
std::array<float, 2> x_at(std::int64_t h, std::int64_t g) {
  const auto base = static_cast<float>(1 + 10 * h + g);
  return {base, base + 1};
}

// An object kept on every worker: each rank's own counter, never sent anywhere.
struct Counter {
  int rank = 0;
  std::int64_t count = 0;
};
WorkerObject make_counter(CallContext& ctx, Args& args) {
  return WorkerObject(std::make_shared<Counter>(Counter{ctx.rank(), args.integer(0)}));
}
// The rank's counter, bumped, as [rank, count] (on the host: a cpu mesh's kernel).
std::vector<Tensor> bump(CallContext&, Args& args) {
  Counter& c = args.object<Counter>(0);
  c.count++;
  return {Tensor::from<std::int64_t>({2}, {c.rank, c.count})};
}

Signature bump_shape(const ArgMetas&) {
  return {.outputs = {TensorMeta({2}, DType::Int64)}, .mutates = {}};
}

}  // namespace

MESHRT_REGISTER_OBJECT("patterns.counter", make_counter);
MESHRT_REGISTER_FUNCTION("patterns.bump", bump, bump_shape);

namespace {

void expect(const Tensor& t, std::array<float, 2> want, const std::string& what) {
  const auto v = t.span<float>();
  if (v.size() != 2 || v[0] != want[0] || v[1] != want[1]) {
    throw Error(fmt::format("{}: expected [{}, {}], found {}", what, want[0], want[1], t.to_string()));
  }
}

void patterns(Controller& ctl, DeviceKind kind) {
  Mesh mesh = ctl.world_mesh({{"host", 2}, {"gpu", 2}}, kind);
  // x = a part that varies along gpu plus one that varies along host.
  DTensor x = mesh.call("meshrt.add", mesh.scatter("gpu", Tensor::from<float>({4}, {1, 2, 2, 3})),
                        mesh.scatter("host", Tensor::from<float>({4}, {0, 0, 10, 10})));
  auto at = [&](const DTensor& t, std::vector<std::pair<std::string, std::int64_t>> coords) {
    return ctl.fetch_shard(t, std::move(coords)).get();
  };

  // Rooted collectives over one dimension, and a barrier (a future).
  DTensor to0 = x.reduce("gpu", Reduction::Sum, Dst{0});  // lives on mesh.slice("gpu", 0)
  for (std::int64_t h = 0; h < 2; ++h) {
    const auto a = x_at(h, 0), b = x_at(h, 1);
    expect(at(to0, {{"host", h}}), {a[0] + b[0], a[1] + b[1]}, "reduce to gpu=0");
  }
  // The rooted result broadcast back onto the whole mesh: x.reduce("gpu", Sum) again.
  DTensor back = to0.to_mesh(mesh);
  for (std::int64_t g = 0; g < 2; ++g) {
    const auto a = x_at(1, 0), b = x_at(1, 1);
    expect(at(back, {{"host", 1}, {"gpu", g}}), {a[0] + b[0], a[1] + b[1]}, "to_mesh from gpu=0 onto the mesh");
  }
  expect(at(x.broadcast("gpu", 1), {{"host", 0}, {"gpu", 0}}), x_at(0, 1), "broadcast from gpu=1");
  mesh.barrier("gpu").get();

  // Several dimensions at once, and a result written into an existing tensor.
  DTensor out = mesh.call("meshrt.zeros", std::vector<std::int64_t>{2}, DType::Float32);
  x.reduce({"host", "gpu"}, Reduction::Sum, false, out);
  expect(at(out, {{"host", 1}, {"gpu", 1}}), {1 + 2 + 11 + 12, 2 + 3 + 12 + 13}, "reduce over (host, gpu)");

  // Several tensors in one fetch (gpu defaults to 0), and futures composed.
  std::vector<Tensor> both = ctl.fetch_shards({x, back}, {{"host", 1}}).get();
  expect(both[0], x_at(1, 0), "fetch_shards: x");
  std::vector<Future<Tensor>> parts;
  for (std::int64_t g = 0; g < 2; ++g) parts.push_back(ctl.fetch_shard(x, {{"host", 0}, {"gpu", g}}));
  std::vector<Tensor> all = when_all(std::move(parts)).get();
  expect(all[1], x_at(0, 1), "when_all");

  if (kind == DeviceKind::Cpu) {
    Object counter = mesh.call_object("patterns.counter", {5});
    (void)mesh.call("patterns.bump", counter);
    DTensor second = mesh.call("patterns.bump", counter);
    for (std::int64_t i = 0; i < 4; ++i) {
      const Tensor got = at(second, {{"host", i / 2}, {"gpu", i % 2}});
      const auto v = got.span<std::int64_t>();
      if (v[0] != mesh.ranks().to_vector()[static_cast<std::size_t>(i)] || v[1] != 7)
        throw Error(fmt::format("counter at position {}: expected [rank, 7], found [{}, {}]", i, v[0], v[1]));
    }
  }

  fmt::print("patterns: all checks passed on {}\n", name(kind));
}

}  // namespace

int main(int argc, char** argv) {
  std::string kind = "cpu";
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == "--kind") kind = argv[i + 1];
  return run(argc, argv, [&](Controller& ctl) {
    patterns(ctl, kind == "emulated" ? DeviceKind::Emulated : kind == "cuda" ? DeviceKind::Cuda : DeviceKind::Cpu);
  });
}
