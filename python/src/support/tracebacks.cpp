#include "support/tracebacks.hpp"

#include <fmt/format.h>

namespace meshrt::python {

std::string qualified_name(py::handle type) {
  const std::string module = py::str(type.attr("__module__"));
  const std::string name = py::str(type.attr("__qualname__"));
  return module == "builtins" ? name : module + "." + name;
}

// "ValueError: bad input"
std::string exception_line(const py::error_already_set& e) {
  const std::string message = py::str(e.value());
  const std::string type = qualified_name(e.type());
  return message.empty() ? type : type + ": " + message;
}

// The traceback's last `limit` frames, as Python prints them.
std::string last_frames(const py::error_already_set& e, int limit) {
  if (!e.trace()) return "";
  int frames = 0;
  for (py::handle tb = e.trace(); !tb.is_none(); tb = tb.attr("tb_next")) ++frames;
  py::list lines = py::module_::import("traceback").attr("format_tb")(e.trace(), py::arg("limit") = -limit);
  std::string out = frames > limit ? fmt::format("Traceback (the last {} of {} frames):\n", limit, frames)
                                   : std::string("Traceback (most recent call last):\n");
  for (py::handle line : lines) out += py::str(line).cast<std::string>();
  while (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

// "file.py:12 in scale_shape": where the innermost frame raised.
std::string innermost(const py::error_already_set& e) {
  if (!e.trace()) return "";
  py::handle tb = e.trace();
  while (!tb.attr("tb_next").is_none()) tb = tb.attr("tb_next");
  py::handle code = tb.attr("tb_frame").attr("f_code");
  return fmt::format("{}:{} in {}", py::str(code.attr("co_filename")).cast<std::string>(),
                     tb.attr("tb_lineno").cast<int>(), py::str(code.attr("co_name")).cast<std::string>());
}

constexpr int kTracebackFrames = 5;

}  // namespace meshrt::python
