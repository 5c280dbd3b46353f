// Remote functions: the registry that maps a name to a kernel (runs on every rank of a
// mesh) and a shape function (runs on the controller at the call site).
//
//   std::vector<meshrt::Tensor> scale_kernel(meshrt::CallContext& ctx, meshrt::Args& args);
//   meshrt::Signature scale_shape(const meshrt::ArgMetas& args);
//   MESHRT_REGISTER_FUNCTION("example.scale", scale_kernel, scale_shape);
//
// An optional description names the arguments, so that argument errors print the
// signature and docs can list the function:
//   MESHRT_REGISTER_FUNCTION("example.scale", scale_kernel, scale_shape,
//                            {.params = {{"x", "tensor"}, {"factor", "float"}},
//                             .returns = "tensor", .doc = "x times factor."});
//
// Registration happens in static initialisers, in libmeshrt, the program, or a library
// loaded with functions::load_library(). Only names registered that way can be called:
// a name arriving on the wire never loads code. Two registrations of one name are refused;
// the first use of the table then raises UsageError naming both places.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <typeinfo>
#include <vector>

#include "meshrt/tensor.hpp"
#include "meshrt/value.hpp"

namespace meshrt {

struct Signature;

// Where and on what a kernel runs.
class CallContext {
 public:
  CallContext() = default;
  // One name, coordinate and size per mesh dimension (0 <= coordinates[i] < sizes[i]),
  // and a native stream on a CUDA device; throws UsageError otherwise.
  CallContext(int rank, std::vector<std::string> dim_names, std::vector<std::int64_t> coordinates,
              std::vector<std::int64_t> sizes, std::uint64_t stream_id = 0, Device device = Device::cpu(),
              void* native_stream = nullptr);

  int rank() const noexcept { return rank_; }
  // The mesh's dimension names and this rank's coordinate along each.
  const std::vector<std::string>& dim_names() const noexcept { return dim_names_; }
  const std::vector<std::int64_t>& coordinates() const noexcept { return coordinates_; }
  // This rank's coordinate along `dim`; throws UsageError naming the mesh's dimensions.
  std::int64_t coordinate(std::string_view dim) const;
  // The mesh's size along each dimension, and along `dim` (throws UsageError naming the
  // mesh's dimensions).
  const std::vector<std::int64_t>& sizes() const noexcept { return sizes_; }
  std::int64_t size(std::string_view dim) const;
  std::uint64_t stream_id() const noexcept { return stream_id_; }
  const Device& device() const noexcept { return device_; }
  // The cudaStream_t to launch on (never null on a CUDA device; nullptr on the CPU and
  // the emulated accelerator, whose work goes through the device layer's streams).
  void* native_stream() const noexcept { return native_stream_; }
  // What the call's shape function declared for these arguments: the outputs the worker
  // checks the kernel's against, and the tensor arguments it may write. Set by the worker
  // for an invocation; nullptr where no shape function ran (a fetch's preprocess function).
  const Signature* signature() const noexcept { return signature_; }
  void set_signature(const Signature* signature) noexcept { signature_ = signature; }

 private:
  int rank_ = 0;
  std::vector<std::string> dim_names_;
  std::vector<std::int64_t> coordinates_;
  std::vector<std::int64_t> sizes_;
  std::uint64_t stream_id_ = 0;
  Device device_;
  void* native_stream_ = nullptr;
  const Signature* signature_ = nullptr;
};

namespace detail {

// Typed, checked access to positional arguments. Every error names the function, the
// argument's position, what was expected and what was found.
class ArgAccess {
 public:
  ArgAccess(std::string function, std::vector<Value> values)
      : function_(std::move(function)), values_(std::move(values)) {}

  std::size_t size() const noexcept { return values_.size(); }
  const std::string& function() const noexcept { return function_; }
  const Value& value(std::size_t i) const;
  const std::vector<Value>& values() const noexcept { return values_; }
  double number(std::size_t i) const;         // int or double
  std::int64_t integer(std::size_t i) const;  // int
  bool boolean(std::size_t i) const;          // bool
  const std::string& string(std::size_t i) const;
  DType dtype(std::size_t i) const;                      // a dtype name such as "float32"
  std::vector<std::int64_t> shape(std::size_t i) const;  // a list of ints >= 0 (or one int)
  // Throws UsageError "<function>(<params>): <message>" (the parameter names when the
  // function was registered with a description, else just the function's name).
  [[noreturn]] void fail(std::string_view message) const;
  // Throws UsageError "<function>(<params>): argument <i> (<name>): <message>".
  [[noreturn]] void fail_arg(std::size_t i, std::string_view message) const;
  // Throws unless size() is in [min, max].
  void expect_count(std::size_t min, std::size_t max) const;

 protected:
  // "meshrt.rand(shape, dtype, seed)" or "my.fn"; and " (seed)" for argument i.
  std::string who() const;
  std::string param_name(std::size_t i) const;
  std::string function_;
  std::vector<Value> values_;
};

}  // namespace detail

// The arguments of a kernel on a worker: refs already replaced by their tensors.
class Args : public detail::ArgAccess {
 public:
  using ArgAccess::ArgAccess;
  // The tensor argument i (mutable: in-place kernels write through it).
  Tensor& tensor(std::size_t i);
  const Tensor& tensor(std::size_t i) const;
  // The worker object argument i as a T (the object its handle names on this rank);
  // UsageError naming the argument when it is no object or another type's.
  template <class T>
  T& object(std::size_t i) const {
    const WorkerObject o = object_value(i);
    if (T* p = o.get<T>()) return *p;
    fail_object_type(i, typeid(T), o.type());
  }
  WorkerObject object_value(std::size_t i) const;

 private:
  [[noreturn]] void fail_object_type(std::size_t i, const std::type_info& want, const std::type_info& found) const;
};

// The arguments of a shape function on the controller: tensors appear as TensorMeta.
class ArgMetas : public detail::ArgAccess {
 public:
  // `device`: where the call's new tensors will live (the mesh's device).
  ArgMetas(std::string function, std::vector<Value> values, Device device = Device::cpu())
      : ArgAccess(std::move(function), std::move(values)), device_(device) {}
  // The meta of tensor argument i (a TensorMeta value, or a Tensor's meta).
  TensorMeta tensor(std::size_t i) const;
  const Device& device() const noexcept { return device_; }

 private:
  Device device_;
};

// A declared view: output `output` of a call lies inside the storage of tensor argument
// `input` (a reshape, a chunk, a slice of rows, or the argument itself). The controller
// then treats both as one value's storage (docs/guide.md "Declared views").
struct View {
  std::size_t output = 0;
  std::size_t input = 0;
  friend bool operator==(const View&, const View&) = default;
};

// What a call produces: its outputs' metas, the positions (in args) of the tensor
// arguments it writes in place, and which outputs are views of which arguments.
struct Signature {
  std::vector<TensorMeta> outputs;
  std::vector<std::size_t> mutates;
  std::vector<View> views;
};

using Kernel = std::function<std::vector<Tensor>(CallContext&, Args&)>;
using ShapeFunction = std::function<Signature(const ArgMetas&)>;
// An object constructor (docs/guide.md, "Worker-side objects"): runs on every rank of a
// mesh for Mesh::call_object, which keeps what it returns on that rank.
using ObjectKernel = std::function<WorkerObject(CallContext&, Args&)>;

namespace functions {

// One argument of a function: its name and kind, e.g. {"shape", "list[int]"}. Kinds read
// like Python annotations: tensor, int, float, bool, str, dtype, list[int], or "a | b".
struct Param {
  std::string name;
  std::string kind;
};

// What a function takes and does, for argument errors and the generated reference
// (docs/builtins.md). Empty for functions registered without one.
struct Description {
  std::vector<Param> params;
  std::string returns;  // "tensor", "none (writes x in place)"
  std::string doc;      // one line
  bool empty() const noexcept { return params.empty() && returns.empty() && doc.empty(); }
};

struct Function {
  std::string name;
  Kernel kernel;
  ShapeFunction shape;
  std::string file;  // where it was registered
  int line = 0;
  std::string library;  // the library path given to load_library, or "" for the program and libmeshrt
  Description description;
  ObjectKernel make_object;  // empty unless it constructs worker objects

  std::string where() const;  // "file:line" (and " in <library>")
  // "meshrt.rand(shape: list[int], dtype: dtype, seed: int) -> tensor"; the bare name
  // when there is no description.
  std::string signature() const;
  // "meshrt.rand(shape, dtype, seed)": the parameter names only.
  std::string short_signature() const;
};

// Adds a function; throws UsageError if the name is taken (naming both places) or empty.
// With `make_object` it also constructs worker objects (a Python function serves both).
void register_function(std::string name, Kernel kernel, ShapeFunction shape, const char* file, int line,
                       Description description = {}, ObjectKernel make_object = {});
// Adds an object constructor only: Mesh::call_object runs it; Mesh::call refuses it.
void register_object_function(std::string name, ObjectKernel make_object, const char* file, int line,
                              Description description = {});

// The function `name`; throws UsageError "unknown function 'x'; did you mean ...".
const Function& lookup(std::string_view name);
// nullptr when unknown.
const Function* find(std::string_view name);
// Sorted names of every registered function.
std::vector<std::string> names();
// FNV-1a 64 over the sorted names: equal on every rank that runs the same build.
std::uint64_t table_hash();
// Throws UsageError if a static registration was refused (a duplicate name); the other
// functions above call it first, so a broken table is reported at its first use.
void check_table();

// dlopens `path` (RTLD_NOW | RTLD_LOCAL; never unloaded) and returns the names its static
// registrars added. Throws UsageError if dlopen fails or the library registers a name
// that already exists (its other functions stay registered).
std::vector<std::string> load_library(const std::string& path);

// Runs a shape function and checks what it returns (mutates indices in range and naming
// tensor arguments); errors name the function.
Signature infer(const Function& f, const ArgMetas& args);

namespace detail {
struct Registrar {
  // Never throws (a throw from a static initialiser would terminate the program with no
  // message): a refused registration is recorded for check_table().
  Registrar(const char* name, Kernel kernel, ShapeFunction shape, const char* file, int line,
            Description description = {}) noexcept;
  Registrar(const char* name, ObjectKernel make_object, const char* file, int line,
            Description description = {}) noexcept;
};
}  // namespace detail

}  // namespace functions
}  // namespace meshrt

#define MESHRT_CONCAT_INNER_(a, b) a##b
#define MESHRT_CONCAT_(a, b) MESHRT_CONCAT_INNER_(a, b)
// At namespace scope: registers `kernel` and `shape_fn` as the remote function `name`,
// with an optional functions::Description after them.
#define MESHRT_REGISTER_FUNCTION(name, kernel, shape_fn, ...)                          \
  [[maybe_unused]] static const ::meshrt::functions::detail::Registrar MESHRT_CONCAT_( \
      meshrt_function_registrar_, __COUNTER__)((name), (kernel), (shape_fn), __FILE__, \
                                               __LINE__ __VA_OPT__(, ) __VA_ARGS__)
// At namespace scope: registers `make` (WorkerObject(CallContext&, Args&)) as the object
// constructor `name`, with an optional functions::Description after it.
#define MESHRT_REGISTER_OBJECT(name, make, ...)                                                \
  [[maybe_unused]] static const ::meshrt::functions::detail::Registrar MESHRT_CONCAT_(         \
      meshrt_function_registrar_, __COUNTER__)((name), ::meshrt::ObjectKernel(make), __FILE__, \
                                               __LINE__ __VA_OPT__(, ) __VA_ARGS__)
