// The Python classes of meshrt's exceptions (errors.cpp), for code that raises them or
// turns a Python exception back into the C++ one (a shape function's UsageError).
#pragma once

#include <pybind11/pybind11.h>

namespace meshrt::python {

enum class ErrorKind { Error, Usage, Remote, Timeout, System, Internal, Protocol };

// The class (borrowed; owned by the module) for `kind`.
PyObject* error_class(ErrorKind kind);

}  // namespace meshrt::python
