#include "meshrt/tensor.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshrt/config.hpp"

#if MESHRT_HAVE_CUDA
#include "common/checks.hpp"
#include "common/cuda_guard.hpp"
#endif

namespace meshrt {

namespace {

constexpr std::array<std::string_view, kNumDTypes> kDTypeNames = {"bool",    "uint8",    "int32",   "int64",
                                                                  "float16", "bfloat16", "float32", "float64"};
constexpr std::array<std::size_t, kNumDTypes> kDTypeSizes = {1, 1, 4, 8, 2, 2, 4, 8};
// Cache-line alignment for CPU storage: vector kernels and MPI both like it.
constexpr std::size_t kHostAlignment = 64;
// Host storage up to this size is aligned by hand (Tensor::Storage::Storage).
constexpr std::size_t kSmallHostBytes = 4096;

}  // namespace

std::size_t element_size(DType dtype) noexcept {
  const auto i = static_cast<std::size_t>(dtype);
  return i < kDTypeSizes.size() ? kDTypeSizes[i] : 0;
}

std::string_view name(DType dtype) noexcept {
  const auto i = static_cast<std::size_t>(dtype);
  return i < kDTypeNames.size() ? kDTypeNames[i] : std::string_view("invalid");
}

DType parse_dtype(std::string_view text) {
  for (std::size_t i = 0; i < kDTypeNames.size(); ++i) {
    if (kDTypeNames[i] == text) return static_cast<DType>(i);
  }
  throw UsageError(fmt::format("dtype: expected one of {}, found '{}'", fmt::join(kDTypeNames, ", "), text));
}

bool is_floating(DType dtype) noexcept {
  return dtype == DType::Float16 || dtype == DType::BFloat16 || dtype == DType::Float32 || dtype == DType::Float64;
}

// After F. Giesen's float_to_half_fast3_rtne: exact round-to-nearest-even without a
// table, using the FPU to round denormals.
Half float_to_half(float value) noexcept {
  constexpr std::uint32_t f32_infinity = 255u << 23;
  constexpr std::uint32_t f16_overflow = (127u + 16u) << 23;
  constexpr std::uint32_t denorm_magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  std::uint32_t x = std::bit_cast<std::uint32_t>(value);
  const std::uint32_t sign = x & 0x80000000u;
  x ^= sign;
  std::uint32_t out = 0;
  if (x >= f16_overflow) {
    out = x > f32_infinity ? 0x7e00u : 0x7c00u;
  } else if (x < (113u << 23)) {
    const float f = std::bit_cast<float>(x) + std::bit_cast<float>(denorm_magic);
    out = std::bit_cast<std::uint32_t>(f) - denorm_magic;
  } else {
    const std::uint32_t mantissa_odd = (x >> 13) & 1u;
    x -= 112u << 23;  // rebias the exponent from 127 to 15
    x += 0xfffu + mantissa_odd;
    out = x >> 13;
  }
  return Half{static_cast<std::uint16_t>(out | (sign >> 16))};
}

float half_to_float(Half value) noexcept {
  constexpr std::uint32_t shifted_exp = 0x7c00u << 13;
  const std::uint32_t h = value.bits;
  std::uint32_t out = (h & 0x7fffu) << 13;
  const std::uint32_t exp = shifted_exp & out;
  out += (127u - 15u) << 23;
  if (exp == shifted_exp) {
    out += (128u - 16u) << 23;  // infinity or NaN
  } else if (exp == 0) {
    out += 1u << 23;  // zero or denormal: renormalise through the FPU
    out = std::bit_cast<std::uint32_t>(std::bit_cast<float>(out) - std::bit_cast<float>(113u << 23));
  }
  return std::bit_cast<float>(out | ((h & 0x8000u) << 16));
}

BFloat16 float_to_bfloat16(float value) noexcept {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(value);
  if ((x & 0x7fffffffu) > 0x7f800000u) return BFloat16{static_cast<std::uint16_t>((x >> 16) | 0x40u)};  // quiet NaN
  const std::uint32_t rounded = x + 0x7fffu + ((x >> 16) & 1u);
  return BFloat16{static_cast<std::uint16_t>(rounded >> 16)};
}

float bfloat16_to_float(BFloat16 value) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(value.bits) << 16);
}

// ---------------------------------------------------------------------------- Device

Device Device::cuda(int index) {
  if (index < 0) throw UsageError(fmt::format("Device::cuda: expected a device index >= 0, found {}", index));
  return Device(Kind::Cuda, index);
}

Device Device::emulated(int index) {
  if (index < 0) throw UsageError(fmt::format("Device::emulated: expected a device index >= 0, found {}", index));
  return Device(Kind::Emulated, index);
}

Device Device::of(Kind kind, int index) {
  switch (kind) {
    case Kind::Cpu:
      if (index != 0) throw UsageError(fmt::format("Device::of: expected index 0 for the cpu, found {}", index));
      return cpu();
    case Kind::Cuda:
      return cuda(index);
    case Kind::Emulated:
      return emulated(index);
  }
  throw UsageError(
      fmt::format("Device::of: expected a kind in 0..{}, found {}", kNumKinds - 1, static_cast<int>(kind)));
}

Device Device::parse(std::string_view text) {
  if (text == "cpu") return cpu();
  for (const Kind kind : {Kind::Cuda, Kind::Emulated}) {
    const std::string_view prefix = name(kind);
    if (text == prefix) return of(kind, 0);
    if (text.starts_with(prefix) && text.size() > prefix.size() && text[prefix.size()] == ':') {
      const std::string_view digits = text.substr(prefix.size() + 1);
      int index = -1;
      const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), index);
      if (ec == std::errc() && end == digits.data() + digits.size() && !digits.empty() && index >= 0) {
        return of(kind, index);
      }
    }
  }
  throw UsageError(fmt::format(
      "device: expected 'cpu', 'cuda', 'cuda:N', 'emulated' or 'emulated:N' with N >= 0, found '{}'", text));
}

std::string Device::to_string() const {
  return is_cpu() ? std::string("cpu") : fmt::format("{}:{}", name(kind_), index_);
}

std::string_view name(Device::Kind kind) noexcept {
  switch (kind) {
    case Device::Kind::Cpu:
      return "cpu";
    case Device::Kind::Cuda:
      return "cuda";
    case Device::Kind::Emulated:
      return "emulated";
  }
  return "invalid";
}

namespace {
thread_local int t_device_memory_access = 0;
std::atomic<detail::DeviceAllocator> g_device_allocator{nullptr};
std::atomic<detail::DeviceCopy> g_device_copy{nullptr};
std::atomic<detail::DeviceZero> g_device_zero{nullptr};
}  // namespace

void detail::set_device_allocator(DeviceAllocator allocator) noexcept {
  g_device_allocator.store(allocator);
}

void detail::set_device_transfers(DeviceCopy copy, DeviceZero zero) noexcept {
  g_device_copy.store(copy);
  g_device_zero.store(zero);
}

DeviceMemoryAccess::DeviceMemoryAccess() noexcept {
  ++t_device_memory_access;
}
DeviceMemoryAccess::~DeviceMemoryAccess() {
  --t_device_memory_access;
}
bool DeviceMemoryAccess::active() noexcept {
  return t_device_memory_access > 0;
}

// ---------------------------------------------------------------------------- TensorMeta

std::int64_t checked_numel(std::span<const std::int64_t> shape, DType dtype) {
  const std::size_t elsize = element_size(dtype);
  if (elsize == 0) {
    throw UsageError(
        fmt::format("tensor: expected a dtype in 0..{}, found {}", kNumDTypes - 1, static_cast<int>(dtype)));
  }
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) {
      throw UsageError(fmt::format("tensor shape [{}]: expected every dimension >= 0, found {} at dimension {}",
                                   fmt::join(shape, ", "), shape[i], i));
    }
  }
  // A zero anywhere makes the product 0, whatever the other dimensions are.
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) return 0;
  const auto limit = std::numeric_limits<std::int64_t>::max() / static_cast<std::int64_t>(elsize);
  std::int64_t numel = 1;
  for (const std::int64_t d : shape) {
    if (numel > limit / d) {
      throw UsageError(fmt::format("tensor shape [{}] of {}: expected at most {} bytes, found a size that overflows",
                                   fmt::join(shape, ", "), name(dtype), std::numeric_limits<std::int64_t>::max()));
    }
    numel *= d;
  }
  return numel;
}

TensorMeta::TensorMeta(std::vector<std::int64_t> shape, DType dtype, Device device)
    : shape_(std::move(shape)), dtype_(dtype), device_(device), numel_(checked_numel(shape_, dtype)) {}

TensorMeta TensorMeta::with_device(Device device) const {
  TensorMeta m = *this;
  m.device_ = device;
  return m;
}

TensorMeta TensorMeta::with_shape(std::vector<std::int64_t> shape) const {
  return TensorMeta(std::move(shape), dtype_, device_);
}

Tensor TensorMeta::empty() const {
  return Tensor::empty(*this);
}
Tensor TensorMeta::zeros() const {
  return Tensor::zeros(*this);
}

std::string TensorMeta::to_string() const {
  return fmt::format("{}[{}] on {}", name(dtype_), fmt::join(shape_, ", "), device_.to_string());
}

// ---------------------------------------------------------------------------- storage

struct Tensor::Storage {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  Device device;

  std::shared_ptr<void> adopted;  // set for adopt_host: the owner frees, not ~Storage
  bool trailing = false;          // small host storage: `ptr` lies in this object's allocation

  // Where a small host storage's bytes begin, set by the allocator before construction.
  struct Trailing {
    void* const* bytes;
  };

  Storage(std::size_t n, Device d);
  Storage(Trailing t, std::size_t n, Device d);
  Storage(std::shared_ptr<void> buffer, std::size_t n) : ptr(buffer.get()), bytes(n), adopted(std::move(buffer)) {}
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
};

namespace {

// Host code touching emulated device memory outside a stream task would be unordered with
// the device's streams: on a GPU it reads stale data (or faults), so the emulator refuses.
void require_host_access(const TensorMeta& meta, const char* what) {
  if (!meta.device().is_emulated() || DeviceMemoryAccess::active()) return;
  throw UsageError(fmt::format(
      "{}: expected host-readable memory, found emulated device memory ({}); the host cannot read an accelerator's "
      "memory: read it in a task on its stream (a kernel on the accelerator's stream) or fetch it",
      what, meta.to_string()));
}

void require_cuda(const Device& device, const char* what) {
  if (!device.is_cuda()) return;
#if MESHRT_HAVE_CUDA
  int count = 0;
  std::string why;  // CUDA's reason for none
  if (const cudaError_t rc = cudaGetDeviceCount(&count); rc != cudaSuccess) {
    (void)cudaGetLastError();
    count = 0;
    why = fmt::format(" (cudaGetDeviceCount: {}, {})", cudaGetErrorString(rc), cudaGetErrorName(rc));
  }
  if (device.index() >= count) {
    throw UsageError(fmt::format("{}: expected a visible CUDA device, found {} requested and {} device(s) visible{}",
                                 what, device.to_string(), count, why));
  }
#else
  throw UsageError(fmt::format("{}: expected a CPU device in this build (meshrt was built without CUDA), found {}",
                               what, device.to_string()));
#endif
}

// Host storage of n bytes rounded up to whole cache lines; never 0, so that kernels and
// MPI may take the address even of an empty tensor.
std::size_t host_rounded(std::size_t n) {
  return std::max<std::size_t>(kHostAlignment, (n + kHostAlignment - 1) / kHostAlignment * kHostAlignment);
}

// Small host storage lives in the allocation of its own shared_ptr control block, aligned
// by hand (WithTrailingBytes): every collective's small output is one of these. glibc's
// aligned allocation splits a larger chunk and frees the pieces, several times the work
// of a plain allocation, and a block of its own beside the control block would cost one
// more malloc and free per tensor.
bool small_host(std::size_t n, const Device& d) {
  // Emulated device memory is host memory, unless the device layer allocates it.
  const bool host = d.is_cpu() || (d.is_emulated() && !g_device_allocator.load());
  return host && host_rounded(n) <= kSmallHostBytes;
}

// The allocator std::allocate_shared uses for a small host storage: it allocates the
// control block (which holds the Storage) with `extra` bytes after it and says where
// they begin, before the Storage is constructed there.
template <class T>
struct WithTrailingBytes {
  using value_type = T;
  std::size_t extra;
  void** bytes;

  WithTrailingBytes(std::size_t e, void** b) noexcept : extra(e), bytes(b) {}
  template <class U>
  WithTrailingBytes(const WithTrailingBytes<U>& other) noexcept : extra(other.extra), bytes(other.bytes) {}

  T* allocate(std::size_t count) {
    const std::size_t head = count * sizeof(T);
    void* p = ::operator new(head + extra);
    *bytes = static_cast<std::byte*>(p) + head;
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t) noexcept { ::operator delete(p); }
  template <class U>
  bool operator==(const WithTrailingBytes<U>& other) const noexcept {
    return extra == other.extra;
  }
};

}  // namespace

Tensor::Storage::Storage(std::size_t n, Device d) : bytes(n), device(d) {
  if (d.is_emulated()) {
    if (const detail::DeviceAllocator allocate = g_device_allocator.load()) {
      adopted = allocate(d, n);
      ptr = adopted.get();
      return;
    }
  }
  // Emulated device memory is host memory; only the accessors tell it apart.
  if (d.is_cpu() || d.is_emulated()) {
    ptr = ::operator new(host_rounded(n), std::align_val_t(kHostAlignment));
    return;
  }
  require_cuda(d, "tensor allocation");
#if MESHRT_HAVE_CUDA
  detail::CudaDeviceGuard guard(d.index());
  const cudaError_t rc = cudaMalloc(&ptr, std::max<std::size_t>(n, 1));
  if (rc != cudaSuccess) {
    // Reported here: it must not stay CUDA's last error, which the next kernel launch's
    // check (cudaGetLastError) would report as its own.
    (void)cudaGetLastError();
    detail::throw_cuda_error(static_cast<int>(rc), "cudaMalloc(&ptr, n)", __FILE__, __LINE__);
  }
#endif
}

Tensor::Storage::Storage(Trailing t, std::size_t n, Device d) : bytes(n), device(d), trailing(true) {
  const auto address = reinterpret_cast<std::uintptr_t>(*t.bytes);
  ptr = reinterpret_cast<void*>((address + kHostAlignment - 1) / kHostAlignment * kHostAlignment);
}

Tensor::Storage::~Storage() {
  if (adopted || trailing) return;
  if (device.is_cpu() || device.is_emulated()) {
    ::operator delete(ptr, std::align_val_t(kHostAlignment));
    return;
  }
#if MESHRT_HAVE_CUDA
  (void)cudaFree(ptr);
#endif
}

namespace {

// Plain host memory on both sides: host memory, or emulated device memory inside a stream
// task (the one place the host may touch it).
bool host_only(const Device& a, const Device& b) {
  if (a.is_cuda() || b.is_cuda()) return false;
  return (a.is_cpu() && b.is_cpu()) || DeviceMemoryAccess::active();
}

// dst and src of n bytes, on any pair of devices: accelerator memory through the device
// layer's ordered copy (detail::set_device_transfers).
void copy_bytes(void* dst, const Device& dst_device, const void* src, const Device& src_device, std::size_t n,
                const char* what) {
  if (n == 0) return;
  if (host_only(dst_device, src_device)) {
    std::memcpy(dst, src, n);
    return;
  }
  require_cuda(dst_device, what);
  require_cuda(src_device, what);
  const detail::DeviceCopy copy = g_device_copy.load();
  if (!copy) throw UsageError(fmt::format("{}: expected the device layer's copies installed, found none", what));
  copy(dst, dst_device, src, src_device, n);
}

// Adopted memory (a pool's, a numpy array's through DLPack) need not be cache-line aligned:
// every kernel, copy and MPI datatype works at element alignment, which is what C++ and
// MPI require.
void require_element_alignment(const TensorMeta& meta, const void* p, const char* what) {
  if (reinterpret_cast<std::uintptr_t>(p) % element_size(meta.dtype()) == 0) return;
  throw UsageError(fmt::format("{}: expected a buffer aligned to the {}-byte elements of {}, found address {}", what,
                               element_size(meta.dtype()), meta.to_string(), p));
}

}  // namespace

// ---------------------------------------------------------------------------- Tensor

Tensor Tensor::empty(const TensorMeta& meta) {
  const std::size_t n = meta.nbytes();
  if (small_host(n, meta.device())) {
    void* bytes = nullptr;
    return Tensor(meta,
                  std::allocate_shared<Storage>(WithTrailingBytes<Storage>(host_rounded(n) + kHostAlignment, &bytes),
                                                Storage::Trailing{&bytes}, n, meta.device()));
  }
  return Tensor(meta, std::make_shared<Storage>(n, meta.device()));
}

Tensor Tensor::adopt_host(const TensorMeta& meta, std::shared_ptr<void> buffer) {
  if (!meta.device().is_cpu()) {
    throw UsageError(fmt::format("Tensor::adopt_host: expected a CPU tensor, found {}", meta.to_string()));
  }
  if (!buffer)
    throw UsageError(fmt::format("Tensor::adopt_host: expected a buffer for {}, found null", meta.to_string()));
  require_element_alignment(meta, buffer.get(), "Tensor::adopt_host");
  return Tensor(meta, std::make_shared<Storage>(std::move(buffer), meta.nbytes()));
}

Tensor Tensor::adopt_device(const TensorMeta& meta, std::shared_ptr<void> buffer) {
  if (!meta.device().is_accelerator()) {
    throw UsageError(fmt::format("Tensor::adopt_device: expected an accelerator tensor, found {}", meta.to_string()));
  }
  if (!buffer)
    throw UsageError(fmt::format("Tensor::adopt_device: expected a buffer for {}, found null", meta.to_string()));
  require_element_alignment(meta, buffer.get(), "Tensor::adopt_device");
  auto storage = std::make_shared<Storage>(std::move(buffer), meta.nbytes());
  storage->device = meta.device();
  return Tensor(meta, std::move(storage));
}

Tensor Tensor::zeros(const TensorMeta& meta) {
  Tensor t = empty(meta);
  if (host_only(meta.device(), meta.device())) {
    std::memset(t.raw_data(), 0, meta.nbytes());
  } else if (meta.nbytes() > 0) {
    const detail::DeviceZero zero = g_device_zero.load();
    if (!zero) throw UsageError("Tensor::zeros: expected the device layer's zero fill installed, found none");
    zero(t.raw_data(), meta.device(), meta.nbytes());
  }
  return t;
}

Tensor Tensor::from_bytes(std::vector<std::int64_t> shape, DType dtype, const void* bytes, std::size_t nbytes) {
  TensorMeta meta(std::move(shape), dtype);
  if (meta.nbytes() != nbytes) {
    throw UsageError(fmt::format("Tensor::from: expected {} values for shape [{}], found {}", meta.numel(),
                                 fmt::join(meta.shape(), ", "), nbytes / element_size(dtype)));
  }
  Tensor t = empty(meta);
  if (nbytes > 0) std::memcpy(t.raw_data(), bytes, nbytes);
  return t;
}

void* Tensor::raw_data() noexcept {
  return storage_ ? storage_->ptr : nullptr;
}
const void* Tensor::raw_data() const noexcept {
  return storage_ ? storage_->ptr : nullptr;
}

namespace {
// The C++ type of a dtype's elements, as a kernel names it in data<T>().
std::string_view element_type_name(DType dtype) noexcept {
  constexpr std::array<std::string_view, kNumDTypes> kTypes = {
      "bool", "std::uint8_t", "std::int32_t", "std::int64_t", "meshrt::Half", "meshrt::BFloat16", "float", "double"};
  return kTypes[static_cast<std::size_t>(dtype)];
}
// Initial-exec: every kernel call clears it, and the default model's look-up through
// __tls_get_addr would be paid per call on the worker.
[[gnu::tls_model("initial-exec")]] thread_local const void* refused_access = nullptr;
}  // namespace

const void* detail::take_refused_access() noexcept {
  return std::exchange(refused_access, nullptr);
}

void Tensor::check_access(DType requested, bool is_element) const {
  if (!defined())
    throw UsageError("tensor data: expected a defined tensor, found an undefined (default-constructed) one");
  if (!is_element || requested != dtype()) {
    refused_access = storage_ ? storage_->ptr : nullptr;
    throw UsageError(fmt::format("tensor data: expected data<{}>() for a {} tensor, found {}",
                                 element_type_name(dtype()), meta_.to_string(),
                                 is_element ? fmt::format("data<{}>()", element_type_name(requested))
                                            : std::string("a type that is no dtype's element type")));
  }
  if (device().is_cuda()) {
    throw UsageError(fmt::format("tensor data: expected a CPU tensor for host access, found {}; use to(Device::cpu())",
                                 meta_.to_string()));
  }
  require_host_access(meta_, "tensor data");
}

double Tensor::item() const {
  if (numel() != 1) throw UsageError(fmt::format("Tensor::item: expected one element, found {}", meta_.to_string()));
  const Tensor host = to(Device::cpu());
  return dispatch_dtype(dtype(), [&](auto tag) -> double {
    using T = decltype(tag);
    const T v = *host.data<T>();
    if constexpr (std::is_same_v<T, Half>)
      return half_to_float(v);
    else if constexpr (std::is_same_v<T, BFloat16>)
      return bfloat16_to_float(v);
    else
      return static_cast<double>(v);
  });
}

Tensor Tensor::clone() const {
  if (!defined()) return {};
  Tensor t = empty(meta_);
  copy_bytes(t.raw_data(), device(), raw_data(), device(), nbytes(), "Tensor::clone");
  return t;
}

Tensor Tensor::to(const Device& target) const {
  if (!defined()) throw UsageError("Tensor::to: expected a defined tensor, found an undefined one");
  if (target == device()) return *this;
  require_cuda(target, "Tensor::to");
  Tensor t = empty(meta_.with_device(target));
  copy_bytes(t.raw_data(), target, raw_data(), device(), nbytes(), "Tensor::to");
  return t;
}

void Tensor::copy_from(const Tensor& other) {
  if (!defined() || !other.defined() || other.shape() != shape() || other.dtype() != dtype()) {
    throw UsageError(fmt::format("Tensor::copy_from: expected a source like {}, found {}",
                                 defined() ? meta_.to_string() : "undefined",
                                 other.defined() ? other.meta_.to_string() : "undefined"));
  }
  copy_bytes(raw_data(), device(), other.raw_data(), other.device(), nbytes(), "Tensor::copy_from");
}

Tensor Tensor::reshape(std::vector<std::int64_t> shape) const {
  TensorMeta m = meta_.with_shape(std::move(shape));
  if (m.numel() != numel()) {
    throw UsageError(fmt::format("Tensor::reshape: expected a shape of {} elements, found [{}] ({} elements)", numel(),
                                 fmt::join(m.shape(), ", "), m.numel()));
  }
  return Tensor(std::move(m), storage_);
}

Tensor Tensor::rows(std::int64_t begin, std::int64_t end) const {
  if (!defined() || shape().empty() || begin < 0 || end < begin || end > shape()[0]) {
    throw UsageError(
        fmt::format("Tensor::rows: expected 0 <= begin <= end <= size(0) of a defined tensor with a "
                    "dimension, found rows [{}, {}) of {}",
                    begin, end, defined() ? to_string() : std::string("an undefined tensor")));
  }
  std::vector<std::int64_t> s = shape();
  const std::size_t row_bytes = s[0] == 0 ? 0 : nbytes() / static_cast<std::size_t>(s[0]);
  s[0] = end - begin;
  TensorMeta m = meta_.with_shape(std::move(s));
  // The rows' bytes inside this storage, which the new handle keeps alive.
  auto storage = std::make_shared<Storage>(
      std::shared_ptr<void>(storage_, static_cast<char*>(storage_->ptr) + static_cast<std::size_t>(begin) * row_bytes),
      m.nbytes());
  storage->device = meta_.device();
  return Tensor(std::move(m), std::move(storage));
}

bool Tensor::equals(const Tensor& other) const {
  if (defined() != other.defined()) return false;
  if (!defined()) return true;
  if (!(meta_ == other.meta_)) return false;
  const Tensor a = to(Device::cpu());
  const Tensor b = other.to(Device::cpu());
  return nbytes() == 0 || std::memcmp(a.raw_data(), b.raw_data(), nbytes()) == 0;
}

namespace {

// Past this many elements a tensor prints summarised, kEdgeItems at each end of every
// dimension longer than 2 * kEdgeItems (numpy's threshold and edgeitems).
constexpr std::int64_t kPrintThreshold = 1000;
constexpr std::int64_t kEdgeItems = 3;

// A float's text: shortest round trip, with a point when it would look like an integer
// ("1." as numpy prints it), so floats and integers read apart.
std::string float_text(std::string text) {
  if (text.find_first_of(".eEni") == std::string::npos) text += '.';
  return text;
}

// The fewest significant digits that read back as the same 16-bit value (0.1, not the
// 0.0999755859375 a float16 0.1 holds), as numpy prints float16.
template <class Round>
std::string shortest16(float value, Round round, std::uint16_t bits) {
  for (int digits = 1; digits < 9; ++digits) {
    std::string text = fmt::format("{:.{}g}", value, digits);
    float parsed = 0;
    std::from_chars(text.data(), text.data() + text.size(), parsed);  // locale-free, unlike strtof
    if (round(parsed) == bits) return text;
  }
  return fmt::format("{}", value);
}

std::string element_text(const void* data, DType dtype, std::int64_t i) {
  std::string out;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T v = static_cast<const T*>(data)[i];
    if constexpr (std::is_same_v<T, bool>) {
      out = v ? "true" : "false";
    } else if constexpr (std::is_same_v<T, Half>) {
      out = float_text(shortest16(
          half_to_float(v), [](float f) { return float_to_half(f).bits; }, v.bits));
    } else if constexpr (std::is_same_v<T, BFloat16>) {
      out = float_text(shortest16(
          bfloat16_to_float(v), [](float f) { return float_to_bfloat16(f).bits; }, v.bits));
    } else if constexpr (std::is_floating_point_v<T>) {
      out = float_text(fmt::format("{}", v));
    } else {
      out = fmt::format("{}", +v);  // uint8 as a number
    }
  });
  return out;
}

// numpy's array layout: rows of the last dimension, blocks of higher ones separated by
// blank lines, elements right-aligned to one width, "..." where a summary skips.
class ValuePrinter {
 public:
  ValuePrinter(const void* data, const TensorMeta& meta)
      : data_(data), dtype_(meta.dtype()), shape_(meta.shape()), strides_(shape_.size(), 1) {
    for (std::size_t d = shape_.size(); d-- > 1;) strides_[d - 1] = strides_[d] * shape_[d];
    summarise_ = meta.numel() > kPrintThreshold;
    if (!shape_.empty()) {
      measuring_ = true;
      (void)block(0, 0);
      measuring_ = false;
    }
  }
  std::string text() { return shape_.empty() ? element_text(data_, dtype_, 0) : block(0, 0); }

 private:
  // The indices shown along a dimension of size n; -1 stands for the skipped ones.
  std::vector<std::int64_t> shown(std::int64_t n) const {
    std::vector<std::int64_t> out;
    if (summarise_ && n > 2 * kEdgeItems) {
      for (std::int64_t i = 0; i < kEdgeItems; ++i) out.push_back(i);
      out.push_back(-1);
      for (std::int64_t i = n - kEdgeItems; i < n; ++i) out.push_back(i);
    } else {
      for (std::int64_t i = 0; i < n; ++i) out.push_back(i);
    }
    return out;
  }
  std::string block(std::size_t dim, std::int64_t offset) {
    const bool last = dim + 1 == shape_.size();
    const std::string separator =
        last ? ", " : ",\n" + std::string(shape_.size() - dim - 2, '\n') + std::string(dim + 1, ' ');
    std::string out = "[";
    bool first = true;
    for (std::int64_t i : shown(shape_[dim])) {
      if (!first) out += separator;
      first = false;
      if (i < 0) {
        out += "...";
      } else if (last) {
        std::string e = element_text(data_, dtype_, offset + i);
        // Matrices and up align their columns; a vector reads best unpadded.
        if (measuring_ && shape_.size() >= 2) width_ = std::max(width_, e.size());
        out += std::string(width_ > e.size() ? width_ - e.size() : 0, ' ') + e;
      } else {
        out += block(dim + 1, offset + i * strides_[dim]);
      }
    }
    return out + "]";
  }

  const void* data_;
  DType dtype_;
  const std::vector<std::int64_t>& shape_;
  std::vector<std::int64_t> strides_;
  bool summarise_ = false;
  bool measuring_ = false;
  std::size_t width_ = 0;
};

}  // namespace

std::string Tensor::to_string() const {
  if (!defined()) return "Tensor(undefined)";
  // CUDA memory, and emulated memory outside a stream task, are not the host's to read
  // here (a copy would wait for the whole device): the meta, and how to see the values.
  if (device().is_cuda() || (device().is_emulated() && !DeviceMemoryAccess::active())) {
    return fmt::format("Tensor({}; values in device memory, not read: .to(Device::cpu()) copies them)",
                       meta_.to_string());
  }
  // Rows of a matrix or more start on lines of their own.
  return fmt::format("Tensor({}:{}{})", meta_.to_string(), meta_.ndim() >= 2 ? "\n" : " ",
                     ValuePrinter(raw_data(), meta_).text());
}

bool cuda_available() noexcept {
#if MESHRT_HAVE_CUDA
  static const bool available = [] {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return count > 0;
  }();
  return available;
#else
  return false;
#endif
}

}  // namespace meshrt
