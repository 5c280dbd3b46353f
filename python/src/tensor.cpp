// DType, Device, TensorMeta and Tensor in Python. Plain values are properties
// (meta.shape, meta.dtype); shapes are tuples; dtypes are meshrt.float32, ... and numpy
// or torch dtypes wherever one is taken.
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "bindings.hpp"
#include "convert.hpp"
#include "meshrt/tensor.hpp"

namespace meshrt::python {
namespace {

py::tuple to_tuple(const std::vector<std::int64_t>& shape) {
  py::tuple t(shape.size());
  for (std::size_t i = 0; i < shape.size(); ++i) t[i] = shape[i];
  return t;
}

std::vector<std::int64_t> to_shape(py::handle obj) {
  if (py::isinstance<py::int_>(obj)) return {obj.cast<std::int64_t>()};
  return obj.cast<std::vector<std::int64_t>>();
}

Device to_device(py::handle obj) {
  if (py::isinstance<Device>(obj)) return obj.cast<Device>();
  return Device::parse(obj.cast<std::string>());
}

}  // namespace

void bind_tensor(py::module_& m) {
  py::enum_<DType> dtype_enum(m, "DType", "A tensor's element type; also meshrt.float32, meshrt.int64, ...");
  for (int i = 0; i < kNumDTypes; ++i) {
    const auto d = static_cast<DType>(i);
    const std::string n(name(d));
    dtype_enum.value(n == "bool" ? "bool_" : n.c_str(), d);
    m.attr(n == "bool" ? "bool_" : n.c_str()) = d;
  }
  dtype_enum.def_property_readonly("itemsize", [](DType d) { return element_size(d); })
      .def_property_readonly("is_floating_point", [](DType d) { return is_floating(d); })
      .def("__str__", [](DType d) { return std::string(name(d)); });

  py::class_<Device>(m, "Device", "Where a tensor lives: cpu, cuda:N or emulated:N.")
      .def(py::init([](const std::string& text) { return Device::parse(text); }), py::arg("name"))
      .def_property_readonly("type", [](const Device& d) { return std::string(name(d.kind())); })
      .def_property_readonly("index", &Device::index)
      .def("__str__", &Device::to_string)
      .def("__repr__", [](const Device& d) { return "meshrt.Device('" + d.to_string() + "')"; })
      .def("__eq__", [](const Device& a, const Device& b) { return a == b; })
      .def("__hash__", [](const Device& d) { return std::hash<std::string>{}(d.to_string()); });

  py::class_<TensorMeta>(m, "TensorMeta", "Shape, dtype and device: what the controller knows of a tensor.")
      .def(py::init([](py::handle shape, py::handle dtype, py::handle device) {
             return TensorMeta(to_shape(shape), to_dtype(dtype), device.is_none() ? Device::cpu() : to_device(device));
           }),
           py::arg("shape"), py::arg("dtype"), py::arg("device") = py::none())
      .def_property_readonly("shape", [](const TensorMeta& t) { return to_tuple(t.shape()); })
      .def_property_readonly("dtype", &TensorMeta::dtype)
      .def_property_readonly("device", &TensorMeta::device)
      .def_property_readonly("ndim", &TensorMeta::ndim)
      .def_property_readonly("numel", &TensorMeta::numel)
      .def_property_readonly("nbytes", &TensorMeta::nbytes)
      .def("with_shape", [](const TensorMeta& t, py::handle shape) { return t.with_shape(to_shape(shape)); })
      .def("with_device", [](const TensorMeta& t, py::handle device) { return t.with_device(to_device(device)); })
      .def("with_dtype",
           [](const TensorMeta& t, py::handle dtype) { return TensorMeta(t.shape(), to_dtype(dtype), t.device()); })
      .def("__eq__", [](const TensorMeta& a, const TensorMeta& b) { return a == b; })
      .def("__str__", &TensorMeta::to_string)
      .def("__repr__", [](const TensorMeta& t) { return "meshrt.TensorMeta(" + t.to_string() + ")"; });

  py::class_<Tensor>(m, "Tensor", "A local tensor: contiguous, row-major, on one device.")
      .def_property_readonly("shape", [](const Tensor& t) { return to_tuple(t.shape()); })
      .def_property_readonly("dtype", &Tensor::dtype)
      .def_property_readonly("device", &Tensor::device)
      .def_property_readonly("meta", &Tensor::meta)
      .def_property_readonly("nbytes", &Tensor::nbytes)
      .def("numpy", [](const Tensor& t) { return to_numpy(t); })
      .def("__str__", &Tensor::to_string)
      .def("__repr__", &Tensor::to_string);
}

}  // namespace meshrt::python
