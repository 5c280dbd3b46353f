#include "group/codec_format.hpp"

#include <map>
#include <utility>

namespace meshrt::python::codec::format {
namespace {

constexpr TorchDType kTorchDTypes[] = {
    {"bool", "|b1", 1},         {"uint8", "|u1", 1},   {"int8", "|i1", 1},      {"int16", "<i2", 2},
    {"int32", "<i4", 4},        {"int64", "<i8", 8},   {"float16", "<f2", 2},   {"bfloat16", "bfloat16", 2},
    {"float32", "<f4", 4},      {"float64", "<f8", 8}, {"complex32", "<c4", 4}, {"complex64", "<c8", 8},
    {"complex128", "<c16", 16},
};

}  // namespace

Cache& cache() {
  static auto* c = new Cache();
  return *c;
}

std::string type_name(py::handle obj) {
  py::handle t = py::type::handle_of(obj);
  const std::string module = py::str(t.attr("__module__"));
  const std::string qual = py::str(t.attr("__qualname__"));
  return module == "builtins" ? qual : module + "." + qual;
}

py::object& cached(py::object*& slot, const char* module, const char* attr) {
  if (slot == nullptr) {
    py::object m = py::module_::import(module);
    slot = new py::object(attr == nullptr ? m : m.attr(attr));
  }
  return *slot;
}

PyObject* imported(const char* name) {
  return PyDict_GetItemString(PyImport_GetModuleDict(), name);  // borrowed
}

PyTypeObject* numpy_ndarray() {
  static PyTypeObject* type = nullptr;  // numpy, once imported, stays
  if (type == nullptr && imported("numpy") != nullptr) type = py::detail::npy_api::get().PyArray_Type_;
  return type;
}

py::handle torch_tensor_type() {
  if (cache().torch_tensor != nullptr) return *cache().torch_tensor;
  if (imported("torch") == nullptr) return py::handle();
  return cached(cache().torch_tensor, "torch", "Tensor");
}

const TorchDType* torch_dtype(std::string_view name) {
  for (const auto& d : kTorchDTypes) {
    if (name == d.name) return &d;
  }
  return nullptr;
}
const char* torch_canonical(std::string_view name) {
  const TorchDType* d = torch_dtype(name);
  return d == nullptr ? nullptr : d->canonical;
}

bool has_objects(const py::dtype& dt) {
  return (static_cast<unsigned char>(dt.flags()) & 0x01) != 0;  // NPY_ITEM_REFCOUNT: holds Python objects
}

const std::string& dtype_str(const py::dtype& dt) {
  static auto* known = new std::map<PyObject*, std::string>();  // holds a reference to each key
  if (auto it = known->find(dt.ptr()); it != known->end()) return it->second;
  std::string s = py::str(dt.attr("str"));
  if (known->size() >= 256) {
    static std::string last;
    last = std::move(s);
    return last;
  }
  return known->emplace(dt.inc_ref().ptr(), std::move(s)).first->second;
}

std::string numpy_canonical(const py::dtype& dt) {
  if (dt.has_fields()) {
    py::object descr = cached(cache().np_dtype_to_descr, "numpy.lib.format", "dtype_to_descr")(dt);
    return "descr:" + std::string(py::repr(descr));
  }
  return dtype_str(dt);
}

}  // namespace meshrt::python::codec::format
