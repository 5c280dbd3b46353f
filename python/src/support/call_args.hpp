// The arguments of controller calls, from Python objects to the C++ API's types, with
// errors that name the Python line (the call site) and what was found.
#pragma once

#include <fmt/format.h>
#include <pybind11/pybind11.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "meshrt/call_site.hpp"
#include "meshrt/controller.hpp"
#include "meshrt/error.hpp"

namespace meshrt::python {

namespace py = pybind11;

// A UsageError of a C++ call that records no site of its own, given the Python line.
template <class F>
auto at_site(const CallSite& where, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const UsageError& e) {
    const std::string site = to_string(where);
    const std::string what = e.what();
    if (what.find("(at " + site + ")") != std::string::npos) throw;
    throw UsageError(fmt::format("{} (at {})", what, site));
  }
}

// A UsageError naming the Python line.
[[noreturn]] void usage(const CallSite& where, const std::string& what);

// The type's qualified name; "list [1, 'a']", shortened: what was found, for an error.
std::string type_name(py::handle obj);
std::string found(py::handle obj);

std::int64_t to_int(py::handle obj, const std::string& what, const CallSite& where);
std::string to_name(py::handle obj, const std::string& what, const CallSite& where);
// {"dp": 2, "tp": 2} or [("dp", 2), ("tp", 2)].
std::vector<std::pair<std::string, std::int64_t>> to_dims(py::handle obj, const std::string& what,
                                                          const CallSite& where);
// The dimensions of a collective: nullopt for one (a str), the list for a tuple or list of
// str (several as one; empty: every dimension); anything else a UsageError naming `call`.
std::optional<std::vector<std::string>> dimension_list(py::handle dim, std::string_view call, const CallSite& where);
Reduction to_reduction(py::handle obj, const CallSite& where);
DeviceKind to_kind(py::handle obj, const CallSite& where);

// A tuple's items (borrowed references).
inline std::span<PyObject* const> items(const py::tuple& t) {
  return {PySequence_Fast_ITEMS(t.ptr()), t.size()};
}
// A remote call's arguments from args[first:], for function `fn`.
std::vector<Arg> to_args(std::span<PyObject* const> args, std::size_t first, const std::string& fn,
                         const CallSite& where);
// A registered function's name: a str, or a function @meshrt.function registered.
std::string function_name(py::handle fn, const CallSite& where, const char* call = "call");
// The controller's array (numpy, torch, meshrt.Tensor) as a host tensor.
Tensor host_tensor(py::handle obj, const std::string& what, const CallSite& where);
// One DTensor, or a tuple or list of them (None: none).
std::vector<DTensor> to_tensors(py::handle obj, const char* what, const CallSite& where);

// A call's one output, or None (an undefined DTensor: a function that only mutates).
py::object one_or_none(DTensor t);
py::list to_list(std::vector<DTensor> ts);
py::list ranks_of(const NDSlice& s);
// The Python exception object `e` would raise, translated as a call would translate it.
py::object exception_object(const std::exception_ptr& e);
std::optional<std::chrono::duration<double>> seconds(std::optional<double> s);
std::string mesh_repr(const Mesh& m);

}  // namespace meshrt::python
