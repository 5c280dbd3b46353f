// The meshrt._core extension module; python/meshrt/__init__.py re-exports it.
#include <pybind11/pybind11.h>

#include "bindings.hpp"
#include "meshrt/version.hpp"

PYBIND11_MODULE(_core, m) {
  namespace mp = meshrt::python;
  m.doc() = "meshrt's native core: the runtime, tensors and groups (see the meshrt package)";
  m.attr("__version__") = MESHRT_VERSION_STRING;
  mp::bind_errors(m);
  mp::bind_tensor(m);
  mp::bind_controller(m);
  mp::bind_functions(m);
  mp::bind_group(m);
}
