// Conversions between Python objects and meshrt's C++ values (convert.hpp). Tensors cross
// without a copy where meshrt can view the memory: DLPack first (numpy arrays, torch
// tensors, anything with __dlpack__: support/dlpack.cpp), then the buffer protocol
// (bytearray, array.array, memoryview); read-only and strided memory is copied, since a
// meshrt tensor is contiguous and may be written in place.
#include "support/convert.hpp"

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
#include "support/call_args.hpp"
#include "support/dlpack.hpp"

namespace meshrt::python {
namespace {

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

Tensor from_buffer(py::handle obj, std::string_view what, const ImportOptions& how) {
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
  const bool contiguous = PyBuffer_IsContiguous(view.get(), 'C') != 0;
  TensorMeta meta;
  try {
    meta = TensorMeta(std::move(shape), *dtype);
  } catch (const UsageError& e) {
    throw UsageError(fmt::format("{}: {}", what, e.what()));
  }
  std::optional<std::string> copy_reason;
  if (how.copy == true) {
    copy_reason = "copy=True";
  } else if (!writable) {
    copy_reason = "read-only memory";
  } else if (!contiguous) {
    copy_reason = "strided memory (not contiguous and row-major)";
  }
  Tensor t;
  if (copy_reason || meta.numel() == 0) {
    if (copy_reason && how.copy == false) {
      throw py::buffer_error(fmt::format(
          "{}: expected memory meshrt can view (contiguous, row-major, writable: kernels may write a tensor) with "
          "copy=False, found {} in a {} of {}; pass copy=None to let meshrt copy it",
          what, *copy_reason, type_name(obj), meta.to_string()));
    }
    t = Tensor::empty(meta);
    if (meta.nbytes() > 0 && PyBuffer_ToContiguous(t.raw_data(), view.get(), view->len, 'C') != 0) {
      throw py::error_already_set();
    }
  } else {
    void* data = view->buf;
    std::shared_ptr<Py_buffer> owner(std::move(view));
    try {
      t = Tensor::adopt_host(meta, std::shared_ptr<void>(owner, data));
    } catch (const UsageError& e) {
      throw UsageError(fmt::format("{}: {}", what, e.what()));
    }
  }
  return on_requested_device(std::move(t), how, what, obj);
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

bool python_alive() {
  return Py_IsInitialized() != 0 && _Py_IsFinalizing() == 0;
}

Tensor to_tensor(py::handle obj, std::string_view what, const ImportOptions& how) {
  if (py::isinstance<Tensor>(obj)) {
    Tensor t = obj.cast<Tensor>();
    const bool elsewhere = how.device && t.device() != *how.device;
    if (elsewhere && how.copy == false) {
      throw py::buffer_error(fmt::format("{}: expected a tensor on {} without a copy (copy=False), found {}", what,
                                         how.device->to_string(), t.meta().to_string()));
    }
    py::gil_scoped_release release;
    if (elsewhere) return t.to(*how.device);
    return how.copy == true ? t.clone() : t;
  }
  const bool buffer = PyObject_CheckBuffer(obj.ptr()) != 0;
  if (py::hasattr(obj, "__dlpack__") && !py::isinstance<py::type>(obj)) {
    if (std::optional<Tensor> t = import_dlpack(obj, what, how, buffer)) return *std::move(t);
  }
  if (buffer) return from_buffer(obj, what, how);
  if (py::hasattr(obj, "__array_interface__")) {
    // Array-likes with neither (old array libraries): numpy views them through the interface.
    return to_tensor(py::module_::import("numpy").attr("asarray")(obj), what, how);
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

Tensor on_requested_device(Tensor t, const ImportOptions& how, std::string_view what, py::handle source) {
  if (how.device && t.device() != *how.device) {
    if (how.copy == false) {
      throw py::buffer_error(fmt::format("{}: expected a tensor on {} without a copy (copy=False), found {} from {}",
                                         what, how.device->to_string(), t.meta().to_string(), type_name(source)));
    }
    py::gil_scoped_release release;
    t = t.to(*how.device);
  }
  return t;
}

}  // namespace meshrt::python
