// The Python line that issued a controller call, as a meshrt::CallSite. Errors, the desync
// report and the flight recorder then name "train.py:42 (step)", not a line of the binding.
#pragma once

#include <pybind11/pybind11.h>

#include <string>

#include "meshrt/call_site.hpp"

namespace meshrt::python {

namespace py = pybind11;

// The innermost Python frame outside the meshrt package (file, function, line). The GIL
// is held. The text it points at is interned and never freed (the controller keeps sites
// for as long as it reports on the work); a call site seen before costs a lookup, not an
// allocation. Without a Python frame: "<unknown>", line 0.
CallSite caller_site();

// "train.py:42 (step)", as the controller writes a site.
inline std::string describe(const CallSite& where) {
  return to_string(where);
}

// _core._caller_site(): (file_name, function_name, line) of caller_site(), for the
// package's tests.
void bind_caller(py::module_& m);

}  // namespace meshrt::python
