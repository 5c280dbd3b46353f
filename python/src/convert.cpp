// Conversions between Python objects and meshrt's C++ values (convert.hpp).
#include "convert.hpp"

#include <fmt/format.h>
#include <pybind11/numpy.h>

#include <cstring>
#include <string>
#include <vector>

#include "meshrt/error.hpp"

namespace meshrt::python {
namespace {

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
  if (!is_tensor_like(obj)) {
    throw UsageError(fmt::format("{}: expected a tensor (a meshrt.Tensor, numpy array or torch tensor), found {}", what,
                                 type_name(obj)));
  }
  // A copy through numpy; the DLPack path replaces it.
  py::array array = py::array::ensure(obj, py::array::c_style);
  if (!array) throw UsageError(fmt::format("{}: expected an array-like tensor, found {}", what, type_name(obj)));
  const DType dtype = to_dtype(array.dtype());
  std::vector<std::int64_t> shape(array.shape(), array.shape() + array.ndim());
  Tensor t = Tensor::empty(TensorMeta(shape, dtype));
  std::memcpy(t.raw_data(), array.data(), t.nbytes());
  return t;
}

py::object to_numpy(const Tensor& t) {
  if (t.device().is_accelerator()) {
    throw UsageError(fmt::format("to_numpy: expected a host tensor, found {} (fetch it to the controller first)",
                                 t.meta().to_string()));
  }
  const char* name = numpy_name(t.dtype());
  if (name == nullptr) throw UsageError(fmt::format("to_numpy: numpy has no {}", meshrt::name(t.dtype())));
  py::array array(py::dtype(name), std::vector<py::ssize_t>(t.shape().begin(), t.shape().end()));
  std::memcpy(array.mutable_data(), t.raw_data(), t.nbytes());
  return array;
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
