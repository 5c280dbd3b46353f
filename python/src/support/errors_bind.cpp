// meshrt's exceptions in Python, mirroring the C++ ones (include/meshrt/error.hpp):
// meshrt.Error and UsageError, RemoteError, TimeoutError (also the builtin TimeoutError),
// SystemError, InternalError, ProtocolError. A C++ exception crossing into Python becomes
// the matching class, with the C++ accessors as attributes.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings.hpp"
#include "meshrt/controller.hpp"
#include "meshrt/error.hpp"

namespace meshrt::python {
namespace {

// Owned by the module object (as attributes), so they outlive every translation.
struct Classes {
  PyObject* error = nullptr;
  PyObject* usage = nullptr;
  PyObject* remote = nullptr;
  PyObject* timeout = nullptr;
  PyObject* system = nullptr;
  PyObject* internal = nullptr;
  PyObject* protocol = nullptr;
};
Classes classes;

PyObject* make_class(py::module_& m, const char* name, py::object bases, const char* doc) {
  const std::string qualified = std::string("meshrt.") + name;
  PyObject* cls = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases.ptr(), nullptr);
  if (cls == nullptr) throw py::error_already_set();
  m.add_object(name, py::handle(cls));
  return cls;
}

// Raises an instance of `cls` with message `what` and the given attributes.
void raise(PyObject* cls, const char* what, const py::dict& attributes) {
  py::object instance = py::reinterpret_borrow<py::object>(cls)(what);
  for (auto [key, value] : attributes) py::setattr(instance, key, value);
  PyErr_SetObject(cls, instance.ptr());
}

}  // namespace

void bind_errors(py::module_& m) {
  py::object exception = py::reinterpret_borrow<py::object>(PyExc_Exception);
  classes.error = make_class(m, "Error", exception, "Every meshrt error.");
  py::object base = py::reinterpret_borrow<py::object>(classes.error);
  classes.usage = make_class(m, "UsageError", base,
                             "A bad call at the controller, in a shape function or in a group: wrong dimension, "
                             "shape, type or stream.");
  classes.remote = make_class(m, "RemoteError", base,
                              "A function failed on a worker, or a value depends on one that did. Attributes: "
                              "ident, function, ranks, worker_message, issued_at.");
  classes.timeout =
      make_class(m, "TimeoutError", py::make_tuple(base, py::reinterpret_borrow<py::object>(PyExc_TimeoutError)),
                 "A blocking operation did not complete in time (also a builtin TimeoutError). "
                 "Attributes: missing_ranks, group_unusable.");
  classes.system = make_class(m, "SystemError", base, "A call into MPI, CUDA or NCCL failed.");
  classes.internal = make_class(m, "InternalError", base, "A bug in meshrt. Attributes: file, line.");
  classes.protocol = make_class(m, "ProtocolError", base, "A message that does not decode.");
  // Not a meshrt.Error: the end of the program, as sys.exit is (except Exception passes it).
  make_class(m, "Terminated", py::reinterpret_borrow<py::object>(PyExc_SystemExit),
             "SIGTERM arrived (scancel, a time limit, or Ctrl-C under mpiexec, which forwards it as SIGTERM): "
             "raised in the program's main thread so that its finally: blocks and with-statements run; the job "
             "ends about a second after the signal.");

  // Most derived first: the first matching catch wins.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const RemoteError& e) {
      py::dict a;
      a["ident"] = e.ident();
      a["function"] = e.function();
      a["ranks"] = e.ranks();
      a["worker_message"] = e.worker_message();
      a["issued_at"] = e.issued_at();
      raise(classes.remote, e.what(), a);
    } catch (const TimeoutError& e) {
      py::dict a;
      a["missing_ranks"] = e.missing_ranks();
      a["group_unusable"] = e.group_unusable();
      raise(classes.timeout, e.what(), a);
    } catch (const InternalError& e) {
      py::dict a;
      a["file"] = e.file();
      a["line"] = e.line();
      raise(classes.internal, e.what(), a);
    } catch (const UsageError& e) {
      raise(classes.usage, e.what(), py::dict());
    } catch (const SystemError& e) {
      raise(classes.system, e.what(), py::dict());
    } catch (const ProtocolError& e) {
      raise(classes.protocol, e.what(), py::dict());
    } catch (const Error& e) {
      raise(classes.error, e.what(), py::dict());
    }
  });
}

}  // namespace meshrt::python
