// Tensor::to_dlpack and Tensor::from_dlpack: every dtype and device kind both ways, no
// byte copied, each deleter run exactly once, and the refusals with their texts.
#include <dlpack/dlpack.h>
#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

#include "../support/expect_error.hpp"
#include "meshrt/internal/tensor.hpp"
#include "meshrt/tensor.hpp"

namespace meshrt {
namespace {

using test::expect_contains;
using test::usage_error;

constexpr std::array kDTypes{DType::Bool,    DType::UInt8,    DType::Int32,   DType::Int64,
                             DType::Float16, DType::BFloat16, DType::Float32, DType::Float64};

// A DLPack producer other than meshrt: its own memory, shape and strides, and a deleter
// that counts its runs.
struct Foreign {
  DLManagedTensor managed{};
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> strides;
  int* deleted;

  Foreign(void* data, DLDataType dtype, std::vector<std::int64_t> s, int* counter, DLDevice device = {kDLCPU, 0})
      : shape(std::move(s)), deleted(counter) {
    DLTensor& t = managed.dl_tensor;
    t.data = data;
    t.device = device;
    t.ndim = static_cast<std::int32_t>(shape.size());
    t.dtype = dtype;
    t.shape = shape.empty() ? nullptr : shape.data();
    t.strides = nullptr;
    t.byte_offset = 0;
    managed.manager_ctx = this;
    managed.deleter = [](DLManagedTensor* m) { ++*static_cast<Foreign*>(m->manager_ctx)->deleted; };
  }
  void set_strides(std::vector<std::int64_t> s) {
    strides = std::move(s);
    managed.dl_tensor.strides = strides.data();
  }
};

// A tensor of `meta` whose bytes are 1, 2, 3, ... (any bit pattern will do: DLPack moves
// bytes, it does not read values), bool as 0/1.
Tensor patterned(const TensorMeta& meta) {
  Tensor t = meta.with_device(Device::cpu()).empty();
  auto* bytes = static_cast<std::uint8_t*>(t.raw_data());
  for (std::size_t i = 0; i < t.nbytes(); ++i) {
    bytes[i] = static_cast<std::uint8_t>(meta.dtype() == DType::Bool ? i % 2 : i + 1);
  }
  return t.to(meta.device());
}

TEST(TensorDLPack, ExportDescribesEveryDtypeWithoutCopying) {
  struct Expected {
    DType dtype;
    std::uint8_t code, bits;
  };
  for (const Expected e : {Expected{DType::Bool, kDLUInt, 8}, Expected{DType::UInt8, kDLUInt, 8},
                           Expected{DType::Int32, kDLInt, 32}, Expected{DType::Int64, kDLInt, 64},
                           Expected{DType::Float16, kDLFloat, 16}, Expected{DType::BFloat16, kDLBfloat, 16},
                           Expected{DType::Float32, kDLFloat, 32}, Expected{DType::Float64, kDLFloat, 64}}) {
    SCOPED_TRACE(std::string(name(e.dtype)));
    const Tensor t = patterned(TensorMeta({2, 3, 4}, e.dtype));
    DLManagedTensor* m = t.to_dlpack();
    const DLTensor& d = m->dl_tensor;
    EXPECT_EQ(d.data, t.raw_data());
    EXPECT_EQ(d.byte_offset, 0u);
    EXPECT_EQ(d.device.device_type, kDLCPU);
    EXPECT_EQ(d.device.device_id, 0);
    EXPECT_EQ(d.dtype.code, e.code);
    EXPECT_EQ(d.dtype.bits, e.bits);
    EXPECT_EQ(d.dtype.lanes, 1);
    ASSERT_EQ(d.ndim, 3);
    EXPECT_EQ(std::vector<std::int64_t>(d.shape, d.shape + 3), (std::vector<std::int64_t>{2, 3, 4}));
    ASSERT_NE(d.strides, nullptr);
    EXPECT_EQ(std::vector<std::int64_t>(d.strides, d.strides + 3), (std::vector<std::int64_t>{12, 4, 1}));
    m->deleter(m);
  }
}

TEST(TensorDLPack, RoundTripEveryDtypeAndDevice) {
  for (const Device device : {Device::cpu(), Device::emulated(0), Device::emulated(3)}) {
    for (const DType dtype : kDTypes) {
      SCOPED_TRACE(std::string(name(dtype)) + " on " + device.to_string());
      const Tensor t = patterned(TensorMeta({3, 5}, dtype, device));
      DLManagedTensor* m = t.to_dlpack();
      if (device.is_emulated()) {
        EXPECT_EQ(m->dl_tensor.device.device_type, kDLExtDev);
        EXPECT_EQ(m->dl_tensor.device.device_id, device.index());
      }
      const Tensor back = Tensor::from_dlpack(m);
      EXPECT_TRUE(back.same_storage(t));
      EXPECT_EQ(back.raw_data(), t.raw_data());
      EXPECT_EQ(back.meta(), t.meta());  // bool stays bool, the device index stays
      EXPECT_TRUE(back.equals(t));
    }
  }
}

TEST(TensorDLPack, ImportEveryDtypeFromAnotherProducerWithoutCopying) {
  struct Case {
    DLDataType dl;
    DType dtype;
  };
  for (const Case c : {Case{{6, 8, 1}, DType::Bool}, Case{{kDLUInt, 8, 1}, DType::UInt8},
                       Case{{kDLInt, 32, 1}, DType::Int32}, Case{{kDLInt, 64, 1}, DType::Int64},
                       Case{{kDLFloat, 16, 1}, DType::Float16}, Case{{kDLBfloat, 16, 1}, DType::BFloat16},
                       Case{{kDLFloat, 32, 1}, DType::Float32}, Case{{kDLFloat, 64, 1}, DType::Float64}}) {
    SCOPED_TRACE(std::string(name(c.dtype)));
    // 16-byte aligned, as numpy's memory is, and then an element past that: meshrt's own
    // storage is 64-byte aligned, and an imported tensor must work without it.
    alignas(64) std::array<std::uint8_t, 64 + 2 * 4 * 8> memory{};
    std::uint8_t* data = memory.data() + 16 + element_size(c.dtype);
    const Tensor expected = patterned(TensorMeta({2, 4}, c.dtype));
    std::memcpy(data, expected.raw_data(), expected.nbytes());
    int deleted = 0;
    Foreign f(data, c.dl, {2, 4}, &deleted);
    {
      const Tensor t = Tensor::from_dlpack(&f.managed);
      const Tensor second_handle = t.reshape({8});
      EXPECT_EQ(t.raw_data(), data);
      EXPECT_EQ(t.meta(), TensorMeta({2, 4}, c.dtype));
      EXPECT_TRUE(t.equals(expected));
      EXPECT_TRUE(t.clone().equals(expected));
      EXPECT_EQ(t.to_string(), expected.to_string());
      // Writes go to the producer's memory.
      Tensor writable = t;
      std::memset(writable.raw_data(), 0, writable.nbytes());
      EXPECT_EQ(std::accumulate(data, data + expected.nbytes(), 0), 0);
      EXPECT_EQ(deleted, 0);
    }
    EXPECT_EQ(deleted, 1);
  }
}

TEST(TensorDLPack, ExportKeepsTheStorageUntilTheDeleterRuns) {
  int freed = 0;
  std::shared_ptr<void> buffer(::operator new(64), [&freed](void* p) {
    ++freed;
    ::operator delete(p);
  });
  DLManagedTensor* m = nullptr;
  {
    const Tensor t = Tensor::adopt_host(TensorMeta({4}, DType::Int32), std::move(buffer));
    m = t.to_dlpack();
  }
  EXPECT_EQ(freed, 0) << "the DLManagedTensor holds the storage";
  static_cast<std::int32_t*>(m->dl_tensor.data)[3] = 7;  // still valid memory
  m->deleter(m);
  EXPECT_EQ(freed, 1);
}

TEST(TensorDLPack, ImportRunsTheDeleterOnceWhenTheLastHandleGoes) {
  std::array<float, 6> values{1, 2, 3, 4, 5, 6};
  int deleted = 0;
  Foreign f(values.data(), {kDLFloat, 32, 1}, {2, 3}, &deleted);
  Tensor t = Tensor::from_dlpack(&f.managed);
  Tensor reshaped = t.reshape({6});
  // Exported again and imported back: still the same storage, the one owner.
  DLManagedTensor* again = reshaped.to_dlpack();
  Tensor back = Tensor::from_dlpack(again);
  EXPECT_TRUE(back.same_storage(t));
  EXPECT_EQ(back.shape(), (std::vector<std::int64_t>{6}));
  DLManagedTensor* held = t.to_dlpack();
  t = Tensor();
  reshaped = Tensor();
  back = Tensor();
  EXPECT_EQ(deleted, 0) << "the second export still holds the storage";
  EXPECT_EQ(static_cast<float*>(held->dl_tensor.data), values.data());
  held->deleter(held);
  EXPECT_EQ(deleted, 1);
}

TEST(TensorDLPack, ByteOffsetZeroDimAndEmpty) {
  std::array<double, 8> values{};
  std::iota(values.begin(), values.end(), 0.0);
  int deleted = 0;
  {
    Foreign f(values.data(), {kDLFloat, 64, 1}, {5}, &deleted);
    f.managed.dl_tensor.byte_offset = 2 * sizeof(double);
    const Tensor t = Tensor::from_dlpack(&f.managed);
    EXPECT_EQ(t.raw_data(), values.data() + 2);
    EXPECT_TRUE(t.equals(Tensor::from<double>({5}, {2, 3, 4, 5, 6})));
  }
  EXPECT_EQ(deleted, 1);
  {
    Foreign f(values.data() + 7, {kDLFloat, 64, 1}, {}, &deleted);  // 0-d: no shape array
    const Tensor t = Tensor::from_dlpack(&f.managed);
    EXPECT_EQ(t.meta(), TensorMeta({}, DType::Float64));
    EXPECT_EQ(t.item(), 7.0);
    DLManagedTensor* m = Tensor::from<std::int64_t>({}, {5}).to_dlpack();
    EXPECT_EQ(m->dl_tensor.ndim, 0);
    EXPECT_EQ(Tensor::from_dlpack(m).item(), 5.0);
  }
  EXPECT_EQ(deleted, 2);
  {
    // torch gives empty tensors no address; any strides describe an empty tensor.
    Foreign f(nullptr, {kDLInt, 32, 1}, {0, 3}, &deleted);
    f.set_strides({1, 7});
    const Tensor t = Tensor::from_dlpack(&f.managed);
    EXPECT_EQ(t.meta(), TensorMeta({0, 3}, DType::Int32));
    EXPECT_NE(t.raw_data(), nullptr);
    EXPECT_TRUE(t.clone().equals(t));
    DLManagedTensor* m = t.to_dlpack();
    EXPECT_EQ(m->dl_tensor.shape[0], 0);
    EXPECT_EQ(m->dl_tensor.data, t.raw_data());
    m->deleter(m);
  }
  EXPECT_EQ(deleted, 3);
}

TEST(TensorDLPack, DevicesAsDLPackDescribesThem) {
  int deleted = 0;
  // CUDA: metadata only (the address is never read here), on any build.
  auto* fake = reinterpret_cast<void*>(std::uintptr_t{1} << 20);
  {
    Foreign f(fake, {kDLFloat, 32, 1}, {4, 4}, &deleted, {kDLCUDA, 1});
    const Tensor t = Tensor::from_dlpack(&f.managed);
    EXPECT_EQ(t.meta(), TensorMeta({4, 4}, DType::Float32, Device::cuda(1)));
    EXPECT_EQ(t.raw_data(), fake);
    expect_contains(usage_error([&] { (void)t.data<float>(); }), "expected a CPU tensor for host access");
    DLManagedTensor* m = t.to_dlpack();
    EXPECT_EQ(m->dl_tensor.device.device_type, kDLCUDA);
    EXPECT_EQ(m->dl_tensor.device.device_id, 1);
    EXPECT_EQ(m->dl_tensor.data, fake);
    m->deleter(m);
  }
  EXPECT_EQ(deleted, 1);
  // Page-locked host memory is a CPU tensor.
  std::array<std::int64_t, 2> host{4, 5};
  {
    Foreign f(host.data(), {kDLInt, 64, 1}, {2}, &deleted, {kDLCUDAHost, 0});
    const Tensor t = Tensor::from_dlpack(&f.managed);
    EXPECT_EQ(t.device(), Device::cpu());
    EXPECT_EQ(t.span<std::int64_t>()[1], 5);
  }
  EXPECT_EQ(deleted, 2);
  // kDLExtDev is the emulated accelerator: its memory stays unreadable from the host.
  {
    Foreign f(host.data(), {kDLInt, 64, 1}, {2}, &deleted, {kDLExtDev, 2});
    const Tensor t = Tensor::from_dlpack(&f.managed);
    EXPECT_EQ(t.device(), Device::emulated(2));
    expect_contains(usage_error([&] { (void)t.data<std::int64_t>(); }), "found emulated device memory");
    DeviceMemoryAccess inside_a_task;
    EXPECT_EQ(t.span<std::int64_t>()[1], 5);
  }
  EXPECT_EQ(deleted, 3);
}

TEST(TensorDLPack, Refusals) {
  alignas(64) std::array<std::uint8_t, 256> memory{};
  int deleted = 0;
  auto refused = [&](Foreign& f) {
    const std::string text = usage_error([&] { (void)Tensor::from_dlpack(&f.managed); });
    EXPECT_EQ(deleted, 0) << "a refusal leaves the DLManagedTensor to the caller";
    return text;
  };
  const std::string dtypes =
      "Tensor::from_dlpack: expected one lane of bool8, uint8, int32, int64, float16, bfloat16, float32 or float64, "
      "found ";
  {
    Foreign f(memory.data(), {kDLComplex, 64, 1}, {2}, &deleted);
    EXPECT_EQ(refused(f), dtypes + "complex64");
  }
  {
    Foreign f(memory.data(), {kDLInt, 16, 1}, {2}, &deleted);
    EXPECT_EQ(refused(f), dtypes + "int16");
  }
  {
    Foreign f(memory.data(), {kDLUInt, 1, 1}, {2}, &deleted);
    EXPECT_EQ(refused(f), dtypes + "uint1");
  }
  {
    Foreign f(memory.data(), {kDLFloat, 32, 4}, {2}, &deleted);
    EXPECT_EQ(refused(f), dtypes + "float32 with 4 lanes");
  }
  {
    Foreign f(memory.data(), {kDLFloat, 32, 1}, {3, 4}, &deleted);
    f.set_strides({1, 3});  // column-major: a transposed view
    EXPECT_EQ(refused(f),
              "Tensor::from_dlpack: expected a contiguous row-major tensor (strides [4, 1] in elements for shape [3, "
              "4]), found strides [1, 3]; make it contiguous first (numpy.ascontiguousarray, torch's .contiguous())");
  }
  {
    Foreign f(memory.data(), {kDLFloat, 32, 1}, {3, 4}, &deleted);
    f.set_strides({8, 2});  // every other column
    expect_contains(refused(f), "found strides [8, 2]; make it contiguous first");
  }
  {
    Foreign f(memory.data(), {kDLFloat, 32, 1}, {2}, &deleted, {kDLOpenCL, 0});
    EXPECT_EQ(refused(f),
              "Tensor::from_dlpack: expected a kDLCPU (1), kDLCUDA (2), kDLCUDAHost (3) or kDLExtDev (12, meshrt's "
              "emulated accelerator) tensor, found device type 4; copy it to the CPU first");
  }
  {
    Foreign f(memory.data(), {kDLFloat, 32, 1}, {2}, &deleted);
    f.managed.dl_tensor.byte_offset = 2;
    expect_contains(refused(f), "expected data aligned to the 4-byte elements of float32[2] on cpu, found address");
  }
  {
    Foreign f(nullptr, {kDLFloat, 32, 1}, {2}, &deleted);
    EXPECT_EQ(refused(f), "Tensor::from_dlpack: expected a data pointer for float32[2] on cpu, found null");
  }
  {
    Foreign f(memory.data(), {kDLFloat, 32, 1}, {2, -1}, &deleted);
    expect_contains(refused(f), "Tensor::from_dlpack: tensor shape [2, -1]: expected every dimension >= 0");
  }
  {
    // Size-1 dimensions may have any stride (numpy and torch give them several).
    Foreign f(memory.data(), {kDLFloat, 32, 1}, {3, 1, 4}, &deleted);
    f.set_strides({4, 99, 1});
    EXPECT_EQ(Tensor::from_dlpack(&f.managed).raw_data(), memory.data());
    EXPECT_EQ(deleted, 1);
  }
  expect_contains(usage_error([] { (void)Tensor::from_dlpack(nullptr); }), "expected a DLManagedTensor, found null");
  expect_contains(usage_error([] { (void)Tensor().to_dlpack(); }), "expected a defined tensor, found an undefined");
  expect_contains(usage_error([&] {
                    (void)Tensor::adopt_host(TensorMeta({2}, DType::Int64),
                                             std::shared_ptr<void>(std::shared_ptr<void>(), memory.data() + 4));
                  }),
                  "Tensor::adopt_host: expected a buffer aligned to the 8-byte elements of int64[2] on cpu, found");
}

TEST(TensorDLPack, CopyGathersAnyStridesInRowMajorOrder) {
  // A 3x4 int32 grid holding 0..11; its transpose, a negative-stride column, a stepped
  // slice and a 0-d element, each copied into compact row-major memory of its own.
  std::array<std::int32_t, 12> grid{};
  std::iota(grid.begin(), grid.end(), 0);
  int deleted = 0;
  struct Case {
    std::vector<std::int64_t> shape, strides;
    std::int64_t first;  // element offset of the first element
    std::vector<std::int32_t> want;
  };
  for (const Case& c : {Case{{4, 3}, {1, 4}, 0, {0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11}}, Case{{3}, {-4}, 9, {9, 5, 1}},
                        Case{{3, 2}, {4, 2}, 1, {1, 3, 5, 7, 9, 11}}, Case{{2, 1, 2}, {8, 99, 1}, 2, {2, 3, 10, 11}},
                        Case{{}, {}, 7, {7}}}) {
    SCOPED_TRACE(::testing::PrintToString(c.shape));
    Foreign f(grid.data() + c.first, {kDLInt, 32, 1}, c.shape, &deleted);
    if (!c.strides.empty()) f.set_strides(c.strides);
    EXPECT_EQ(is_compact_dlpack(f.managed), c.shape.empty()) << "none but the 0-d one is row-major";
    const Tensor t = copy_from_dlpack(f.managed);
    EXPECT_EQ(t.meta(), TensorMeta(c.shape, DType::Int32));
    EXPECT_TRUE(t.equals(Tensor::from<std::int32_t>(c.shape, std::span<const std::int32_t>(c.want))));
    EXPECT_NE(t.raw_data(), grid.data() + c.first);
  }
  EXPECT_EQ(deleted, 0) << "a copy leaves the producer's tensor to its owner";
  grid[0] = 100;  // the copies have memory of their own
  Foreign f(grid.data(), {kDLInt, 32, 1}, {2, 2}, &deleted);
  EXPECT_TRUE(is_compact_dlpack(f.managed));
  const Tensor copy = copy_from_dlpack(f.managed);
  grid[0] = 0;
  EXPECT_EQ(copy.data<std::int32_t>()[0], 100);
  f.set_strides({1, 2});
  EXPECT_FALSE(is_compact_dlpack(f.managed));
  expect_contains(usage_error([&] {
                    Foreign g(grid.data(), {kDLComplex, 64, 1}, {2}, &deleted);
                    (void)copy_from_dlpack(g.managed);
                  }),
                  "copy_from_dlpack: expected one lane of bool8");
}

}  // namespace
}  // namespace meshrt
