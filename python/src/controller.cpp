// run(), Controller, Mesh, DTensor, Stream, Future and Reduction in Python: the C++ API
// of include/meshrt/controller.hpp with Python spelling (DESIGN section 11). Every call
// that can block releases the GIL.
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bindings.hpp"
#include "convert.hpp"
#include "meshrt/controller.hpp"
#include "meshrt/runtime.hpp"

namespace meshrt::python {
namespace {

// The process's Runtime: made by the first run(), kept for later sessions (MPI can be
// initialised once per process), ended at interpreter exit.
std::unique_ptr<Runtime>& runtime() {
  static std::unique_ptr<Runtime> rt;
  return rt;
}

Runtime& start_runtime() {
  auto& rt = runtime();
  if (!rt) {
    int argc = 1;
    static char program[] = "python";
    static char* args[] = {program, nullptr};
    char** argv = args;
    py::gil_scoped_release release;
    rt = std::make_unique<Runtime>(argc, argv);
  }
  return *rt;
}

Reduction to_reduction(py::handle obj) {
  if (py::isinstance<Reduction>(obj)) return obj.cast<Reduction>();
  return parse_reduction(obj.cast<std::string>());
}

Arg to_arg(py::handle obj, std::string_view what) {
  if (py::isinstance<DTensor>(obj)) return Arg(obj.cast<DTensor>());
  if (py::isinstance<py::bool_>(obj)) return Arg(obj.cast<bool>());
  if (py::isinstance<py::int_>(obj)) return Arg(obj.cast<long long>());
  if (py::isinstance<py::float_>(obj)) return Arg(obj.cast<double>());
  if (py::isinstance<py::str>(obj)) return Arg(obj.cast<std::string>());
  if (obj.is_none()) return Arg(Value());
  if (py::isinstance<DType>(obj) || is_dtype_like(obj)) return Arg(to_dtype(obj));
  if (py::isinstance<py::tuple>(obj) || py::isinstance<py::list>(obj)) {
    Value::List items;
    for (py::handle item : obj) items.push_back(to_arg(item, what).value());
    return Arg(Value(std::move(items)));
  }
  if (is_tensor_like(obj)) return Arg(to_tensor(obj, what));
  throw UsageError(std::string(what) + ": expected a DTensor, number, string, dtype, shape or tensor, found " +
                   std::string(py::str(py::type::handle_of(obj).attr("__qualname__"))));
}

}  // namespace

bool runtime_started() {
  return runtime() != nullptr;
}

void bind_controller(py::module_& m) {
  py::enum_<Reduction> reduction(m, "Reduction", "How reduce() combines a mesh dimension; or its name, \"sum\".");
  for (int i = 0; i < kNumReductions; ++i) {
    const auto r = static_cast<Reduction>(i);
    std::string n(name(r));
    for (auto& c : n) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    reduction.value(n.c_str(), r);
  }

  py::class_<Future<Tensor>>(m, "Future", "A tensor that will come back from the workers.")
      .def(
          "result",
          [](Future<Tensor>& f, std::optional<double> timeout) {
            Tensor t;
            {
              py::gil_scoped_release release;
              t = timeout ? f.get(std::chrono::duration<double>(*timeout)) : f.get();
            }
            return wrap_tensor(std::move(t));
          },
          py::arg("timeout") = py::none())
      .def("done", [](Future<Tensor>& f) {
        py::gil_scoped_release release;
        return f.done();
      });

  py::class_<DTensor>(m, "DTensor", "A distributed tensor: one local tensor per rank of its mesh.")
      .def_property_readonly("meta", &DTensor::meta)
      .def(
          "reduce",
          [](const DTensor& t, const std::string& dim, py::handle r, bool scatter) {
            return t.reduce(dim, to_reduction(r), scatter);
          },
          py::arg("dim"), py::arg("reduction"), py::arg("scatter") = false);

  py::class_<Mesh>(m, "Mesh", "A device mesh: named dimensions over a set of ranks.")
      .def_property_readonly("names", &Mesh::names)
      .def_property_readonly("sizes", &Mesh::sizes)
      .def("call", [](const Mesh& mesh, const std::string& fn, py::args args) {
        std::vector<Arg> converted;
        for (std::size_t i = 0; i < args.size(); ++i) {
          converted.push_back(to_arg(args[i], fn + " argument " + std::to_string(i)));
        }
        std::vector<DTensor> out = mesh.call_n(fn, std::move(converted));
        // One output is the DTensor itself (DESIGN section 11: mesh.call(...).reduce(...)).
        return out.size() == 1 ? py::cast(out[0]) : py::cast(out);
      });

  py::class_<Controller, std::unique_ptr<Controller, py::nodelete>>(
      m, "Controller", "The program on rank 0 drives every worker through it (given to main by meshrt.run).")
      .def(
          "world_mesh",
          [](Controller& ctl, py::handle dims) {
            std::vector<std::pair<std::string, std::int64_t>> d;
            if (py::isinstance<py::dict>(dims)) {
              for (auto [k, v] : dims.cast<py::dict>()) d.emplace_back(py::str(k), v.cast<std::int64_t>());
            } else {
              d = dims.cast<std::vector<std::pair<std::string, std::int64_t>>>();
            }
            return ctl.world_mesh(std::move(d));
          },
          py::arg("dims"))
      .def(
          "fetch_shard",
          [](Controller& ctl, const DTensor& t, py::kwargs coords) {
            std::vector<std::pair<std::string, std::int64_t>> c;
            for (auto [k, v] : coords) c.emplace_back(py::str(k), v.cast<std::int64_t>());
            return ctl.fetch_shard(t, std::move(c));
          },
          py::arg("t"))
      .def("synchronize", [](Controller& ctl) {
        py::gil_scoped_release release;
        ctl.synchronize();
      });

  m.def(
      "run",
      [](py::function main) {
        Runtime& rt = start_runtime();
        py::object result = py::none();
        {
          py::gil_scoped_release release;
          rt.session([&](Controller& ctl) {
            py::gil_scoped_acquire acquire;
            result = main(py::cast(&ctl, py::return_value_policy::reference));
          });
        }
        return result;
      },
      py::arg("main"), "Runs main(ctl) on rank 0 and the worker on every rank; returns main's result on rank 0.");
  m.def("_shutdown", [] {
    py::gil_scoped_release release;
    runtime().reset();
  });
  // For the tests of Python kernels on the emulated accelerator, until world_mesh takes a
  // device: a mesh placed on `kind` ("cpu", "emulated" or "cuda").
  py::reinterpret_borrow<py::class_<Controller, std::unique_ptr<Controller, py::nodelete>>>(m.attr("Controller"))
      .def("_world_mesh_on", [](Controller& ctl, const py::dict& dims, const std::string& kind) {
        std::vector<std::pair<std::string, std::int64_t>> d;
        for (auto [k, v] : dims) d.emplace_back(py::str(k), v.cast<std::int64_t>());
        for (const Device::Kind k : {Device::Kind::Cpu, Device::Kind::Cuda, Device::Kind::Emulated}) {
          if (name(k) == kind) return ctl.world_mesh(std::move(d), k);
        }
        throw UsageError("_world_mesh_on: expected a device kind cpu, cuda or emulated, found '" + kind + "'");
      });
}

}  // namespace meshrt::python
