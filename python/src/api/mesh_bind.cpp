// Mesh in Python: sub-meshes, calls of registered functions, data from the controller.
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
#include "support/fast_method.hpp"

namespace meshrt::python {

void bind_worker_object(py::module_& m) {
  auto cls = api_class<WorkerObjectClass>(m, "WorkerObject");
  cls.def_property_readonly(
         "mesh",
         [](const Object& o) {
           const auto where = caller_site();
           return at_site(where, [&] { return o.mesh(); });
         },
         "The mesh whose ranks keep the objects.")
      .def_property_readonly(
          "stream",
          [](const Object& o) {
            const auto where = caller_site();
            return at_site(where, [&] { return o.stream(); });
          },
          "The stream it was made on, which calls given it run on.")
      .def_property_readonly(
          "dropped", [](const Object& o) { return !o.defined(); }, "Whether drop() has run.")
      .def(
          "drop", [](Object& o) { released([&] { o.drop(); }); },
          "Lets this handle go now: the workers free their objects once no handle holds them (as when the last "
          "reference goes). Later uses of the handle raise UsageError.")
      .def("__repr__", [](const Object& o) {
        if (!o.defined()) return std::string("<meshrt.WorkerObject (dropped)>");
        return fmt::format("<meshrt.WorkerObject on mesh {}>", fmt::join(o.mesh().names(), "x"));
      });
}

namespace {

// mesh.call and its kin are fast methods (support/fast_method.hpp): the calls a program
// issues in its inner loop.

py::object call(const Mesh& mesh, FastArgs args) {
  const auto where = caller_site();
  if (args.empty()) usage(where, "call: expected a function name and its arguments, found none");
  const std::string fn = function_name(args[0], where);
  std::vector<Arg> a = to_args(args, 1, fn, where);
  DTensor out = released([&] {
    std::vector<DTensor> outs = mesh.call_n(FunctionName(fn, where), std::move(a));
    if (outs.size() > 1) {
      usage(where, fmt::format("call: {} returns {} tensors; use call_n to get all of them", fn, outs.size()));
    }
    return outs.empty() ? DTensor() : std::move(outs.front());
  });
  return one_or_none(std::move(out));
}

py::object call_n(const Mesh& mesh, FastArgs args) {
  const auto where = caller_site();
  if (args.empty()) usage(where, "call_n: expected a function name and its arguments, found none");
  const std::string fn = function_name(args[0], where);
  std::vector<Arg> a = to_args(args, 1, fn, where);
  return to_list(released([&] { return mesh.call_n(FunctionName(fn, where), std::move(a)); }));
}

py::object call_object(const Mesh& mesh, FastArgs args) {
  const auto where = caller_site();
  if (args.empty()) usage(where, "call_object: expected a function and its arguments, found none");
  const std::string fn = function_name(args[0], where, "call_object");
  std::vector<Arg> a = to_args(args, 1, fn, where);
  return py::cast(released([&] { return mesh.call_object(FunctionName(fn, where), std::move(a)); }));
}

py::object call_on(const Mesh& mesh, FastArgs args) {
  const auto where = caller_site();
  if (args.size() < 2 || !py::isinstance<Stream>(args[0])) {
    usage(where, "call_on: expected a Stream, a function name and its arguments, found " +
                     (args.empty() ? std::string("none") : found(args[0])));
  }
  const Stream stream = py::handle(args[0]).cast<const Stream&>();
  const std::string fn = function_name(args[1], where);
  std::vector<Arg> a = to_args(args, 2, fn, where);
  return to_list(released([&] { return mesh.call_on(stream, FunctionName(fn, where), std::move(a)); }));
}

}  // namespace

void bind_mesh(py::module_& m) {
  bind_worker_object(m);
  auto cls = api_class<MeshClass>(m, "Mesh");
  cls.def_property_readonly("names", &Mesh::names)
      .def_property_readonly("sizes", &Mesh::sizes)
      .def_property_readonly(
          "ranks", [](const Mesh& mesh) { return ranks_of(mesh.ranks()); }, "The world ranks.")
      .def(
          "size",
          [](const Mesh& mesh, py::handle dims) {
            const auto where = caller_site();
            const auto d = dims.is_none() ? std::vector<std::string>{} : dimension_list(dims, "Mesh.size", where);
            if (!d) return at_site(where, [&] { return mesh.size(dims.cast<std::string>()); });
            return at_site(where, [&] { return mesh.size(*d); });
          },
          py::arg("dims") = py::none(),
          "The size of dim (a str); of several as one line (a tuple: the product); of every dimension "
          "(none given).")
      .def(
          "slice",
          [](const Mesh& mesh, const std::string& dim, std::int64_t begin, std::optional<std::int64_t> end,
             std::int64_t step) {
            const auto where = caller_site();
            return released([&] {
              return at_site(where, [&] { return end ? mesh.slice(dim, begin, *end, step) : mesh.slice(dim, begin); });
            });
          },
          py::arg("dim"), py::arg("index"), py::arg("end") = py::none(), py::arg("step") = 1,
          "slice(dim, index): the sub-mesh where dim == index (dim dropped); slice(dim, begin, end, step=1): "
          "indices begin, begin+step, ... < end (dim kept).")
      .def(
          "rename",
          [](const Mesh& mesh, const std::string& from, std::string to) {
            const auto where = caller_site();
            return released([&] { return at_site(where, [&] { return mesh.rename(from, std::move(to)); }); });
          },
          py::arg("dim"), py::arg("name"))
      .def(
          "split",
          [](const Mesh& mesh, const std::string& dim, py::handle parts) {
            const auto where = caller_site();
            auto p = to_dims(parts, fmt::format("split of '{}'", dim), where);
            return released([&] { return at_site(where, [&] { return mesh.split(dim, std::move(p)); }); });
          },
          py::arg("dim"), py::arg("parts"),
          "Splits dim into dimensions of the given sizes: {\"a\": 2, \"b\": 2} or [(\"a\", 2), (\"b\", 2)]; "
          "one size may be -1 (inferred).")
      .def(
          "flatten",
          [](const Mesh& mesh, std::string name) {
            const auto where = caller_site();
            return released([&] { return at_site(where, [&] { return mesh.flatten(std::move(name)); }); });
          },
          py::arg("name"), "One dimension over all ranks, in row-major order.")
      .def(
          "rank",
          [](const Mesh& mesh, const std::string& dim) {
            const auto where = caller_site();
            return released([&] { return at_site(where, [&] { return mesh.rank(dim, where); }); });
          },
          py::arg("dim"), "Each rank's coordinate along dim, as an int64 0-d DTensor.")
      .def(
          "barrier",
          [](const Mesh& mesh, py::handle dim) {
            const auto where = caller_site();
            const std::optional<std::vector<std::string>> dims =
                dim.is_none() ? std::optional<std::vector<std::string>>(std::vector<std::string>())
                              : dimension_list(dim, "barrier", where);
            const std::string one = dims ? std::string() : dim.cast<std::string>();
            return PyFuture{released([&] { return dims ? mesh.barrier(*dims, where) : mesh.barrier(one, where); })};
          },
          py::arg("dim") = py::none(),
          "A barrier over dim (a str; each line along it on its own), several dimensions as one (a tuple), or "
          "every dimension (none given): a Future whose result() is None once every rank of each line has "
          "entered it and the work issued before it is complete. Device work already queued is not waited for.");
  def_fast_method<const Mesh, call>(
      cls, "call",
      "call(self: meshrt._core.Mesh, *args) -> object\n\ncall(fn, *args): runs a registered function on every rank; "
      "its one output (None for a function that only mutates).\n");
  def_fast_method<const Mesh, call_n>(
      cls, "call_n",
      "call_n(self: meshrt._core.Mesh, *args) -> list\n\ncall_n(fn, *args): as call, returning the list of every "
      "output.\n");
  def_fast_method<const Mesh, call_object>(
      cls, "call_object",
      "call_object(self: meshrt._core.Mesh, *args) -> meshrt._core.WorkerObject\n\ncall_object(fn, *args): runs the "
      "registered function fn(ctx, *args) on every rank, which keeps what it returns; a WorkerObject handle to those "
      "objects, which calls on this mesh take as an argument.\n");
  def_fast_method<const Mesh, call_on>(
      cls, "call_on",
      "call_on(self: meshrt._core.Mesh, *args) -> list\n\ncall_on(stream, fn, *args): as call_n, on an explicit "
      "stream.\n");
  cls.def(
         "from_host",
         [](const Mesh& mesh, py::handle array) {
           const auto where = caller_site();
           const Tensor t = host_tensor(array, "from_host", where);
           return released([&] { return mesh.from_host(t, where); });
         },
         py::arg("array"), "The controller's array (numpy, torch, meshrt.Tensor) copied to every rank of the mesh.")
      .def(
          "scatter",
          [](const Mesh& mesh, const std::string& dim, py::handle array) {
            const auto where = caller_site();
            const Tensor t = host_tensor(array, "scatter", where);
            return released([&] { return mesh.scatter(dim, t, where); });
          },
          py::arg("dim"), py::arg("array"),
          "The array split along its first axis into size(dim) shards: coordinate i along dim holds shard i.")
      .def("__eq__", [](const Mesh& a, const Mesh& b) { return a == b; })
      .def("__repr__", &mesh_repr);
}

}  // namespace meshrt::python
