// meshrt_bench._loop: the benchmark's C++ controller loop, beside the Python one (calls.py),
// built for the benchmark only. It takes meshrt._core's Mesh and DTensor objects: pybind11
// shares its type registry between extension modules built alike.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "meshrt/controller.hpp"

namespace py = pybind11;

namespace {

meshrt::Arg plain_arg(py::handle obj) {
  if (py::isinstance<meshrt::DTensor>(obj)) return meshrt::Arg(obj.cast<meshrt::DTensor>());
  if (py::isinstance<py::bool_>(obj)) return meshrt::Arg(obj.cast<bool>());
  if (py::isinstance<py::int_>(obj)) return meshrt::Arg(obj.cast<long long>());
  if (py::isinstance<py::float_>(obj)) return meshrt::Arg(obj.cast<double>());
  if (py::isinstance<py::str>(obj)) return meshrt::Arg(obj.cast<std::string>());
  if (obj.is_none()) return meshrt::Arg(meshrt::Value());
  if (py::isinstance<py::tuple>(obj) || py::isinstance<py::list>(obj)) {
    meshrt::Value::List items;
    for (py::handle item : obj) items.push_back(plain_arg(item).value());
    return meshrt::Arg(meshrt::Value(std::move(items)));
  }
  return meshrt::Arg(meshrt::parse_dtype(py::str(obj).cast<std::string>()));  // meshrt.float32 prints "float32"
}

}  // namespace

PYBIND11_MODULE(_loop, m) {
  m.def(
      "call_loop",
      [](const meshrt::Mesh& mesh, const std::string& fn, const py::tuple& args, std::int64_t n) {
        std::vector<meshrt::Arg> converted;
        for (py::handle a : args) converted.push_back(plain_arg(a));
        py::gil_scoped_release release;
        for (std::int64_t i = 0; i < n; ++i) (void)mesh.call_n(fn, converted);
      },
      py::arg("mesh"), py::arg("fn"), py::arg("args"), py::arg("n"),
      "Calls fn(*args) on mesh n times from C++ (the benchmark's C++ controller loop).");
}
