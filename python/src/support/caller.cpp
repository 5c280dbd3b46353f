// Python call sites as meshrt::CallSite (site.hpp): interned text, so a site outlives
// every use the controller makes of it.
#include "support/caller.hpp"

#include <frameobject.h>

#include <cstring>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace meshrt::python {
namespace {

struct CodeLineHash {
  std::size_t operator()(const std::pair<PyCodeObject*, int>& k) const noexcept {
    return std::hash<const void*>{}(k.first) ^ (static_cast<std::size_t>(k.second) * 0x9e3779b97f4a7c15ULL);
  }
};

// Every site made so far. Touched with the GIL held only; never freed.
struct Sites {
  std::set<std::string> text;  // file names and function names (nodes do not move)
  // (code object, bytecode offset) -> site: the offset, unlike the line, costs nothing to
  // read, so a call site seen before is one lookup. The code objects are kept alive (a
  // strong reference each) so that an address is never reused for other code while it is
  // a key here.
  std::unordered_map<std::pair<PyCodeObject*, int>, CallSite, CodeLineHash> by_code;
  // Code objects of the meshrt package's own files, which a call site skips; kept alive
  // for the same reason.
  std::unordered_set<PyCodeObject*> in_package;
  std::string package;  // the meshrt package's folder, with a trailing '/'
};

Sites& sites() {
  static Sites* s = new Sites();  // never destroyed: sites outlive every controller
  return *s;
}

const char* intern(const char* text) {
  return sites().text.emplace(text).first->c_str();
}

CallSite make_site(const char* file, const char* function, int line) {
  return CallSite(intern(file), intern(function), static_cast<std::uint32_t>(line < 0 ? 0 : line));
}

const std::string& package_folder() {
  Sites& s = sites();
  if (s.package.empty()) {
    py::object path = py::module_::import("meshrt").attr("__path__");
    s.package = py::str(path[py::int_(0)]).cast<std::string>() + "/";
  }
  return s.package;
}

bool in_package(PyCodeObject* code, const std::string& package) {
  const char* file = PyUnicode_AsUTF8(code->co_filename);
  if (file == nullptr) {
    PyErr_Clear();
    return false;
  }
  return std::strncmp(file, package.data(), package.size()) == 0;
}

// The offset of the frame's current instruction, which identifies its line.
int last_instruction(PyFrameObject* frame) {
#if PY_VERSION_HEX >= 0x030B0000
  return PyFrame_GetLasti(frame);
#else
  return frame->f_lasti;
#endif
}

}  // namespace

CallSite caller_site() {
  Sites& s = sites();
  const std::string& package = package_folder();
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  CallSite found;
  bool have = false;
  while (frame != nullptr && !have) {
    PyCodeObject* code = PyFrame_GetCode(frame);  // new reference
    const auto key = std::make_pair(code, last_instruction(frame));
    if (auto it = s.by_code.find(key); it != s.by_code.end()) {
      found = it->second;
      have = true;
    } else if (!s.in_package.contains(code)) {
      if (in_package(code, package)) {
        Py_INCREF(code);  // the set's reference
        s.in_package.insert(code);
      } else {
        const char* file = PyUnicode_AsUTF8(code->co_filename);
        const char* function = PyUnicode_AsUTF8(code->co_name);
        if (file == nullptr || function == nullptr) PyErr_Clear();
        found = make_site(file ? file : "<unknown>", function ? function : "<unknown>", PyFrame_GetLineNumber(frame));
        Py_INCREF(code);  // the key's reference
        s.by_code.emplace(key, found);
        have = true;
      }
    }
    Py_DECREF(code);
    if (have) break;
    PyFrameObject* back = PyFrame_GetBack(frame);  // new reference
    Py_DECREF(frame);
    frame = back;
  }
  Py_XDECREF(frame);
  return have ? found : make_site("<unknown>", "<unknown>", 0);
}

void bind_caller(py::module_& m) {
  m.def(
      "_caller_site",
      [] {
        const CallSite where = caller_site();
        return py::make_tuple(where.file_name(), where.function_name(), where.line());
      },
      "(file, function, line) of the Python line that called it, as the controller records a call site "
      "(for the package's tests).");
}

}  // namespace meshrt::python
