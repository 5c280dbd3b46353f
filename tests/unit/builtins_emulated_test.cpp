// The built-ins on the emulated accelerator give what they give on the CPU, through
// stream tasks; and a fetch without its ordering reads a wrong value. Run with
// MESHRT_EMULATED_DELAY_US set (CMake does), so a missing ordering shows every time.
#include <gtest/gtest.h>

#include <vector>

#include "../support/expect_error.hpp"
#include "meshrt/functions.hpp"
#include "meshrt/internal/device.hpp"

namespace meshrt::test {
namespace {

constexpr std::uint64_t kStream = 41;

std::vector<Tensor> call(const std::string& fn, std::vector<Value> args, const Device& where) {
  CallContext ctx(0, {}, {}, {}, kStream, where);
  Args a(fn, std::move(args));
  return functions::lookup(fn).kernel(ctx, a);
}

device::Stream stream() {
  return device::stream_for(kStream, Device::emulated(0));
}

// The host copy of an emulated tensor, in its stream's order.
Tensor fetched(const Tensor& t) {
  device::Fetch f = device::fetch(t, stream());
  f.done.synchronize();
  return f.host;
}

Tensor on_emulated(const Tensor& host) {
  return device::to_device(host, Device::emulated(0), stream());
}

TEST(BuiltinsEmulated, MatchTheCpu) {
  const Device emu = Device::emulated(0);
  struct Case {
    std::string fn;
    std::vector<Value> args;
  };
  const Tensor a = Tensor::from<float>({2, 2}, {1, 2, 3, 4});
  const Tensor b = Tensor::from<float>({2, 2}, {5, 6, 7, 8});
  const std::vector<Case> creations = {
      {"meshrt.full", {Value{3}, Value("float16"), Value(2.5)}},
      {"meshrt.zeros", {Value{4}, Value("int64")}},
      {"meshrt.arange", {Value(5), Value("int32")}},
      {"meshrt.rand", {Value{6}, Value("float32"), Value(7)}},
      {"meshrt.fail", {Value("not here"), Value{3}}},
  };
  for (const Case& c : creations) {
    const Tensor cpu = call(c.fn, c.args, Device::cpu()).at(0);
    const Tensor dev = call(c.fn, c.args, emu).at(0);
    EXPECT_EQ(dev.device(), emu) << c.fn;
    EXPECT_TRUE(fetched(dev).equals(cpu)) << c.fn;
  }
  const std::vector<Case> ops = {
      {"meshrt.add", {Value(a), Value(b)}},
      {"meshrt.sub", {Value(a), Value(b)}},
      {"meshrt.mul", {Value(a), Value(b)}},
      {"meshrt.scale", {Value(a), Value(0.5)}},
      {"meshrt.matmul", {Value(a), Value(b)}},
      {"meshrt.copy", {Value(a)}},
      {"meshrt.sum", {Value(a)}},
  };
  for (const Case& c : ops) {
    std::vector<Value> dev_args;
    for (const Value& v : c.args) dev_args.push_back(v.is_tensor() ? Value(on_emulated(v.as_tensor())) : v);
    const Tensor cpu = call(c.fn, c.args, Device::cpu()).at(0);
    const Tensor dev = call(c.fn, dev_args, emu).at(0);
    EXPECT_EQ(dev.device(), emu) << c.fn;
    EXPECT_TRUE(fetched(dev).equals(cpu)) << c.fn << ": " << fetched(dev).to_string();
  }
  // In place: fill_ then add_ on one device tensor, in stream order.
  Tensor x = on_emulated(Tensor::from<std::int32_t>({3}, {1, 2, 3}));
  (void)call("meshrt.fill_", {Value(x), Value(4)}, emu);
  (void)call("meshrt.add_", {Value(x), Value(on_emulated(Tensor::from<std::int32_t>({3}, {1, 2, 3})))}, emu);
  EXPECT_TRUE(fetched(x).equals(Tensor::from<std::int32_t>({3}, {5, 6, 7})));
  EXPECT_FALSE(stream().error());
}

TEST(BuiltinsEmulated, AUserKernelReadingDeviceMemoryFromTheHostFails) {
  const Tensor t = call("meshrt.full", {Value{2}, Value("float32"), Value(1.0)}, Device::emulated(0)).at(0);
  expect_contains(usage_error([&] { (void)t.span<float>(); }), "emulated device memory (float32[2] on emulated:0)");
}

TEST(BuiltinsEmulated, AFetchWithoutItsOrderingReadsAWrongValue) {
  // arange then scale on the stream; the fetch's copy must wait for both.
  // (Another factor each time: the pool hands the last run's block back, which still
  // holds the last run's values.)
  const auto run = [](double factor) {
    const Tensor r = call("meshrt.arange", {Value(4), Value("float32")}, Device::emulated(0)).at(0);
    const Tensor s = call("meshrt.scale", {Value(r), Value(factor)}, Device::emulated(0)).at(0);
    return fetched(s);
  };
  EXPECT_TRUE(run(2.0).equals(Tensor::from<float>({4}, {0, 2, 4, 6})));
  device::set_unordered_fetch_for_testing(true);
  const Tensor unordered = run(3.0);
  device::set_unordered_fetch_for_testing(false);
  EXPECT_FALSE(unordered.equals(Tensor::from<float>({4}, {0, 3, 6, 9})))
      << "the emulator did not catch the missing ordering";
  stream().synchronize();
}

}  // namespace
}  // namespace meshrt::test
