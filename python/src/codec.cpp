// The Python group's object codec (codec.hpp): the walk over Python objects with the C API,
// and the decoder that checks every length against the bytes it has before it allocates.
#include "codec.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cstring>
#include <limits>
#include <map>
#include <utility>

#include "convert.hpp"
#include "meshrt/error.hpp"
#include "meshrt/tensor.hpp"

namespace meshrt::python::codec {
namespace {

constexpr std::uint32_t kMagic = 0x5950524d;  // "MRPY"
constexpr std::uint8_t kVersion = 1;
constexpr std::size_t kHeaderBytes = 12;
constexpr std::uint8_t kFlagPickled = 1;
// Deeper nesting is refused on both sides (a cycle, or an object no one meant to send).
constexpr int kMaxDepth = 1000;
// numpy's own limit is 32 (64 from numpy 2).
constexpr std::uint32_t kMaxDims = 64;

enum Tag : std::uint8_t {
  kNone = 'N',
  kTrue = 'T',
  kFalse = 'F',
  kInt = 'i',
  kBigInt = 'I',
  kFloat = 'f',
  kStr = 's',
  kBytes = 'b',
  kByteArray = 'y',
  kList = 'l',
  kTuple = 't',
  kDict = 'd',
  kNumpy = 'a',
  kNumpyScalar = 'e',
  kTorch = 'g',
  kMeshrt = 'm',
  kPickle = 'P',
};
// How the bytes of an array, bytes or bytearray travel.
enum Storage : std::uint8_t { kInline = 0, kOutOfBand = 1 };
// How a numpy dtype is written: its dtype.str, or (structured) its descr.
enum DTypeForm : std::uint8_t { kDTypeStr = 0, kDTypeDescr = 1 };

std::string type_name(py::handle obj) {
  py::handle t = py::type::handle_of(obj);
  const std::string module = py::str(t.attr("__module__"));
  const std::string qual = py::str(t.attr("__qualname__"));
  return module == "builtins" ? qual : module + "." + qual;
}

// Python objects the codec looks up once (leaked on purpose: they must outlive every
// group object, and the interpreter tears modules down in no fixed order).
py::object& cached(py::object*& slot, const char* module, const char* attr) {
  if (slot == nullptr) {
    py::object m = py::module_::import(module);
    slot = new py::object(attr == nullptr ? m : m.attr(attr));
  }
  return *slot;
}
py::object* g_pickle_dumps = nullptr;
py::object* g_pickle_loads = nullptr;
py::object* g_ascontiguous = nullptr;
py::object* g_np_generic = nullptr;
py::object* g_np_dtype_to_descr = nullptr;
py::object* g_np_descr_to_dtype = nullptr;
py::object* g_torch = nullptr;
py::object* g_torch_tensor = nullptr;
py::object* g_torch_strided = nullptr;

// A module only if the program has imported it (an object of its types cannot exist
// otherwise, so checking for one never imports anything).
PyObject* imported(const char* name) {
  return PyDict_GetItemString(PyImport_GetModuleDict(), name);  // borrowed
}

PyTypeObject* numpy_ndarray() {
  static PyTypeObject* type = nullptr;  // numpy, once imported, stays
  if (type == nullptr && imported("numpy") != nullptr) type = py::detail::npy_api::get().PyArray_Type_;
  return type;
}

py::handle torch_tensor_type() {
  if (g_torch_tensor != nullptr) return *g_torch_tensor;
  if (imported("torch") == nullptr) return py::handle();
  return cached(g_torch_tensor, "torch", "Tensor");
}

// torch dtypes the codec takes, with their canonical (numpy dtype.str) spelling.
// (meshrt's dtypes are among them, under the same names.)
struct TorchDType {
  const char* name;
  const char* canonical;
  std::size_t itemsize;
};
constexpr TorchDType kTorchDTypes[] = {
    {"bool", "|b1", 1},         {"uint8", "|u1", 1},   {"int8", "|i1", 1},      {"int16", "<i2", 2},
    {"int32", "<i4", 4},        {"int64", "<i8", 8},   {"float16", "<f2", 2},   {"bfloat16", "bfloat16", 2},
    {"float32", "<f4", 4},      {"float64", "<f8", 8}, {"complex32", "<c4", 4}, {"complex64", "<c8", 8},
    {"complex128", "<c16", 16},
};
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

// numpy's dtype.str, remembered per dtype object (the common ones are singletons; asking
// numpy costs more than encoding a small array).
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

// The canonical spelling of a numpy dtype (ArraySpec::dtype).
std::string numpy_canonical(const py::dtype& dt) {
  if (dt.has_fields()) {
    py::object descr = cached(g_np_dtype_to_descr, "numpy.lib.format", "dtype_to_descr")(dt);
    return "descr:" + std::string(py::repr(descr));
  }
  return dtype_str(dt);
}

// ---- encoding -------------------------------------------------------------------------

// A part of the object the safe codec does not take (and pickle was not allowed, or
// failed): unwinds to the top, each container adding its index to `path`.
struct Unsupported {
  std::string type;
  std::string reason;
  std::string path;
  bool pickle_failed = false;
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
                        "", false};
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
    if (PyByteArray_CheckExact(p)) {
      u8(kByteArray);
      return storage(PyByteArray_AS_STRING(p), static_cast<std::size_t>(PyByteArray_GET_SIZE(p)), o, in_key);
    }
    PyTypeObject* ndarray = numpy_ndarray();
    if (ndarray != nullptr && Py_TYPE(p) == ndarray) return numpy_array(o, in_key);
    if (py::isinstance<Tensor>(o)) return meshrt_tensor(o, in_key);
    if (py::handle tt = torch_tensor_type(); tt && PyObject_IsInstance(p, tt.ptr()) == 1)
      return torch_tensor(o, in_key);
    if (ndarray != nullptr && PyObject_IsInstance(p, cached(g_np_generic, "numpy", "generic").ptr()) == 1) {
      return numpy_scalar(o, in_key);
    }
    unsupported(o, "", in_key);
  }

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

  void numpy_dtype(const py::dtype& dt) {
    if (dt.has_fields()) {
      u8(kDTypeDescr);
      value(cached(g_np_dtype_to_descr, "numpy.lib.format", "dtype_to_descr")(dt), 0, true);
    } else {
      u8(kDTypeStr);
      const std::string& s = dtype_str(dt);
      blob(s.data(), s.size());
    }
  }

  void numpy_array(py::handle o, bool in_key) {
    auto a = py::reinterpret_borrow<py::array>(o);
    py::dtype dt = a.dtype();
    if (has_objects(dt))
      return unsupported(o, "a numpy array of Python objects (dtype " + std::string(py::str(dt)) + ")", in_key);
    if (!(a.flags() & py::detail::npy_api::NPY_ARRAY_C_CONTIGUOUS_)) {
      a = cached(g_ascontiguous, "numpy", "ascontiguousarray")(a);
    }
    u8(kNumpy);
    numpy_dtype(dt);
    shape(std::vector<std::int64_t>(a.shape(), a.shape() + a.ndim()));
    storage(static_cast<const char*>(a.data()), static_cast<std::size_t>(a.nbytes()), a, in_key);
  }

  void numpy_scalar(py::handle o, bool in_key) {
    py::array a = py::array::ensure(o);
    if (!a) throw py::error_already_set();
    py::dtype dt = a.dtype();
    if (has_objects(dt)) return unsupported(o, "a numpy scalar holding a Python object", in_key);
    u8(kNumpyScalar);
    numpy_dtype(dt);
    u8(kInline);
    blob(static_cast<const char*>(a.data()), static_cast<std::size_t>(a.nbytes()));
  }

  void torch_tensor(py::handle o, bool in_key) {
    py::object t = py::reinterpret_borrow<py::object>(o);
    const std::string device = py::str(t.attr("device").attr("type"));
    if (device != "cpu")
      return unsupported(o, "a torch tensor on " + device + " (move it to the CPU first: .cpu())", in_key);
    if (t.attr("layout").ptr() != cached(g_torch_strided, "torch", "strided").ptr()) {
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
      b = cached(g_pickle_dumps, "pickle", "dumps")(o, py::arg("protocol") = 5);
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

// ---- decoding -------------------------------------------------------------------------

class Reader {
 public:
  Reader(std::string_view bytes, std::size_t begin, std::size_t end, const Where& where)
      : base_(bytes.data()), pos_(begin), end_(end), where_(where) {}

  [[noreturn]] void corrupt(const std::string& what) const {
    throw ProtocolError(
        fmt::format("{}: the object does not decode at byte {}: {} (corrupt, or not sent by a "
                    "meshrt Python group)",
                    where_(), pos_, what));
  }
  std::size_t remaining() const { return end_ - pos_; }
  std::size_t pos() const { return pos_; }
  const char* take(std::size_t n) {
    if (n > remaining()) corrupt(fmt::format("expected {} more bytes, found {}", n, remaining()));
    const char* p = base_ + pos_;
    pos_ += n;
    return p;
  }
  template <class T>
  T get() {
    T v;
    std::memcpy(&v, take(sizeof v), sizeof v);
    return v;
  }
  std::uint8_t u8() { return get<std::uint8_t>(); }
  std::uint32_t u32() { return get<std::uint32_t>(); }
  std::uint64_t u64() { return get<std::uint64_t>(); }
  std::string_view blob() {
    const std::uint64_t n = u64();
    if (n > remaining()) corrupt(fmt::format("a field declares {} bytes, {} remain", n, remaining()));
    return {take(static_cast<std::size_t>(n)), static_cast<std::size_t>(n)};
  }
  // A count of items each taking at least `min_bytes`.
  std::size_t count(std::size_t min_bytes) {
    const std::uint64_t n = u64();
    if (n > remaining() / min_bytes)
      corrupt(fmt::format("a container declares {} items, {} bytes remain", n, remaining()));
    return static_cast<std::size_t>(n);
  }
  std::vector<std::int64_t> shape() {
    const std::uint32_t nd = u32();
    if (nd > kMaxDims) corrupt(fmt::format("an array declares {} dimensions (at most {})", nd, kMaxDims));
    std::vector<std::int64_t> s(nd);
    for (auto& d : s) {
      d = get<std::int64_t>();
      if (d < 0) corrupt(fmt::format("an array declares dimension {}", d));
    }
    return s;
  }

 private:
  const char* base_;
  std::size_t pos_;
  std::size_t end_;
  const Where& where_;
};

struct Header {
  std::uint8_t flags = 0;
  std::uint32_t nbuf = 0;
  std::size_t value_end = 0;
};

Header read_header(std::string_view bytes, const Where& where) {
  Reader r(bytes, 0, bytes.size(), where);
  if (bytes.size() < kHeaderBytes)
    r.corrupt(fmt::format("expected a {}-byte header, found {} bytes", kHeaderBytes, bytes.size()));
  const auto magic = r.u32();
  const auto version = r.u8();
  Header h;
  h.flags = r.u8();
  (void)r.get<std::uint16_t>();
  h.nbuf = r.u32();
  if (magic != kMagic || version != kVersion) {
    r.corrupt(fmt::format("expected magic {:#x} version {}, found {:#x} version {}", kMagic, kVersion, magic, version));
  }
  if (h.nbuf > (bytes.size() - kHeaderBytes) / 8) r.corrupt(fmt::format("{} buffers declared", h.nbuf));
  h.value_end = bytes.size() - 8 * std::size_t{h.nbuf};
  return h;
}

std::size_t checked_nbytes(Reader& r, const std::vector<std::int64_t>& shape, std::size_t item) {
  std::size_t n = item;
  for (std::int64_t d : shape) {
    if (d != 0 && n > std::numeric_limits<std::size_t>::max() / static_cast<std::size_t>(d)) {
      r.corrupt(fmt::format("an array of shape [{}] overflows", fmt::join(shape, ", ")));
    }
    n *= static_cast<std::size_t>(d);
  }
  return n;
}

// numpy dtypes made from their wire spelling, reused (a program sends a handful).
py::dtype numpy_dtype_from(Reader& r) {
  static auto* cache = new std::map<std::string, py::dtype, std::less<>>();
  const std::uint8_t form = r.u8();
  py::dtype dt;
  if (form == kDTypeStr) {
    const std::string_view s = r.blob();
    if (auto it = cache->find(s); it != cache->end()) return it->second;
    try {
      dt = py::dtype(std::string(s));
    } catch (py::error_already_set&) {
      r.corrupt(fmt::format("numpy has no dtype \"{}\"", s));
    }
    if (has_objects(dt)) r.corrupt(fmt::format("dtype \"{}\" holds Python objects, which are never decoded", s));
    if (cache->size() < 256) cache->emplace(std::string(s), dt);
    return dt;
  }
  if (form != kDTypeDescr) r.corrupt(fmt::format("unknown dtype form {}", form));
  return dt;  // the caller decodes the descr (a value) and builds the dtype
}

class Decoder {
 public:
  Decoder(std::string_view bytes, const Header& h, bool allow_pickle, const Where& where, const Where& from,
          Decoded& out)
      : r_(bytes, kHeaderBytes, h.value_end, where),
        trailer_(bytes, h.value_end, bytes.size(), where),
        nbuf_(h.nbuf),
        allow_pickle_(allow_pickle),
        where_(where),
        from_(from),
        out_(out) {}

  py::object top(const OutTarget* target) {
    py::object v = value(0, false, target);
    if (r_.remaining() != 0) r_.corrupt(fmt::format("{} bytes left over after the object", r_.remaining()));
    if (out_.targets.size() != nbuf_) {
      r_.corrupt(
          fmt::format("the header declares {} out-of-band buffers, the object holds {}", nbuf_, out_.targets.size()));
    }
    return v;
  }

  // The spec of the object if it is one array (nothing is allocated).
  std::optional<ArraySpec> top_array_spec() {
    const std::uint8_t tag = r_.u8();
    if (tag != kNumpy && tag != kTorch && tag != kMeshrt) return std::nullopt;
    return array_head(tag, 0).spec();
  }

 private:
  py::object value(int depth, bool in_key, const OutTarget* target) {
    if (depth > kMaxDepth) r_.corrupt(fmt::format("nested deeper than {} levels", kMaxDepth));
    const std::uint8_t tag = r_.u8();
    if (target != nullptr && tag != kNumpy && tag != kTorch && tag != kMeshrt) {
      throw UsageError(fmt::format("{}: out= is {}, but {} sent an object that is not an array", where_(),
                                   target->spec.to_string(), from_()));
    }
    switch (tag) {
      case kNone:
        return py::none();
      case kTrue:
        return py::bool_(true);
      case kFalse:
        return py::bool_(false);
      case kInt:
        return py::int_(static_cast<long long>(r_.get<std::int64_t>()));
      case kBigInt: {
        const std::string_view b = r_.blob();
        return py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(&PyLong_Type))
            .attr("from_bytes")(py::bytes(b.data(), b.size()), "little", py::arg("signed") = true);
      }
      case kFloat:
        return py::float_(r_.get<double>());
      case kStr: {
        const std::string_view s = r_.blob();
        PyObject* u = PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "strict");
        if (u == nullptr) {
          PyErr_Clear();
          r_.corrupt("a str that is not UTF-8");
        }
        return py::reinterpret_steal<py::object>(u);
      }
      case kBytes:
      case kByteArray:
        return bytes_like(tag == kByteArray, in_key);
      case kList:
      case kTuple: {
        const std::size_t n = r_.count(1);
        PyObject* c = tag == kList ? PyList_New(static_cast<Py_ssize_t>(n)) : PyTuple_New(static_cast<Py_ssize_t>(n));
        if (c == nullptr) throw py::error_already_set();
        auto owner = py::reinterpret_steal<py::object>(c);
        for (std::size_t i = 0; i < n; ++i) {
          PyObject* item = value(depth + 1, in_key, nullptr).release().ptr();
          if (tag == kList) {
            PyList_SET_ITEM(c, static_cast<Py_ssize_t>(i), item);
          } else {
            PyTuple_SET_ITEM(c, static_cast<Py_ssize_t>(i), item);
          }
        }
        return owner;
      }
      case kDict: {
        const std::size_t n = r_.count(2);
        py::dict d;
        for (std::size_t i = 0; i < n; ++i) {
          py::object k = value(depth + 1, true, nullptr);
          py::object v = value(depth + 1, in_key, nullptr);
          if (PyDict_SetItem(d.ptr(), k.ptr(), v.ptr()) != 0) {
            PyErr_Clear();
            r_.corrupt(fmt::format("a dict key of type {} is unhashable", type_name(k)));
          }
        }
        return d;
      }
      case kNumpy:
      case kNumpyScalar:
      case kTorch:
      case kMeshrt:
        return array(tag, depth, in_key, target);
      case kPickle: {
        const std::string_view b = r_.blob();
        if (!allow_pickle_) {
          throw UsageError(fmt::format(
              "{}: the object from {} holds pickled data (the sender passed allow_pickle=True), but this rank did not "
              "pass allow_pickle=True; pickle runs code when it decodes, so the safe codec refuses it unless both "
              "sides pass allow_pickle=True",
              where_(), from_()));
        }
        return cached(g_pickle_loads, "pickle",
                      "loads")(py::memoryview::from_memory(b.data(), static_cast<py::ssize_t>(b.size())));
      }
      default:
        r_.corrupt(fmt::format("unknown tag {:#04x}", tag));
    }
  }

  // Where `n` bytes of an array go: copied now if inline, else a target for buffer i.
  void fill(char* dst, std::size_t n, bool in_key) {
    const std::uint8_t storage = r_.u8();
    if (storage == kInline) {
      const std::string_view b = r_.blob();
      if (b.size() != n) r_.corrupt(fmt::format("an array of {} bytes carries {}", n, b.size()));
      if (n != 0) std::memcpy(dst, b.data(), n);
      return;
    }
    if (storage != kOutOfBand || in_key) r_.corrupt(fmt::format("unknown storage {}", storage));
    const std::uint64_t declared = r_.u64();
    if (out_.targets.size() >= nbuf_) r_.corrupt(fmt::format("more out-of-band buffers than the {} declared", nbuf_));
    const std::uint64_t listed = trailer_.u64();
    if (declared != n || listed != n) {
      r_.corrupt(
          fmt::format("an array of {} bytes declares {} bytes out of band, the trailer {}", n, declared, listed));
    }
    out_.targets.push_back(Target{dst, n});
  }

  // Checks that the next field carries `n` bytes (inline, or out of band as the trailer
  // says), before anything of that size is allocated.
  void expect_storage(std::size_t n) {
    Reader probe = r_;
    const std::uint8_t storage = probe.u8();
    const std::uint64_t declared = probe.u64();
    if (storage == kInline) {
      if (declared != n || n > probe.remaining()) {
        r_.corrupt(fmt::format("{} inline bytes declared for an object of {} bytes, {} remain", declared, n,
                               probe.remaining()));
      }
      return;
    }
    if (storage != kOutOfBand) r_.corrupt(fmt::format("unknown storage {}", storage));
    Reader listed = trailer_;
    if (out_.targets.size() >= nbuf_ || declared != n || listed.u64() != n) {
      r_.corrupt(fmt::format("an object of {} bytes declares {} bytes out of band, which the trailer does not list", n,
                             declared));
    }
  }

  // The size a bytes-like field declares (checked like expect_storage).
  std::size_t storage_size() {
    Reader probe = r_;
    (void)probe.u8();
    const auto n = static_cast<std::size_t>(probe.u64());
    expect_storage(n);
    return n;
  }

  py::object bytes_like(bool bytearray, bool in_key) {
    const std::size_t n = storage_size();
    PyObject* o = bytearray ? PyByteArray_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(n))
                            : PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(n));
    if (o == nullptr) throw py::error_already_set();
    auto owner = py::reinterpret_steal<py::object>(o);
    fill(bytearray ? PyByteArray_AS_STRING(o) : PyBytes_AS_STRING(o), n, in_key);
    return owner;
  }

  // An array's head: what it is, its element type and shape, and its size in bytes.
  struct ArrayHead {
    std::uint8_t tag = 0;
    py::dtype np;      // numpy
    DType dtype{};     // meshrt
    std::string name;  // torch and meshrt: the dtype's name
    std::vector<std::int64_t> shape;
    std::size_t nbytes = 0;

    // Comparable across kinds (numpy spells it only when asked: it costs a Python call).
    ArraySpec spec() const {
      if (tag == kNumpy || tag == kNumpyScalar) return ArraySpec{numpy_canonical(np), shape};
      const char* canonical = torch_canonical(name);
      return ArraySpec{canonical != nullptr ? canonical : name, shape};
    }
  };

  ArrayHead array_head(std::uint8_t tag, int depth) {
    ArrayHead a;
    a.tag = tag;
    if (tag == kNumpy || tag == kNumpyScalar) {
      a.np = numpy_dtype_from(r_);
      if (!a.np) {
        py::object descr = value(depth + 1, true, nullptr);
        try {
          a.np = cached(g_np_descr_to_dtype, "numpy.lib.format", "descr_to_dtype")(descr);
        } catch (py::error_already_set& e) {
          r_.corrupt(fmt::format("a structured dtype that numpy refuses: {}", e.what()));
        }
        if (has_objects(a.np)) r_.corrupt("a structured dtype holding Python objects, which are never decoded");
      }
      if (tag == kNumpy) a.shape = r_.shape();
      a.nbytes = checked_nbytes(r_, a.shape, static_cast<std::size_t>(a.np.itemsize()));
      return a;
    }
    a.name = std::string(r_.blob());
    std::size_t item = 0;
    if (tag == kTorch) {
      const TorchDType* t = torch_dtype(a.name);
      if (t == nullptr) r_.corrupt(fmt::format("torch dtype \"{}\" is not one the codec sends", a.name));
      item = t->itemsize;
    } else {
      try {
        a.dtype = parse_dtype(a.name);
      } catch (const UsageError&) {
        r_.corrupt(fmt::format("meshrt has no dtype \"{}\"", a.name));
      }
      item = element_size(a.dtype);
    }
    a.shape = r_.shape();
    a.nbytes = checked_nbytes(r_, a.shape, item);
    return a;
  }

  py::object array(std::uint8_t tag, int depth, bool in_key, const OutTarget* target) {
    ArrayHead a = array_head(tag, depth);
    expect_storage(a.nbytes);
    if (target != nullptr) {
      if (!(target->spec == a.spec())) {
        throw UsageError(fmt::format("{}: type or size mismatch: out= is {}, but {} sent {}", where_(),
                                     target->spec.to_string(), from_(), a.spec().to_string()));
      }
      fill(target->data, a.nbytes, in_key);
      return target->obj;
    }
    if (tag == kNumpy || tag == kNumpyScalar) {
      py::array arr(a.np, std::vector<py::ssize_t>(a.shape.begin(), a.shape.end()));
      fill(static_cast<char*>(arr.mutable_data()), a.nbytes, in_key);
      if (tag == kNumpyScalar) return arr[py::tuple()];
      return arr;
    }
    if (tag == kTorch) {
      py::object torch_mod;
      try {
        torch_mod = cached(g_torch, "torch", nullptr);
      } catch (py::error_already_set& e) {
        throw UsageError(fmt::format("{}: {} sent a torch tensor, but torch does not import on this rank: {}", where_(),
                                     from_(), e.what()));
      }
      py::tuple shape(a.shape.size());
      for (std::size_t i = 0; i < a.shape.size(); ++i) shape[i] = a.shape[i];
      py::object t = torch_mod.attr("empty")(shape, py::arg("dtype") = torch_mod.attr(a.name.c_str()));
      fill(reinterpret_cast<char*>(t.attr("data_ptr")().cast<std::uintptr_t>()), a.nbytes, in_key);
      return t;
    }
    Tensor t = Tensor::empty(TensorMeta(a.shape, a.dtype));
    fill(static_cast<char*>(t.raw_data()), a.nbytes, in_key);
    return wrap_tensor(std::move(t));
  }

  Reader r_;
  Reader trailer_;
  std::uint32_t nbuf_;
  bool allow_pickle_;
  const Where& where_;
  const Where& from_;
  Decoded& out_;
};

}  // namespace

std::string ArraySpec::to_string() const {
  std::string name = dtype;
  if (name.starts_with("descr:")) {
    name = name.substr(6);
  } else if (!name.empty() && (name[0] == '<' || name[0] == '>' || name[0] == '|' || name[0] == '=')) {
    try {
      name = py::str(py::dtype(dtype).attr("name"));
    } catch (py::error_already_set&) {
      // an unknown spelling is shown as it is
    }
  }
  return fmt::format("{}[{}]", name, fmt::join(shape, ", "));
}

void encode(py::handle obj, bool allow_pickle, Encoded& out) {
  out.bytes.clear();
  out.buffers.clear();
  out.pickled = false;
  out.bytes.resize(kHeaderBytes);
  Encoder e(allow_pickle, out);
  try {
    e.value(obj, 0, false);
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

Summary summarize(std::string_view bytes, const Where& where) {
  const Header h = read_header(bytes, where);
  Summary s;
  s.pickled = (h.flags & kFlagPickled) != 0;
  Reader t(bytes, h.value_end, bytes.size(), where);
  for (std::uint32_t i = 0; i < h.nbuf; ++i) s.buffer_sizes.push_back(t.u64());
  return s;
}

std::optional<ArraySpec> top_level_array(std::string_view bytes, const Where& where) {
  const Header h = read_header(bytes, where);
  Decoded d;
  Decoder dec(bytes, h, false, where, where, d);
  return dec.top_array_spec();
}

OutTarget out_target(py::handle out) {
  OutTarget t;
  t.obj = py::reinterpret_borrow<py::object>(out);
  if (py::isinstance<py::array>(out)) {
    auto a = py::reinterpret_borrow<py::array>(out);
    py::dtype dt = a.dtype();
    if (has_objects(dt)) throw UsageError("out= is a numpy array of Python objects; expected one of numbers");
    if (!(a.flags() & py::detail::npy_api::NPY_ARRAY_C_CONTIGUOUS_) || !a.writeable()) {
      throw UsageError("out= is a numpy array that is not C-contiguous and writable; expected one that is");
    }
    t.spec = ArraySpec{numpy_canonical(dt), std::vector<std::int64_t>(a.shape(), a.shape() + a.ndim())};
    t.data = static_cast<char*>(a.mutable_data());
    t.nbytes = static_cast<std::size_t>(a.nbytes());
    return t;
  }
  if (py::isinstance<Tensor>(out)) {
    Tensor& m = out.cast<Tensor&>();
    if (!m.defined() || m.device().is_accelerator()) {
      throw UsageError(fmt::format("out= is a meshrt.Tensor on {}; expected a host tensor", m.device().to_string()));
    }
    const std::string n(name(m.dtype()));
    const char* canonical = torch_canonical(n);
    t.spec = ArraySpec{canonical ? canonical : n, m.shape()};
    t.data = static_cast<char*>(m.raw_data());
    t.nbytes = m.nbytes();
    return t;
  }
  if (py::handle tt = torch_tensor_type(); tt && PyObject_IsInstance(out.ptr(), tt.ptr()) == 1) {
    py::object o = t.obj;
    const std::string device = py::str(o.attr("device").attr("type"));
    if (device != "cpu") throw UsageError("out= is a torch tensor on " + device + "; expected a CPU tensor");
    if (!o.attr("is_contiguous")().cast<bool>() ||
        o.attr("layout").ptr() != cached(g_torch_strided, "torch", "strided").ptr()) {
      throw UsageError("out= is a torch tensor that is not contiguous; expected a contiguous one");
    }
    if (o.attr("requires_grad").cast<bool>()) {
      throw UsageError("out= is a torch tensor that requires grad; pass out=t.detach() (it shares t's memory)");
    }
    std::string n = py::str(o.attr("dtype"));
    if (n.starts_with("torch.")) n = n.substr(6);
    const char* canonical = torch_canonical(n);
    if (canonical == nullptr)
      throw UsageError("out= is a torch tensor of dtype " + n + ", which the codec does not send");
    t.spec = ArraySpec{canonical, o.attr("shape").cast<std::vector<std::int64_t>>()};
    t.data = reinterpret_cast<char*>(o.attr("data_ptr")().cast<std::uintptr_t>());
    t.nbytes = o.attr("numel")().cast<std::size_t>() * o.attr("element_size")().cast<std::size_t>();
    return t;
  }
  throw UsageError("out= is a " + type_name(out) + "; expected a numpy array, torch tensor or meshrt.Tensor");
}

Decoded decode(std::string_view bytes, bool allow_pickle, const OutTarget* out, const Where& where, const Where& from) {
  const Header h = read_header(bytes, where);
  Decoded d;
  Decoder dec(bytes, h, allow_pickle, where, from, d);
  d.value = dec.top(out);
  return d;
}

}  // namespace meshrt::python::codec
