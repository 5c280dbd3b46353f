// StatelessGroup in Python: its creation (MPI starts on demand, through the core's MPI
// session, and ends after the interpreter), its properties and its operations
// (group_ops.hpp).
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <mpi.h>
#include <pybind11/stl.h>

#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bindings.hpp"
#include "group/group_ops.hpp"
#include "meshrt/internal/mpi_session.hpp"
#include "support/fast_method.hpp"

namespace meshrt::python {
namespace {

using group_ops::Seconds;

// Without the trailing NUL and newline some libraries include.
std::string trimmed(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == '\0' || s.back() == ' ')) s.pop_back();
  return s;
}

std::string mpi_library_version() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int len = 0;
  if (MPI_Get_library_version(text, &len) != MPI_SUCCESS) return "unknown";
  return trimmed(std::string(text, static_cast<std::size_t>(std::max(len, 0))));
}

const char* mpi_vendor() {
#if defined(OMPI_MAJOR_VERSION)
  return "Open MPI";
#elif defined(MPICH_VERSION)
  return "MPICH";
#else
  return "unknown";
#endif
}

GroupOptions options_for(std::optional<double> timeout, const char* op) {
  GroupOptions o;
  if (timeout) {
    if (!(*timeout >= 0)) {
      throw UsageError(
          fmt::format("{}: timeout: expected seconds >= 0 (0 or math.inf: no limit), found {}", op, *timeout));
    }
    o.timeout = Seconds(std::isinf(*timeout) ? 0.0 : *timeout);
  }
  return o;
}

std::unique_ptr<PyGroup> create(const std::vector<int>& members, std::optional<double> timeout) {
  const char* op = "StatelessGroup.create";
  start_mpi(op);
  const GroupOptions o = options_for(timeout, op);
  auto pg = std::make_unique<PyGroup>();
  py::gil_scoped_release release;
  pg->g.emplace(StatelessGroup::create(members, MPI_COMM_WORLD, o));
  return pg;
}

std::unique_ptr<PyGroup> from_mpi4py(py::handle comm, std::optional<double> timeout) {
  const char* op = "StatelessGroup.from_mpi4py";
  py::module_ mpi = py::module_::import("mpi4py.MPI");
  const auto vendor = mpi.attr("get_vendor")().cast<py::tuple>();
  const std::string their_vendor = py::str(vendor[0]);
  const std::string theirs = trimmed(py::str(mpi.attr("Get_library_version")()).cast<std::string>());
  const std::string ours = mpi_library_version();
  if (their_vendor != mpi_vendor() || theirs != ours) {
    throw UsageError(fmt::format(
        "{}: mpi4py is built for {} ({}), meshrt for {} ({}): a communicator of one MPI library cannot be used by "
        "another; build mpi4py and meshrt against the same MPI",
        op, their_vendor, theirs.substr(0, theirs.find('\n')), mpi_vendor(), ours.substr(0, ours.find('\n'))));
  }
  if (!py::isinstance(comm, mpi.attr("Intracomm"))) {
    throw UsageError(fmt::format("{}: expected an mpi4py.MPI.Intracomm, found {}", op,
                                 std::string(py::str(py::type::handle_of(comm).attr("__qualname__")))));
  }
  start_mpi(op);
  const MPI_Comm c = MPI_Comm_f2c(static_cast<MPI_Fint>(comm.attr("py2f")().cast<int>()));
  if (c == MPI_COMM_NULL) throw UsageError(fmt::format("{}: expected a communicator, found MPI.COMM_NULL", op));
  const GroupOptions o = options_for(timeout, op);
  auto pg = std::make_unique<PyGroup>();
  py::gil_scoped_release release;
  pg->g.emplace(StatelessGroup::from_comm(c, o));
  return pg;
}

// The codec alone, for tests of what it takes and refuses: the encoded bytes (header,
// structure, trailer) and the out-of-band buffers' bytes; and back.
py::tuple codec_encode(py::handle obj, bool allow_pickle) {
  codec::Encoded e;
  codec::encode(obj, allow_pickle, e);
  py::list buffers;
  for (const codec::Buffer& b : e.buffers) buffers.append(py::bytes(b.data, b.size));
  return py::make_tuple(py::bytes(e.bytes), buffers);
}

py::object codec_decode(const py::bytes& data, const std::vector<py::bytes>& buffers, bool allow_pickle) {
  const codec::Where where = [] { return std::string("meshrt._codec_decode"); };
  codec::Decoded d = codec::decode(std::string_view(data), allow_pickle, nullptr, where, where);
  if (d.targets.size() != buffers.size()) {
    throw UsageError(fmt::format("_codec_decode: the object holds {} out-of-band buffers, {} were given",
                                 d.targets.size(), buffers.size()));
  }
  for (std::size_t i = 0; i < buffers.size(); ++i) {
    const std::string_view b = buffers[i];
    if (b.size() != d.targets[i].size) {
      throw UsageError(
          fmt::format("_codec_decode: buffer {} holds {} bytes, expected {}", i, b.size(), d.targets[i].size));
    }
    if (!b.empty()) std::memcpy(d.targets[i].data, b.data(), b.size());
  }
  return d.value;
}

// The arguments of the fast methods below, converted as pybind11 converts them (a
// TypeError where it would find no overload).
int int_arg(const char* op, const char* name, PyObject* o) {
  if (PyFloat_Check(o) == 0 && PyIndex_Check(o) != 0) {
    const long v = PyLong_AsLong(py::reinterpret_steal<py::object>(PyNumber_Index(o)).ptr());
    if (v == -1 && PyErr_Occurred() != nullptr) throw py::error_already_set();
    if (v >= std::numeric_limits<int>::min() && v <= std::numeric_limits<int>::max()) return static_cast<int>(v);
  }
  throw py::type_error(fmt::format("{}(): {}: expected an int, found {}", op, name, Py_TYPE(o)->tp_name));
}
std::optional<double> timeout_arg(const char* op, PyObject* o) {
  if (o == nullptr || o == Py_None) return std::nullopt;
  const double v = PyFloat_AsDouble(o);
  if (v == -1.0 && PyErr_Occurred() != nullptr) {
    PyErr_Clear();
    throw py::type_error(
        fmt::format("{}(): timeout: expected seconds (a float) or None, found {}", op, Py_TYPE(o)->tp_name));
  }
  return v;
}
bool bool_arg(const char* op, const char* name, PyObject* o) {
  if (o == nullptr || o == Py_False || o == Py_None) return false;
  if (o == Py_True) return true;
  PyNumberMethods* num = Py_TYPE(o)->tp_as_number;
  if (num != nullptr && num->nb_bool != nullptr) {
    const int v = num->nb_bool(o);
    if (v == 0 || v == 1) return v != 0;
    PyErr_Clear();
  }
  throw py::type_error(fmt::format("{}(): {}: expected a bool, found {}", op, name, Py_TYPE(o)->tp_name));
}
py::handle obj_arg(PyObject* o) {
  return o == nullptr ? py::none() : py::handle(o);
}

// The calls a program makes in its loop skip pybind11's dispatcher (support/fast_method.hpp).
py::object fast_broadcast_obj(PyGroup& pg, const std::array<PyObject*, 5>& a) {
  const char* op = "broadcast_obj";
  return broadcast_obj(pg, obj_arg(a[0]), int_arg(op, "src", a[1]), timeout_arg(op, a[2]),
                       bool_arg(op, "allow_pickle", a[3]), obj_arg(a[4]));
}
py::object fast_all_gather_obj(PyGroup& pg, const std::array<PyObject*, 3>& a) {
  const char* op = "all_gather_obj";
  return all_gather_obj(pg, obj_arg(a[0]), timeout_arg(op, a[1]), bool_arg(op, "allow_pickle", a[2]));
}
py::object fast_barrier(PyGroup& pg, const std::array<PyObject*, 1>& a) {
  barrier(pg, timeout_arg("barrier", a[0]));
  return py::none();
}

}  // namespace

void bind_group(py::module_& m) {
  m.def("_codec_encode", &codec_encode, py::arg("obj"), py::arg("allow_pickle") = false,
        "The group's codec alone (for tests): (bytes, [out-of-band buffers]).");
  m.def("_codec_decode", &codec_decode, py::arg("data"), py::arg("buffers"), py::arg("allow_pickle") = false,
        "The group's codec alone (for tests): the object _codec_encode's bytes and buffers encode.");
  m.def("_mpi_library_version", &mpi_library_version, "MPI_Get_library_version of the MPI meshrt is built with.");
  m.def("_mpi_vendor", &mpi_vendor, "The MPI meshrt is built with, as mpi4py.MPI.get_vendor() names it.");

  py::class_<PyGroup>(m, "StatelessGroup",
                      "Object collectives over MPI for any subset of ranks, without global state (vLLM's "
                      "StatelessProcessGroup over MPI). Objects travel through a safe codec; pickle only where both "
                      "sides pass allow_pickle=True.")
      .def_static("create", &create, py::arg("members"), py::arg("timeout") = py::none(),
                  "A group of the world ranks `members` (members[i] becomes group rank i). Only the members call "
                  "it, each with the same list. timeout: every call's default in seconds (None: "
                  "MESHRT_GROUP_TIMEOUT; 0 or math.inf: no limit). Starts MPI if the program has not.")
      .def_static("from_mpi4py", &from_mpi4py, py::arg("comm"), py::arg("timeout") = py::none(),
                  "A group over every rank of an mpi4py intracommunicator (on a duplicate of it); every rank of "
                  "comm calls it. mpi4py must use the MPI library meshrt is built with.")
      .def_property_readonly("rank", [](PyGroup& pg) { return pg.group("rank").rank(); })
      .def_property_readonly("size", [](PyGroup& pg) { return pg.group("size").world_size(); })
      .def_property_readonly(
          "world_size", [](PyGroup& pg) { return pg.group("world_size").world_size(); },
          "The group's size (vLLM's name).")
      .def_property_readonly(
          "members", [](PyGroup& pg) { return pg.group("members").members(); },
          "The members' ranks in the parent (MPI_COMM_WORLD for create, comm for from_mpi4py), by group rank.")
      .def_property_readonly(
          "usable", [](PyGroup& pg) { return pg.g && pg.g->usable() && pg.broken.empty(); },
          "False once a timeout or a failure mid-transfer has left messages in flight (later calls raise).")
      .def_property_readonly(
          "timeout",
          [](PyGroup& pg) {
            // The C++ group holds "no limit" as the largest duration; Python spells it math.inf.
            const double s = pg.group("timeout").default_timeout().count();
            return s >= group_ops::kNoLimitFrom ? std::numeric_limits<double>::infinity() : s;
          },
          "Every call's default timeout in seconds (math.inf: no limit).")
      .def("send_obj", &send_obj, py::arg("obj"), py::arg("dst"), py::arg("timeout") = py::none(), py::kw_only(),
           py::arg("allow_pickle") = false, "Sends obj to group rank dst; returns once it has left this rank.")
      .def("recv_obj", &recv_obj, py::arg("src"), py::arg("timeout") = py::none(), py::kw_only(),
           py::arg("allow_pickle") = false, py::arg("out") = py::none(),
           "The next object group rank src sent to this rank. out: an array to receive a sent array into.")
      .def("broadcast_obj", &broadcast_obj, py::arg("obj"), py::arg("src"), py::arg("timeout") = py::none(),
           py::kw_only(), py::arg("allow_pickle") = false, py::arg("out") = py::none(),
           "Every member calls it with the same src; returns src's object on every member (obj itself on src; "
           "obj is ignored elsewhere). out: on the others, an array to receive the root's array into (its dtype "
           "and shape must match, else a UsageError on every member).")
      .def("all_gather_obj", &all_gather_obj, py::arg("obj"), py::arg("timeout") = py::none(), py::kw_only(),
           py::arg("allow_pickle") = false, "Every member's object, in group rank order (obj itself at this rank's).")
      .def("gather_obj", &gather_obj, py::arg("obj"), py::arg("dst"), py::arg("timeout") = py::none(), py::kw_only(),
           py::arg("allow_pickle") = false,
           "Every member calls it with the same dst; returns every member's object in group rank order on dst "
           "(obj itself at dst's place), None on the others.")
      .def("scatter_obj", &scatter_obj, py::arg("objs"), py::arg("src"), py::arg("timeout") = py::none(), py::kw_only(),
           py::arg("allow_pickle") = false,
           "Every member calls it with the same src; src passes a list or tuple of one object per member "
           "(objs is ignored elsewhere) and each member gets its own, objs[rank] (the root's: the object itself).")
      .def("barrier", &barrier, py::arg("timeout") = py::none(), "Returns once every member has called it.")
      .def(
          "close", [](PyGroup& pg) { pg.g.reset(); }, "Frees the group's communicator now (later calls raise).")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyGroup& pg, py::args) { pg.g.reset(); })
      .def("__repr__", [](PyGroup& pg) {
        if (!pg.g || pg.g->comm() == MPI_COMM_NULL) return std::string("meshrt.StatelessGroup(closed)");
        return fmt::format("meshrt.StatelessGroup(rank {} of {}, members [{}]{})", pg.g->rank(), pg.g->world_size(),
                           fmt::join(pg.g->members(), ", "), pg.g->usable() && pg.broken.empty() ? "" : ", unusable");
      });
  const py::object cls = m.attr("StatelessGroup");
  replace_with_fast_method<PyGroup, 5, fast_broadcast_obj>(cls, "broadcast_obj",
                                                           {"obj", "src", "timeout", "allow_pickle", "out"}, 3, 2);
  replace_with_fast_method<PyGroup, 3, fast_all_gather_obj>(cls, "all_gather_obj", {"obj", "timeout", "allow_pickle"},
                                                            2, 1);
  replace_with_fast_method<PyGroup, 1, fast_barrier>(cls, "barrier", {"timeout"}, 1, 0);
}

}  // namespace meshrt::python
