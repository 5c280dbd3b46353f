// DType, Device, TensorMeta and Tensor in Python. Plain values are properties
// (meta.shape, meta.dtype); shapes are tuples; dtypes are meshrt.float32, ... and numpy
// or torch dtypes wherever one is taken. Tensor speaks DLPack both ways (__dlpack__,
// __dlpack_device__, from_dlpack) and views as numpy (numpy(), __array__) without a copy.
#include <dlpack/dlpack.h>
#include <fmt/format.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "bindings.hpp"
#include "meshrt/tensor.hpp"
#include "support/convert.hpp"

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

// The capsule finishes what the consumer did not take: renamed "used_dltensor", it is the
// consumer's; still "dltensor", the DLManagedTensor is deleted with it.
void delete_unused_capsule(PyObject* capsule) {
  if (PyCapsule_IsValid(capsule, "dltensor") == 0) return;
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
  if (managed->deleter != nullptr) managed->deleter(managed);
}

py::object dlpack_capsule(const Tensor& t, std::optional<std::int64_t> /*stream*/) {
  DLManagedTensor* managed = t.to_dlpack();
  PyObject* capsule = PyCapsule_New(managed, "dltensor", delete_unused_capsule);
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

// The element as the Python scalar of its kind (an int64 stays exact, unlike Tensor::item's
// double).
py::object item(const Tensor& t) {
  if (t.numel() != 1)
    throw UsageError(fmt::format("Tensor.item: expected one element, found {}", t.meta().to_string()));
  Tensor host;
  {
    py::gil_scoped_release release;
    host = t.to(Device::cpu());
  }
  return dispatch_dtype(t.dtype(), [&](auto tag) -> py::object {
    using T = decltype(tag);
    const T v = *host.data<T>();
    if constexpr (std::is_same_v<T, bool>) {
      return py::bool_(v);
    } else if constexpr (std::is_same_v<T, Half>) {
      return py::float_(half_to_float(v));
    } else if constexpr (std::is_same_v<T, BFloat16>) {
      return py::float_(bfloat16_to_float(v));
    } else if constexpr (std::is_floating_point_v<T>) {
      return py::float_(v);
    } else {
      return py::int_(v);
    }
  });
}

}  // namespace

void bind_tensor(py::module_& m) {
  py::enum_<DType> dtypes(m, "DType", "A tensor's element type; also meshrt.float32, meshrt.int64, ...");
  for (int i = 0; i < kNumDTypes; ++i) {
    const auto d = static_cast<DType>(i);
    const std::string n(name(d));
    dtypes.value(n == "bool" ? "bool_" : n.c_str(), d);
    m.attr(n == "bool" ? "bool_" : n.c_str()) = d;
  }
  dtypes.def_property_readonly("itemsize", [](DType d) { return element_size(d); })
      .def_property_readonly("is_floating_point", [](DType d) { return is_floating(d); })
      // Before py::enum_'s own __str__ ("DType.float32"): overloads are tried in order.
      .def(
          "__str__", [](DType d) { return std::string(name(d)); }, py::prepend());

  py::class_<Device>(m, "Device", "Where a tensor lives: cpu, cuda:N or emulated:N.")
      .def(py::init([](const std::string& text) { return Device::parse(text); }), py::arg("name"))
      .def_property_readonly("type", [](const Device& d) { return std::string(name(d.kind())); })
      .def_property_readonly("index", &Device::index)
      .def("__str__", &Device::to_string)
      .def("__repr__", [](const Device& d) { return "meshrt.Device('" + d.to_string() + "')"; })
      .def("__eq__", [](const Device& a, const Device& b) { return a == b; })
      .def("__hash__", [](const Device& d) { return std::hash<std::string>{}(d.to_string()); });

  // Both classes first, so that each one's methods name the other in their signatures.
  py::class_<TensorMeta> metas(m, "TensorMeta", "Shape, dtype and device: what the controller knows of a tensor.");
  py::class_<Tensor> tensors(m, "Tensor",
                             "A local tensor: contiguous, row-major, on one device. It shares memory with numpy and "
                             "torch through DLPack: np.from_dlpack(t) and torch.from_dlpack(t) view it, "
                             "meshrt.from_dlpack(obj) views theirs.");
  metas
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
      .def(
          "with_shape", [](const TensorMeta& t, py::handle shape) { return t.with_shape(to_shape(shape)); },
          py::arg("shape"), "The same meta with another shape.")
      .def(
          "with_device", [](const TensorMeta& t, py::handle device) { return t.with_device(to_device(device)); },
          py::arg("device"), "The same meta on another device.")
      .def(
          "with_dtype",
          [](const TensorMeta& t, py::handle dtype) { return TensorMeta(t.shape(), to_dtype(dtype), t.device()); },
          py::arg("dtype"), "The same meta with another dtype.")
      .def("empty", &TensorMeta::empty, "A new tensor of this meta, uninitialised.")
      .def("zeros", &TensorMeta::zeros, "A new tensor of this meta, zeroed.")
      .def("__eq__", [](const TensorMeta& a, const TensorMeta& b) { return a == b; })
      .def("__str__", &TensorMeta::to_string)
      .def("__repr__", [](const TensorMeta& t) { return "meshrt.TensorMeta(" + t.to_string() + ")"; });

  tensors
      .def(py::init([](py::handle obj) { return to_tensor(obj, "meshrt.Tensor(obj)"); }), py::arg("obj"),
           "A view of a numpy array, torch tensor or writable buffer (read-only memory is copied).")
      .def_static(
          "from_dlpack", [](py::handle obj) { return to_tensor(obj, "meshrt.Tensor.from_dlpack"); }, py::arg("obj"),
          "A view of anything with __dlpack__ (or the buffer protocol): no copy.")
      .def("__dlpack__", &dlpack_capsule, py::arg("stream") = py::none(),
           "A DLPack capsule viewing this tensor (the DLPack protocol; stream is accepted and not used: the caller "
           "orders device work).")
      .def("__dlpack_device__", &dlpack_device)
      .def(
          "numpy", [](const Tensor& t) { return to_numpy(t); }, "A numpy array viewing this host tensor's memory.")
      .def(
          "__array__",
          [](const Tensor& t, py::handle dtype) {
            py::object array = to_numpy(t);
            return dtype.is_none() ? array : array.attr("astype")(dtype, py::arg("copy") = false);
          },
          py::arg("dtype") = py::none())
      .def_property_readonly("shape", [](const Tensor& t) { return to_tuple(t.shape()); })
      .def_property_readonly("dtype", &Tensor::dtype)
      .def_property_readonly("device", &Tensor::device)
      .def_property_readonly("meta", &Tensor::meta)
      .def_property_readonly("ndim", [](const Tensor& t) { return t.meta().ndim(); })
      .def_property_readonly("numel", &Tensor::numel)
      .def_property_readonly("nbytes", &Tensor::nbytes)
      .def_property_readonly(
          "data_ptr", [](const Tensor& t) { return reinterpret_cast<std::uintptr_t>(t.raw_data()); },
          "The address of the first element (host or device memory, per device).")
      .def("__len__",
           [](const Tensor& t) {
             if (t.meta().ndim() == 0) throw py::type_error("len() of a 0-d tensor: expected a dimension, found none");
             return t.shape()[0];
           })
      .def("item", &item, "The one element of a tensor of one element, as a Python bool, int or float.")
      .def("clone", &Tensor::clone, py::call_guard<py::gil_scoped_release>(), "A copy on the same device.")
      .def(
          "to", [](const Tensor& t, py::handle device) { return t.to(to_device(device)); }, py::arg("device"),
          "This tensor on `device` (itself when already there; otherwise a copy).")
      .def(
          "reshape", [](const Tensor& t, py::handle shape) { return t.reshape(to_shape(shape)); }, py::arg("shape"),
          "A view of the same memory with another shape of the same number of elements.")
      .def("equals", &Tensor::equals, py::arg("other"), py::call_guard<py::gil_scoped_release>(),
           "Same shape, dtype, device and bytes.")
      .def("same_storage", &Tensor::same_storage, py::arg("other"), "Whether both share one storage.")
      .def("__str__", &Tensor::to_string)
      .def("__repr__", &Tensor::to_string);

  m.def(
      "from_dlpack", [](py::handle obj) { return to_tensor(obj, "meshrt.from_dlpack"); }, py::arg("obj"),
      "A meshrt.Tensor viewing a numpy array, torch tensor or anything with __dlpack__ (or the buffer protocol): no "
      "copy.");
}

}  // namespace meshrt::python
