// Bad input at the controller (issue 9): every mistake a user can make at a call site is
// refused there, before anything is sent, with a message that says what was expected,
// what was found and where (function, mesh dimension, rank); and the session keeps
// working afterwards. Runs at 4 ranks as a 2x2 mesh; every TEST is one session.
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <cstddef>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "meshrt/internal/controller.hpp"
#include "meshrt/internal/protocol.hpp"
#include "runtime_support.hpp"

using namespace meshrt;
using meshrt::test::session;

MESHRT_RUNTIME_TEST_ENVIRONMENT();

namespace {
// test.declared_only(shape, dtype, device): the controller sees a tensor of that meta (on
// a GPU, or of several GiB). Its kernel always fails, so the workers never allocate it:
// the test needs no GPU and little memory, and runs alike on machines with a GPU.
Signature declared_only_shape(const ArgMetas& a) {
  return {{TensorMeta(a.shape(0), a.dtype(1), Device::parse(a.string(2)))}, {}};
}
std::vector<Tensor> declared_only_kernel(CallContext&, Args&) {
  throw std::runtime_error("test.declared_only fails on purpose");
}

// test.shape_throws(kind): a shape function that throws something other than a
// UsageError (kind 0: std::runtime_error, 1: std::out_of_range, 2: an int).
Signature shape_throws_shape(const ArgMetas& a) {
  const std::int64_t kind = a.integer(0);
  if (kind == 0) throw std::runtime_error("shape trouble");
  if (kind == 1) throw std::out_of_range("index 9 past the end");
  throw 42;
}
std::vector<Tensor> shape_throws_kernel(CallContext&, Args&) {
  return {};
}
constexpr int kShapeThrowsLine = __LINE__ + 1;
MESHRT_REGISTER_FUNCTION("test.shape_throws", shape_throws_kernel, shape_throws_shape);
}  // namespace

MESHRT_REGISTER_FUNCTION("test.declared_only", declared_only_kernel, declared_only_shape);

namespace {
// test.drive_controller(mode): on rank 0 its kernel (run by worker 0, beside the
// controller) uses the controller's handles the test left in these, the way `mode` says;
// every other rank returns a float32 scalar.
Controller* g_controller = nullptr;
Mesh* g_mesh = nullptr;
DTensor* g_tensor = nullptr;
Signature drive_controller_shape(const ArgMetas& a) {
  return {{TensorMeta({}, DType::Float32, a.device())}, {}};
}
std::vector<Tensor> drive_controller_kernel(CallContext& ctx, Args& args) {
  if (ctx.rank() == 0) {
    const std::string mode = args.string(0);
    if (mode == "synchronize") g_controller->synchronize(std::chrono::seconds(5));
    if (mode == "fetch") (void)g_controller->fetch_shard(*g_tensor, {{"host", 0}, {"gpu", 1}});
    if (mode == "call") (void)g_mesh->call("test.pattern", {2}, DType::Float32);
    if (mode == "reduce") (void)g_tensor->reduce("gpu", Reduction::Sum);
    if (mode == "world_mesh") (void)g_controller->world_mesh({{"all", 4}});
  }
  return {Tensor::zeros(TensorMeta({}, DType::Float32))};
}
}  // namespace
MESHRT_REGISTER_FUNCTION("test.drive_controller", drive_controller_kernel, drive_controller_shape);

namespace {

using Coords = std::vector<std::pair<std::string, std::int64_t>>;

Mesh make_mesh(Controller& ctl) {
  return ctl.world_mesh({{"host", 2}, {"gpu", 2}});
}

// Runs `f`, expects it to throw E, and returns the message ("" and a failure otherwise).
template <class E, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected " << ::testing::internal::GetTypeName<E>() << ", got another exception: " << e.what();
    return e.what();
  }
  ADD_FAILURE() << "expected " << ::testing::internal::GetTypeName<E>() << ", nothing was thrown";
  return "";
}

// Every part must appear in the message, in this order.
void expect_parts(const std::string& text, const std::vector<std::string>& parts) {
  std::size_t at = 0;
  for (const std::string& p : parts) {
    const std::size_t found = text.find(p, at);
    EXPECT_NE(found, std::string::npos) << "expected \"" << p << "\" (after offset " << at << ") in: " << text;
    if (found != std::string::npos) at = found + p.size();
  }
}

// The session still computes: a reduction over each dimension, fetched from every rank
// (element 0 of test.pattern on rank r is r * 100 + 1).
void expect_session_works(Controller& ctl, const Mesh& mesh) {
  DTensor x = mesh.call("test.pattern", {2}, DType::Float64);
  DTensor over_gpu = x.reduce("gpu", Reduction::Sum);
  for (std::int64_t h = 0; h < 2; ++h) {
    for (std::int64_t g = 0; g < 2; ++g) {
      const Tensor t = ctl.fetch_shard(over_gpu, {{"host", h}, {"gpu", g}}).get(std::chrono::seconds(30));
      const double r0 = static_cast<double>(h * 2), r1 = static_cast<double>(h * 2 + 1);
      EXPECT_EQ(t.span<double>()[0], r0 * 100 + 1 + r1 * 100 + 1) << "host " << h << " gpu " << g;
    }
  }
  EXPECT_NO_THROW(ctl.synchronize(std::chrono::seconds(30)));
}

}  // namespace

TEST(BadInput, UnknownFunction) {
  session([](Controller& ctl) {
    Mesh mesh = make_mesh(ctl);
    DTensor x = mesh.call("test.pattern", {3}, DType::Float32);
    // A typo: the closest registered names are suggested.
    expect_parts(error_of<UsageError>([&] { mesh.call("meshrt.ad", x, x); }),
                 {"unknown function 'meshrt.ad'", "did you mean", "meshrt.add", "functions registered"});
    // Nothing close: every registered name is listed, so the user sees what exists.
    expect_parts(error_of<UsageError>([&] { mesh.call("zzzzzzzzzzzzzzzzzzzz"); }),
                 {"unknown function 'zzzzzzzzzzzzzzzzzzzz'", "registered:", "meshrt.add", "test.pattern"});
    // The same for a fetch's preprocessing function, checked before anything is sent.
    expect_parts(error_of<UsageError>([&] {
                   ctl.fetch_shard(x, {{"host", 0}, {"gpu", 1}}, std::string("no.such"));
                 }),
                 {"unknown function 'no.such'"});
    expect_session_works(ctl, mesh);
  });
}

TEST(BadInput, ShapeFunctionErrorsNameTheFunctionAndBothShapes) {
  session([](Controller& ctl) {
    Mesh mesh = make_mesh(ctl);
    DTensor a = mesh.call("test.pattern", {5}, DType::Float32);
    DTensor b = mesh.call("test.pattern", {4}, DType::Float32);
    expect_parts(error_of<UsageError>([&] { mesh.call("meshrt.add", a, b); }),
                 {"meshrt.add", "expected arguments 0 and 1 of one shape, dtype and device", "found",
                  "float32[5] on cpu", "float32[4] on cpu"});
    DTensor m23 = mesh.call("test.pattern", {2, 3}, DType::Float32);
    DTensor m45 = mesh.call("test.pattern", {4, 5}, DType::Float32);
    expect_parts(error_of<UsageError>([&] { mesh.call("meshrt.matmul", m23, m45); }),
                 {"meshrt.matmul", "expected [m, k] and [k, n] matrices", "found", "float32[2, 3]", "float32[4, 5]"});
    // Wrong argument count and kind name the function and the argument's position.
    expect_parts(error_of<UsageError>([&] { mesh.call("meshrt.matmul", m23); }),
                 {"meshrt.matmul(a, b)", "expected 2 arguments, found 1"});
    expect_parts(error_of<UsageError>([&] { mesh.call("meshrt.matmul", m23, 1.5); }),
                 {"meshrt.matmul(a, b): argument 1 (b)", "expected a tensor, found"});
    expect_session_works(ctl, mesh);
  });
}

// Argument errors print the function's parameters and name the argument; a world_mesh of
// the wrong size names the line that asked for it (issue 24).
TEST(BadInput, ArgumentAndWorldMeshErrorsSayWhereAndWhat) {
  session([](Controller& ctl) {
    Mesh mesh = make_mesh(ctl);
    expect_parts(error_of<UsageError>([&] { mesh.call("meshrt.rand", {2}, DType::Float32); }),
                 {"meshrt.rand(shape, dtype, seed): expected 3 arguments, found 2", "(at bad_input_test.cpp:"});
    expect_parts(error_of<UsageError>([&] { mesh.call("meshrt.full", {2}, 2.0, 1.0); }),
                 {"meshrt.full(shape, dtype, value): argument 1 (dtype): expected a dtype such as \"float32\", found "
                  "double 2"});
    const int line = __LINE__ + 1;
    const std::string e = error_of<UsageError>([&] { ctl.world_mesh({{"host", 3}}); });
    expect_parts(e, {"world_mesh: expected sizes that hold the 4 worker ranks, found [3] (3 ranks)",
                     "(at bad_input_test.cpp:" + std::to_string(line) + " (TestBody))"});
    expect_session_works(ctl, mesh);
  });
}

TEST(BadInput, BitwiseReductionOnAFloatDtype) {
  session([](Controller& ctl) {
    Mesh mesh = make_mesh(ctl);
    DTensor x = mesh.call("test.pattern", {3}, DType::Float32);
    for (Reduction r : {Reduction::Band, Reduction::Bor, Reduction::Bxor}) {
      const std::string rule =
          "bitwise reduction " + std::string(name(r)) + " needs an integer or bool dtype, found float32";
      expect_parts(error_of<UsageError>([&] { x.reduce("gpu", r); }),
                   {std::string("reduce ") + std::string(name(r)) + " over 'gpu': ", rule});
      expect_parts(error_of<UsageError>([&] { x.reduce_("host", r); }),
                   {std::string("reduce_ ") + std::string(name(r)) + " over 'host': ", rule});
    }
    // The same reductions on an integer dtype are fine.
    DTensor i = mesh.call("test.pattern", {3}, DType::Int64);
    const Tensor got = ctl.fetch_shard(i.reduce("gpu", Reduction::Bor), {{"host", 0}, {"gpu", 0}}).get();
    EXPECT_EQ(got.span<std::int64_t>()[0], std::int64_t{1} | std::int64_t{101});
    expect_session_works(ctl, mesh);
  });
}

TEST(BadInput, ScatterNeedsDimZeroOfTheDimensionSize) {
  session([](Controller& ctl) {
    Mesh mesh = make_mesh(ctl);
    DTensor x = mesh.call("test.pattern", {5, 3}, DType::Float32);
    expect_parts(
        error_of<UsageError>([&] { x.reduce("gpu", Reduction::Sum, /*scatter=*/true); }),
        {"reduce sum with scatter over 'gpu': ",
         "sum with scatter over a dimension of size 2 needs an input with size(0) == 2", "found float32[5, 3] on cpu"});
    expect_parts(
        error_of<UsageError>([&] { x.reduce_("host", Reduction::Stack, /*scatter=*/true); }),
        {"reduce_ stack with scatter over 'host': ", "needs an input with size(0) == 2", "found float32[5, 3] on cpu"});
    DTensor scalar = mesh.call("meshrt.zeros", std::vector<std::int64_t>{}, DType::Float32);
    expect_parts(error_of<UsageError>([&] { scalar.reduce("gpu", Reduction::Stack, true); }),
                 {"needs an input with size(0) == 2", "found float32[] on cpu"});
    expect_session_works(ctl, mesh);
  });
}

// The rest of the reductions table is checked at the call site too, with the line of
// the call: before, bool sum/avg/product and in-place bitwise ops on a CUDA tensor were
// accepted and failed later on the workers (or, in place, left the value unreduced).
TEST(BadInput, ReductionRulesAtTheCallSiteWithTheLine) {
  session([](Controller& ctl) {
    Mesh mesh = make_mesh(ctl);
    DTensor flags = mesh.call("meshrt.zeros", std::vector<std::int64_t>{3}, DType::Bool);
    const std::string site = "(at bad_input_test.cpp:";
    for (Reduction r : {Reduction::Sum, Reduction::Avg, Reduction::Product}) {
      const std::string rule = "reduction " + std::string(name(r)) + " needs a numeric dtype, found bool";
      const int line = __LINE__ + 1;
      const std::string out_of_place = error_of<UsageError>([&] { flags.reduce("gpu", r); });
      expect_parts(out_of_place,
                   {"reduce " + std::string(name(r)) + " over 'gpu': ", rule, site + std::to_string(line) + " "});
      const int line_ = __LINE__ + 1;
      const std::string in_place = error_of<UsageError>([&] { flags.reduce_("host", r); });
      expect_parts(in_place,
                   {"reduce_ " + std::string(name(r)) + " over 'host': ", rule, site + std::to_string(line_) + " "});
    }
    // Avg on an integer dtype would truncate: refused at the call, naming the dtype, what
    // to do instead and the line.
    DTensor counts = mesh.call("test.pattern", {3}, DType::Int64);
    const int avg_line = __LINE__ + 1;
    const std::string avg = error_of<UsageError>([&] { counts.reduce("gpu", Reduction::Avg); });
    expect_parts(avg, {"reduce avg over 'gpu': ", "reduction avg needs a floating-point dtype, found int64",
                       "use sum and divide, or cast to a float dtype", site + std::to_string(avg_line) + " "});
    // In place: stack without scatter (all_gather) and sum with scatter (reduce_scatter).
    DTensor x = mesh.call("test.pattern", {2, 3}, DType::Float32);
    expect_parts(error_of<UsageError>([&] { x.reduce_("gpu", Reduction::Stack); }),
                 {"reduce_ stack over 'gpu': ", "stack (all_gather) cannot run in place", site});
    expect_parts(
        error_of<UsageError>([&] { x.reduce_("gpu", Reduction::Sum, true); }),
        {"reduce_ sum with scatter over 'gpu': ", "sum with scatter (reduce_scatter) cannot run in place", site});
    // A tensor the controller places on a GPU (its kernel never succeeds: the workers
    // need no GPU for this test). NCCL has no bitwise reductions, in place or not.
    DTensor on_gpu = mesh.call("test.declared_only", {4}, DType::Int32, "cuda:0");
    ASSERT_TRUE(on_gpu.meta().device().is_cuda());
    for (Reduction r : {Reduction::Band, Reduction::Bor, Reduction::Bxor}) {
      const std::string rule = "bitwise reduction " + std::string(name(r)) +
                               " is not supported by NCCL, found a CUDA tensor int32[4] on cuda:0";
      const int line = __LINE__ + 1;
      const std::string in_place = error_of<UsageError>([&] { on_gpu.reduce_("gpu", r); });
      expect_parts(in_place,
                   {"reduce_ " + std::string(name(r)) + " over 'gpu': ", rule, site + std::to_string(line) + " "});
      expect_parts(error_of<UsageError>([&] { on_gpu.reduce("host", r); }), {rule, site});
    }
    // Nothing of the refused calls reached the workers: the only failure is the kernel.
    expect_parts(error_of<RemoteError>([&] { ctl.synchronize(); }), {"test.declared_only failed", "on purpose"});
    expect_session_works(ctl, mesh);
  });
}

// A fetch is one control message (at most 2 GiB): a larger tensor is refused at the
// call, naming its size and the limit, instead of after the worker has serialised it.
TEST(BadInput, FetchOverTheWireLimitRefusedAtTheCall) {
  session([](Controller& ctl) {
    Mesh mesh = make_mesh(ctl);
    DTensor big = mesh.call("test.declared_only", {std::int64_t{3} << 28, 1}, DType::Float32, "cpu");  // 3 GiB
    const int line = __LINE__ + 1;
    const std::string text = error_of<UsageError>([&] { ctl.fetch_shard(big, {{"host", 0}, {"gpu", 1}}); });
    expect_parts(text, {"fetch_shard: the tensor float32[805306368, 1] on cpu is 3221225472 bytes",
                        "expected at most 2147479551 bytes in one fetch", "at most 2147483647 bytes with its frame",
                        "fetch it in pieces", "(at bad_input_test.cpp:" + std::to_string(line) + " "});
    // One byte over the limit is refused too; nothing was sent for either.
    DTensor over = mesh.call("test.declared_only", {std::int64_t{2147479552}}, DType::UInt8, "cpu");
    expect_parts(error_of<UsageError>([&] {
                   ctl.fetch_shard(over, {{"host", 1}, {"gpu", 0}});
                 }),
                 {"is 2147479552 bytes, expected at most 2147479551 bytes"});
    expect_parts(error_of<RemoteError>([&] { ctl.synchronize(); }), {"test.declared_only failed", "on purpose"});
    expect_session_works(ctl, mesh);
  });
}

// Whatever a shape function throws is a UsageError at the call, naming the function, where
// it was registered and the call's line; before, a std::runtime_error escaped raw.
TEST(BadInput, ThrowingShapeFunctionIsAUsageErrorAtTheCall) {
  session([](Controller& ctl) {
    Mesh mesh = make_mesh(ctl);
    const std::string fn = "bad_input_test.cpp:" + std::to_string(kShapeThrowsLine) + "): its shape function threw";
    const int line = __LINE__ + 1;
    const std::string runtime = error_of<UsageError>([&] { mesh.call("test.shape_throws", 0); });
    expect_parts(runtime, {"test.shape_throws (registered at ", fn + ": shape trouble",
                           "(at bad_input_test.cpp:" + std::to_string(line) + " "});
    expect_parts(error_of<UsageError>([&] { mesh.call("test.shape_throws", 1); }),
                 {fn + ": index 9 past the end", "(at bad_input_test.cpp:"});
    expect_parts(error_of<UsageError>([&] { mesh.call("test.shape_throws", 2); }),
                 {fn + " an exception that is not a std::exception", "(at bad_input_test.cpp:"});
    expect_session_works(ctl, mesh);
  });
}

// Dimension names are checked at the controller, for every way a mesh is made: before,
// an empty name passed and was refused first on the workers.
TEST(BadInput, EmptyOrDuplicateDimensionNamesRefusedAtTheController) {
  session([](Controller& ctl) {
    const std::string empty = "mesh dimension names must be non-empty, found an empty one in";
    const std::string duplicate = "mesh dimension names must be unique, found";
    expect_parts(error_of<UsageError>([&] { ctl.world_mesh({{"host", 2}, {"", 2}}); }), {empty, "['host', '']"});
    expect_parts(error_of<UsageError>([&] { ctl.world_mesh({{"", 4}}); }), {empty, "['']"});
    expect_parts(error_of<UsageError>([&] {
                   ctl.world_mesh({{"host", 2}, {"host", 2}});
                 }),
                 {duplicate, "[host, host]"});
    Mesh mesh = make_mesh(ctl);
    expect_parts(error_of<UsageError>([&] { mesh.rename("gpu", ""); }), {empty, "['host', '']"});
    expect_parts(error_of<UsageError>([&] { mesh.rename("gpu", "host"); }), {duplicate, "[host, host]"});
    expect_parts(error_of<UsageError>([&] { mesh.split("gpu", {{"", 1}, {"g", 2}}); }), {empty, "['host', '', 'g']"});
    expect_parts(error_of<UsageError>([&] { mesh.split("gpu", {{"a", 1}, {"a", 2}}); }), {duplicate, "[host, a, a]"});
    expect_parts(error_of<UsageError>([&] { mesh.flatten(""); }), {empty, "['']"});
    expect_session_works(ctl, mesh);
  });
}

TEST(BadInput, UnknownDimensionListsTheMeshDimensions) {
  session([](Controller& ctl) {
    Mesh mesh = make_mesh(ctl);
    DTensor x = mesh.call("test.pattern", {2}, DType::Float32);
    const std::vector<std::string> parts{"unknown mesh dimension 'tp'", "the mesh has dimensions [host, gpu]"};
    expect_parts(error_of<UsageError>([&] { x.reduce("tp", Reduction::Sum); }), parts);
    expect_parts(error_of<UsageError>([&] { x.reduce_("tp", Reduction::Sum); }), parts);
    expect_parts(error_of<UsageError>([&] { ctl.fetch_shard(x, {{"tp", 0}}); }), parts);
    expect_parts(error_of<UsageError>([&] { mesh.slice("tp", 0); }), parts);
    expect_parts(error_of<UsageError>([&] { (void)mesh.size("tp"); }), parts);
    // A sliced-away dimension is unknown on the slice, which lists what is left.
    expect_parts(error_of<UsageError>([&] { x.slice_mesh("host", 0).reduce("host", Reduction::Sum); }),
                 {"unknown mesh dimension 'host'", "the mesh has dimensions [gpu]"});
    expect_session_works(ctl, mesh);
  });
}

TEST(BadInput, ToMeshBetweenMeshesOfDifferentShapes) {
  session([](Controller& ctl) {
    Mesh mesh = make_mesh(ctl);
    DTensor x = mesh.call("test.pattern", {2}, DType::Float32);
    expect_parts(error_of<UsageError>([&] { x.to_mesh(mesh.slice("host", 0)); }),
                 {"to_mesh", "expected a target mesh of the same sizes as the source [host=2, gpu=2]",
                  "found the target [gpu=2]"});
    expect_parts(error_of<UsageError>([&] { x.slice_mesh("host", 1).to_mesh(mesh.slice("gpu", 0, 1)); }),
                 {"to_mesh", "expected a target mesh of the same sizes as the source [gpu=2]",
                  "found the target [host=2, gpu=1], which has no dimension 'gpu' of size 2"});
    // Same sizes work, even across a renamed dimension.
    DTensor moved = x.slice_mesh("host", 0).to_mesh(mesh.slice("host", 1));
    EXPECT_EQ(ctl.fetch_shard(moved, {{"gpu", 1}}).get().span<float>()[0], 101.0f);
    expect_session_works(ctl, mesh);
  });
}

TEST(BadInput, FetchFromACoordinateOutsideTheMesh) {
  session([](Controller& ctl) {
    Mesh mesh = make_mesh(ctl);
    DTensor x = mesh.call("test.pattern", {2}, DType::Float32);
    expect_parts(error_of<UsageError>([&] {
                   ctl.fetch_shard(x, {{"host", 0}, {"gpu", 2}});
                 }),
                 {"fetch_shard", "coordinate 2 of dimension 'gpu' is outside the mesh (size 2)"});
    expect_parts(error_of<UsageError>([&] {
                   ctl.fetch_shard(x, {{"host", -1}, {"gpu", 0}});
                 }),
                 {"fetch_shard", "coordinate -1 of dimension 'host' is outside the mesh (size 2)"});
    expect_parts(error_of<UsageError>([&] {
                   ctl.fetch_shard(x, {{"host", 1}, {"rack", 0}});
                 }),
                 {"unknown mesh dimension 'rack'"});
    expect_parts(error_of<UsageError>([&] {
                   ctl.fetch_shard(x, {{"gpu", 0}, {"host", 0}, {"gpu", 1}});
                 }),
                 {"fetch_shard", "dimension 'gpu' given twice"});
    expect_session_works(ctl, mesh);
  });
}

TEST(BadInput, UseOfADroppedBorrow) {
  session([](Controller& ctl) {
    Mesh mesh = make_mesh(ctl);
    Stream comms = ctl.stream("comms");
    DTensor y = mesh.call("test.pattern", {2}, DType::Float64);
    const int borrowed_line = __LINE__ + 1;
    DTensor b = comms.borrow(y);
    const int dropped_line = __LINE__ + 1;
    b.drop();
    // Both lines: where the borrow was made and where it was dropped, not only the use.
    const std::vector<std::string> dropped{
        "the tensor (borrowed on stream 'comms' at bad_input_test.cpp:" + std::to_string(borrowed_line),
        ") was dropped; it cannot be used any more",
        "(dropped at bad_input_test.cpp:" + std::to_string(dropped_line) + " "};
    expect_parts(error_of<UsageError>([&] { b.reduce("gpu", Reduction::Sum); }),
                 {"reduce sum over 'gpu': ", dropped[0], dropped[1], dropped[2]});
    expect_parts(error_of<UsageError>([&] {
                   ctl.fetch_shard(b, {{"host", 0}, {"gpu", 0}});
                 }),
                 {"fetch_shard: ", dropped[0], dropped[1], dropped[2]});
    expect_parts(error_of<UsageError>([&] { mesh.call_on(comms, "meshrt.copy", {b}); }),
                 {"meshrt.copy: ", dropped[0], dropped[1], dropped[2]});
    expect_parts(error_of<UsageError>([&] { b.drop(); }),
                 {"drop: the borrow was already dropped at bad_input_test.cpp:" + std::to_string(dropped_line)});
    // The origin is usable again.
    EXPECT_EQ(ctl.fetch_shard(y, {{"host", 1}, {"gpu", 1}}).get().span<double>()[1], 302.0);
    expect_session_works(ctl, mesh);
  });
}

TEST(BadInput, UseAfterRestartWorkers) {
  session([](Controller& ctl) {
    Mesh mesh = make_mesh(ctl);
    DTensor x = mesh.call("test.pattern", {2}, DType::Float32);
    ctl.synchronize();
    ctl.restart_workers();
    const std::string gone = "made before restart_workers(); the workers no longer have it";
    expect_parts(error_of<UsageError>([&] { x.reduce("gpu", Reduction::Sum); }), {"tensor", gone});
    expect_parts(error_of<UsageError>([&] { ctl.fetch_shard(x, {{"host", 0}, {"gpu", 0}}); }), {"tensor", gone});
    expect_parts(error_of<UsageError>([&] { mesh.call("test.pattern", {2}, DType::Float32); }), {"mesh", gone});
    Mesh fresh = make_mesh(ctl);
    expect_parts(error_of<UsageError>([&] { fresh.call("meshrt.copy", x); }), {"tensor", gone});
    expect_session_works(ctl, fresh);
  });
}

// The decoder refuses garbage with a ProtocolError naming the field and byte offset
// (the live worker's handling of such frames is tested in worker_garbage_test.cpp).
TEST(BadInput, GarbageDecodedAsACommand) {
  std::mt19937 rng(9);
  for (int i = 0; i < 200; ++i) {
    std::vector<std::byte> bytes(static_cast<std::size_t>(rng() % 64));
    for (auto& b : bytes) b = static_cast<std::byte>(rng());
    if (i % 2 == 0 && bytes.size() >= 2) {  // half with a valid magic, to get past the header
      bytes[0] = std::byte{'m'};
      bytes[1] = std::byte{'r'};
    }
    expect_parts(error_of<ProtocolError>([&] { (void)protocol::decode_command(bytes); }),
                 {"protocol: decoding ", " at byte ", "-byte frame: "});
  }
  // A valid frame cut short says how far it got and what it was reading.
  const auto frame = protocol::encode(protocol::Command{
      protocol::CallFunction{7, {Ref{3}}, {}, "meshrt.add", {Value(Ref{1}), Value(Ref{2})}, Ref{4}, Ref{5}}});
  const std::span<const std::byte> cut(frame.data(), frame.size() - 3);
  expect_parts(error_of<ProtocolError>([&] { (void)protocol::decode_command(cut); }),
               {"protocol: decoding ", "of a " + std::to_string(cut.size()) + "-byte frame"});
  // Everything is fine on the controller afterwards.
  session([](Controller& ctl) { expect_session_works(ctl, make_mesh(ctl)); });
}

// A kernel on rank 0 runs on worker 0's thread, beside the controller: one that uses the
// controller (a handle it captured) would wait for its own worker for ever. It fails at
// once naming the call, and the controller goes on.
TEST(BadInput, AKernelThatDrivesTheControllerFailsAndTheControllerGoesOn) {
  session([](Controller& ctl) {
    Mesh mesh = make_mesh(ctl);
    DTensor x = mesh.call("test.pattern", {2}, DType::Float64);
    g_controller = &ctl;
    g_mesh = &mesh;
    g_tensor = &x;
    const std::vector<std::pair<std::string, std::string>> modes{{"synchronize", "Controller::synchronize"},
                                                                 {"fetch", "Controller::fetch_shard"},
                                                                 {"call", "a Mesh, DTensor or Stream method"},
                                                                 {"reduce", "a Mesh, DTensor or Stream method"},
                                                                 {"world_mesh", "Controller::world_mesh"}};
    for (const auto& [mode, what] : modes) {
      DTensor y = mesh.call("test.drive_controller", mode);
      expect_parts(error_of<RemoteError>([&] {
                     (void)ctl.fetch_shard(y, {{"host", 0}, {"gpu", 0}}).get(std::chrono::seconds(30));
                   }),
                   {"test.drive_controller",
                    what + " called from inside the kernel of test.drive_controller running "
                           "on rank 0's worker: a kernel cannot drive the controller",
                    "return values from the kernel instead"});
    }
    g_controller = nullptr;
    g_mesh = nullptr;
    g_tensor = nullptr;
    expect_session_works(ctl, mesh);
  });
}

// A mesh placed on cuda in a job whose accelerator is not cuda had no GPU chosen per rank
// (or there is none): refused at the call, saying what the job has, not at a fetch with
// the CUDA driver's words.
TEST(BadInput, ACudaMeshInAJobWithoutTheCudaAcceleratorIsRefusedAtTheCall) {
  session([](Controller& ctl) {
    if (ctl.accelerator() == DeviceKind::Cuda) GTEST_SKIP() << "the job's accelerator is cuda";
    const int line = __LINE__ + 1;
    const std::string e = error_of<UsageError>([&] { ctl.world_mesh({{"host", 2}, {"gpu", 2}}, DeviceKind::Cuda); });
    expect_parts(e, {"world_mesh: a mesh placed on cuda needs a job whose accelerator is cuda, found accelerator " +
                         std::string(ctl.accelerator() == DeviceKind::Emulated ? "emulated" : "none"),
                     "place the mesh on ctl.accelerator()", "MESHRT_ACCELERATOR=emulated and DeviceKind::Emulated",
                     "(at bad_input_test.cpp:" + std::to_string(line) + " "});
    expect_session_works(ctl, make_mesh(ctl));
  });
}

// Host data travels inside the command, one control message that MPI counts in an int:
// over the limit it is refused at the call (from_host, scatter, a call's argument, a
// recording), saying the limit and what to do instead; under it, a batch of several is
// split before it passes the limit. The real limit with a tensor of 2 GiB of reserved
// address space (no memory), the rest under a limit lowered for the test.
TEST(BadInput, HostDataOverTheControlPlanesLimitIsRefusedAtTheCall) {
  session([](Controller& ctl) {
    Mesh mesh = make_mesh(ctl);
    {
      // 2 GiB of address space that can never be read or written: reserved, not memory,
      // even where the kernel commits every allocation (a refused call never touches it).
      const std::size_t bytes = std::size_t{1} << 31;
      void* reserved = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      ASSERT_NE(reserved, MAP_FAILED);
      const Tensor big = Tensor::adopt_host(TensorMeta({static_cast<std::int64_t>(bytes)}, DType::UInt8),
                                            std::shared_ptr<void>(reserved, [bytes](void* p) { munmap(p, bytes); }));
      const int line = __LINE__ + 1;
      expect_parts(error_of<UsageError>([&] { (void)mesh.from_host(big); }),
                   {"from_host: the tensor uint8[2147483648] on cpu: 2147483648 bytes, expected at most 2130706431 "
                    "bytes of host data in one call",
                    "at most 2147483647 bytes with its frame", "load the data on the workers with a kernel",
                    "or send it in pieces", "(at bad_input_test.cpp:" + std::to_string(line) + " "});
    }
    detail::set_payload_limit(std::size_t{1} << 20);
    const Tensor over = Tensor::zeros(TensorMeta({2, 100000}, DType::Float64));  // 1.6 MB
    expect_parts(error_of<UsageError>([&] { (void)mesh.from_host(over); }),
                 {"from_host: the tensor float64[2, 100000] on cpu: 1600000 bytes, expected at most 1048576"});
    expect_parts(error_of<UsageError>([&] { (void)mesh.scatter("host", over); }),
                 {"scatter over 'host': the tensor float64[2, 100000] on cpu: 1600000 bytes"});
    expect_parts(error_of<UsageError>([&] { (void)mesh.call("meshrt.from_host", over); }),
                 {"meshrt.from_host: argument 0 (the host tensor float64[2, 100000] on cpu):"});
    const Tensor part = Tensor::zeros(TensorMeta({70000}, DType::Float64));  // 560 kB
    expect_parts(error_of<UsageError>([&] { (void)mesh.call("test.weighted_sum", part, part); }),
                 {"test.weighted_sum: the call's 2 arguments together:", "expected at most 1048576"});
    DTensor seed = mesh.call("test.pattern", {2}, DType::Float64);
    expect_parts(error_of<UsageError>([&] {
                   ctl.record({seed}, [&](const std::vector<DTensor>& in) {
                     (void)mesh.from_host(part);
                     (void)mesh.from_host(part);
                     return in;
                   });
                 }),
                 {"the recording's commands would carry", "expected at most 1048576 in one recording"});
    // Under the limit, one after the other: each batch stays under it, and both arrive.
    Tensor a = Tensor::zeros(TensorMeta({70000}, DType::Float64));
    a.data<double>()[69999] = 3;
    DTensor da = mesh.from_host(a);
    a.data<double>()[69999] = 4;
    DTensor db = mesh.from_host(a);
    EXPECT_EQ(ctl.fetch_shard(da, {{"host", 1}, {"gpu", 1}}).get(std::chrono::seconds(30)).span<double>()[69999], 3);
    EXPECT_EQ(ctl.fetch_shard(db, {{"host", 1}, {"gpu", 0}}).get(std::chrono::seconds(30)).span<double>()[69999], 4);
    detail::set_payload_limit(0);
    expect_session_works(ctl, mesh);
  });
}
