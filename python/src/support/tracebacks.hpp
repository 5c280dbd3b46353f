// Python exceptions as meshrt's messages name them: "ValueError: bad input", the last
// frames of a traceback, the innermost frame. The GIL is held.
#pragma once

#include <pybind11/pybind11.h>

#include <string>

namespace meshrt::python {

namespace py = pybind11;

// "numpy.ndarray", "ValueError" (builtins without their module).
std::string qualified_name(py::handle type);
// "ValueError: bad input"
std::string exception_line(const py::error_already_set& e);
// The traceback's last `limit` frames, as Python prints them.
std::string last_frames(const py::error_already_set& e, int limit);
// "file.py:12 in scale_shape": where the innermost frame raised.
std::string innermost(const py::error_already_set& e);

}  // namespace meshrt::python
