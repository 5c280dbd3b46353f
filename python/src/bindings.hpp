// The parts of the meshrt._core extension module, one bind_* per bound thing, each in its
// own file under python/src/ (support/, api/, group/); PYBIND11_MODULE (module.cpp) calls
// them in this order.
#pragma once

#include <pybind11/pybind11.h>

namespace meshrt::python {

namespace py = pybind11;

// meshrt.Error and its subclasses, and the translation of C++ exceptions
// (support/errors_bind.cpp).
void bind_errors(py::module_& m);
// _core._caller_site, for the package's tests (support/caller.cpp).
void bind_caller(py::module_& m);
// DType and its module-level names (meshrt.float32, ...), Device, TensorMeta, Tensor and
// DLPack (api/tensor_bind.cpp).
void bind_tensor(py::module_& m);
// Reduction, DeviceKind, MeshPermutation (api/enums_bind.cpp).
void bind_enums(py::module_& m);
// The controller API's classes, declared before any method (api/classes.cpp), then each
// class's methods.
void declare_api_classes(py::module_& m);
void bind_future(py::module_& m);
void bind_stream(py::module_& m);
void bind_dtensor(py::module_& m);
void bind_mesh(py::module_& m);
void bind_recording(py::module_& m);
void bind_controller(py::module_& m);
// meshrt.run, rank, world_size, _shutdown (runtime_bind.cpp).
void bind_runtime(py::module_& m);
// Python remote functions: CallContext, Signature, _register_function
// (api/functions_bind.cpp).
void bind_functions(py::module_& m);
// StatelessGroup and its object codec (group/group_bind.cpp).
void bind_group(py::module_& m);

// Registers the provider of Python stacks for the desync report (support/python_stacks.cpp).
void register_python_stacks();

// Whether this process's Runtime has started, its handshake done (runtime_bind.cpp):
// Python functions registered later would exist on this rank only.
bool runtime_started();
// Starts MPI through the core's MPI session unless it runs; finalised after the
// interpreter if meshrt started it (runtime_bind.cpp). `who` names the caller in errors.
void start_mpi(const char* who);

}  // namespace meshrt::python
