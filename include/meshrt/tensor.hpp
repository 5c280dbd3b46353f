// Tensors: DType, Device, TensorMeta (which is also the TensorFactory) and Tensor.
//
// A Tensor is contiguous, row-major and shares its storage: copying a Tensor copies a
// handle (like torch.Tensor), clone() copies the data. CPU storage that meshrt allocates is
// 64-byte aligned (cache lines for kernels and MPI); nothing relies on more than element
// alignment, so that memory adopted from others (a numpy array is 16-byte aligned, a
// slice of one may be less) works in place. CUDA storage exists only when
// meshrt was built with CUDA; no CUDA header is included here. Emulated-accelerator
// storage (docs/ARCHITECTURE.md section 7) is host memory that host code may not read, except inside
// a task running on one of the emulated accelerator's streams (DeviceMemoryAccess).
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "meshrt/error.hpp"

// DLPack's tensor (dlpack/dlpack.h, which users include themselves where they need it).
struct DLManagedTensor;

namespace meshrt {

enum class DType : std::uint8_t { Bool, UInt8, Int32, Int64, Float16, BFloat16, Float32, Float64 };
inline constexpr int kNumDTypes = 8;

std::size_t element_size(DType dtype) noexcept;
// "bool", "uint8", "int32", "int64", "float16", "bfloat16", "float32", "float64".
std::string_view name(DType dtype) noexcept;
// Parses the names above; throws UsageError listing them.
DType parse_dtype(std::string_view text);
bool is_floating(DType dtype) noexcept;

// IEEE binary16 and bfloat16, stored as bits. Arithmetic goes through float.
struct Half {
  std::uint16_t bits = 0;
  friend bool operator==(Half, Half) = default;
};
struct BFloat16 {
  std::uint16_t bits = 0;
  friend bool operator==(BFloat16, BFloat16) = default;
};
// Round to nearest even; NaN stays NaN, overflow goes to infinity.
Half float_to_half(float value) noexcept;
float half_to_float(Half value) noexcept;
BFloat16 float_to_bfloat16(float value) noexcept;
float bfloat16_to_float(BFloat16 value) noexcept;

// The C++ element type of each dtype: dtype_of<float> == DType::Float32.
template <class T>
inline constexpr bool kIsElement = false;
template <class T>
inline constexpr DType dtype_of = DType::Bool;  // only meaningful where kIsElement<T>
#define MESHRT_ELEMENT_(T, D)                 \
  template <>                                 \
  inline constexpr bool kIsElement<T> = true; \
  template <>                                 \
  inline constexpr DType dtype_of<T> = DType::D;
MESHRT_ELEMENT_(bool, Bool)
MESHRT_ELEMENT_(std::uint8_t, UInt8)
MESHRT_ELEMENT_(std::int32_t, Int32)
MESHRT_ELEMENT_(std::int64_t, Int64)
MESHRT_ELEMENT_(Half, Float16)
MESHRT_ELEMENT_(BFloat16, BFloat16)
MESHRT_ELEMENT_(float, Float32)
MESHRT_ELEMENT_(double, Float64)
#undef MESHRT_ELEMENT_

// Calls f(T{}) with T the element type of `dtype`: the one switch every typed kernel uses.
template <class F>
decltype(auto) dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::Bool:
      return f(bool{});
    case DType::UInt8:
      return f(std::uint8_t{});
    case DType::Int32:
      return f(std::int32_t{});
    case DType::Int64:
      return f(std::int64_t{});
    case DType::Float16:
      return f(Half{});
    case DType::BFloat16:
      return f(BFloat16{});
    case DType::Float32:
      return f(float{});
    case DType::Float64:
      return f(double{});
  }
  throw UsageError("dispatch_dtype: expected a valid dtype, found " + std::to_string(static_cast<int>(dtype)));
}

class Device {
 public:
  // Emulated: the emulated accelerator (docs/ARCHITECTURE.md section 7), which enforces a GPU's
  // rules on the host. The order is part of the wire format: append only.
  enum class Kind : std::uint8_t { Cpu, Cuda, Emulated };
  static constexpr int kNumKinds = 3;
  constexpr Device() = default;
  static constexpr Device cpu() { return Device(); }
  // Throws UsageError for a negative index.
  static Device cuda(int index);
  static Device emulated(int index);
  // Any kind; throws UsageError for a negative index, or a non-zero one for the cpu.
  static Device of(Kind kind, int index);
  // "cpu", "cuda" (= cuda:0), "cuda:N", "emulated" (= emulated:0) or "emulated:N";
  // throws UsageError otherwise.
  static Device parse(std::string_view text);

  Kind kind() const noexcept { return kind_; }
  int index() const noexcept { return index_; }
  bool is_cpu() const noexcept { return kind_ == Kind::Cpu; }
  bool is_cuda() const noexcept { return kind_ == Kind::Cuda; }
  bool is_emulated() const noexcept { return kind_ == Kind::Emulated; }
  // Device memory that host code cannot read directly (cuda, emulated).
  bool is_accelerator() const noexcept { return kind_ != Kind::Cpu; }
  std::string to_string() const;
  friend bool operator==(const Device&, const Device&) = default;

 private:
  constexpr Device(Kind kind, int index) : kind_(kind), index_(index) {}
  Kind kind_ = Kind::Cpu;
  int index_ = 0;
};

// "cpu", "cuda" or "emulated".
std::string_view name(Device::Kind kind) noexcept;
// What a mesh is placed on (docs/ARCHITECTURE.md section 7): ctl.world_mesh(dims, DeviceKind::Emulated).
using DeviceKind = Device::Kind;

// While one is alive on a thread, that thread may read and write emulated device memory
// through Tensor's accessors: the emulated accelerator holds one while it runs a task on
// a stream, the only place a GPU's memory is readable from kernels. Nests.
class DeviceMemoryAccess {
 public:
  DeviceMemoryAccess() noexcept;
  ~DeviceMemoryAccess();
  DeviceMemoryAccess(const DeviceMemoryAccess&) = delete;
  DeviceMemoryAccess& operator=(const DeviceMemoryAccess&) = delete;
  // Whether the calling thread is inside one.
  static bool active() noexcept;
};

namespace detail {
// The storage of the last tensor whose typed host access (data<T>, span<T>) was refused
// for its element type on this thread, and clears it: the registry's kernel wrapper names
// the argument that tensor was.
const void* take_refused_access() noexcept;
// Where Tensor::empty gets emulated device memory: the device layer installs its pool here
// at load time (it sits above tensor in the module order, so tensor cannot call it).
using DeviceAllocator = std::shared_ptr<void> (*)(const Device& device, std::size_t bytes);
void set_device_allocator(DeviceAllocator allocator) noexcept;
// Where Tensor's own copies and zero fills of accelerator memory go (clone, to, copy_from,
// zeros; so item and equals too), installed at load time by the device layer as well: it
// runs them on a stream of its own, ordered after everything enqueued so far on that
// device's streams in this process, and waits for them. Never the legacy default stream.
using DeviceCopy = void (*)(void* dst, const Device& dst_device, const void* src, const Device& src_device,
                            std::size_t bytes);
using DeviceZero = void (*)(void* dst, const Device& device, std::size_t bytes);
void set_device_transfers(DeviceCopy copy, DeviceZero zero) noexcept;
}  // namespace detail

class Tensor;

// Shape, dtype and device: what the controller knows of a tensor without its data, and
// the factory a worker uses to make zeros when its real input is broken.
class TensorMeta {
 public:
  TensorMeta() = default;  // a 0-d float32 CPU tensor
  // Throws UsageError for a negative dimension or a size that overflows.
  TensorMeta(std::vector<std::int64_t> shape, DType dtype, Device device = Device::cpu());

  const std::vector<std::int64_t>& shape() const noexcept { return shape_; }
  std::size_t ndim() const noexcept { return shape_.size(); }
  DType dtype() const noexcept { return dtype_; }
  const Device& device() const noexcept { return device_; }
  std::int64_t numel() const noexcept { return numel_; }
  std::size_t nbytes() const noexcept { return static_cast<std::size_t>(numel_) * element_size(dtype_); }

  TensorMeta with_device(Device device) const;
  TensorMeta with_shape(std::vector<std::int64_t> shape) const;

  // The factory: uninitialised storage, or zeros.
  Tensor empty() const;
  Tensor zeros() const;

  // "float32[3, 4] on cpu"
  std::string to_string() const;
  friend bool operator==(const TensorMeta& a, const TensorMeta& b) noexcept {
    return a.dtype_ == b.dtype_ && a.device_ == b.device_ && a.shape_ == b.shape_;
  }

 private:
  std::vector<std::int64_t> shape_;
  DType dtype_ = DType::Float32;
  Device device_;
  std::int64_t numel_ = 1;
};

// Checks a shape: every dimension >= 0 and numel * element_size fits in int64. Returns
// numel; throws UsageError naming the bad dimension.
std::int64_t checked_numel(std::span<const std::int64_t> shape, DType dtype);

class Tensor {
 public:
  // An undefined tensor (no storage); defined() is false.
  Tensor() = default;
  static Tensor empty(const TensorMeta& meta);
  static Tensor zeros(const TensorMeta& meta);
  // A CPU tensor over host memory that the caller owns: `buffer` must hold at least
  // meta.nbytes() bytes, aligned to the element size (UsageError otherwise); its deleter
  // runs when the last handle goes. This is how buffer pools (the comm data plane's output
  // pool) hand out warm memory.
  static Tensor adopt_host(const TensorMeta& meta, std::shared_ptr<void> buffer);
  // The same for device memory of meta.device() (cuda or emulated), which is how the device
  // layer's stream-ordered pool hands out its blocks.
  static Tensor adopt_device(const TensorMeta& meta, std::shared_ptr<void> buffer);

  // DLPack, zero-copy both ways. Devices: cpu <-> kDLCPU (kDLCUDAHost is accepted too),
  // cuda:N <-> kDLCUDA N, emulated:N <-> kDLExtDev N, which no host library reads (the
  // emulated accelerator's memory stays unreadable from the host). Dtypes: every meshrt
  // dtype, bfloat16 as kDLBfloat; bool is exported as kDLUInt 8 (the one-byte 0/1 it is:
  // numpy 1.24 and torch 1.13 accept no kDLBool) and imported from kDLBool 8 too.
  //
  // to_dlpack: a DLManagedTensor viewing this tensor's storage with explicit row-major
  // strides and byte_offset 0; it holds a handle, so the storage lives until the consumer
  // calls its deleter (exactly once). Throws UsageError for an undefined tensor.
  DLManagedTensor* to_dlpack() const;
  // from_dlpack: a tensor viewing `managed`'s memory (data + byte_offset), which must be
  // compact row-major (null strides, or any stride on a dimension of size 1) with one lane
  // of a meshrt dtype, aligned to the element size. On success the tensor owns `managed`
  // and calls its deleter when the last handle goes; one of meshrt's own (to_dlpack) comes
  // back as the tensor it was, bool included. A refusal throws UsageError naming what it
  // found and leaves `managed` to the caller.
  static Tensor from_dlpack(DLManagedTensor* managed);
  // A CPU tensor holding a copy of `values` with the given shape.
  template <class T>
  static Tensor from(std::vector<std::int64_t> shape, std::span<const T> values);
  template <class T>
  static Tensor from(std::vector<std::int64_t> shape, std::initializer_list<T> values) {
    return from<T>(std::move(shape), std::span<const T>(values.begin(), values.size()));
  }

  bool defined() const noexcept { return storage_ != nullptr; }
  const TensorMeta& meta() const noexcept { return meta_; }
  const std::vector<std::int64_t>& shape() const noexcept { return meta_.shape(); }
  DType dtype() const noexcept { return meta_.dtype(); }
  const Device& device() const noexcept { return meta_.device(); }
  std::int64_t numel() const noexcept { return meta_.numel(); }
  std::size_t nbytes() const noexcept { return meta_.nbytes(); }

  // The raw storage (host or device memory, per device()). nullptr when undefined.
  void* raw_data() noexcept;
  const void* raw_data() const noexcept;

  // Typed host access; throws UsageError if T is not this tensor's element type, the
  // tensor is on CUDA, or it is emulated device memory outside a stream task.
  template <class T>
  T* data() {
    check_access(dtype_of<T>, kIsElement<T>);
    return static_cast<T*>(raw_data());
  }
  template <class T>
  const T* data() const {
    check_access(dtype_of<T>, kIsElement<T>);
    return static_cast<const T*>(raw_data());
  }
  template <class T>
  std::span<T> span() {
    return {data<T>(), static_cast<std::size_t>(numel())};
  }
  template <class T>
  std::span<const T> span() const {
    return {data<T>(), static_cast<std::size_t>(numel())};
  }
  // The single element of a tensor with numel() == 1, as double (bool -> 0/1).
  double item() const;

  // A deep copy on the same device. These host-side copies (clone, to, copy_from, zeros,
  // item, equals) are synchronous. On accelerator memory they name no stream, so the
  // device layer orders them after all work enqueued so far on the device's streams in
  // this process (the value's among them) and waits: correct, but a wait for the whole
  // device; the device layer (meshrt/device.hpp) has forms on one stream that do not
  // block. Inside an emulated stream task they are plain host copies.
  Tensor clone() const;
  // This tensor on `device` (itself when already there). Without CUDA, or without a GPU,
  // a CUDA device raises UsageError.
  Tensor to(const Device& device) const;
  // Copies `other`'s data into this tensor's storage; shapes and dtypes must match.
  void copy_from(const Tensor& other);
  // A tensor sharing this storage with another shape of the same numel.
  Tensor reshape(std::vector<std::int64_t> shape) const;

  // Rows [begin, end) of dimension 0, sharing this storage (a contiguous slice: chunk,
  // t[begin:end]); throws UsageError for a 0-d tensor or rows outside [0, shape[0]].
  Tensor rows(std::int64_t begin, std::int64_t end) const;

  // True if both handles share storage.
  bool same_storage(const Tensor& other) const noexcept { return storage_ == other.storage_; }
  // Same meta and same bytes (copies device data to the host to compare).
  bool equals(const Tensor& other) const;

  std::string to_string() const;

  struct Storage;  // defined in tensor.cpp; holds host or device memory

 private:
  Tensor(TensorMeta meta, std::shared_ptr<Storage> storage) : meta_(std::move(meta)), storage_(std::move(storage)) {}
  void check_access(DType requested, bool is_element) const;
  static Tensor from_bytes(std::vector<std::int64_t> shape, DType dtype, const void* bytes, std::size_t nbytes);

  TensorMeta meta_;
  std::shared_ptr<Storage> storage_;
};

template <class T>
Tensor Tensor::from(std::vector<std::int64_t> shape, std::span<const T> values) {
  static_assert(kIsElement<T>, "Tensor::from: not a meshrt element type");
  return from_bytes(std::move(shape), dtype_of<T>, values.data(), values.size() * sizeof(T));
}

// Whether this process can use CUDA tensors: built with CUDA and a device is visible.
bool cuda_available() noexcept;

}  // namespace meshrt
