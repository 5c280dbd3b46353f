// DType, Device, TensorMeta and Tensor in Python. Plain values are properties
// (meta.shape, meta.dtype); shapes are tuples; dtypes are meshrt.float32, ... and numpy
// or torch dtypes wherever one is taken. Tensor speaks DLPack both ways (__dlpack__,
// __dlpack_device__, from_dlpack) and views as numpy (numpy(), __array__) without a copy.
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
#include "support/dlpack.hpp"

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

// from_dlpack's device= and copy= (the array API's), as ImportOptions.
ImportOptions import_options(py::handle device, py::handle copy, const char* what) {
  ImportOptions how;
  if (!device.is_none()) how.device = to_device(device);
  if (!copy.is_none()) {
    if (!py::isinstance<py::bool_>(copy)) {
      throw py::type_error(
          fmt::format("{}: expected copy=None, True or False, found {}", what, std::string(py::repr(copy))));
    }
    how.copy = copy.cast<bool>();
  }
  return how;
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
      .def(
          py::init([](py::handle obj, py::handle copy) {
            return to_tensor(obj, "meshrt.Tensor(obj)", import_options(py::none(), copy, "meshrt.Tensor(obj)"));
          }),
          py::arg("obj"), py::kw_only(), py::arg("copy") = py::none(),
          "A view of a numpy array, torch tensor or writable buffer; read-only or strided memory is copied (copy=False "
          "refuses that with BufferError, copy=True always copies).")
      .def_static(
          "from_dlpack",
          [](py::handle obj, py::handle device, py::handle copy) {
            return to_tensor(obj, "meshrt.Tensor.from_dlpack",
                             import_options(device, copy, "meshrt.Tensor.from_dlpack"));
          },
          py::arg("obj"), py::kw_only(), py::arg("device") = py::none(), py::arg("copy") = py::none(),
          "meshrt.from_dlpack(obj, device=, copy=).")
      .def("__dlpack__", &export_dlpack, py::arg("stream") = py::none(), py::kw_only(),
           py::arg("max_version") = py::none(), py::arg("dl_device") = py::none(), py::arg("copy") = py::none(),
           "A DLPack capsule of this tensor (the Python array API's protocol): 'dltensor', or DLPack 1.0's "
           "'dltensor_versioned' when max_version is (1, 0) or later. A view; a copy when copy=True, or on dl_device "
           "when it differs from this tensor's device (BufferError with copy=False). On a CUDA tensor inside a torch "
           "kernel, the consumer's stream waits for the kernel's.")
      .def("__dlpack_device__", &dlpack_device, "(device type, device id) as DLPack names them.")
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
      "from_dlpack",
      [](py::handle obj, py::handle device, py::handle copy) {
        return to_tensor(obj, "meshrt.from_dlpack", import_options(device, copy, "meshrt.from_dlpack"));
      },
      py::arg("obj"), py::pos_only(), py::kw_only(), py::arg("device") = py::none(), py::arg("copy") = py::none(),
      "A meshrt.Tensor of a numpy array, torch tensor or anything with __dlpack__ (or the buffer protocol): a view "
      "where meshrt can view the memory as it is (contiguous, row-major, writable), else a copy; copy=True always "
      "copies, copy=False never does (BufferError where it would have to); device= copies to that device where the "
      "memory is elsewhere.");
}

}  // namespace meshrt::python
