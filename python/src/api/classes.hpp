// The Python classes of the controller API (Future, Stream, DTensor, Mesh, WorkerObject,
// Recording, Controller): declared first, all of them, so that every method's signature names the
// Python classes it takes and returns (pybind11 writes a signature when a method is
// bound); each *_bind.cpp then adds its class's methods.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <variant>

#include "meshrt/controller.hpp"
#include "support/gil.hpp"

namespace meshrt::python {

namespace py = pybind11;

// What main(ctl) receives: the session's Controller while the session runs.
struct ControllerHandle {
  Controller* ctl = nullptr;
  Controller& get() const {
    if (ctl == nullptr) {
      throw UsageError(
          "this Controller's session has ended (meshrt.run returned); use the one the next meshrt.run passes to "
          "main");
    }
    return *ctl;
  }
};

// A recording and the form its function returned: one DTensor, None, or a tuple of them
// (a list returns as a tuple); each replay returns the same form.
struct PyRecording {
  Recording recording;
  enum class Form { One, None, Tuple } form = Form::Tuple;
};

// A Python object a handle keeps: released with the GIL taken, since the handle may die on
// a thread without it (the graveyard), and leaked once the interpreter is gone.
class KeptObject {
 public:
  explicit KeptObject(py::object o) : object_(std::move(o)) {}
  ~KeptObject() {
    if (!Py_IsInitialized()) {
      (void)object_.release();
      return;
    }
    py::gil_scoped_acquire gil;
    object_ = py::object();
  }
  KeptObject(const KeptObject&) = delete;
  KeptObject& operator=(const KeptObject&) = delete;
  const py::object& get() const { return object_; }

 private:
  py::object object_;
};

// A meshrt.Future: a fetch's tensor, a completion (a barrier's) whose result is None, or a
// fetch of several tensors; `finish`, when set, makes the Python result of the raw one
// (the pytree of a fetch of several, the decoded value of ctl.fetch).
struct PyFuture {
  std::variant<Future<Tensor>, Future<void>, Future<std::vector<Tensor>>> future;
  std::shared_ptr<KeptObject> finish;
};

using FutureClass = py::class_<PyFuture, Holder<PyFuture>>;
using StreamClass = py::class_<Stream, Holder<Stream>>;
using DTensorClass = py::class_<DTensor, Holder<DTensor>>;
using MeshClass = py::class_<Mesh, Holder<Mesh>>;
using WorkerObjectClass = py::class_<Object, Holder<Object>>;
using RecordingClass = py::class_<PyRecording, Holder<PyRecording>>;
using ControllerClass = py::class_<ControllerHandle, std::shared_ptr<ControllerHandle>>;

// Registers the seven classes (no methods yet).
void declare_api_classes(py::module_& m);

// A class declare_api_classes registered, to add methods to.
template <class Class>
Class api_class(py::module_& m, const char* name) {
  return py::reinterpret_borrow<Class>(m.attr(name));
}

}  // namespace meshrt::python
