#include "support/call_args.hpp"

#include <fmt/ranges.h>

#include <cctype>

#include "support/convert.hpp"

namespace meshrt::python {
namespace {

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// A numpy scalar (numpy.float32(1.5), numpy.int64(3)): taken as the Python number it holds.
bool is_numpy_scalar(py::handle obj) {
  PyObject* numpy = PyImport_GetModule(py::str("numpy").ptr());  // only if already imported
  if (numpy == nullptr) {
    PyErr_Clear();
    return false;
  }
  py::object np = py::reinterpret_steal<py::object>(numpy);
  return py::isinstance(obj, np.attr("generic"));
}

// An argument's position for error messages ("2", "0[1]"), formatted only when one is
// raised: a call converts its arguments on every call, and fails rarely.
struct Position {
  const Position* parent = nullptr;
  std::size_t index = 0;
  std::string text() const { return parent ? fmt::format("{}[{}]", parent->text(), index) : std::to_string(index); }
};

Arg to_arg(py::handle obj, const std::string& fn, const Position& position, const CallSite& where);

// A tuple or list (or a subclass of either) as a list argument.
Arg list_arg(py::handle obj, const std::string& fn, const Position& position, const CallSite& where) {
  std::vector<Arg> items;
  if (PyTuple_CheckExact(obj.ptr())) {  // its items by index: no iterator made
    const std::size_t n = static_cast<std::size_t>(PyTuple_GET_SIZE(obj.ptr()));
    items.reserve(n);
    for (std::size_t i = 0; i < n; ++i)
      items.push_back(to_arg(PyTuple_GET_ITEM(obj.ptr(), i), fn, Position{&position, i}, where));
    return Arg::list(std::move(items));
  }
  items.reserve(py::len(obj));
  std::size_t i = 0;
  for (py::handle item : obj) items.push_back(to_arg(item, fn, Position{&position, i++}, where));
  return Arg::list(std::move(items));
}

Arg to_arg(py::handle obj, const std::string& fn, const Position& position, const CallSite& where) {
  // The exact builtin types and meshrt's own first, by type pointer: no pybind11 lookups.
  PyObject* p = obj.ptr();
  static PyTypeObject* const dtensor_type = reinterpret_cast<PyTypeObject*>(py::type::of<DTensor>().ptr());
  static PyTypeObject* const dtype_type = reinterpret_cast<PyTypeObject*>(py::type::of<DType>().ptr());
  if (Py_TYPE(p) == dtensor_type) return Arg(obj.cast<const DTensor&>());
  if (PyFloat_CheckExact(p)) return Arg(PyFloat_AS_DOUBLE(p));
  if (PyLong_CheckExact(p)) {
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(p, &overflow);
    if (overflow == 0) return Arg(v);
  }
  if (PyUnicode_CheckExact(p)) {
    Py_ssize_t n = 0;
    if (const char* text = PyUnicode_AsUTF8AndSize(p, &n)) return Arg(std::string(text, static_cast<std::size_t>(n)));
    PyErr_Clear();
  }
  if (Py_TYPE(p) == dtype_type) return Arg(obj.cast<DType>());
  if (PyBool_Check(p)) return Arg(p == Py_True);
  if (p == Py_None) return Arg(Value());
  if (PyTuple_CheckExact(p) || PyList_CheckExact(p)) return list_arg(obj, fn, position, where);
  if (py::isinstance<DTensor>(obj)) return Arg(obj.cast<const DTensor&>());
  if (py::isinstance<Object>(obj)) {
    const Object& o = obj.cast<const Object&>();
    if (!o.defined()) {
      usage(where, fmt::format("{}: argument {}: the WorkerObject was dropped (.drop()); it names no object any more",
                               fn, position.text()));
    }
    return Arg(o);
  }
  if (py::isinstance<py::bool_>(obj)) return Arg(obj.cast<bool>());
  if (py::isinstance<py::int_>(obj))
    return Arg(to_int(obj, fmt::format("{}: argument {}", fn, position.text()), where));
  if (py::isinstance<py::float_>(obj)) return Arg(obj.cast<double>());
  if (py::isinstance<py::str>(obj)) return Arg(obj.cast<std::string>());
  if (obj.is_none()) return Arg(Value());
  if (is_dtype_like(obj)) {
    try {
      return Arg(to_dtype(obj));
    } catch (const UsageError& e) {
      usage(where, fmt::format("{}: argument {}: {}", fn, position.text(), e.what()));
    }
  }
  if (is_numpy_scalar(obj)) return to_arg(obj.attr("item")(), fn, position, where);
  if (py::isinstance<py::tuple>(obj) || py::isinstance<py::list>(obj)) return list_arg(obj, fn, position, where);
  if (is_tensor_like(obj)) {
    try {
      return Arg(to_tensor(obj, fmt::format("{}: argument {}", fn, position.text())));
    } catch (const UsageError& e) {
      usage(where, e.what());
    }
  }
  usage(where, fmt::format("{}: argument {}: expected a DTensor, a WorkerObject, a number, bool, str, None, a dtype, "
                           "a tuple or list of these, or a tensor (numpy array, torch tensor, meshrt.Tensor); found {}",
                           fn, position.text(), found(obj)));
}

}  // namespace

[[noreturn]] void usage(const CallSite& where, const std::string& what) {
  throw UsageError(fmt::format("{} (at {})", what, to_string(where)));
}

std::string type_name(py::handle obj) {
  return py::str(py::type::handle_of(obj).attr("__qualname__"));
}

// "list [1, 'a']", shortened: what was found, for an error.
std::string found(py::handle obj) {
  std::string r = py::repr(obj);
  if (r.size() > 60) r = r.substr(0, 57) + "...";
  return fmt::format("{} {}", type_name(obj), r);
}

std::int64_t to_int(py::handle obj, const std::string& what, const CallSite& where) {
  if (py::isinstance<py::bool_>(obj) || !PyIndex_Check(obj.ptr()))
    usage(where, what + ": expected an int, found " + found(obj));
  py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(obj.ptr()));
  if (!index) throw py::error_already_set();
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  if (overflow != 0) usage(where, what + ": expected an int that fits in 64 bits, found " + found(obj));
  return v;
}

std::string to_name(py::handle obj, const std::string& what, const CallSite& where) {
  if (!py::isinstance<py::str>(obj)) usage(where, what + ": expected a str, found " + found(obj));
  return obj.cast<std::string>();
}

std::optional<std::vector<std::string>> dimension_list(py::handle dim, std::string_view call, const CallSite& where) {
  if (py::isinstance<py::str>(dim)) return std::nullopt;
  if (py::isinstance<py::tuple>(dim) || py::isinstance<py::list>(dim)) {
    std::vector<std::string> out;
    for (py::handle d : dim) {
      if (!py::isinstance<py::str>(d)) {
        usage(where, fmt::format("{}: expected each dimension a str, found {}", call, found(d)));
      }
      out.push_back(d.cast<std::string>());
    }
    return out;
  }
  usage(where, fmt::format("{}: expected a dimension (a str) or several (a tuple of str), found {}", call, found(dim)));
}

// {"dp": 2, "tp": 2} or [("dp", 2), ("tp", 2)].
std::vector<std::pair<std::string, std::int64_t>> to_dims(py::handle obj, const std::string& what,
                                                          const CallSite& where) {
  std::vector<std::pair<std::string, std::int64_t>> dims;
  if (py::isinstance<py::dict>(obj)) {
    for (auto [k, v] : obj.cast<py::dict>()) {
      const std::string name = to_name(k, what + ": a dimension name", where);
      dims.emplace_back(name, to_int(v, fmt::format("{}: the size of '{}'", what, name), where));
    }
    return dims;
  }
  if (!py::isinstance<py::list>(obj) && !py::isinstance<py::tuple>(obj)) {
    usage(where, what + ": expected a dict {name: size} or a list of (name, size) pairs, found " + found(obj));
  }
  for (py::handle item : obj) {
    if (!(py::isinstance<py::tuple>(item) || py::isinstance<py::list>(item)) || py::len(item) != 2) {
      usage(where, what + ": expected (name, size) pairs, found " + found(item));
    }
    const std::string name = to_name(item[py::int_(0)], what + ": a dimension name", where);
    dims.emplace_back(name, to_int(item[py::int_(1)], fmt::format("{}: the size of '{}'", what, name), where));
  }
  return dims;
}

Reduction to_reduction(py::handle obj, const CallSite& where) {
  if (py::isinstance<Reduction>(obj)) return obj.cast<Reduction>();
  if (py::isinstance<py::str>(obj))
    return at_site(where, [&] { return parse_reduction(lower(obj.cast<std::string>())); });
  usage(where, "reduce: expected a meshrt.Reduction or its name (\"sum\"), found " + found(obj));
}

DeviceKind to_kind(py::handle obj, const CallSite& where) {
  if (py::isinstance<DeviceKind>(obj)) return obj.cast<DeviceKind>();
  if (py::isinstance<py::str>(obj)) {
    const std::string text = lower(obj.cast<std::string>());
    for (DeviceKind k : {DeviceKind::Cpu, DeviceKind::Cuda, DeviceKind::Emulated}) {
      if (text == name(k)) return k;
    }
  }
  usage(where, "world_mesh: expected kind \"cpu\", \"cuda\", \"emulated\" or a meshrt.DeviceKind, found " + found(obj));
}

std::vector<Arg> to_args(std::span<PyObject* const> args, std::size_t first, const std::string& fn,
                         const CallSite& where) {
  std::vector<Arg> out;
  out.reserve(args.size() - first);
  for (std::size_t i = first; i < args.size(); ++i)
    out.push_back(to_arg(args[i], fn, Position{nullptr, i - first}, where));
  return out;
}

std::string function_name(py::handle fn, const CallSite& where, const char* call) {
  if (py::isinstance<py::str>(fn)) return fn.cast<std::string>();
  // A function @meshrt.function registered stands for its name.
  if (py::object name = py::getattr(fn, "__meshrt_function__", py::none()); py::isinstance<py::str>(name))
    return name.cast<std::string>();
  usage(where, fmt::format("{}: expected a registered function's name (a str), or the function @meshrt.function "
                           "registered, found {}",
                           call, found(fn)));
}

Tensor host_tensor(py::handle obj, const std::string& what, const CallSite& where) {
  try {
    return to_tensor(obj, what);
  } catch (const UsageError& e) {
    usage(where, e.what());
  }
}

// A new Python DTensor owning `t`, made as py::cast makes it but without its lookups (the
// class by its C++ type's name; a Python object already at `t`'s address, which a
// DTensor just moved from a call's results never has).
py::object new_dtensor(DTensor t) {
  static py::detail::type_info* const info = py::detail::get_type_info(typeid(DTensor), /*throw_if_missing=*/true);
  auto object = py::reinterpret_steal<py::object>(py::detail::make_new_instance(info->type));
  auto* instance = reinterpret_cast<py::detail::instance*>(object.ptr());
  instance->owned = true;
  instance->get_value_and_holder().value_ptr() = new DTensor(std::move(t));
  info->init_instance(instance, nullptr);  // the holder takes the DTensor
  return object;
}

py::object one_or_none(DTensor t) {
  if (!t.defined()) return py::none();
  return new_dtensor(std::move(t));
}

py::list to_list(std::vector<DTensor> ts) {
  py::list out(ts.size());
  for (std::size_t i = 0; i < ts.size(); ++i) out[i] = new_dtensor(std::move(ts[i]));
  return out;
}

// A recording and the form its function returned: one DTensor, None, or a tuple of them

std::vector<DTensor> to_tensors(py::handle obj, const char* what, const CallSite& where) {
  std::vector<DTensor> out;
  auto one = [&](py::handle item) {
    if (!py::isinstance<DTensor>(item)) usage(where, fmt::format("{}: expected DTensors, found {}", what, found(item)));
    out.push_back(item.cast<DTensor>());
  };
  if (py::isinstance<py::tuple>(obj) || py::isinstance<py::list>(obj)) {
    for (py::handle item : obj) one(item);
  } else if (!obj.is_none()) {
    one(obj);
  }
  return out;
}

py::list ranks_of(const NDSlice& s) {
  py::list out;
  for (auto r : s) out.append(static_cast<std::int64_t>(r));
  return out;
}

// The Python exception object `e` would raise, translated as a call would translate it.
py::object exception_object(const std::exception_ptr& e) {
  py::cpp_function raiser([e] { std::rethrow_exception(e); });
  try {
    raiser();
  } catch (py::error_already_set& err) {
    return err.value();
  }
  return py::none();
}

std::optional<std::chrono::duration<double>> seconds(std::optional<double> s) {
  if (!s) return std::nullopt;
  return std::chrono::duration<double>(*s);
}

std::string mesh_repr(const Mesh& m) {
  std::vector<std::string> dims;
  const auto sizes = m.sizes();
  for (std::size_t i = 0; i < sizes.size(); ++i) dims.push_back(fmt::format("'{}': {}", m.names()[i], sizes[i]));
  std::vector<std::int64_t> ranks;
  for (auto r : m.ranks()) ranks.push_back(static_cast<std::int64_t>(r));
  return fmt::format("meshrt.Mesh({{{}}}, ranks [{}])", fmt::join(dims, ", "), fmt::join(ranks, ", "));
}

}  // namespace meshrt::python
