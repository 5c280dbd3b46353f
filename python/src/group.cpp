// StatelessGroup in Python, with its object codec.
#include "bindings.hpp"

namespace meshrt::python {

void bind_group(py::module_&) {}

}  // namespace meshrt::python
