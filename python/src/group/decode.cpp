// The object codec's decoder (obj_codec.hpp), which checks every length against the bytes
// it has before it allocates.
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
      case kComplex: {
        const auto re = r_.get<double>();
        const auto im = r_.get<double>();
        return py::reinterpret_steal<py::object>(PyComplex_FromDoubles(re, im));
      }
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
      case kSet:
      case kFrozenSet:
        return set(tag == kFrozenSet, depth);
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
        return cached(cache().pickle_loads, "pickle",
                      "loads")(py::memoryview::from_memory(b.data(), static_cast<py::ssize_t>(b.size())));
      }
      default:
        r_.corrupt(fmt::format("unknown tag {:#04x}", tag));
    }
  }

  // A set's items are decoded as dict keys (inline only); a sender's set holds distinct
  // items, and they stay distinct when decoded.
  py::object set(bool frozen, int depth) {
    const std::size_t n = r_.count(1);
    PyObject* s = frozen ? PyFrozenSet_New(nullptr) : PySet_New(nullptr);
    if (s == nullptr) throw py::error_already_set();
    auto owner = py::reinterpret_steal<py::object>(s);
    for (std::size_t i = 0; i < n; ++i) {
      py::object item = value(depth + 1, true, nullptr);
      if (PySet_Add(s, item.ptr()) != 0) {
        PyErr_Clear();
        r_.corrupt(fmt::format("a set item of type {} is unhashable", type_name(item)));
      }
    }
    if (static_cast<std::size_t>(PySet_GET_SIZE(s)) != n) {
      r_.corrupt(fmt::format("a {} declares {} items, {} of them distinct", frozen ? "frozenset" : "set", n,
                             PySet_GET_SIZE(s)));
    }
    return owner;
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
          a.np = cached(cache().np_descr_to_dtype, "numpy.lib.format", "descr_to_dtype")(descr);
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
        torch_mod = cached(cache().torch, "torch", nullptr);
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
        o.attr("layout").ptr() != cached(cache().torch_strided, "torch", "strided").ptr()) {
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
