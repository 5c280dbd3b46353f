// Python call sites as std::source_location (site.hpp).
//
// A std::source_location holds one pointer to a constant record {file, function, line,
// column} that the compiler emits for source_location::current(): the layout GCC's and
// Clang's __builtin_source_location() require of std::source_location::__impl, in
// libstdc++ and libc++ alike. The standard offers no constructor from run-time values, so
// a Python site is such a record made at run time, interned and never freed, and its
// address copied into a std::source_location. check_site_layout() proves the layout at
// import, both ways, before any site is made.
#include "site.hpp"

#include <frameobject.h>

#include <bit>
#include <cstring>
#include <deque>
#include <set>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>

#include "controller/site.hpp"

namespace meshrt::python {
namespace {

struct SiteRecord {
  const char* file;
  const char* function;
  unsigned line;
  unsigned column;
};
static_assert(sizeof(std::source_location) == sizeof(const SiteRecord*),
              "std::source_location is expected to hold one pointer to its record");
static_assert(std::is_trivially_copyable_v<std::source_location>);

std::source_location location_of(const SiteRecord* record) {
  return std::bit_cast<std::source_location>(record);
}

const SiteRecord* record_of(const std::source_location& loc) {
  return std::bit_cast<const SiteRecord*>(loc);
}

struct CodeLineHash {
  std::size_t operator()(const std::pair<PyCodeObject*, int>& k) const noexcept {
    return std::hash<const void*>{}(k.first) ^ (static_cast<std::size_t>(k.second) * 0x9e3779b97f4a7c15ULL);
  }
};

// Every site made so far. Touched with the GIL held only; never freed.
struct Sites {
  std::set<std::string> text;      // file names and function names (nodes do not move)
  std::deque<SiteRecord> records;  // elements do not move when it grows
  // (code object, line) -> record. The code objects are kept alive (a strong reference
  // each) so that an address is never reused for other code while it is a key here.
  std::unordered_map<std::pair<PyCodeObject*, int>, const SiteRecord*, CodeLineHash> by_code;
  std::string package;  // the meshrt package's folder, with a trailing '/'
  const SiteRecord* unknown = nullptr;
};

Sites& sites() {
  static Sites* s = new Sites();  // never destroyed: sites outlive every controller
  return *s;
}

const char* intern(const char* text) {
  return sites().text.emplace(text).first->c_str();
}

const SiteRecord* make_record(const char* file, const char* function, int line) {
  Sites& s = sites();
  s.records.push_back(SiteRecord{intern(file), intern(function), static_cast<unsigned>(line < 0 ? 0 : line), 0});
  return &s.records.back();
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

}  // namespace

std::source_location caller_site() {
  Sites& s = sites();
  const std::string& package = package_folder();
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  const SiteRecord* found = nullptr;
  while (frame != nullptr && found == nullptr) {
    PyCodeObject* code = PyFrame_GetCode(frame);  // new reference
    if (!in_package(code, package)) {
      const int line = PyFrame_GetLineNumber(frame);
      const auto key = std::make_pair(code, line);
      if (auto it = s.by_code.find(key); it != s.by_code.end()) {
        found = it->second;
      } else {
        const char* file = PyUnicode_AsUTF8(code->co_filename);
        const char* function = PyUnicode_AsUTF8(code->co_name);
        if (file == nullptr || function == nullptr) PyErr_Clear();
        found = make_record(file ? file : "<unknown>", function ? function : "<unknown>", line);
        Py_INCREF(code);  // the key's reference
        s.by_code.emplace(key, found);
      }
    }
    Py_DECREF(code);
    PyFrameObject* back = PyFrame_GetBack(frame);  // new reference
    Py_DECREF(frame);
    frame = back;
  }
  Py_XDECREF(frame);
  if (found == nullptr) {
    if (s.unknown == nullptr) s.unknown = make_record("<unknown>", "<unknown>", 0);
    found = s.unknown;
  }
  return location_of(found);
}

std::string describe(const std::source_location& where) {
  return detail::describe(where);
}

void check_site_layout() {
  // Ours read through std::source_location ...
  static const SiteRecord probe{"probe.py", "probe", 7, 3};
  const std::source_location made = location_of(&probe);
  // ... and the compiler's read through ours.
  const std::source_location here = std::source_location::current();
  const SiteRecord* read = record_of(here);
  const bool ok = made.line() == 7 && made.column() == 3 && std::strcmp(made.file_name(), "probe.py") == 0 &&
                  std::strcmp(made.function_name(), "probe") == 0 && read != nullptr && read->line == here.line() &&
                  read->column == here.column() && std::strcmp(read->file, here.file_name()) == 0 &&
                  std::strcmp(read->function, here.function_name()) == 0;
  if (!ok) {
    throw py::import_error(
        "meshrt._core: this C++ standard library lays out std::source_location differently from the "
        "{file, function, line, column} record meshrt expects; Python call sites cannot be named "
        "(build meshrt with GCC or Clang and libstdc++ or libc++)");
  }
}

void bind_site(py::module_& m) {
  m.def(
      "_caller_site",
      [] {
        const std::source_location where = caller_site();
        return py::make_tuple(where.file_name(), where.function_name(), where.line());
      },
      "(file, function, line) of the Python line that called it, as the controller records a call site "
      "(for the package's tests).");
}

}  // namespace meshrt::python
