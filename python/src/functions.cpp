// Python remote functions: meshrt.function and CallContext.
#include "bindings.hpp"

namespace meshrt::python {

void bind_functions(py::module_&) {}

}  // namespace meshrt::python
