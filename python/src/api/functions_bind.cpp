// meshrt.function's registration entry points, CallContext and Signature in Python.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "api/python_functions.hpp"
#include "bindings.hpp"
#include "meshrt/functions.hpp"

namespace meshrt::python {

void bind_functions(py::module_& m) {
  py::class_<CallContext>(m, "CallContext", "Where and on what a kernel runs: the first argument of a Python kernel.")
      .def_property_readonly("rank", &CallContext::rank)
      .def_property_readonly("dim_names", [](const CallContext& c) { return py::tuple(py::cast(c.dim_names())); })
      .def_property_readonly("coordinates", [](const CallContext& c) { return py::tuple(py::cast(c.coordinates())); })
      .def_property_readonly("sizes", [](const CallContext& c) { return py::tuple(py::cast(c.sizes())); })
      .def_property_readonly("device", [](const CallContext& c) { return c.device(); })
      .def_property_readonly("stream_id", &CallContext::stream_id)
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
                        "What a call produces, returned by a shape function: its outputs' metas, and the positions "
                        "of the tensor arguments its kernel writes in place.")
      .def(py::init([](py::handle outputs, std::vector<std::size_t> mutates) {
             PyFunction anonymous{"meshrt.Signature", {}, {}, false};
             Signature s = signature_of(anonymous, outputs);
             s.mutates = std::move(mutates);
             return s;
           }),
           py::arg("outputs") = py::tuple(), py::arg("mutates") = std::vector<std::size_t>{})
      .def_property_readonly("outputs", [](const Signature& s) { return py::tuple(py::cast(s.outputs)); })
      .def_property_readonly("mutates", [](const Signature& s) { return py::tuple(py::cast(s.mutates)); })
      .def("__repr__", [](const Signature& s) {
        std::vector<std::string> outputs;
        for (const TensorMeta& o : s.outputs) outputs.push_back(o.to_string());
        return fmt::format("meshrt.Signature(outputs=[{}], mutates={})", fmt::join(outputs, ", "), s.mutates);
      });

  m.def("_register_function", &register_python_function, py::arg("name"), py::arg("kernel"), py::arg("shape"),
        py::arg("torch"), py::arg("file"), py::arg("line"), py::arg("params"), py::arg("returns"), py::arg("doc"),
        "Registers a Python kernel and shape function (meshrt.function is the way to call it).");
  m.def("_release_functions", &release_functions,
        "Drops the Python functions' callables (at exit, before Python finalises).");
  // Last out, after _shutdown (registered later, by the package) has stopped the runtime.
  py::module_::import("atexit").attr("register")(m.attr("_release_functions"));
}

}  // namespace meshrt::python
