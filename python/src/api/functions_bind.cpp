// meshrt.function's registration entry points, CallContext and Signature in Python.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "api/python_functions.hpp"
#include "bindings.hpp"
#include "meshrt/functions.hpp"

namespace meshrt::python {
namespace {

// A shape function's argument from Python (_infer): TensorMetas, plain values and tuples
// or lists of them.
Value meta_value(py::handle a) {
  if (a.is_none()) return {};
  if (py::isinstance<TensorMeta>(a)) return a.cast<TensorMeta>();
  if (py::isinstance<py::bool_>(a)) return a.cast<bool>();
  if (py::isinstance<py::int_>(a)) return a.cast<std::int64_t>();
  if (py::isinstance<py::float_>(a)) return a.cast<double>();
  if (py::isinstance<py::str>(a)) return a.cast<std::string>();
  if (py::isinstance<py::tuple>(a) || py::isinstance<py::list>(a)) {
    Value::List items;
    for (py::handle item : a) items.push_back(meta_value(item));
    return Value::list(std::move(items));
  }
  throw py::type_error(fmt::format("_infer: expected TensorMetas, numbers, strings, None or tuples of them, found {}",
                                   std::string(py::repr(a))));
}

}  // namespace

void bind_functions(py::module_& m) {
  py::class_<CallContext>(m, "CallContext", "Where and on what a kernel runs: the first argument of a Python kernel.")
      .def_property_readonly("rank", &CallContext::rank)
      .def_property_readonly("dim_names", [](const CallContext& c) { return py::tuple(py::cast(c.dim_names())); })
      .def_property_readonly("coordinates", [](const CallContext& c) { return py::tuple(py::cast(c.coordinates())); })
      .def_property_readonly("sizes", [](const CallContext& c) { return py::tuple(py::cast(c.sizes())); })
      .def_property_readonly("device", [](const CallContext& c) { return c.device(); })
      .def_property_readonly("stream_id", &CallContext::stream_id)
      .def_property_readonly(
          "torch_device",
          [](const CallContext& c) { return c.device().is_cuda() ? c.device().to_string() : std::string("cpu"); },
          "Where a torch kernel's tensors are, as torch names devices: 'cuda:N' on a CUDA mesh, 'cpu' on cpu and "
          "emulated meshes (whose kernels get host views): torch.zeros(n, device=ctx.torch_device) runs unchanged on "
          "every kind.")
      .def("coordinate", &CallContext::coordinate, py::arg("dim"), "This rank's coordinate along mesh dimension dim.")
      .def("size", &CallContext::size, py::arg("dim"), "The mesh's size along dimension dim.")
      .def("__repr__", [](const CallContext& c) {
        std::vector<std::string> dims;
        for (std::size_t i = 0; i < c.dim_names().size(); ++i) {
          dims.push_back(fmt::format("{}={}/{}", c.dim_names()[i], c.coordinates()[i], c.sizes()[i]));
        }
        return fmt::format("meshrt.CallContext(rank={}, {}, device={}, stream_id={})", c.rank(), fmt::join(dims, ", "),
                           c.device().to_string(), c.stream_id());
      });

  py::class_<Signature>(m, "Signature",
                        "What a call produces, returned by a shape function: its outputs' metas, the positions "
                        "of the tensor arguments its kernel writes in place, and which outputs are views of which "
                        "tensor arguments ({output: argument}).")
      .def(py::init([](py::handle outputs, std::vector<std::size_t> mutates,
                       const std::map<std::size_t, std::size_t>& views) {
             PyFunction anonymous{"meshrt.Signature", {}, {}, false};
             Signature s = signature_of(anonymous, outputs);
             s.mutates = std::move(mutates);
             for (const auto& [output, input] : views) s.views.push_back({.output = output, .input = input});
             return s;
           }),
           py::arg("outputs") = py::tuple(), py::arg("mutates") = std::vector<std::size_t>{},
           py::arg("views") = std::map<std::size_t, std::size_t>{})
      .def_property_readonly("outputs", [](const Signature& s) { return py::tuple(py::cast(s.outputs)); })
      .def_property_readonly("mutates", [](const Signature& s) { return py::tuple(py::cast(s.mutates)); })
      .def_property_readonly("views",
                             [](const Signature& s) {
                               std::map<std::size_t, std::size_t> out;
                               for (const View& v : s.views) out[v.output] = v.input;
                               return out;
                             })
      .def("__repr__", [](const Signature& s) {
        std::vector<std::string> outputs, views;
        for (const TensorMeta& o : s.outputs) outputs.push_back(o.to_string());
        for (const View& v : s.views) views.push_back(fmt::format("{}: {}", v.output, v.input));
        return fmt::format("meshrt.Signature(outputs=[{}], mutates={}, views={{{}}})", fmt::join(outputs, ", "),
                           s.mutates, fmt::join(views, ", "));
      });

  m.def("_register_function", &register_python_function, py::arg("name"), py::arg("kernel"), py::arg("shape"),
        py::arg("torch"), py::arg("file"), py::arg("line"), py::arg("params"), py::arg("returns"), py::arg("doc"),
        "Registers a Python kernel and shape function (meshrt.function is the way to call it).");
  m.def(
      "_infer",
      [](const std::string& name, py::handle device, const py::args& args) {
        std::vector<Value> values;
        for (py::handle a : args) values.push_back(meta_value(a));
        const Device where =
            py::isinstance<Device>(device) ? device.cast<Device>() : Device::parse(device.cast<std::string>());
        return functions::infer(functions::lookup(name), ArgMetas(name, std::move(values), where));
      },
      py::arg("name"), py::arg("device"),
      "The Signature a call of remote function `name` with these arguments (TensorMetas for tensors) gets from its "
      "shape function on a mesh placed on `device`, as the controller and the workers ask it; what it raises. For "
      "tests.");
  m.def("_release_functions", &release_functions,
        "Drops the Python functions' callables (at exit, before Python finalises).");
  // Last out, after _shutdown (registered later, by the package) has stopped the runtime.
  py::module_::import("atexit").attr("register")(m.attr("_release_functions"));
}

}  // namespace meshrt::python
