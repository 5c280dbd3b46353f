// Methods bound as CPython METH_FASTCALL functions instead of through pybind11's
// dispatcher, for the calls a program issues in its inner loop (mesh.call): the
// dispatcher's argument tuple, overload loop and type lookups cost as much as converting
// the arguments. They raise what a pybind11 method raises (the same exception
// translators), and their docstrings keep pybind11's signature line, which
// python/stubgen.py reads.
#pragma once

#include <pybind11/pybind11.h>

#ifdef __GLIBCXX__
#include <cxxabi.h>
#endif

#include <array>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <typeinfo>

namespace meshrt::python {

namespace py = pybind11;

// A fast method's positional arguments (borrowed references).
using FastArgs = std::span<PyObject* const>;

namespace fast_method_internal {

// The exception being handled as a Python error, as pybind11's dispatcher sets it.
inline PyObject* raise_current() {
  try {
    throw;
  } catch (py::error_already_set& e) {
    e.restore();
#ifdef __GLIBCXX__
  } catch (abi::__forced_unwind&) {
    throw;
#endif
  } catch (...) {
    if (py::detail::apply_exception_translators(py::detail::get_local_internals().registered_exception_translators))
      return nullptr;
    if (py::detail::apply_exception_translators(py::detail::get_internals().registered_exception_translators))
      return nullptr;
    PyErr_SetString(PyExc_SystemError, "Exception escaped from default exception translator!");
  }
  return nullptr;
}

// The C++ object of `self`, an instance of T's class (the method descriptor has checked
// that): its value pointer, found without a type lookup when its type is T's own class.
template <class T>
T& self_of(PyObject* self) {
  static py::detail::type_info* const info = py::detail::get_type_info(typeid(T), /*throw_if_missing=*/true);
  auto* inst = reinterpret_cast<py::detail::instance*>(self);
  auto vh = inst->get_value_and_holder(info, /*throw_if_missing=*/true);
  if (!vh.holder_constructed()) throw py::type_error("a method called on an instance that was never initialised");
  return *vh.template value_ptr<std::remove_const_t<T>>();
}

template <class T, py::object (*F)(T&, FastArgs)>
PyObject* call(PyObject* self, PyObject* const* args, Py_ssize_t n) {
  try {
    return F(self_of<T>(self), FastArgs(args, static_cast<std::size_t>(n))).release().ptr();
  } catch (...) {
    return raise_current();
  }
}

template <class T, std::size_t N, py::object (*F)(T&, const std::array<PyObject*, N>&)>
struct KwCall {
  static inline std::array<const char*, N> names{};
  static inline std::size_t positional = 0;  // how many may be given by position
  static inline std::size_t required = 0;    // how many must be given
  static inline const char* name = "";

  // pybind11's errors for a call that does not match the signature are TypeErrors; so are these.
  static void parse(PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames, std::array<PyObject*, N>& out) {
    const auto np = static_cast<std::size_t>(nargs);
    if (np > positional) {
      throw py::type_error(std::string(name) + "() takes at most " + std::to_string(positional) +
                           " positional arguments (" + std::to_string(np) + " given)");
    }
    for (std::size_t i = 0; i < np; ++i) out[i] = args[i];
    if (kwnames != nullptr) {
      const Py_ssize_t nk = PyTuple_GET_SIZE(kwnames);
      for (Py_ssize_t k = 0; k < nk; ++k) {
        PyObject* key = PyTuple_GET_ITEM(kwnames, k);
        std::size_t i = 0;
        while (i < N && PyUnicode_CompareWithASCIIString(key, names[i]) != 0) ++i;
        if (i == N) {
          throw py::type_error(std::string(name) + "() got an unexpected keyword argument '" +
                               py::str(key).cast<std::string>() + "'");
        }
        if (out[i] != nullptr) {
          throw py::type_error(std::string(name) + "() got multiple values for argument '" + names[i] + "'");
        }
        out[i] = args[nargs + k];
      }
    }
    for (std::size_t i = 0; i < required; ++i) {
      if (out[i] == nullptr) {
        throw py::type_error(std::string(name) + "() missing required argument '" + names[i] + "'");
      }
    }
  }

  static PyObject* call(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
    try {
      std::array<PyObject*, N> a{};
      parse(args, nargs, kwnames, a);
      return F(self_of<T>(self), a).release().ptr();
    } catch (...) {
      return raise_current();
    }
  }
};

}  // namespace fast_method_internal

// Adds the method `name` to `cls` (T's class): F(self, positional arguments). `doc` starts
// with the signature line pybind11 would write ("call(self: meshrt._core.Mesh, *args) ->
// object\n\n...").
template <class T, py::object (*F)(T&, FastArgs)>
void def_fast_method(py::handle cls, const char* name, const char* doc) {
  // The method table entry lives as long as the class, which is as long as the process.
  auto* def = new PyMethodDef{
      name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fast_method_internal::call<T, F>)),
      METH_FASTCALL, doc};
  auto method = py::reinterpret_steal<py::object>(PyDescr_NewMethod(reinterpret_cast<PyTypeObject*>(cls.ptr()), def));
  if (!method) throw py::error_already_set();
  py::setattr(cls, name, method);
}

// Replaces the pybind11 method `name` of `cls` (T's class) with a METH_FASTCALL |
// METH_KEYWORDS one: F receives the arguments named `names` (borrowed; nullptr where not
// given), the first `positional` of which may come by position and the first `required`
// must be given. The docstring is the pybind11 method's, so its signature line (which
// python/stubgen.py reads) stays what it was.
template <class T, std::size_t N, py::object (*F)(T&, const std::array<PyObject*, N>&)>
void replace_with_fast_method(py::handle cls, const char* name, const std::array<const char*, N>& names,
                              std::size_t positional, std::size_t required) {
  using K = fast_method_internal::KwCall<T, N, F>;
  K::names = names;
  K::positional = positional;
  K::required = required;
  K::name = name;
  // The docstring and method table entry live as long as the class: the process.
  auto* doc = new std::string(py::str(cls.attr(name).attr("__doc__")).cast<std::string>());
  auto* def = new PyMethodDef{name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&K::call)),
                              METH_FASTCALL | METH_KEYWORDS, doc->c_str()};
  auto method = py::reinterpret_steal<py::object>(PyDescr_NewMethod(reinterpret_cast<PyTypeObject*>(cls.ptr()), def));
  if (!method) throw py::error_already_set();
  py::setattr(cls, name, method);
}

}  // namespace meshrt::python
