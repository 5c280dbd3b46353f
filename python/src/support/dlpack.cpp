// DLPack in Python (dlpack.hpp): capsules out of meshrt.Tensor, in from any producer.
#include "support/dlpack.hpp"

#include <dlpack/dlpack.h>
#include <fmt/format.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "meshrt/error.hpp"
#include "meshrt/internal/device.hpp"
#include "meshrt/internal/tensor.hpp"
#include "support/call_args.hpp"
#include "support/dlpack_versioned.hpp"

namespace meshrt::python {
namespace {

thread_local const device::Stream* t_kernel_stream = nullptr;

// ---------------------------------------------------------------------------- export

// A versioned export: DLPack 1.0's struct around meshrt's unversioned one, which holds
// the tensor handle and the shape and strides arrays both point into.
struct VersionedExport {
  dlpack::ManagedTensorVersioned versioned{};
  DLManagedTensor* inner = nullptr;
};

void delete_versioned_export(dlpack::ManagedTensorVersioned* self) {
  auto* e = static_cast<VersionedExport*>(self->manager_ctx);
  e->inner->deleter(e->inner);
  delete e;
}

// A capsule's destructor finishes what no consumer took: still under its first name, the
// tensor is released with it; renamed "used_...", it is the consumer's.
void delete_unused_capsule(PyObject* capsule) {
  if (PyCapsule_IsValid(capsule, dlpack::kCapsule) != 0) {
    auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, dlpack::kCapsule));
    if (managed->deleter != nullptr) managed->deleter(managed);
  }
}

void delete_unused_versioned_capsule(PyObject* capsule) {
  if (PyCapsule_IsValid(capsule, dlpack::kVersionedCapsule) != 0) {
    auto* managed =
        static_cast<dlpack::ManagedTensorVersioned*>(PyCapsule_GetPointer(capsule, dlpack::kVersionedCapsule));
    if (managed->deleter != nullptr) managed->deleter(managed);
  }
}

std::string describe(py::handle obj) {
  return std::string(py::repr(obj));
}

// A tuple or list of two ints (not bools), or nullopt: anything else, a bare int
// included, is the caller's TypeError rather than Python's own about iterating it.
std::optional<std::pair<std::int64_t, std::int64_t>> int_pair(py::handle value) {
  if (!py::isinstance<py::tuple>(value) && !py::isinstance<py::list>(value)) return std::nullopt;
  auto items = py::reinterpret_borrow<py::sequence>(value);
  if (items.size() != 2) return std::nullopt;
  std::int64_t both[2] = {0, 0};
  for (std::size_t i = 0; i < 2; ++i) {
    py::object item = items[i];
    if (!py::isinstance<py::int_>(item) || py::isinstance<py::bool_>(item)) return std::nullopt;
    try {
      both[i] = item.cast<std::int64_t>();
    } catch (const py::cast_error&) {
      return std::nullopt;  // beyond int64
    }
  }
  return std::pair{both[0], both[1]};
}

// DLPack's (device type, id) as a meshrt device; BufferError for a device meshrt has not.
Device requested_device(py::handle dl_device, const Tensor& t) {
  const std::optional<std::pair<std::int64_t, std::int64_t>> pair = int_pair(dl_device);
  if (!pair) {
    throw py::type_error(
        fmt::format("Tensor.__dlpack__: expected dl_device as a (device type, device id) pair of "
                    "ints, found {}",
                    describe(dl_device)));
  }
  const auto [type, id] = *pair;
  if (id < 0) {
    throw py::buffer_error(fmt::format("Tensor.__dlpack__ of {}: expected a device id >= 0 in dl_device, found {}",
                                       t.meta().to_string(), describe(dl_device)));
  }
  switch (type) {
    case kDLCPU:
      return Device::cpu();
    case kDLCUDA:
      return Device::cuda(static_cast<int>(id));
    case kDLExtDev:
      return Device::emulated(static_cast<int>(id));
    default:
      break;
  }
  throw py::buffer_error(fmt::format(
      "Tensor.__dlpack__ of {}: expected dl_device on kDLCPU (1), kDLCUDA (2) or kDLExtDev (12, meshrt's emulated "
      "accelerator), found device type {}; export to one of those and copy it there",
      t.meta().to_string(), type));
}

// None, True or False.
std::optional<bool> optional_bool(py::handle value, const char* what) {
  if (value.is_none()) return std::nullopt;
  if (!py::isinstance<py::bool_>(value)) {
    throw py::type_error(fmt::format("{}: expected copy=None, True or False, found {}", what, describe(value)));
  }
  return value.cast<bool>();
}

// Whether max_version asks for a versioned capsule: None (no, a consumer from before
// DLPack 1.0), or a (major, minor) pair.
bool wants_versioned(py::handle max_version) {
  if (max_version.is_none()) return false;
  const std::optional<std::pair<std::int64_t, std::int64_t>> pair = int_pair(max_version);
  if (!pair) {
    throw py::type_error(
        fmt::format("Tensor.__dlpack__: expected max_version as a (major, minor) pair of ints or "
                    "None, found {}",
                    describe(max_version)));
  }
  return pair->first >= 1;
}

// The consumer's stream for a CUDA export (DLPack: None the legacy default stream, 1 the
// legacy default stream, 2 the per-thread one, any other the cudaStream_t itself; -1 no
// hand-off), made to wait for the running kernel's stream. Non-CUDA memory takes None
// (or -1) only.
void hand_off(const Tensor& t, py::handle stream) {
  std::optional<std::int64_t> value;
  if (!stream.is_none()) {
    if (!py::isinstance<py::int_>(stream) || py::isinstance<py::bool_>(stream)) {
      throw py::type_error(
          fmt::format("Tensor.__dlpack__: expected stream as an int or None, found {}", describe(stream)));
    }
    value = stream.cast<std::int64_t>();
  }
  if (!t.device().is_cuda()) {
    if (value && *value != -1) {
      throw py::value_error(
          fmt::format("Tensor.__dlpack__ of {}: expected stream=None (DLPack's streams are CUDA's), found stream={}",
                      t.meta().to_string(), *value));
    }
    return;
  }
  if (value && *value == 0) {
    throw py::value_error(fmt::format(
        "Tensor.__dlpack__ of {}: expected stream=None, 1 (the legacy default stream), 2 (the per-thread default "
        "stream), -1 (no hand-off) or a cudaStream_t, found 0, which DLPack disallows as ambiguous",
        t.meta().to_string()));
  }
  if (value && *value == -1) return;
  const device::Stream* kernel = KernelStreamScope::current();
  if (kernel == nullptr || kernel->device() != t.device().index()) return;
  void* native = value ? reinterpret_cast<void*>(static_cast<std::intptr_t>(*value)) : nullptr;
  py::gil_scoped_release release;
  device::make_native_wait(native, *kernel);
}

DLDataType versioned_dtype(DType dtype, DLDataType unversioned) {
  if (dtype == DType::Bool) return {dlpack::kDLBoolCode, 8, 1};
  return unversioned;
}

// ---------------------------------------------------------------------------- import

// A producer's tensor as meshrt holds it: numpy's deleter (1.24) drops a reference
// without taking the GIL, and meshrt's last handle may go on any thread, so meshrt calls
// the producer's deleter (unversioned or versioned) with the GIL held.
struct HeldWithGil {
  DLManagedTensor managed{};
  DLManagedTensor* producer = nullptr;
  dlpack::ManagedTensorVersioned* versioned = nullptr;
};

void release_producer(DLManagedTensor* producer, dlpack::ManagedTensorVersioned* versioned) {
  if (!python_alive()) return;  // the producer's memory is left to the process's exit
  py::gil_scoped_acquire gil;
  if (producer != nullptr && producer->deleter != nullptr) producer->deleter(producer);
  if (versioned != nullptr && versioned->deleter != nullptr) versioned->deleter(versioned);
}

void delete_with_gil(DLManagedTensor* managed) {
  auto* held = static_cast<HeldWithGil*>(managed->manager_ctx);
  DLManagedTensor* producer = held->producer;
  dlpack::ManagedTensorVersioned* versioned = held->versioned;
  delete held;
  release_producer(producer, versioned);
}

// torch 1.13 exports no bool tensor through DLPack: its uint8 view, read back as bool.
bool is_torch_bool(py::handle obj) {
  if (!py::hasattr(obj, "dtype") || !py::hasattr(obj, "view")) return false;
  return std::string(py::str(obj.attr("dtype"))) == "torch.bool";
}

// The kDLCUDA device index of a producer (its __dlpack_device__), or -1.
int cuda_index(py::handle obj) {
  if (!py::hasattr(obj, "__dlpack_device__")) return -1;
  try {
    auto pair = obj.attr("__dlpack_device__")().cast<py::tuple>();
    if (pair.size() == 2 && pair[0].cast<int>() == kDLCUDA) return pair[1].cast<int>();
  } catch (const py::error_already_set&) {
  } catch (const py::cast_error&) {
  }
  return -1;
}

// The types whose __dlpack__ took no max_version (numpy 1.24's ndarray, torch 1.13's
// Tensor): asked without it from then on, since raising and catching the TypeError costs
// more than the import itself. Held (never freed: it may outlive the interpreter) and
// read under the GIL.
std::vector<py::object>& pre_1_0_types() {
  static auto* types = new std::vector<py::object>();
  return *types;
}

bool known_pre_1_0(py::handle type) {
  for (const py::object& t : pre_1_0_types()) {
    if (t.is(type)) return true;
  }
  return false;
}

// obj.__dlpack__, asking for DLPack 1.0 (max_version) and, inside a kernel on a CUDA
// stream, handing the producer that stream; a producer from before DLPack 1.0 raises
// TypeError on the keyword, and is asked again without it.
py::object capsule_of(py::handle source) {
  py::dict kwargs;
  const device::Stream* kernel = KernelStreamScope::current();
  if (kernel != nullptr) {
    const int index = cuda_index(source);
    if (index >= 0 && index == kernel->device()) {
      kwargs["stream"] = py::int_(reinterpret_cast<std::intptr_t>(kernel->native()));
    }
  }
  py::object method = source.attr("__dlpack__");
  const py::handle type = py::type::handle_of(source);
  if (!known_pre_1_0(type)) {
    kwargs["max_version"] = py::make_tuple(dlpack::kVersion.major, dlpack::kVersion.minor);
    try {
      return method(**kwargs);
    } catch (py::error_already_set& e) {
      if (!e.matches(PyExc_TypeError)) throw;
    }
    PyDict_DelItemString(kwargs.ptr(), "max_version");
  }
  py::object capsule = method(**kwargs);
  if (!known_pre_1_0(type)) pre_1_0_types().push_back(py::reinterpret_borrow<py::object>(type));
  return capsule;
}

std::string capsule_found(py::handle capsule) {
  if (PyCapsule_CheckExact(capsule.ptr()) == 0) return type_name(capsule);
  const char* name = PyCapsule_GetName(capsule.ptr());
  return fmt::format("a capsule named '{}'", name != nullptr ? name : "(null)");
}

// Where a producer's memory is, as meshrt names devices; nullopt for a device it has not.
std::optional<Device> device_of(const DLDevice& d) {
  switch (d.device_type) {
    case kDLCPU:
    case kDLCUDAHost:
      return Device::cpu();
    case kDLCUDA:
      return Device::cuda(d.device_id);
    case kDLExtDev:
      return Device::emulated(d.device_id);
    default:
      return std::nullopt;
  }
}

// Why meshrt cannot view `held`'s memory as it is, or nullopt.
std::optional<std::string> copy_reason(const HeldWithGil& held, bool read_only, const ImportOptions& how) {
  // A copy to another device is a copy already.
  const bool moves = how.device && device_of(held.managed.dl_tensor.device) != how.device;
  if (how.copy == true && !moves) return "copy=True";
  if (read_only) return "read-only memory (DLPack's read-only flag)";
  if (!is_compact_dlpack(held.managed)) return "strided memory (not contiguous and row-major)";
  return std::nullopt;
}

}  // namespace

// ---------------------------------------------------------------------------- KernelStreamScope

KernelStreamScope::KernelStreamScope(device::Stream stream) : stream_(std::move(stream)), previous_(t_kernel_stream) {
  t_kernel_stream = &stream_;
}

KernelStreamScope::~KernelStreamScope() {
  t_kernel_stream = previous_;
}

const device::Stream* KernelStreamScope::current() noexcept {
  return t_kernel_stream;
}

// ---------------------------------------------------------------------------- export

py::object export_dlpack(const Tensor& tensor, py::handle stream, py::handle max_version, py::handle dl_device,
                         py::handle copy) {
  if (!tensor.defined()) throw UsageError("Tensor.__dlpack__: expected a defined tensor, found an undefined one");
  const bool versioned = wants_versioned(max_version);
  const std::optional<bool> copy_flag = optional_bool(copy, "Tensor.__dlpack__");
  Tensor t = tensor;
  bool copied = false;
  if (!dl_device.is_none()) {
    const Device target = requested_device(dl_device, tensor);
    if (target != tensor.device()) {
      if (copy_flag == false) {
        throw py::buffer_error(fmt::format(
            "Tensor.__dlpack__ of {}: dl_device {} needs a copy to {}, and copy=False forbids one; pass copy=None "
            "(or True), or ask for {}",
            tensor.meta().to_string(), describe(dl_device), target.to_string(), tensor.device().to_string()));
      }
      py::gil_scoped_release release;
      t = tensor.to(target);
      copied = true;
    }
  }
  if (copy_flag == true && !copied) {
    py::gil_scoped_release release;
    t = tensor.clone();
    copied = true;
  }
  hand_off(t, stream);
  if (!versioned) return unversioned_capsule(t);
  DLManagedTensor* managed = t.to_dlpack();
  auto e = std::make_unique<VersionedExport>();
  e->inner = managed;
  e->versioned.version = dlpack::kVersion;
  e->versioned.manager_ctx = e.get();
  e->versioned.deleter = delete_versioned_export;
  e->versioned.flags = copied ? dlpack::kFlagIsCopied : 0;
  e->versioned.dl_tensor = managed->dl_tensor;
  e->versioned.dl_tensor.dtype = versioned_dtype(t.dtype(), managed->dl_tensor.dtype);
  PyObject* capsule = PyCapsule_New(&e->versioned, dlpack::kVersionedCapsule, delete_unused_versioned_capsule);
  if (capsule == nullptr) {
    managed->deleter(managed);
    throw py::error_already_set();
  }
  (void)e.release();  // the capsule's now
  return py::reinterpret_steal<py::object>(capsule);
}

py::object unversioned_capsule(const Tensor& t) {
  DLManagedTensor* managed = t.to_dlpack();
  PyObject* capsule = PyCapsule_New(managed, dlpack::kCapsule, delete_unused_capsule);
  if (capsule == nullptr) {
    managed->deleter(managed);
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(capsule);
}

py::tuple dlpack_device(const Tensor& t) {
  switch (t.device().kind()) {
    case Device::Kind::Cpu:
      return py::make_tuple(static_cast<int>(kDLCPU), 0);
    case Device::Kind::Cuda:
      return py::make_tuple(static_cast<int>(kDLCUDA), t.device().index());
    case Device::Kind::Emulated:
      break;
  }
  return py::make_tuple(static_cast<int>(kDLExtDev), t.device().index());
}

// ---------------------------------------------------------------------------- import

std::optional<Tensor> import_dlpack(py::handle obj, std::string_view what, const ImportOptions& how,
                                    bool buffer_fallback) {
  const bool as_bool = is_torch_bool(obj);
  py::object capsule;
  try {
    py::object source = as_bool ? obj.attr("view")(py::module_::import("torch").attr("uint8"))
                                : py::reinterpret_borrow<py::object>(obj);
    capsule = capsule_of(source);
  } catch (py::error_already_set& e) {
    if (buffer_fallback) return std::nullopt;
    throw UsageError(fmt::format("{}: {}.__dlpack__() failed: {}", what, type_name(obj), e.what()));
  }

  auto held = std::make_unique<HeldWithGil>();
  bool read_only = false;
  const char* used = nullptr;
  if (PyCapsule_IsValid(capsule.ptr(), dlpack::kCapsule) != 0) {
    held->producer = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), dlpack::kCapsule));
    held->managed.dl_tensor = held->producer->dl_tensor;
    used = dlpack::kUsedCapsule;
  } else if (PyCapsule_IsValid(capsule.ptr(), dlpack::kVersionedCapsule) != 0) {
    auto* v =
        static_cast<dlpack::ManagedTensorVersioned*>(PyCapsule_GetPointer(capsule.ptr(), dlpack::kVersionedCapsule));
    if (v->version.major != dlpack::kVersion.major) {
      // Left unconsumed: its destructor releases it.
      throw UsageError(fmt::format(
          "{}: expected a DLPack {}.x tensor (meshrt asked for max_version ({}, {})), found DLPack {}.{} from {}", what,
          dlpack::kVersion.major, dlpack::kVersion.major, dlpack::kVersion.minor, v->version.major, v->version.minor,
          type_name(obj)));
    }
    held->versioned = v;
    held->managed.dl_tensor = v->dl_tensor;
    read_only = (v->flags & dlpack::kFlagReadOnly) != 0;
    used = dlpack::kUsedVersionedCapsule;
  } else {
    throw UsageError(
        fmt::format("{}: expected __dlpack__() to return a capsule named 'dltensor' or 'dltensor_versioned', found {}",
                    what, capsule_found(capsule)));
  }
  if (as_bool) held->managed.dl_tensor.dtype = {dlpack::kDLBoolCode, 8, 1};
  held->managed.manager_ctx = held.get();
  held->managed.deleter = delete_with_gil;

  Tensor t;
  if (const std::optional<std::string> reason = copy_reason(*held, read_only, how)) {
    if (how.copy == false) {
      throw py::buffer_error(fmt::format(
          "{}: expected memory meshrt can view (contiguous, row-major, writable: kernels may write a tensor) with "
          "copy=False, found {} from {}; pass copy=None to let meshrt copy it",
          what, *reason, type_name(obj)));
    }
    try {
      t = copy_from_dlpack(held->managed);
    } catch (const UsageError& e) {
      throw UsageError(fmt::format("{}: {}", what, e.what()));
    }
    // Copied: the producer's tensor is released now, the capsule renamed as taken.
    PyCapsule_SetName(capsule.ptr(), used);
    DLManagedTensor* producer = held->producer;
    dlpack::ManagedTensorVersioned* versioned = held->versioned;
    held.reset();
    release_producer(producer, versioned);
  } else {
    try {
      t = Tensor::from_dlpack(&held->managed);
    } catch (const UsageError& e) {
      throw UsageError(fmt::format("{}: {}", what, e.what()));
    }
    (void)held.release();  // the tensor's storage owns it now
    PyCapsule_SetName(capsule.ptr(), used);
  }
  return on_requested_device(std::move(t), how, what, obj);
}

}  // namespace meshrt::python
