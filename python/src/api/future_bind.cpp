// Future in Python: result(timeout=), done(), exception(); waits release the GIL.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
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
         [](PyFuture& f, std::optional<double> timeout) -> py::object {
           return std::visit(
               [&]<class F>(F& fut) -> py::object {
                 if constexpr (std::is_same_v<F, Future<void>>) {
                   released([&] { timeout ? fut.get(*seconds(timeout)) : fut.get(); });
                   return py::none();
                 } else {
                   Tensor t = released([&] { return timeout ? fut.get(*seconds(timeout)) : fut.get(); });
                   return wrap_tensor(std::move(t));
                 }
               },
               f.future);
         },
         py::arg("timeout") = py::none(),
         "Waits (Ctrl-C interrupts) and returns the meshrt.Tensor (None for a completion, mesh.barrier()'s); "
         "RemoteError if it depends on a failure, meshrt.TimeoutError after `timeout` seconds.")
      .def(
          "done",
          [](PyFuture& f) {
            return released([&] { return std::visit([](auto& fut) { return fut.done(); }, f.future); });
          },
          "True once result() would return or raise without waiting.")
      .def(
          "exception",
          [](PyFuture& f) -> py::object {
            std::exception_ptr e =
                released([&] { return std::visit([](auto& fut) { return fut.exception(); }, f.future); });
            if (!e) return py::none();
            return exception_object(e);
          },
          "Waits; the exception result() would raise, or None.");
}

}  // namespace meshrt::python
