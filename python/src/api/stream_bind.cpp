// Stream in Python: a stream of work on the workers, and its borrows.
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

void bind_stream(py::module_& m) {
  auto cls = api_class<StreamClass>(m, "Stream");
  cls.def_property_readonly("name", &Stream::name)
      .def(
          "borrow",
          [](const Stream& s, const DTensor& t, bool mutable_borrow) {
            const auto where = caller_site();
            return released([&] { return s.borrow(t, mutable_borrow, where); });
          },
          py::arg("t"), py::arg("mutable") = false,
          "A handle to t usable on this stream; end it with drop(). A mutable borrow needs no other active borrow.")
      .def("__eq__", [](const Stream& a, const Stream& b) { return a == b; })
      .def("__repr__", [](const Stream& s) { return "meshrt.Stream('" + s.name() + "')"; });
}

}  // namespace meshrt::python
