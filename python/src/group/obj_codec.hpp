// The Python group's object codec (docs/python.md, "StatelessGroup"): a safe encoding of None, bool, int,
// float, complex, str, bytes, bytearray, lists, tuples, sets, frozensets, dicts of these, numpy arrays and scalars,
// torch tensors (CPU) and meshrt tensors. Decoding never runs code: pickle is only used
// where both sides allow it. Arrays and long bytes travel as raw buffers beside the
// structure, and the decoder allocates the new array first so that its buffer can be
// received into directly.
//
// Layout of an encoded object (little-endian, as the members' own memory):
//   header (12 bytes): magic "MRPY", version, flags (bit 0: contains pickle), reserved,
//                      number of out-of-band buffers
//   the value: a tag byte, then its fields; containers hold their items
//   trailer: the size of every out-of-band buffer, in the order they follow
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace meshrt::python::codec {

namespace py = pybind11;

// Where an object is decoded ("recv_obj on group rank 1 (parent rank 1) of 4"), or who
// sent it, for error messages: made only when an error is raised.
using Where = std::function<std::string()>;

// Arrays, bytes and bytearrays larger than this travel beside the structure, each in its
// own message straight into the receiver's new object; smaller ones inside it.
constexpr std::size_t kInlineMax = 8 * 1024;

// An out-of-band buffer of an encoded object, kept alive by its owner.
struct Buffer {
  const char* data = nullptr;
  std::size_t size = 0;
  py::object owner;
};

struct Encoded {
  std::string bytes;  // header, value, trailer
  std::vector<Buffer> buffers;
  bool pickled = false;
};

// Encodes `obj` into `out` (cleared first). A type the safe codec does not take is pickled
// if allow_pickle, else a UsageError: "object of type X (at [1]['w']) is not supported by
// the safe codec; pass allow_pickle=True on both sides".
void encode(py::handle obj, bool allow_pickle, Encoded& out);

// What an encoded object holds, read from its header and trailer. ProtocolError naming
// `where` if the bytes are not an encoded object.
struct Summary {
  bool pickled = false;
  std::vector<std::uint64_t> buffer_sizes;
};
Summary summarize(std::string_view bytes, const Where& where);

// An array's element type and shape, comparable across numpy, torch and meshrt.
struct ArraySpec {
  std::string dtype;  // canonical: numpy's dtype.str ("<f4"), or "bfloat16"
  std::vector<std::int64_t> shape;
  std::string to_string() const;  // "float32[3, 4]" (asks numpy for the name: GIL held)
  bool operator==(const ArraySpec& o) const { return dtype == o.dtype && shape == o.shape; }
};

// An array, tensor or meshrt.Tensor to receive into (out=): writable, contiguous, host.
struct OutTarget {
  ArraySpec spec;
  char* data = nullptr;
  std::size_t nbytes = 0;
  py::object obj;
};
// UsageError saying why `out` cannot be received into.
OutTarget out_target(py::handle out);

// The spec of the encoded object if it is one array, tensor or meshrt.Tensor (nullopt
// otherwise). The bytes must have passed summarize().
std::optional<ArraySpec> top_level_array(std::string_view bytes, const Where& where);

// Where out-of-band buffer i of a decoded object goes.
struct Target {
  char* data = nullptr;
  std::size_t size = 0;
};
struct Decoded {
  py::object value;
  std::vector<Target> targets;
};
// Decodes an encoded object; its out-of-band arrays are allocated (not yet filled: the
// caller receives buffer i into targets[i]). With `out`, a top-level array is received
// into it (UsageError if its spec differs). ProtocolError for malformed bytes; UsageError
// for pickle without allow_pickle ("... was pickled by the sender, and this rank did not
// pass allow_pickle=True ...", naming `from`).
Decoded decode(std::string_view bytes, bool allow_pickle, const OutTarget* out, const Where& where, const Where& from);

}  // namespace meshrt::python::codec
