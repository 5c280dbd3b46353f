// Reduction, DeviceKind and MeshPermutation in Python: enums whose str() is their name
// ("sum", "emulated"), which every call also takes as a string.
#include <pybind11/stl.h>

#include <cctype>
#include <string>

#include "bindings.hpp"
#include "meshrt/controller.hpp"

namespace meshrt::python {

void bind_enums(py::module_& m) {
  py::enum_<Reduction> reduction(m, "Reduction", "How reduce() combines a mesh dimension; or its name, \"sum\".");
  for (int i = 0; i < kNumReductions; ++i) {
    const auto r = static_cast<Reduction>(i);
    std::string n(name(r));
    for (auto& c : n) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    reduction.value(n.c_str(), r);
  }
  // torch.distributed's name for avg; "mean" parses too.
  reduction.attr("MEAN") = py::cast(Reduction::Avg);
  // str() is the name ("sum", "emulated"); a def() would chain behind pybind11's own __str__.
  reduction.attr("__str__") =
      py::cpp_function([](Reduction r) { return std::string(name(r)); }, py::name("__str__"), py::is_method(reduction));

  py::enum_<DeviceKind> kinds(m, "DeviceKind",
                              "What a mesh is placed on; or its name: \"cpu\", \"cuda\", \"emulated\".");
  kinds.value("CPU", DeviceKind::Cpu).value("CUDA", DeviceKind::Cuda).value("EMULATED", DeviceKind::Emulated);
  kinds.attr("__str__") =
      py::cpp_function([](DeviceKind k) { return std::string(name(k)); }, py::name("__str__"), py::is_method(kinds));

  py::class_<MeshPermutation>(m, "MeshPermutation",
                              "A rank order for DTensor.to_mesh: rotate(dim, shift), transpose(a, b), mapping(to).")
      .def_static("rotate", &MeshPermutation::rotate, py::arg("dim"), py::arg("shift"),
                  "Along dim, coordinate i goes to (i + shift) mod size(dim).")
      .def_static("transpose", &MeshPermutation::transpose, py::arg("dim_a"), py::arg("dim_b"),
                  "The coordinates along dim_a and dim_b (of equal sizes) trade places.")
      .def_static("mapping", &MeshPermutation::mapping, py::arg("to"),
                  "Source position k (row-major) goes to target position to[k].")
      .def("resolve", &MeshPermutation::resolve, py::arg("names"), py::arg("sizes"),
           "The target position of every source position for a mesh with these dimensions.")
      .def("__str__", &MeshPermutation::to_string)
      .def("__repr__", [](const MeshPermutation& p) { return "meshrt.MeshPermutation(" + p.to_string() + ")"; });
}

}  // namespace meshrt::python
