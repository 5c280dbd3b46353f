// The object codec's encoder (obj_codec.hpp): the walk over Python objects with the C API.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cstring>
#include <limits>
#include <map>
#include <utility>

#include "group/codec_format.hpp"
#include "group/obj_codec.hpp"
#include "meshrt/error.hpp"
#include "meshrt/tensor.hpp"
#include "support/convert.hpp"

namespace meshrt::python::codec {
namespace {

using namespace format;  // NOLINT(google-build-using-namespace): the codec's own vocabulary

// ---- encoding -------------------------------------------------------------------------

// A part of the object the safe codec does not take (and pickle was not allowed, or
// failed): unwinds to the top, each container adding its index to `path`.
struct Unsupported {
  std::string type;
  std::string reason;
  std::string path;
  bool pickle_failed = false;
  bool too_deep = false;
};

std::string key_text(py::handle key) {
  std::string r = py::repr(key);
  if (r.size() > 40) r = r.substr(0, 37) + "...";
  return r;
}

class Encoder {
 public:
  Encoder(bool allow_pickle, Encoded& out) : allow_pickle_(allow_pickle), out_(out) {}

  void value(py::handle o, int depth, bool in_key) {
    if (depth > kMaxDepth) {
      throw Unsupported{type_name(o), fmt::format("nested deeper than {} levels (does it contain itself?)", kMaxDepth),
                        "", false, true};
    }
    PyObject* p = o.ptr();
    if (p == Py_None) return u8(kNone);
    if (p == Py_True) return u8(kTrue);
    if (p == Py_False) return u8(kFalse);
    if (PyLong_CheckExact(p)) return integer(o);
    if (PyFloat_CheckExact(p)) {
      u8(kFloat);
      const double v = PyFloat_AS_DOUBLE(p);
      return put(&v, sizeof v);
    }
    if (PyComplex_CheckExact(p)) {
      u8(kComplex);
      const Py_complex c = PyComplex_AsCComplex(p);
      put(&c.real, sizeof c.real);
      return put(&c.imag, sizeof c.imag);
    }
    if (PyUnicode_CheckExact(p)) {
      Py_ssize_t n = 0;
      const char* s = PyUnicode_AsUTF8AndSize(p, &n);
      if (s == nullptr) {
        PyErr_Clear();
        return unsupported(o, "a str with unpaired surrogates has no UTF-8 form", in_key);
      }
      u8(kStr);
      return blob(s, static_cast<std::size_t>(n));
    }
    if (PyBytes_CheckExact(p)) {
      u8(kBytes);
      return storage(PyBytes_AS_STRING(p), static_cast<std::size_t>(PyBytes_GET_SIZE(p)), o, in_key);
    }
    if (PyList_CheckExact(p) || PyTuple_CheckExact(p)) {
      const bool list = PyList_CheckExact(p);
      const Py_ssize_t n = list ? PyList_GET_SIZE(p) : PyTuple_GET_SIZE(p);
      u8(list ? kList : kTuple);
      u64(static_cast<std::uint64_t>(n));
      for (Py_ssize_t i = 0; i < n; ++i) {
        // A list may change under a __repr__ or __reduce__ called while encoding it.
        if (list && i >= PyList_GET_SIZE(p)) {
          throw Unsupported{"list", "it changed size while being encoded", "", false};
        }
        py::handle item = list ? PyList_GET_ITEM(p, i) : PyTuple_GET_ITEM(p, i);
        try {
          value(item, depth + 1, in_key);
        } catch (Unsupported& e) {
          e.path = fmt::format("[{}]{}", i, e.path);
          throw;
        }
      }
      return;
    }
    if (PyDict_CheckExact(p)) {
      u8(kDict);
      u64(static_cast<std::uint64_t>(PyDict_Size(p)));
      Py_ssize_t pos = 0;
      PyObject* k = nullptr;
      PyObject* v = nullptr;
      std::size_t count = 0;
      while (PyDict_Next(p, &pos, &k, &v)) {
        py::object key = py::reinterpret_borrow<py::object>(k);  // held: the dict may change under us
        py::object val = py::reinterpret_borrow<py::object>(v);
        try {
          value(key, depth + 1, true);
          value(val, depth + 1, in_key);
        } catch (Unsupported& e) {
          e.path = fmt::format("[{}]{}", key_text(key), e.path);
          throw;
        }
        ++count;
      }
      if (count != static_cast<std::size_t>(PyDict_Size(p))) {
        throw Unsupported{"dict", "it changed size while being encoded", "", false};
      }
      return;
    }
    if (PyAnySet_CheckExact(p)) return set(o, depth);
    if (PyByteArray_CheckExact(p)) {
      u8(kByteArray);
      return storage(PyByteArray_AS_STRING(p), static_cast<std::size_t>(PyByteArray_GET_SIZE(p)), o, in_key);
    }
    PyTypeObject* ndarray = numpy_ndarray();
    if (ndarray != nullptr && Py_TYPE(p) == ndarray) return numpy_array(o, depth, in_key);
    if (py::isinstance<Tensor>(o)) return meshrt_tensor(o, in_key);
    if (py::handle tt = torch_tensor_type(); tt && PyObject_IsInstance(p, tt.ptr()) == 1)
      return torch_tensor(o, in_key);
    if (ndarray != nullptr && PyObject_IsInstance(p, cached(cache().np_generic, "numpy", "generic").ptr()) == 1) {
      return numpy_scalar(o, depth, in_key);
    }
    unsupported(o, "", in_key);
  }

  // The whole object pickled (allow_pickle): for one the safe codec cannot walk, such as
  // one that contains itself, which pickle keeps as it is.
  void pickled(py::handle o) { unsupported(o, "", false); }

 private:
  void put(const void* p, std::size_t n) { out_.bytes.append(static_cast<const char*>(p), n); }
  void u8(std::uint8_t v) { out_.bytes.push_back(static_cast<char>(v)); }
  void u32(std::uint32_t v) { put(&v, sizeof v); }
  void u64(std::uint64_t v) { put(&v, sizeof v); }
  void blob(const char* p, std::size_t n) {
    u64(n);
    put(p, n);
  }
  // Dict keys stay inline: a key is hashed as soon as it is decoded, before any
  // out-of-band buffer could fill it.
  void storage(const char* p, std::size_t n, py::handle owner, bool in_key) {
    if (n <= kInlineMax || in_key) {
      u8(kInline);
      return blob(p, n);
    }
    u8(kOutOfBand);
    u64(n);
    out_.buffers.push_back(Buffer{p, n, py::reinterpret_borrow<py::object>(owner)});
  }
  void shape(const std::vector<std::int64_t>& s) {
    u32(static_cast<std::uint32_t>(s.size()));
    for (std::int64_t d : s) put(&d, sizeof d);
  }

  // A set's items are hashed as soon as they are decoded, so they travel as dict keys do.
  void set(py::handle o, int depth) {
    PyObject* p = o.ptr();
    const auto n = static_cast<std::size_t>(PySet_GET_SIZE(p));
    const char* kind = PyFrozenSet_CheckExact(p) ? "frozenset" : "set";
    u8(PyFrozenSet_CheckExact(p) ? kFrozenSet : kSet);
    u64(n);
    auto it = py::reinterpret_steal<py::object>(PyObject_GetIter(p));
    if (!it) throw py::error_already_set();
    std::size_t count = 0;
    while (PyObject* next = PyIter_Next(it.ptr())) {
      py::object item = py::reinterpret_steal<py::object>(next);
      if (count == n) break;
      try {
        value(item, depth + 1, true);
      } catch (Unsupported& e) {
        e.path = fmt::format("{{{}}}{}", key_text(item), e.path);
        throw;
      }
      ++count;
    }
    // The set's own iterator raises once its size changes (under a __reduce__ called while
    // encoding it).
    if (PyErr_Occurred() != nullptr) PyErr_Clear();
    if (count != n || static_cast<std::size_t>(PySet_GET_SIZE(p)) != n) {
      throw Unsupported{kind, "it changed size while being encoded", "", false};
    }
  }

  void integer(py::handle o) {
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(o.ptr(), &overflow);
    if (overflow == 0) {
      u8(kInt);
      const std::int64_t w = v;
      return put(&w, sizeof w);
    }
    // Arbitrary size: two's complement, little-endian, one sign bit to spare.
    const auto bits = o.attr("bit_length")().cast<std::size_t>();
    const std::size_t n = bits / 8 + 1;
    py::bytes b = o.attr("to_bytes")(n, "little", py::arg("signed") = true);
    u8(kBigInt);
    const std::string_view s = b;
    blob(s.data(), s.size());
  }

  // A structured dtype's descr is a value nested in the array's, as the decoder counts it.
  void numpy_dtype(const py::dtype& dt, int depth) {
    if (dt.has_fields()) {
      u8(kDTypeDescr);
      value(cached(cache().np_dtype_to_descr, "numpy.lib.format", "dtype_to_descr")(dt), depth + 1, true);
    } else {
      u8(kDTypeStr);
      const std::string& s = dtype_str(dt);
      blob(s.data(), s.size());
    }
  }

  void numpy_array(py::handle o, int depth, bool in_key) {
    auto a = py::reinterpret_borrow<py::array>(o);
    py::dtype dt = a.dtype();
    if (has_objects(dt))
      return unsupported(o, "a numpy array of Python objects (dtype " + std::string(py::str(dt)) + ")", in_key);
    if (!(a.flags() & py::detail::npy_api::NPY_ARRAY_C_CONTIGUOUS_)) {
      a = cached(cache().ascontiguous, "numpy", "ascontiguousarray")(a);
    }
    u8(kNumpy);
    numpy_dtype(dt, depth);
    shape(std::vector<std::int64_t>(a.shape(), a.shape() + a.ndim()));
    storage(static_cast<const char*>(a.data()), static_cast<std::size_t>(a.nbytes()), a, in_key);
  }

  void numpy_scalar(py::handle o, int depth, bool in_key) {
    py::array a = py::array::ensure(o);
    if (!a) throw py::error_already_set();
    py::dtype dt = a.dtype();
    if (has_objects(dt)) return unsupported(o, "a numpy scalar holding a Python object", in_key);
    u8(kNumpyScalar);
    numpy_dtype(dt, depth);
    u8(kInline);
    blob(static_cast<const char*>(a.data()), static_cast<std::size_t>(a.nbytes()));
  }

  void torch_tensor(py::handle o, bool in_key) {
    py::object t = py::reinterpret_borrow<py::object>(o);
    const std::string device = py::str(t.attr("device").attr("type"));
    if (device != "cpu")
      return unsupported(o, "a torch tensor on " + device + " (move it to the CPU first: .cpu())", in_key);
    if (t.attr("layout").ptr() != cached(cache().torch_strided, "torch", "strided").ptr()) {
      return unsupported(o, "a torch tensor of layout " + std::string(py::str(t.attr("layout"))), in_key);
    }
    std::string dtype = py::str(t.attr("dtype"));
    if (dtype.starts_with("torch.")) dtype = dtype.substr(6);
    if (torch_canonical(dtype) == nullptr) return unsupported(o, "a torch tensor of dtype " + dtype, in_key);
    if (t.attr("requires_grad").cast<bool>()) t = t.attr("detach")();
    if (t.attr("is_conj")().cast<bool>()) t = t.attr("resolve_conj")();
    if (py::hasattr(t, "is_neg") && t.attr("is_neg")().cast<bool>()) t = t.attr("resolve_neg")();
    if (!t.attr("is_contiguous")().cast<bool>()) t = t.attr("contiguous")();
    const auto s = t.attr("shape").cast<std::vector<std::int64_t>>();
    const auto numel = t.attr("numel")().cast<std::size_t>();
    const auto item = t.attr("element_size")().cast<std::size_t>();
    const auto ptr = t.attr("data_ptr")().cast<std::uintptr_t>();
    u8(kTorch);
    blob(dtype.data(), dtype.size());
    shape(s);
    storage(reinterpret_cast<const char*>(ptr), numel * item, t, in_key);
  }

  void meshrt_tensor(py::handle o, bool in_key) {
    const Tensor& t = o.cast<const Tensor&>();
    if (!t.defined()) return unsupported(o, "an undefined meshrt.Tensor", in_key);
    if (t.device().is_accelerator()) {
      return unsupported(o, "a meshrt.Tensor on " + t.device().to_string() + " (only host tensors travel)", in_key);
    }
    const std::string_view dtype = name(t.dtype());
    u8(kMeshrt);
    blob(dtype.data(), dtype.size());
    shape(t.shape());
    storage(static_cast<const char*>(t.raw_data()), t.nbytes(), o, in_key);
  }

  void unsupported(py::handle o, const std::string& reason, bool /*in_key*/) {
    if (!allow_pickle_) throw Unsupported{type_name(o), reason, "", false};
    py::bytes b;
    try {
      b = cached(cache().pickle_dumps, "pickle", "dumps")(o, py::arg("protocol") = 5);
    } catch (py::error_already_set& e) {
      throw Unsupported{type_name(o), e.what(), "", true};
    }
    u8(kPickle);
    const std::string_view s = b;
    blob(s.data(), s.size());
    out_.pickled = true;
  }

  bool allow_pickle_;
  Encoded& out_;
};

}  // namespace

void encode(py::handle obj, bool allow_pickle, Encoded& out) {
  out.bytes.clear();
  out.buffers.clear();
  out.pickled = false;
  out.bytes.resize(kHeaderBytes);
  Encoder e(allow_pickle, out);
  try {
    try {
      e.value(obj, 0, false);
    } catch (const Unsupported& u) {
      if (!u.too_deep || !allow_pickle) throw;
      out.bytes.resize(kHeaderBytes);
      out.buffers.clear();
      e.pickled(obj);
    }
  } catch (const Unsupported& u) {
    out.buffers.clear();
    const std::string at = u.path.empty() ? std::string() : " (at " + u.path + ")";
    if (u.pickle_failed) {
      throw UsageError(fmt::format(
          "object of type {}{} is not supported by the safe codec and could not be pickled: {}", u.type, at, u.reason));
    }
    throw UsageError(
        fmt::format("object of type {}{} is not supported by the safe codec{}; pass allow_pickle=True on "
                    "both sides",
                    u.type, at, u.reason.empty() ? std::string() : " (" + u.reason + ")"));
  }
  for (const Buffer& b : out.buffers) {
    const std::uint64_t n = b.size;
    out.bytes.append(reinterpret_cast<const char*>(&n), sizeof n);
  }
  const std::uint32_t nbuf = static_cast<std::uint32_t>(out.buffers.size());
  const std::uint8_t flags = out.pickled ? kFlagPickled : 0;
  char* h = out.bytes.data();
  std::memcpy(h, &kMagic, 4);
  h[4] = static_cast<char>(kVersion);
  h[5] = static_cast<char>(flags);
  h[6] = h[7] = 0;
  std::memcpy(h + 8, &nbuf, 4);
}

}  // namespace meshrt::python::codec
