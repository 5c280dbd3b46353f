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
      .def_property_readonly(
          "shape", [](const DTensor& t) { return py::tuple(py::cast(t.meta().shape())); },
          "Each rank's local shape (meta.shape).")
      .def_property_readonly("dtype", [](const DTensor& t) { return t.meta().dtype(); })
      .def_property_readonly("mesh", &DTensor::mesh)
      .def_property_readonly("stream", &DTensor::stream)
      .def(
          "reduce",
          [](const DTensor& t, py::handle dim, py::handle r, bool scatter, std::optional<std::int64_t> dst,
             py::object out) -> py::object {
            const auto where = caller_site();
            const Reduction red = to_reduction(r, where);
            const std::optional<std::vector<std::string>> dims = dimension_list(dim, "reduce", where);
            if (dst && dims) {
              usage(where, fmt::format("reduce: expected one dimension (a str) with dst=, found a tuple of {}; "
                                       "reduce to a root over one dimension",
                                       dims->size()));
            }
            if (dst && scatter) {
              usage(where,
                    "reduce: expected scatter=False with dst=, found scatter=True (a reduce_scatter has no root); "
                    "drop dst= or scatter=");
            }
            if (!out.is_none()) {
              if (dst) usage(where, "reduce: expected dst= or out=, found both; a rooted reduce makes its result");
              if (!py::isinstance<DTensor>(out)) {
                usage(where, fmt::format("reduce: expected out= a DTensor, found {}", found(out)));
              }
              DTensor& o = out.cast<DTensor&>();
              released([&] {
                if (dims)
                  t.reduce(*dims, red, scatter, o, where);
                else
                  t.reduce(py::cast<std::string>(dim), red, scatter, o, where);
              });
              return out;
            }
            return py::cast(released([&] {
              if (dims) return t.reduce(*dims, red, scatter, where);
              const std::string d = py::cast<std::string>(dim);
              return dst ? t.reduce(d, red, Dst{*dst}, where) : t.reduce(d, red, scatter, where);
            }));
          },
          py::arg("dim"), py::arg("reduction"), py::arg("scatter") = false, py::kw_only(), py::arg("dst") = py::none(),
          py::arg("out") = py::none(),
          "The reduction over mesh dimension dim (a str), or over several as one (a tuple; () = every dimension): "
          "meshrt.Reduction.SUM or \"sum\" (\"mean\" is avg), ...; stack gathers. With dst=i, to coordinate i of "
          "dim only: the result lives on mesh.slice(dim, i). With out=y, written into y (of the result's meta, "
          "mesh and stream) in place; returns y.")
      .def(
          "reduce_",
          [](py::object self, py::handle dim, py::handle r, bool scatter) {
            const auto where = caller_site();
            const Reduction red = to_reduction(r, where);
            const std::optional<std::vector<std::string>> dims = dimension_list(dim, "reduce_", where);
            DTensor& t = self.cast<DTensor&>();
            released([&] {
              if (dims)
                t.reduce_(*dims, red, scatter, where);
              else
                t.reduce_(py::cast<std::string>(dim), red, scatter, where);
            });
            return self;
          },
          py::arg("dim"), py::arg("reduction"), py::arg("scatter") = false,
          "In place: this tensor's value changes (and every handle's that shares it); returns self.")
      .def(
          "gather",
          [](const DTensor& t, const std::string& dim, std::int64_t dst) {
            const auto where = caller_site();
            return released([&] { return t.gather(dim, dst, where); });
          },
          py::arg("dim"), py::kw_only(), py::arg("dst"),
          "Every coordinate's tensor stacked along a new first axis, on coordinate dst of dim only (the result lives "
          "on mesh.slice(dim, dst)).")
      .def(
          "broadcast",
          [](const DTensor& t, const std::string& dim, std::int64_t src) {
            const auto where = caller_site();
            return released([&] { return t.broadcast(dim, src, where); });
          },
          py::arg("dim"), py::kw_only(), py::arg("src"), "Coordinate src's tensor, on every coordinate along dim.")
      .def(
          "scatter",
          [](const DTensor& t, const std::string& dim, std::int64_t src) {
            const auto where = caller_site();
            return released([&] { return t.scatter(dim, src, where); });
          },
          py::arg("dim"), py::kw_only(), py::arg("src"),
          "Coordinate src's tensor split along its first axis into size(dim) parts: coordinate i gets part i.")
      .def(
          "to_mesh",
          [](const DTensor& t, const Mesh& target, std::optional<MeshPermutation> permutation) {
            const auto where = caller_site();
            return released(
                [&] { return permutation ? t.to_mesh(target, *permutation, where) : t.to_mesh(target, where); });
          },
          py::arg("target"), py::arg("permutation") = py::none(),
          "The same values sent to target: a mesh of the same sizes (positionally, or in permutation's order), "
          "or a mesh this tensor's mesh is a slice of, where each rank gets the shard of the source rank whose "
          "coordinates agree with its own on the source's dimensions (the missing dimensions broadcast).")
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
          "Ends a borrow: the origin stream may use the tensor again. Any other tensor: its value is freed on "
          "the workers after the work issued on it so far; a later use of any handle to it raises UsageError.")
      .def("__repr__", [](const DTensor& t) {
        return fmt::format("meshrt.DTensor({} on {}, stream '{}')", t.meta().to_string(), mesh_repr(t.mesh()),
                           t.stream().name());
      });
}

}  // namespace meshrt::python
