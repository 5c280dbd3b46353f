// Tensor::to_dlpack and Tensor::from_dlpack: meshrt tensors as DLPack tensors and back,
// zero-copy, on the public Tensor API alone (adopt_host / adopt_device over an aliasing
// shared_ptr whose owner calls the producer's deleter).
#include <dlpack/dlpack.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "meshrt/internal/tensor.hpp"
#include "meshrt/tensor.hpp"

namespace meshrt {
namespace {

// DLPack 0.8's kDLBool; Debian 12's dlpack.h (0.6) predates it.
constexpr std::uint8_t kDLBoolCode = 6;

// ---------------------------------------------------------------------------- export

// What a DLManagedTensor of meshrt's holds: the tensor handle that keeps the storage alive
// and the shape and strides arrays the DLTensor points into.
struct Exported {
  DLManagedTensor managed{};
  Tensor tensor;
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> strides;
};

void delete_exported(DLManagedTensor* managed) {
  delete static_cast<Exported*>(managed->manager_ctx);
}

DLDataType dl_dtype(DType dtype) {
  const auto bits = static_cast<std::uint8_t>(element_size(dtype) * 8);
  switch (dtype) {
    case DType::Bool:  // one byte holding 0 or 1: see the header on why not kDLBool
    case DType::UInt8:
      return {kDLUInt, bits, 1};
    case DType::Int32:
    case DType::Int64:
      return {kDLInt, bits, 1};
    case DType::Float16:
    case DType::Float32:
    case DType::Float64:
      return {kDLFloat, bits, 1};
    case DType::BFloat16:
      return {kDLBfloat, bits, 1};
  }
  throw UsageError(fmt::format("Tensor::to_dlpack: expected a valid dtype, found code {}", static_cast<int>(dtype)));
}

DLDevice dl_device(const Device& device) {
  switch (device.kind()) {
    case Device::Kind::Cpu:
      return {kDLCPU, 0};
    case Device::Kind::Cuda:
      return {kDLCUDA, device.index()};
    case Device::Kind::Emulated:
      return {kDLExtDev, device.index()};
  }
  throw UsageError(fmt::format("Tensor::to_dlpack: expected a cpu, cuda or emulated device, found kind {}",
                               static_cast<int>(device.kind())));
}

std::vector<std::int64_t> row_major_strides(std::span<const std::int64_t> shape) {
  std::vector<std::int64_t> strides(shape.size(), 1);
  for (std::size_t d = shape.size(); d-- > 1;) strides[d - 1] = strides[d] * shape[d];
  return strides;
}

// ---------------------------------------------------------------------------- import

// The owner of an imported DLManagedTensor: the last tensor handle's going calls the
// producer's deleter, once. `managed` is set only after everything that may throw, so a
// refusal leaves the DLManagedTensor to the caller.
struct Imported {
  DLManagedTensor* managed = nullptr;
  Imported() = default;
  Imported(const Imported&) = delete;
  Imported& operator=(const Imported&) = delete;
  ~Imported() {
    if (managed != nullptr && managed->deleter != nullptr) managed->deleter(managed);
  }
};

// Where an empty imported tensor points when its producer gave no address (torch does
// for empty tensors): meshrt's storage is never null, so that kernels and MPI may take
// the address of any tensor.
alignas(64) std::byte g_empty_storage[64];

std::string dl_dtype_name(const DLDataType& t) {
  static constexpr std::array<const char*, 7> kCodes = {"int",    "uint",    "float", "opaque handle",
                                                        "bfloat", "complex", "bool"};
  std::string text = t.code < kCodes.size() ? fmt::format("{}{}", kCodes[t.code], t.bits)
                                            : fmt::format("type code {} of {} bits", +t.code, +t.bits);
  if (t.lanes != 1) text += fmt::format(" with {} lanes", t.lanes);
  return text;
}

std::optional<DType> meshrt_dtype(const DLDataType& t) {
  if (t.lanes != 1) return std::nullopt;
  switch (t.code) {
    case kDLUInt:
      if (t.bits == 8) return DType::UInt8;
      break;
    case kDLInt:
      if (t.bits == 32) return DType::Int32;
      if (t.bits == 64) return DType::Int64;
      break;
    case kDLFloat:
      if (t.bits == 16) return DType::Float16;
      if (t.bits == 32) return DType::Float32;
      if (t.bits == 64) return DType::Float64;
      break;
    case kDLBfloat:
      if (t.bits == 16) return DType::BFloat16;
      break;
    case kDLBoolCode:
      if (t.bits == 8) return DType::Bool;
      break;
    default:
      break;
  }
  return std::nullopt;
}

Device meshrt_device(const DLDevice& d, const char* what) {
  switch (d.device_type) {
    case kDLCPU:
    case kDLCUDAHost:  // page-locked host memory: a CPU tensor to meshrt
      return Device::cpu();
    case kDLCUDA:
      if (d.device_id >= 0) return Device::cuda(d.device_id);
      break;
    case kDLExtDev:
      if (d.device_id >= 0) return Device::emulated(d.device_id);
      break;
    default:
      throw UsageError(fmt::format(
          "{}: expected a kDLCPU (1), kDLCUDA (2), kDLCUDAHost (3) or kDLExtDev (12, meshrt's emulated accelerator) "
          "tensor, found device type {}; copy it to the CPU first",
          what, static_cast<int>(d.device_type)));
  }
  throw UsageError(fmt::format("{}: expected a device id >= 0, found {} on device type {}", what, d.device_id,
                               static_cast<int>(d.device_type)));
}

// Null strides, or the row-major ones on every dimension longer than 1; an empty tensor
// addresses no element, so any strides describe it.
void check_strides(const DLTensor& t, std::span<const std::int64_t> shape, std::int64_t numel, const char* what) {
  if (t.strides == nullptr || numel == 0) return;
  const std::span<const std::int64_t> strides(t.strides, shape.size());
  const std::vector<std::int64_t> compact = row_major_strides(shape);
  for (std::size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] != 1 && strides[d] != compact[d]) {
      throw UsageError(fmt::format(
          "{}: expected a contiguous row-major tensor (strides [{}] in elements for shape [{}]), found strides [{}]; "
          "make it contiguous first (numpy.ascontiguousarray, torch's .contiguous())",
          what, fmt::join(compact, ", "), fmt::join(shape, ", "), fmt::join(strides, ", ")));
    }
  }
}

// The meta a DLTensor describes (dtype, device, shape), checked; UsageError naming `what`.
TensorMeta imported_meta(const DLTensor& t, const char* what) {
  const std::optional<DType> dtype = meshrt_dtype(t.dtype);
  if (!dtype) {
    throw UsageError(fmt::format(
        "{}: expected one lane of bool8, uint8, int32, int64, float16, bfloat16, float32 or float64, found {}", what,
        dl_dtype_name(t.dtype)));
  }
  if (t.ndim < 0 || (t.ndim > 0 && t.shape == nullptr)) {
    throw UsageError(fmt::format("{}: expected ndim >= 0 and a shape array, found ndim {} and {}", what, t.ndim,
                                 t.shape == nullptr ? "no shape" : "a shape"));
  }
  const Device device = meshrt_device(t.device, what);
  try {
    return TensorMeta(std::vector<std::int64_t>(t.shape, t.shape + t.ndim), *dtype, device);
  } catch (const UsageError& e) {
    throw UsageError(fmt::format("{}: {}", what, e.what()));
  }
}

// The address of a DLTensor's first element (data + byte_offset), checked for alignment;
// an empty tensor with no address gets g_empty_storage's.
void* imported_data(const DLTensor& t, const TensorMeta& meta, const char* what) {
  void* data = t.data == nullptr ? nullptr : static_cast<std::byte*>(t.data) + t.byte_offset;
  if (data == nullptr) {
    if (meta.numel() != 0) {
      throw UsageError(fmt::format("{}: expected a data pointer for {}, found null", what, meta.to_string()));
    }
    return g_empty_storage;
  }
  const std::size_t alignment = element_size(meta.dtype());
  if (reinterpret_cast<std::uintptr_t>(data) % alignment != 0) {
    throw UsageError(fmt::format(
        "{}: expected data aligned to the {}-byte elements of {}, found address {} (data {} + byte_offset {})", what,
        alignment, meta.to_string(), data, t.data, t.byte_offset));
  }
  return data;
}

}  // namespace

DLManagedTensor* Tensor::to_dlpack() const {
  if (!defined()) {
    throw UsageError("Tensor::to_dlpack: expected a defined tensor, found an undefined (default-constructed) one");
  }
  auto exported = std::make_unique<Exported>();
  exported->tensor = *this;
  exported->shape = shape();
  exported->strides = row_major_strides(shape());
  DLTensor& t = exported->managed.dl_tensor;
  t.data = const_cast<void*>(raw_data());
  t.device = dl_device(device());
  t.ndim = static_cast<std::int32_t>(exported->shape.size());
  t.dtype = dl_dtype(dtype());
  t.shape = exported->shape.data();
  t.strides = exported->strides.data();
  t.byte_offset = 0;
  exported->managed.manager_ctx = exported.get();
  exported->managed.deleter = delete_exported;
  return &exported.release()->managed;
}

Tensor Tensor::from_dlpack(DLManagedTensor* managed) {
  if (managed == nullptr) throw UsageError("Tensor::from_dlpack: expected a DLManagedTensor, found null");
  if (managed->deleter == delete_exported) {
    // meshrt's own: the tensor it was (a bool stays bool), and the export's handle goes.
    Tensor t = static_cast<Exported*>(managed->manager_ctx)->tensor;
    managed->deleter(managed);
    return t;
  }
  const DLTensor& t = managed->dl_tensor;
  const TensorMeta meta = imported_meta(t, "Tensor::from_dlpack");
  check_strides(t, meta.shape(), meta.numel(), "Tensor::from_dlpack");
  void* data = imported_data(t, meta, "Tensor::from_dlpack");
  auto owner = std::make_shared<Imported>();
  std::shared_ptr<void> buffer(owner, data);
  Tensor out = meta.device().is_cpu() ? adopt_host(meta, std::move(buffer)) : adopt_device(meta, std::move(buffer));
  owner->managed = managed;  // the last step: nothing throws after it
  return out;
}

bool is_compact_dlpack(const DLManagedTensor& managed) {
  const DLTensor& t = managed.dl_tensor;
  if (t.strides == nullptr || t.ndim <= 0 || t.shape == nullptr) return true;
  const std::span<const std::int64_t> shape(t.shape, static_cast<std::size_t>(t.ndim));
  std::int64_t numel = 1;
  for (const std::int64_t n : shape) numel *= n;
  if (numel == 0) return true;
  const std::vector<std::int64_t> compact = row_major_strides(shape);
  for (std::size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] != 1 && t.strides[d] != compact[d]) return false;
  }
  return true;
}

Tensor copy_from_dlpack(const DLManagedTensor& managed) {
  const DLTensor& t = managed.dl_tensor;
  const TensorMeta meta = imported_meta(t, "copy_from_dlpack");
  const auto* data = static_cast<const std::byte*>(imported_data(t, meta, "copy_from_dlpack"));
  if (!meta.device().is_cpu()) {
    // Device memory is copied by the device, which copies compact memory only.
    check_strides(t, meta.shape(), meta.numel(), "copy_from_dlpack");
    const std::shared_ptr<void> borrowed(const_cast<std::byte*>(data), [](void*) {});
    return Tensor::adopt_device(meta, borrowed).clone();
  }
  Tensor out = Tensor::empty(meta);
  if (meta.numel() == 0) return out;
  const std::size_t element = element_size(meta.dtype());
  const std::span<const std::int64_t> shape = meta.shape();
  const std::vector<std::int64_t> strides =
      t.strides == nullptr ? row_major_strides(shape)
                           : std::vector<std::int64_t>(t.strides, t.strides + static_cast<std::size_t>(t.ndim));
  auto* dst = static_cast<std::byte*>(out.raw_data());
  if (shape.empty()) {
    std::memcpy(dst, data, element);
    return out;
  }
  // Row by row along the last dimension (one memcpy when its stride is one element),
  // stepping an index over the others as an odometer.
  const std::size_t last = shape.size() - 1;
  const std::int64_t row = shape[last];
  const bool contiguous_rows = strides[last] == 1;
  std::vector<std::int64_t> index(last, 0);  // of the row, over every dimension but the last
  std::ptrdiff_t offset = 0;                 // of the row's first element, in elements
  while (true) {
    const std::byte* src = data + offset * static_cast<std::ptrdiff_t>(element);
    if (contiguous_rows) {
      std::memcpy(dst, src, static_cast<std::size_t>(row) * element);
      dst += static_cast<std::size_t>(row) * element;
    } else {
      for (std::int64_t i = 0; i < row; ++i, dst += element) {
        std::memcpy(dst, src + i * strides[last] * static_cast<std::ptrdiff_t>(element), element);
      }
    }
    // The next row: the index counts up as an odometer, the last of its dimensions fastest.
    std::size_t d = last;
    while (true) {
      if (d == 0) return out;
      --d;
      offset += strides[d];
      if (++index[d] < shape[d]) break;
      offset -= strides[d] * shape[d];
      index[d] = 0;
    }
  }
}

}  // namespace meshrt
