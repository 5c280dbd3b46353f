// Future in Python: result(timeout=), done(), exception(); waits release the GIL.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "api/classes.hpp"
#include "bindings.hpp"
#include "support/call_args.hpp"
#include "support/caller.hpp"
#include "support/convert.hpp"

namespace meshrt::python {

void bind_future(py::module_& m) {
  auto cls = api_class<FutureClass>(m, "Future");
  cls.def(
         "result",
         [](Future<Tensor>& f, std::optional<double> timeout) {
           Tensor t = released([&] { return timeout ? f.get(*seconds(timeout)) : f.get(); });
           return wrap_tensor(std::move(t));
         },
         py::arg("timeout") = py::none(),
         "Waits (Ctrl-C interrupts) and returns the meshrt.Tensor; RemoteError if it depends on a failure, "
         "meshrt.TimeoutError after `timeout` seconds.")
      .def(
          "done", [](Future<Tensor>& f) { return released([&] { return f.done(); }); },
          "True once result() would return or raise without waiting.")
      .def(
          "exception",
          [](Future<Tensor>& f) -> py::object {
            std::exception_ptr e = released([&] { return f.exception(); });
            if (!e) return py::none();
            return exception_object(e);
          },
          "Waits; the exception result() would raise, or None.");
}

}  // namespace meshrt::python
