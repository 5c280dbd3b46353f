// Conversions between Python objects and meshrt's C++ values (convert.hpp). Tensors cross
// without a copy: DLPack first (numpy arrays, torch tensors, anything with __dlpack__),
// then the buffer protocol (bytearray, array.array, memoryview); only read-only memory is
// copied, since a meshrt tensor may be written in place.
#include "support/convert.hpp"

#include <dlpack/dlpack.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <pybind11/numpy.h>

#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "meshrt/error.hpp"

namespace meshrt::python {
namespace {

// DLPack 0.8's kDLBool; Debian 12's dlpack.h (0.6) predates it. Tensor::from_dlpack takes it.
constexpr std::uint8_t kDLBoolCode = 6;

std::string type_name(py::handle obj) {
  return py::str(py::type::handle_of(obj).attr("__qualname__"));
}

const char* numpy_name(DType dtype) {
  switch (dtype) {
    case DType::Bool:
      return "bool";
    case DType::UInt8:
      return "uint8";
    case DType::Int32:
      return "int32";
    case DType::Int64:
      return "int64";
    case DType::Float16:
      return "float16";
    case DType::BFloat16:
      return nullptr;  // numpy has none
    case DType::Float32:
      return "float32";
    case DType::Float64:
      return "float64";
  }
  return nullptr;
}

// Whether Python objects may still be touched: a tensor's last handle can go on a worker
// thread after the interpreter has finished, where taking the GIL would crash. Then the
// producer's memory is left to the process's exit.
bool python_alive() {
  return Py_IsInitialized() != 0 && _Py_IsFinalizing() == 0;
}

// ---------------------------------------------------------------------------- DLPack

// A Python producer's DLManagedTensor, as meshrt holds it: numpy's deleter (1.24) drops
// a reference without taking the GIL, and meshrt's last handle may go on any thread, so
// meshrt calls it with the GIL held.
struct HeldWithGil {
  DLManagedTensor managed{};
  DLManagedTensor* producer = nullptr;
};

void delete_with_gil(DLManagedTensor* managed) {
  auto* held = static_cast<HeldWithGil*>(managed->manager_ctx);
  DLManagedTensor* producer = held->producer;
  delete held;
  if (producer->deleter == nullptr || !python_alive()) return;
  py::gil_scoped_acquire gil;
  producer->deleter(producer);
}

// The tensor a "dltensor" capsule describes; the capsule is renamed "used_dltensor" once
// meshrt owns it (the DLPack protocol), and left as it was on a refusal. `as_bool`
// reads uint8 memory as bool (torch 1.13 exports no bool: its bool tensors come as a
// uint8 view).
Tensor from_capsule(py::handle capsule, std::string_view what, bool as_bool) {
  if (PyCapsule_IsValid(capsule.ptr(), "dltensor") == 0) {
    const std::string found =
        PyCapsule_CheckExact(capsule.ptr()) != 0
            ? fmt::format("a capsule named '{}'",
                          PyCapsule_GetName(capsule.ptr()) ? PyCapsule_GetName(capsule.ptr()) : "(null)")
            : type_name(capsule);
    throw UsageError(
        fmt::format("{}: expected __dlpack__() to return a capsule named 'dltensor', found {}", what, found));
  }
  auto* producer = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  auto held = std::make_unique<HeldWithGil>();
  held->managed.dl_tensor = producer->dl_tensor;
  if (as_bool) held->managed.dl_tensor.dtype = {kDLBoolCode, 8, 1};
  held->managed.manager_ctx = held.get();
  held->managed.deleter = delete_with_gil;
  held->producer = producer;
  Tensor t;
  try {
    t = Tensor::from_dlpack(&held->managed);
  } catch (const UsageError& e) {
    throw UsageError(fmt::format("{}: {}", what, e.what()));
  }
  held.release();  // the tensor's storage owns it now
  PyCapsule_SetName(capsule.ptr(), "used_dltensor");
  return t;
}

// torch 1.13 exports no bool tensor through DLPack: its uint8 view, read back as bool.
bool is_torch_bool(py::handle obj) {
  if (!py::hasattr(obj, "dtype") || !py::hasattr(obj, "view")) return false;
  return std::string(py::str(obj.attr("dtype"))) == "torch.bool";
}

std::optional<Tensor> try_dlpack(py::handle obj, std::string_view what, bool buffer_fallback) {
  const bool as_bool = is_torch_bool(obj);
  py::object capsule;
  try {
    py::object source = as_bool ? obj.attr("view")(py::module_::import("torch").attr("uint8"))
                                : py::reinterpret_borrow<py::object>(obj);
    capsule = source.attr("__dlpack__")();
  } catch (py::error_already_set& e) {
    // numpy 1.24 exports neither read-only nor bool arrays; the buffer protocol takes both.
    if (buffer_fallback) return std::nullopt;
    throw UsageError(fmt::format("{}: {}.__dlpack__() failed: {}", what, type_name(obj), e.what()));
  }
  return from_capsule(capsule, what, as_bool);
}

// ---------------------------------------------------------------------------- buffers

struct BufferDeleter {
  void operator()(Py_buffer* view) const {
    if (python_alive()) {
      py::gil_scoped_acquire gil;
      PyBuffer_Release(view);
    }
    delete view;
  }
};

// The dtype of a buffer's struct-module format ('<f', '=q', '?', ...); nullopt when meshrt
// has none.
std::optional<DType> buffer_dtype(std::string_view format, py::ssize_t itemsize) {
  if (!format.empty() && (format[0] == '@' || format[0] == '=' || format[0] == '<')) format.remove_prefix(1);
  if (format.size() != 1) return std::nullopt;
  std::optional<DType> dtype;
  switch (format[0]) {
    case '?':
      dtype = DType::Bool;
      break;
    case 'B':
      dtype = DType::UInt8;
      break;
    case 'i':
    case 'l':
    case 'q':
    case 'n':
      if (itemsize == 4) dtype = DType::Int32;
      if (itemsize == 8) dtype = DType::Int64;
      break;
    case 'e':
      dtype = DType::Float16;
      break;
    case 'f':
      dtype = DType::Float32;
      break;
    case 'd':
      dtype = DType::Float64;
      break;
    default:
      break;
  }
  if (dtype && static_cast<py::ssize_t>(element_size(*dtype)) != itemsize) return std::nullopt;
  return dtype;
}

Tensor from_buffer(py::handle obj, std::string_view what) {
  std::unique_ptr<Py_buffer, BufferDeleter> view(new Py_buffer{});
  bool writable = PyObject_GetBuffer(obj.ptr(), view.get(), PyBUF_RECORDS) == 0;
  if (!writable) {
    PyErr_Clear();
    if (PyObject_GetBuffer(obj.ptr(), view.get(), PyBUF_RECORDS_RO) != 0) {
      const py::error_already_set error;
      delete view.release();  // not filled: nothing to release
      throw UsageError(fmt::format("{}: {} refused its buffer: {}", what, type_name(obj), error.what()));
    }
  }
  const std::string format = view->format ? view->format : "B";
  const std::optional<DType> dtype = buffer_dtype(format, view->itemsize);
  if (!dtype) {
    throw UsageError(fmt::format(
        "{}: expected a buffer of bool, uint8, int32, int64, float16, float32 or float64 elements, found format '{}' "
        "of {} bytes ({})",
        what, format, view->itemsize, type_name(obj)));
  }
  std::vector<std::int64_t> shape(view->shape, view->shape + view->ndim);
  if (PyBuffer_IsContiguous(view.get(), 'C') == 0) {
    throw UsageError(fmt::format(
        "{}: expected a contiguous row-major buffer, found a {} of shape ({}) with other strides; make it contiguous "
        "first (numpy.ascontiguousarray)",
        what, type_name(obj), fmt::join(shape, ", ")));
  }
  TensorMeta meta;
  try {
    meta = TensorMeta(std::move(shape), *dtype);
  } catch (const UsageError& e) {
    throw UsageError(fmt::format("{}: {}", what, e.what()));
  }
  if (!writable || meta.numel() == 0) {
    // Read-only memory (bytes, a read-only array) is copied: kernels may write a tensor.
    Tensor t = Tensor::empty(meta);
    if (meta.nbytes() > 0) std::memcpy(t.raw_data(), view->buf, meta.nbytes());
    return t;
  }
  void* data = view->buf;
  std::shared_ptr<Py_buffer> owner(std::move(view));
  try {
    return Tensor::adopt_host(meta, std::shared_ptr<void>(owner, data));
  } catch (const UsageError& e) {
    throw UsageError(fmt::format("{}: {}", what, e.what()));
  }
}

}  // namespace

py::object wrap_tensor(Tensor t) {
  return py::cast(std::move(t));
}

bool is_tensor_like(py::handle obj) {
  if (py::isinstance<Tensor>(obj)) return true;
  if (py::isinstance<py::str>(obj) || py::isinstance<py::bytes>(obj) || py::isinstance<py::bool_>(obj) ||
      py::isinstance<py::int_>(obj) || py::isinstance<py::float_>(obj) || py::isinstance<py::list>(obj) ||
      py::isinstance<py::tuple>(obj)) {
    return false;
  }
  return py::hasattr(obj, "__dlpack__") || py::hasattr(obj, "__array_interface__") || PyObject_CheckBuffer(obj.ptr());
}

Tensor to_tensor(py::handle obj, std::string_view what) {
  if (py::isinstance<Tensor>(obj)) return obj.cast<Tensor>();
  const bool buffer = PyObject_CheckBuffer(obj.ptr()) != 0;
  if (py::hasattr(obj, "__dlpack__") && !py::isinstance<py::type>(obj)) {
    if (std::optional<Tensor> t = try_dlpack(obj, what, buffer)) return *std::move(t);
  }
  if (buffer) return from_buffer(obj, what);
  if (py::hasattr(obj, "__array_interface__")) {
    // Array-likes with neither (old array libraries): numpy views them through the interface.
    return to_tensor(py::module_::import("numpy").attr("asarray")(obj), what);
  }
  throw UsageError(fmt::format(
      "{}: expected a tensor (a meshrt.Tensor, numpy array, torch tensor, or an object with __dlpack__ or the buffer "
      "protocol), found {}",
      what, type_name(obj)));
}

py::object to_numpy(const Tensor& t) {
  if (!t.defined()) throw UsageError("to_numpy: expected a defined tensor, found an undefined one");
  if (t.device().is_cuda()) {
    throw UsageError(fmt::format(
        "to_numpy: expected a host tensor, found {} (numpy reads host memory only: torch.from_dlpack(t) views it on "
        "the GPU, a fetch brings it to the host)",
        t.meta().to_string()));
  }
  if (t.device().is_emulated() && !DeviceMemoryAccess::active()) {
    throw UsageError(fmt::format(
        "to_numpy: expected a host tensor, found {}: the host cannot read an accelerator's memory outside a task on "
        "its stream; fetch it to read it",
        t.meta().to_string()));
  }
  const char* name = numpy_name(t.dtype());
  if (name == nullptr) {
    throw UsageError(fmt::format(
        "to_numpy: expected a dtype numpy has, found {} (numpy has no bfloat16: torch.from_dlpack(t) views it)",
        t.meta().to_string()));
  }
  std::vector<py::ssize_t> shape(t.shape().begin(), t.shape().end());
  std::vector<py::ssize_t> strides(shape.size(), static_cast<py::ssize_t>(element_size(t.dtype())));
  for (std::size_t d = shape.size(); d-- > 1;) strides[d - 1] = strides[d] * shape[d];
  // A view: the array's base is a meshrt.Tensor holding the storage.
  return py::array(py::dtype(name), std::move(shape), std::move(strides), t.raw_data(), wrap_tensor(t));
}

bool is_dtype_like(py::handle obj) {
  if (py::isinstance<DType>(obj) || py::isinstance<py::dtype>(obj)) return true;
  if (py::isinstance<py::type>(obj) && py::hasattr(obj, "__module__") &&
      py::str(obj.attr("__module__")).cast<std::string>() == "numpy") {
    return true;
  }
  return type_name(obj) == "dtype";  // torch.dtype
}

DType to_dtype(py::handle obj) {
  if (py::isinstance<DType>(obj)) return obj.cast<DType>();
  if (py::isinstance<py::str>(obj)) return parse_dtype(obj.cast<std::string>());
  std::string text;
  if (py::isinstance<py::dtype>(obj)) {
    text = py::str(obj.attr("name"));
  } else if (py::isinstance<py::type>(obj) && py::hasattr(obj, "__name__")) {
    text = py::str(obj.attr("__name__"));
  } else {
    text = py::str(obj);  // torch.float32 -> "torch.float32"
    if (text.starts_with("torch.")) text = text.substr(6);
  }
  if (text == "bool_") text = "bool";
  if (text == "half") text = "float16";
  if (text == "float") text = "float32";
  if (text == "double") text = "float64";
  if (text == "long") text = "int64";
  if (text == "int") text = "int32";
  try {
    return parse_dtype(text);
  } catch (const UsageError&) {
    throw UsageError(
        fmt::format("expected a dtype (meshrt.float32, a numpy or torch dtype, or a name such as "
                    "\"float32\"), found {} {}",
                    type_name(obj), std::string(py::repr(obj))));
  }
}

}  // namespace meshrt::python
