// The parts of the meshrt._core extension module, each in its own file under python/src/:
// PYBIND11_MODULE (module.cpp) calls them in this order.
#pragma once

#include <pybind11/pybind11.h>

namespace meshrt::python {

namespace py = pybind11;

// meshrt.Error and its subclasses, and the translation of C++ exceptions (errors.cpp).
void bind_errors(py::module_& m);
// DType and its module-level names (meshrt.float32, ...), Device, TensorMeta, Tensor and
// DLPack (tensor.cpp).
void bind_tensor(py::module_& m);
// run(), Controller, Mesh, DTensor, Stream, Future, Reduction (controller.cpp).
void bind_controller(py::module_& m);
// Python remote functions: meshrt.function, CallContext (functions.cpp).
void bind_functions(py::module_& m);
// StatelessGroup and its object codec (group.cpp).
void bind_group(py::module_& m);

// Whether this process's Runtime has started, its handshake done (controller.cpp): Python
// functions registered later would exist on this rank only (functions.cpp refuses them).
bool runtime_started();

}  // namespace meshrt::python
