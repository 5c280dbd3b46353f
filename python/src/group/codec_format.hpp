// What the Python group's object codec's encoder and decoder share (obj_codec.hpp): the
// wire format's constants and tags, and the Python objects and dtype spellings both look
// up.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace meshrt::python::codec::format {

namespace py = pybind11;

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
  kComplex = 'c',  // two float64: real, imaginary
  kStr = 's',
  kBytes = 'b',
  kByteArray = 'y',
  kList = 'l',
  kTuple = 't',
  kDict = 'd',
  kSet = 'u',        // a count, then the items (each a dict key: inline, hashed on arrival)
  kFrozenSet = 'z',  // as kSet
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

// The type's name as Python shows it ("numpy.ndarray"; builtins without a module).
std::string type_name(py::handle obj);

// Python objects the codec looks up once (leaked on purpose: they must outlive every
// group object, and the interpreter tears modules down in no fixed order).
py::object& cached(py::object*& slot, const char* module, const char* attr);
struct Cache {
  py::object* pickle_dumps = nullptr;
  py::object* pickle_loads = nullptr;
  py::object* ascontiguous = nullptr;
  py::object* np_generic = nullptr;
  py::object* np_dtype_to_descr = nullptr;
  py::object* np_descr_to_dtype = nullptr;
  py::object* torch = nullptr;
  py::object* torch_tensor = nullptr;
  py::object* torch_strided = nullptr;
};
Cache& cache();

// A module only if the program has imported it (an object of its types cannot exist
// otherwise, so checking for one never imports anything).
PyObject* imported(const char* name);
PyTypeObject* numpy_ndarray();
py::handle torch_tensor_type();

// torch dtypes the codec takes, with their canonical (numpy dtype.str) spelling.
// (meshrt's dtypes are among them, under the same names.)
struct TorchDType {
  const char* name;
  const char* canonical;
  std::size_t itemsize;
};
const TorchDType* torch_dtype(std::string_view name);
const char* torch_canonical(std::string_view name);

// Whether a numpy dtype holds Python objects.
bool has_objects(const py::dtype& dt);
// numpy's dtype.str, remembered per dtype object (the common ones are singletons; asking
// numpy costs more than encoding a small array).
const std::string& dtype_str(const py::dtype& dt);
// The canonical spelling of a numpy dtype (ArraySpec::dtype).
std::string numpy_canonical(const py::dtype& dt);

}  // namespace meshrt::python::codec::format
