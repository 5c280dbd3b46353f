// Recording in Python (ctl.record's result): a replay returns the form the recorded
// function returned.
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
namespace {

py::object in_form(std::vector<DTensor> out, PyRecording::Form form) {
  if (form == PyRecording::Form::None) return py::none();
  if (form == PyRecording::Form::One) return py::cast(std::move(out.front()));
  py::tuple t(out.size());
  for (std::size_t i = 0; i < out.size(); ++i) t[i] = py::cast(std::move(out[i]));
  return t;
}

}  // namespace

void bind_recording(py::module_& m) {
  auto cls = api_class<RecordingClass>(m, "Recording");
  cls.def(
         "__call__",
         [](const PyRecording& r, py::args inputs) {
           const auto where = caller_site();
           std::vector<DTensor> in = to_tensors(inputs, "replay", where);
           std::vector<DTensor> out = released([&] { return r.recording(in, where); });
           return in_form(std::move(out), r.form);
         },
         "Replays the step on tensors of the same metas, meshes and streams as the examples; returns fresh "
         "results in the form the recorded function returned them.")
      .def_property_readonly("num_inputs", [](const PyRecording& r) { return r.recording.num_inputs(); })
      .def_property_readonly("num_outputs", [](const PyRecording& r) { return r.recording.num_outputs(); })
      .def_property_readonly("num_commands", [](const PyRecording& r) { return r.recording.num_commands(); });
}

}  // namespace meshrt::python
