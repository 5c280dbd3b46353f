// The Python line that issued a controller call, in the form the C++ controller keeps a
// call site: a std::source_location. Errors, the desync report and the flight recorder
// then name "train.py:42 (step)", not a line of the binding.
#pragma once

#include <pybind11/pybind11.h>

#include <source_location>
#include <string>

namespace meshrt::python {

namespace py = pybind11;

// The innermost Python frame outside the meshrt package (file, function, line). The GIL
// is held. The text it points at is interned and never freed (the controller keeps sites
// for as long as it reports on the work); a call site seen before costs a lookup, not an
// allocation. Without a Python frame: "<unknown>", line 0.
std::source_location caller_site();

// "train.py:42 (step)", as the controller writes a site.
std::string describe(const std::source_location& where);

// Checks that a std::source_location made from interned text reads back (this standard
// library's layout); throws ImportError when it does not. Run once, at import.
void check_site_layout();

// _core._caller_site(): (file_name, function_name, line) of caller_site() read back
// through std::source_location, for the package's tests.
void bind_site(py::module_& m);

}  // namespace meshrt::python
