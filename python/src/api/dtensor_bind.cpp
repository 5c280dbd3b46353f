// DTensor in Python: reductions, sends between meshes, slices and drops.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "api/classes.hpp"
#include "bindings.hpp"
#include "support/call_args.hpp"
#include "support/caller.hpp"
#include "support/convert.hpp"

namespace meshrt::python {

void bind_dtensor(py::module_& m) {
  auto cls = api_class<DTensorClass>(m, "DTensor");
  cls.def_property_readonly("meta", [](const DTensor& t) { return t.meta(); })
      .def_property_readonly("mesh", &DTensor::mesh)
      .def_property_readonly("stream", &DTensor::stream)
      .def(
          "reduce",
          [](const DTensor& t, const std::string& dim, py::handle r, bool scatter) {
            const auto where = caller_site();
            const Reduction red = to_reduction(r, where);
            return released([&] { return t.reduce(dim, red, scatter, where); });
          },
          py::arg("dim"), py::arg("reduction"), py::arg("scatter") = false,
          "The reduction over mesh dimension dim: meshrt.Reduction.SUM or \"sum\", ...; stack gathers.")
      .def(
          "reduce_",
          [](py::object self, const std::string& dim, py::handle r, bool scatter) {
            const auto where = caller_site();
            const Reduction red = to_reduction(r, where);
            DTensor& t = self.cast<DTensor&>();
            released([&] { t.reduce_(dim, red, scatter, where); });
            return self;
          },
          py::arg("dim"), py::arg("reduction"), py::arg("scatter") = false,
          "In place: this tensor's value changes (and every handle's that shares it); returns self.")
      .def(
          "to_mesh",
          [](const DTensor& t, const Mesh& target, std::optional<MeshPermutation> permutation) {
            const auto where = caller_site();
            return released(
                [&] { return permutation ? t.to_mesh(target, *permutation, where) : t.to_mesh(target, where); });
          },
          py::arg("target"), py::arg("permutation") = py::none(),
          "The same values sent to target (a mesh of the same sizes), positionally or in permutation's order.")
      .def(
          "rotate",
          [](const DTensor& t, const std::string& dim, std::int64_t shift) {
            const auto where = caller_site();
            return released([&] { return t.rotate(dim, shift, where); });
          },
          py::arg("dim"), py::arg("shift"), "Each rank's tensor moves shift coordinates along dim (a ring).")
      .def(
          "slice_mesh",
          [](const DTensor& t, const std::string& dim, std::int64_t index) {
            const auto where = caller_site();
            return released([&] { return at_site(where, [&] { return t.slice_mesh(dim, index); }); });
          },
          py::arg("dim"), py::arg("index"), "The part of this tensor on the sub-mesh where dim == index.")
      .def(
          "drop",
          [](DTensor& t) {
            const auto where = caller_site();
            released([&] { t.drop(where); });
          },
          "Ends a borrow: the origin stream may use the tensor again.")
      .def("__repr__", [](const DTensor& t) {
        return fmt::format("meshrt.DTensor({} on {}, stream '{}')", t.meta().to_string(), mesh_repr(t.mesh()),
                           t.stream().name());
      });
}

}  // namespace meshrt::python
