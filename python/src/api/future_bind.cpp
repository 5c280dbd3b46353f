// Future in Python: result(timeout=), done(), exception(); waits release the GIL. The
// concurrent.futures and asyncio surface (callbacks, await) is meshrt._futures'.
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
namespace {

py::module_ futures() {
  return py::module_::import("meshrt._futures");
}

}  // namespace

void bind_future(py::module_& m) {
  auto cls = api_class<FutureClass>(m, "Future");
  cls.def(
         "result",
         [](PyFuture& f, std::optional<double> timeout) -> py::object {
           return std::visit(
               [&]<class F>(F& fut) -> py::object {
                 py::object out;
                 if constexpr (std::is_same_v<F, Future<void>>) {
                   released([&] { timeout ? fut.get(*seconds(timeout)) : fut.get(); });
                   out = py::none();
                 } else if constexpr (std::is_same_v<F, Future<std::vector<Tensor>>>) {
                   std::vector<Tensor> ts = released([&] { return timeout ? fut.get(*seconds(timeout)) : fut.get(); });
                   py::list l;
                   for (Tensor& t : ts) l.append(wrap_tensor(std::move(t)));
                   out = std::move(l);
                 } else {
                   Tensor t = released([&] { return timeout ? fut.get(*seconds(timeout)) : fut.get(); });
                   out = wrap_tensor(std::move(t));
                 }
                 return f.finish ? f.finish->get()(out) : out;
               },
               f.future);
         },
         py::arg("timeout") = py::none(),
         "Waits (Ctrl-C interrupts) and returns the meshrt.Tensor (None for a completion, mesh.barrier()'s; the "
         "same structure of them for a fetch_shard of a tuple, list or dict; the value for ctl.fetch); "
         "RemoteError if it depends on a failure, meshrt.TimeoutError after `timeout` seconds.")
      .def(
          "done",
          [](PyFuture& f) {
            return released([&] { return std::visit([](auto& fut) { return fut.done(); }, f.future); });
          },
          "True once result() would return or raise without waiting.")
      .def(
          "exception",
          [](PyFuture& f, std::optional<double> timeout) -> py::object {
            std::exception_ptr e = released([&] {
              return std::visit([&](auto& fut) { return timeout ? fut.exception(*seconds(timeout)) : fut.exception(); },
                                f.future);
            });
            if (!e) return py::none();
            return exception_object(e);
          },
          py::arg("timeout") = py::none(),
          "Waits; the exception result() would raise, or None; meshrt.TimeoutError after `timeout` seconds.")
      .def(
          "add_done_callback",
          [](const py::object& self, const py::object& fn) { futures().attr("add_done_callback")(self, fn); },
          py::arg("fn"),
          "Calls fn(future) once the future is done: at once (on this thread) if it is, else from meshrt's "
          "completion thread, which polls the replies while callbacks are pending. An exception in fn is logged "
          "(logger \"meshrt\"), never lost and never raised into meshrt.")
      .def(
          "cancel", [](const PyFuture&) { return false; },
          "False: meshrt cannot cancel work it has issued (the workers may already run it); drop the values "
          "instead.")
      .def(
          "cancelled", [](const PyFuture&) { return false; }, "False: a meshrt future is never cancelled.")
      .def(
          "running",
          [](PyFuture& f) {
            return !released([&] { return std::visit([](auto& fut) { return fut.done(); }, f.future); });
          },
          "True until done(): issued work counts as running (it cannot be cancelled).")
      .def(
          "__await__", [](const py::object& self) { return futures().attr("await_future")(self); },
          "`await future` in asyncio: the result, or the exception; the event loop never blocks (the completion "
          "thread settles it through loop.call_soon_threadsafe).");
}

}  // namespace meshrt::python
