// The meshrt._core extension module; python/meshrt/__init__.py re-exports it.
#include <pybind11/pybind11.h>

#include "bindings.hpp"
#include "meshrt/internal/controller.hpp"
#include "meshrt/version.hpp"
#include "support/gil.hpp"

PYBIND11_MODULE(_core, m) {
  namespace mp = meshrt::python;
  m.doc() = "meshrt's native core: the runtime, tensors and groups (see the meshrt package)";
  m.attr("__version__") = MESHRT_VERSION_STRING;
  meshrt::detail::set_wait_check(&mp::check_signals);
  mp::register_python_stacks();
  mp::bind_errors(m);
  mp::bind_caller(m);
  mp::bind_tensor(m);
  mp::bind_enums(m);
  mp::declare_api_classes(m);
  mp::bind_future(m);
  mp::bind_stream(m);
  mp::bind_dtensor(m);
  mp::bind_mesh(m);
  mp::bind_recording(m);
  mp::bind_controller(m);
  mp::bind_runtime(m);
  mp::bind_functions(m);
  mp::bind_group(m);
}
