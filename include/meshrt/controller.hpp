// The controller: the user's program on rank 0 drives every worker through these
// handles (docs/ARCHITECTURE.md section 4).
//
//   meshrt::Mesh mesh = ctl.world_mesh({{"host", 2}, {"gpu", 2}});
//   meshrt::DTensor x = mesh.call("meshrt.full", {3, 4}, meshrt::DType::Float32, 1.0);
//   meshrt::DTensor y = x.reduce("gpu", meshrt::Reduction::Sum);
//   meshrt::Tensor v = ctl.fetch_shard(y, {{"host", 1}, {"gpu", 0}}).get();
//
// Every call returns at once: work is queued, batched per mesh and sent to the workers;
// results come back through Futures. A shape, dimension or stream mistake raises
// UsageError at the call, before anything is sent. A failure on a worker poisons only the
// values that depend on it and surfaces as RemoteError from Future::get() or
// synchronize(), naming the function, the rank(s), the worker's message and the line of
// the controller program that issued it.
#pragma once

#include <chrono>
#include <concepts>
#include <cstdint>
#include <exception>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshrt/call_site.hpp"
#include "meshrt/error.hpp"
#include "meshrt/ndslice.hpp"
#include "meshrt/reduction.hpp"
#include "meshrt/tensor.hpp"
#include "meshrt/traffic.hpp"
#include "meshrt/value.hpp"

namespace meshrt {

class Controller;
class DTensor;
class Mesh;
class Object;
template <class T>
class Future;
class Recording;
class Stream;

namespace detail {
struct ControllerState;
struct MeshState;
struct TensorState;
struct StreamState;
struct FutureState;
struct Node;
struct RecordingState;
}  // namespace detail

// A function failed on a worker, or a value depends on one that did.
class RemoteError : public Error {
 public:
  RemoteError(const std::string& what, std::uint64_t ident, std::string function, std::vector<int> ranks,
              std::string worker_message, std::string issued_at)
      : Error(what),
        ident_(ident),
        function_(std::move(function)),
        ranks_(std::move(ranks)),
        worker_message_(std::move(worker_message)),
        issued_at_(std::move(issued_at)) {}
  // The root cause: the first failed invocation this value depends on.
  std::uint64_t ident() const noexcept { return ident_; }
  const std::string& function() const noexcept { return function_; }
  const std::vector<int>& ranks() const noexcept { return ranks_; }
  const std::string& worker_message() const noexcept { return worker_message_; }
  // "file:line (function)" of the controller call that issued the failed work.
  const std::string& issued_at() const noexcept { return issued_at_; }

 private:
  std::uint64_t ident_;
  std::string function_;
  std::vector<int> ranks_;
  std::string worker_message_;
  std::string issued_at_;
};

// A registered function's name, with the controller call site that named it.
struct FunctionName {
  FunctionName(const char* n, CallSite l = std::source_location::current()) : name(n), where(l) {}
  FunctionName(std::string n, CallSite l = std::source_location::current()) : name(std::move(n)), where(l) {}
  FunctionName(std::string_view n, CallSite l = std::source_location::current()) : name(n), where(l) {}
  std::string name;
  CallSite where;
};

// One argument of a remote call: a DTensor, a number, a string, a bool, a dtype, a shape,
// or a (nested) list of these.
class Arg {
 public:
  Arg(const DTensor& t);
  Arg(const Value& v) : value_(v) {}
  Arg(DType d) : value_(std::string(name(d))) {}
  Arg(bool b) : value_(b) {}
  Arg(int i) : value_(i) {}
  Arg(long i) : value_(i) {}
  Arg(long long i) : value_(i) {}
  Arg(unsigned i) : value_(i) {}
  Arg(unsigned long i) : value_(i) {}
  Arg(double d) : value_(d) {}
  Arg(float f) : value_(f) {}
  Arg(const char* s) : value_(s) {}
  Arg(std::string s) : value_(std::move(s)) {}
  Arg(const std::vector<std::int64_t>& shape) : value_(shape) {}
  // A host tensor: a copy, sent to every rank of the mesh in the call's command (see
  // Mesh::from_host). The command leaves later; the copy keeps what the call saw. One over
  // the control plane's limit (about 2 GiB: docs/running.md, "Limits") is not copied: the
  // call refuses it.
  Arg(const Tensor& t);
  Arg(std::initializer_list<Arg> items);
  // A worker object: each rank's kernel gets that rank's object (its mesh must be the
  // call's).
  Arg(const Object& o);
  // A list of any length, built at run time (a braced list is the literal form).
  static Arg list(std::vector<Arg> items);

  const Value& value() const noexcept { return value_; }
  const std::vector<DTensor>& tensors() const noexcept { return tensors_; }

 private:
  Value value_;                   // DTensors appear as Refs
  std::vector<DTensor> tensors_;  // the DTensors referenced, in tree order
};

// A stream of work on the workers. Tensors belong to the stream that made them; using
// one on another stream needs a borrow.
class Stream {
 public:
  const std::string& name() const;
  // A handle to `t` usable on this stream. A mutable borrow needs that no other borrow of
  // `t` is active; while it is, only this stream may use `t`. End it with drop().
  DTensor borrow(const DTensor& t, bool mutable_borrow = false, CallSite where = std::source_location::current()) const;
  friend bool operator==(const Stream& a, const Stream& b) noexcept { return a.state_ == b.state_; }

 private:
  friend class Controller;
  friend class DTensor;
  friend class Mesh;
  friend class Object;
  explicit Stream(std::shared_ptr<detail::StreamState> s) : state_(std::move(s)) {}
  std::shared_ptr<detail::StreamState> state_;
};

// A rank order for DTensor::to_mesh between meshes of the same sizes: to which
// coordinate of the target each coordinate of the source sends its local tensor. The
// dimensions are named as in the source mesh.
//
//   x = x.to_mesh(mesh, MeshPermutation::rotate("sp", 1));  // ring: coordinate i -> i + 1
//   y = x.to_mesh(mesh, MeshPermutation::transpose("row", "col"));
class MeshPermutation {
 public:
  // Along `dim`, coordinate i goes to (i + shift) mod size(dim); a negative shift
  // rotates the other way.
  static MeshPermutation rotate(std::string dim, std::int64_t shift);
  // The coordinates along `dim_a` and `dim_b` (of equal sizes) trade places.
  static MeshPermutation transpose(std::string dim_a, std::string dim_b);
  // Source position k (row-major over the mesh's coordinates) goes to target position
  // to[k]; `to` is a permutation of 0..n-1 for a mesh of n ranks.
  static MeshPermutation mapping(std::vector<std::int64_t> to);

  // The target position of every source position, for a mesh with these dimensions;
  // UsageError naming the problem (unknown dimension, sizes, not a permutation).
  std::vector<std::int64_t> resolve(const std::vector<std::string>& names,
                                    const std::vector<std::int64_t>& sizes) const;
  // "rotate 'sp' by 1", "transpose 'row' and 'col'", "mapping [1, 0, 3, 2]".
  std::string to_string() const;

 private:
  enum class Kind : std::uint8_t { Rotate, Transpose, Mapping };
  MeshPermutation(Kind kind, std::string a, std::string b, std::int64_t shift, std::vector<std::int64_t> to)
      : kind_(kind), dim_a_(std::move(a)), dim_b_(std::move(b)), shift_(shift), to_(std::move(to)) {}
  Kind kind_;
  std::string dim_a_, dim_b_;
  std::int64_t shift_ = 0;
  std::vector<std::int64_t> to_;
};

// The destination coordinate of a rooted reduce: x.reduce("gpu", Reduction::Sum, Dst{0}).
struct Dst {
  std::int64_t index = 0;
};

// A distributed tensor: one local tensor per rank of its mesh, all with meta().
class DTensor {
 public:
  DTensor() = default;
  const TensorMeta& meta() const;
  Mesh mesh() const;
  Stream stream() const;
  bool defined() const noexcept { return state_ != nullptr; }

  // The reduction over mesh dimension `dim` (docs/ARCHITECTURE.md section 3.6's table).
  DTensor reduce(std::string_view dim, Reduction reduction, bool scatter = false,
                 CallSite where = std::source_location::current()) const;
  // In place (sum..bxor without scatter, and stack with scatter): this handle's value
  // changes; handles that share it see the change.
  DTensor& reduce_(std::string_view dim, Reduction reduction, bool scatter = false,
                   CallSite where = std::source_location::current());
  // The same over several dimensions as one: their ranks form one line of the product of
  // their sizes, ranked row-major in the mesh's order of the dimensions (whatever order
  // `dims` gives), as if the mesh were flattened over them; stack and scatter stack and
  // split along that line. No dimension ({}) means every dimension of the mesh. One
  // collective, over a communicator of that set of dimensions.
  DTensor reduce(const std::vector<std::string>& dims, Reduction reduction, bool scatter = false,
                 CallSite where = std::source_location::current()) const;
  DTensor reduce(std::initializer_list<std::string_view> dims, Reduction reduction, bool scatter = false,
                 CallSite where = std::source_location::current()) const;
  DTensor& reduce_(const std::vector<std::string>& dims, Reduction reduction, bool scatter = false,
                   CallSite where = std::source_location::current());
  DTensor& reduce_(std::initializer_list<std::string_view> dims, Reduction reduction, bool scatter = false,
                   CallSite where = std::source_location::current());
  // The same, written into `out` (a tensor of the result's meta on the result's mesh and
  // stream): out's value changes, and every handle's that shares it; returns out.
  DTensor& reduce(std::string_view dim, Reduction reduction, bool scatter, DTensor& out,
                  CallSite where = std::source_location::current()) const;
  DTensor& reduce(const std::vector<std::string>& dims, Reduction reduction, bool scatter, DTensor& out,
                  CallSite where = std::source_location::current()) const;
  DTensor& reduce(std::initializer_list<std::string_view> dims, Reduction reduction, bool scatter, DTensor& out,
                  CallSite where = std::source_location::current()) const;
  // Rooted (docs/guide.md, "Rooted collectives"): the reduction over `dim` to coordinate
  // dst.index only; the result lives on mesh().slice(dim, dst.index). Sum..bxor as reduce
  // (and its dtype rules), stack as gather.
  DTensor reduce(std::string_view dim, Reduction reduction, Dst dst,
                 CallSite where = std::source_location::current()) const;
  // Every coordinate's tensor stacked ([size(dim), *S]) on coordinate `dst` only: the
  // result lives on mesh().slice(dim, dst).
  DTensor gather(std::string_view dim, std::int64_t dst, CallSite where = std::source_location::current()) const;
  // Coordinate `src`'s tensor, on every coordinate along `dim` (a new tensor on this mesh).
  DTensor broadcast(std::string_view dim, std::int64_t src, CallSite where = std::source_location::current()) const;
  // Coordinate `src`'s tensor split along its first axis into size(dim) equal parts:
  // coordinate i gets part i ([size(0) / size(dim), ...]); a size(0) that does not split
  // is a UsageError.
  DTensor scatter(std::string_view dim, std::int64_t src, CallSite where = std::source_location::current()) const;
  // The same values, sent to `target`: positionally to a mesh of the same sizes, or, onto a
  // mesh this tensor's mesh is a slice of (mesh().slice(dim, i), a rooted reduce's result),
  // as a broadcast: each rank of `target` gets the shard of the source rank whose
  // coordinates agree with its own on the source's dimensions (docs/guide.md, "Sends").
  // Any other target is a UsageError naming both meshes.
  DTensor to_mesh(const Mesh& target, CallSite where = std::source_location::current()) const;
  // The same values, sent to `target` (a mesh of the same sizes, or this tensor's own
  // mesh) in the rank order `p` says: one SendTensor in which a rank may both send and
  // receive. The result lives on `target`. A permutation does not combine with a
  // broadcast: a target of other sizes is a UsageError.
  DTensor to_mesh(const Mesh& target, const MeshPermutation& p, CallSite where = std::source_location::current()) const;
  // to_mesh(mesh(), MeshPermutation::rotate(dim, shift)): each rank's tensor moves `shift`
  // coordinates along `dim` (ring attention, pipeline loops: `x = x.rotate("sp", 1)`).
  DTensor rotate(std::string_view dim, std::int64_t shift, CallSite where = std::source_location::current()) const;
  // The part of this tensor on the sub-mesh where `dim` == index.
  DTensor slice_mesh(std::string_view dim, std::int64_t index) const;
  // Ends a borrow: the origin stream may use the tensor again (and waits for this one).
  // Any other tensor: its value is freed on the workers once the work issued on it so far
  // is done, without waiting for its last handle; a later use of any handle to it is a
  // UsageError naming this line.
  void drop(CallSite where = std::source_location::current());

 private:
  friend class Arg;
  friend class Controller;
  friend class Mesh;
  friend class Object;
  friend class Stream;
  friend struct detail::ControllerState;
  friend struct detail::RecordingState;
  DTensor(std::shared_ptr<detail::TensorState> s, std::shared_ptr<detail::MeshState> mesh)
      : state_(std::move(s)), mesh_(std::move(mesh)) {}
  DTensor send_to_mesh(const Mesh& target, const MeshPermutation* permutation, const CallSite& where) const;
  std::shared_ptr<detail::TensorState> state_;
  std::shared_ptr<detail::MeshState> mesh_;  // the (sub-)mesh this handle covers
};

// A mesh is a value: the last handle (a Mesh, or a DTensor on it) frees it and its
// communicators on the workers. Made again with the same names over the same ranks
// while one is alive (or among the session's 16 most recent), it is the same mesh.
class Mesh {
 public:
  const std::vector<std::string>& names() const;
  std::vector<std::int64_t> sizes() const;
  std::int64_t size(std::string_view dim) const;
  // The product of the dimensions' sizes (every dimension's for {}): the ranks of one line
  // of a reduction over them.
  std::int64_t size(const std::vector<std::string>& dims) const;
  std::int64_t size(std::initializer_list<std::string_view> dims) const;
  // The world ranks of the mesh.
  const NDSlice& ranks() const;

  // The sub-mesh where `dim` == index (the dimension is dropped).
  Mesh slice(std::string_view dim, std::int64_t index) const;
  // The sub-mesh of indices begin, begin+step, ... < end along `dim` (kept).
  Mesh slice(std::string_view dim, std::int64_t begin, std::int64_t end, std::int64_t step = 1) const;
  Mesh rename(std::string_view from, std::string to) const;
  // Splits `dim` into dimensions of the given sizes (their product is size(dim)); one size
  // may be -1, inferred: split("x", {{"a", 2}, {"b", -1}}).
  Mesh split(std::string_view dim, std::vector<std::pair<std::string, std::int64_t>> parts) const;
  // One dimension `name` over all ranks, in row-major order of this mesh's coordinates.
  Mesh flatten(std::string name) const;
  // Each rank's coordinate along `dim`, as an int64 0-d tensor.
  DTensor rank(std::string_view dim, CallSite where = std::source_location::current()) const;

  // A barrier over `dim` (docs/guide.md, "Barriers"): each line along it on its own,
  // several dimensions as one line, or every dimension (none given). A rank enters once it
  // has run the commands issued to it before; it leaves once every rank of its line has
  // entered. Device work already queued is not waited for. The future completes, as any
  // future, once the barrier and all work issued before it are complete. Refused inside a
  // recording. Runs on the default stream.
  Future<void> barrier(CallSite where = std::source_location::current()) const;
  Future<void> barrier(std::string_view dim, CallSite where = std::source_location::current()) const;
  Future<void> barrier(const std::vector<std::string>& dims, CallSite where = std::source_location::current()) const;
  Future<void> barrier(std::initializer_list<std::string_view> dims,
                       CallSite where = std::source_location::current()) const;

  // Runs a registered function on every rank. Tensor arguments must be on this mesh and
  // on one stream (the call runs there; with no tensor arguments, the default stream).
  // Returns its one output (an undefined DTensor for a function that only mutates).
  DTensor call(FunctionName fn) const { return one(call_n(std::move(fn), {})); }
  DTensor call(FunctionName fn, Arg a) const { return one(call_n(std::move(fn), {std::move(a)})); }
  DTensor call(FunctionName fn, Arg a, Arg b) const { return one(call_n(std::move(fn), {std::move(a), std::move(b)})); }
  DTensor call(FunctionName fn, Arg a, Arg b, Arg c) const {
    return one(call_n(std::move(fn), {std::move(a), std::move(b), std::move(c)}));
  }
  DTensor call(FunctionName fn, Arg a, Arg b, Arg c, Arg d) const {
    return one(call_n(std::move(fn), {std::move(a), std::move(b), std::move(c), std::move(d)}));
  }
  DTensor call(FunctionName fn, Arg a, Arg b, Arg c, Arg d, Arg e) const {
    return one(call_n(std::move(fn), {std::move(a), std::move(b), std::move(c), std::move(d), std::move(e)}));
  }
  DTensor call(FunctionName fn, Arg a, Arg b, Arg c, Arg d, Arg e, Arg f) const {
    return one(
        call_n(std::move(fn), {std::move(a), std::move(b), std::move(c), std::move(d), std::move(e), std::move(f)}));
  }
  // Any number of arguments, each converting to an Arg. A braced list such as {3, 4}
  // cannot be deduced as a template argument: the overloads above take it (up to six
  // arguments); in longer calls a shape names its type, std::vector<std::int64_t>{3, 4}.
  template <std::convertible_to<Arg>... A>
  DTensor call(FunctionName fn, A&&... args) const {
    return one(call_n(std::move(fn), std::vector<Arg>{Arg(std::forward<A>(args))...}));
  }
  // Any number of arguments and outputs.
  std::vector<DTensor> call_n(FunctionName fn, std::vector<Arg> args) const;
  // Runs the object constructor `fn` (MESHRT_REGISTER_OBJECT, or a Python function) on
  // every rank, which keeps what it returns (docs/guide.md, "Worker-side objects"). Tensor
  // arguments as for call (on a cpu mesh only); refused inside a recording.
  Object call_object(FunctionName fn, std::vector<Arg> args = {}) const;

  // Host data onto the mesh (docs/guide.md, "Host data onto a mesh"). Both send `t` in the
  // command, to every rank of the mesh: fine for parameters and small inputs; load large
  // data on the workers instead (a registered function that reads the file).
  // The controller's tensor `t`, copied to every rank (on the mesh's device).
  DTensor from_host(const Tensor& t, CallSite where = std::source_location::current()) const;
  // `t` split along its first axis into size(dim) equal shards: the ranks at coordinate i
  // along `dim` hold shard i (the same shard along the other dimensions).
  DTensor scatter(std::string_view dim, const Tensor& t, CallSite where = std::source_location::current()) const;
  // The same on an explicit stream.
  std::vector<DTensor> call_on(const Stream& stream, FunctionName fn, std::vector<Arg> args) const;

  friend bool operator==(const Mesh& a, const Mesh& b) noexcept { return a.state_ == b.state_; }

 private:
  friend class Controller;
  friend class DTensor;
  friend class Object;
  friend class Stream;
  friend struct detail::ControllerState;
  explicit Mesh(std::shared_ptr<detail::MeshState> s) : state_(std::move(s)) {}
  DTensor one(std::vector<DTensor> outputs) const;
  std::vector<DTensor> call_n_impl(FunctionName fn, std::vector<Arg> args) const;
  std::vector<DTensor> call_on_impl(const Stream& stream, FunctionName fn, std::vector<Arg> args) const;
  Object call_object_impl(FunctionName fn, std::vector<Arg> args) const;
  Future<void> barrier_impl(std::vector<std::string> dims, const CallSite& where) const;
  std::shared_ptr<detail::MeshState> state_;
};

// A handle to the object each rank of a mesh keeps (Mesh::call_object). Passed to a call
// on that mesh, it gives each rank's kernel that rank's own object: the same one every
// time, so what a kernel changes in it the next kernel sees. The last handle (copies share
// it) frees the objects on the workers. When the constructor failed, every call given the
// handle fails with a RemoteError naming the constructor, the rank and this handle's line.
class Object {
 public:
  Object() = default;
  bool defined() const noexcept { return state_ != nullptr; }
  Mesh mesh() const;
  Stream stream() const;
  // Lets this handle go now (it becomes undefined): the objects go once no handle holds
  // them.
  void drop() noexcept;

 private:
  friend class Arg;
  friend class Mesh;
  friend struct detail::ControllerState;
  Object(std::shared_ptr<detail::TensorState> s, std::shared_ptr<detail::MeshState> mesh)
      : state_(std::move(s)), mesh_(std::move(mesh)) {}
  std::shared_ptr<detail::TensorState> state_;  // its value on the workers, as a tensor's
  std::shared_ptr<detail::MeshState> mesh_;
};

// A recorded step (docs/guide.md, "Recorded steps"): the commands a function issued once,
// kept by every worker, and run again by one small command per replay.
//
//   meshrt::Recording step = ctl.record({w, x}, [&](const std::vector<meshrt::DTensor>& in) {
//     meshrt::DTensor y = mesh.call("my.forward", in[0], in[1]).reduce("tp", meshrt::Reduction::Sum);
//     return std::vector<meshrt::DTensor>{y};
//   });
//   for (...) y = step({w, next_x})[0];
//
// The last handle frees it on the workers.
class Recording {
 public:
  Recording() = default;
  bool defined() const noexcept { return state_ != nullptr; }
  // Runs the step on `inputs`, tensors of the same metas, meshes and streams as the
  // recording's examples (UsageError naming the first that differs), and returns its
  // results: fresh tensors, or the input or captured tensor the function returned. A
  // failure in a replayed command names the line in the recorded function and `where`.
  std::vector<DTensor> operator()(const std::vector<DTensor>& inputs,
                                  CallSite where = std::source_location::current()) const;
  std::size_t num_inputs() const;
  std::size_t num_outputs() const;
  // The commands recorded (on all ranks together): what each replay saves sending.
  std::size_t num_commands() const;

 private:
  friend class Controller;
  explicit Recording(std::shared_ptr<detail::RecordingState> s) : state_(std::move(s)) {}
  std::shared_ptr<detail::RecordingState> state_;
};

namespace detail {
std::exception_ptr future_wait(FutureState& f, std::optional<std::chrono::duration<double>> timeout);
bool future_done(FutureState& f);
const Value& future_value(const FutureState& f);
Tensor value_to_tensor(const Value& v);
// when_all's state: complete when every part is; its error is the first failed part's.
std::shared_ptr<FutureState> future_all(std::vector<std::shared_ptr<FutureState>> parts);
const std::vector<std::shared_ptr<FutureState>>& future_parts(const FutureState& f);
std::vector<Tensor> future_tensors(const FutureState& f);
template <class T>
struct is_vector : std::false_type {};
template <class T>
struct is_vector<std::vector<T>> : std::true_type {};
}  // namespace detail

// A value that will come back from the workers (Future<void>: a completion, a barrier's).
template <class T>
class Future {
 public:
  // Waits; throws RemoteError if the value depends on a failure, TimeoutError (naming the
  // ranks that have not reached the invocation and what they are on) after `timeout`.
  T get() { return get_impl(std::nullopt); }
  T get(std::chrono::duration<double> timeout) { return get_impl(timeout); }
  // True once get() would return or throw without waiting.
  bool done() { return detail::future_done(*state_); }
  // Waits; the error get() would throw, or nullptr. TimeoutError after `timeout`.
  std::exception_ptr exception() { return detail::future_wait(*state_, std::nullopt); }
  std::exception_ptr exception(std::chrono::duration<double> timeout) { return detail::future_wait(*state_, timeout); }

 private:
  friend class Controller;
  friend class Mesh;
  template <class U>
  friend class Future;
  template <class U>
  friend Future<std::vector<U>> when_all(std::vector<Future<U>> futures);
  friend Future<void> when_all(std::vector<Future<void>> futures);
  explicit Future(std::shared_ptr<detail::FutureState> s) : state_(std::move(s)) {}
  T get_impl(std::optional<std::chrono::duration<double>> timeout) {
    if (auto e = detail::future_wait(*state_, timeout)) std::rethrow_exception(e);
    if constexpr (std::is_void_v<T>) {
      return;
    } else if constexpr (std::is_same_v<T, std::vector<Tensor>>) {
      return detail::future_tensors(*state_);
    } else if constexpr (detail::is_vector<T>::value) {
      T out;
      for (const auto& part : detail::future_parts(*state_)) out.push_back(Future<typename T::value_type>(part).get());
      return out;
    } else if constexpr (std::is_same_v<T, Tensor>) {
      return detail::value_to_tensor(detail::future_value(*state_));
    } else {
      return detail::future_value(*state_);
    }
  }
  std::shared_ptr<detail::FutureState> state_;
};

// One future for several (a completion when they are Future<void>): done once every one
// is, and get() waits for all of them, then returns their values in order or throws the
// first failure in the list's order as a RemoteError naming its position ("when_all:
// future 2 of 3 failed: ..."); a timeout is one deadline for all of them. An empty list is
// done at once. The futures may come from different meshes and streams.
template <class T>
Future<std::vector<T>> when_all(std::vector<Future<T>> futures) {
  std::vector<std::shared_ptr<detail::FutureState>> parts;
  parts.reserve(futures.size());
  for (Future<T>& f : futures) parts.push_back(std::move(f.state_));
  return Future<std::vector<T>>(detail::future_all(std::move(parts)));
}
Future<void> when_all(std::vector<Future<void>> futures);

class Controller {
 public:
  ~Controller();
  Controller(const Controller&) = delete;
  Controller& operator=(const Controller&) = delete;

  // The mesh of every worker rank; the product of the sizes must equal their number.
  // `kind` places it (docs/ARCHITECTURE.md section 7): its calls make tensors on each rank's own
  // device of that kind, and its slices keep it.
  Mesh world_mesh(std::vector<std::pair<std::string, std::int64_t>> dims, DeviceKind kind = DeviceKind::Cpu,
                  CallSite where = std::source_location::current());
  // The job's accelerator (MESHRT_ACCELERATOR; cpu when there is none), to place meshes on.
  DeviceKind accelerator() const;
  // The stream `name` (created on first use); "default" is where work runs by default.
  Stream stream(const std::string& name);
  Stream default_stream();

  // The local tensor of `t` at `coords` (coordinate 0 along the dimensions not named),
  // optionally passed through a registered function on the worker.
  // That function's shape function says whether it mutates its argument; if it does, the
  // fetch is a mutating use of `t` (refused while `t` is borrowed; later uses depend on
  // it).
  Future<Tensor> fetch_shard(const DTensor& t, std::vector<std::pair<std::string, std::int64_t>> coords = {},
                             std::optional<std::string> preprocess = std::nullopt,
                             CallSite where = std::source_location::current());

  // The local tensors of `ts` at `coords` (0 along the dimensions not named; a dimension
  // applies to the tensors whose meshes have it), in order, in one round trip: one command
  // to each rank involved (per stream) and one reply from it, however many tensors.
  Future<std::vector<Tensor>> fetch_shards(const std::vector<DTensor>& ts,
                                           std::vector<std::pair<std::string, std::int64_t>> coords = {},
                                           CallSite where = std::source_location::current());

  // Runs registered function `fn` on the one rank of `mesh` at `coords` (0 along the
  // dimensions not named) and brings back its one output in one round trip: a value
  // computed where the data is (a norm, a statistic, a summary), made into no DTensor.
  // Tensor arguments are DTensors on `mesh` (that rank's local tensors; on one stream, where
  // it runs) or host tensors. The function may neither mutate its arguments nor declare
  // views; its CallContext holds the rank (no mesh coordinates). Python's ctl.fetch runs a
  // Python function this way and brings back any value the safe codec carries.
  Future<Tensor> fetch_call(const Mesh& mesh, FunctionName fn, std::vector<Arg> args,
                            std::vector<std::pair<std::string, std::int64_t>> coords = {});

  // Records the commands `body` issues (calls, reductions, to_mesh, borrows) on formal
  // inputs shaped like `examples` (their metas, meshes and streams; their values are not
  // used). Tensors the body uses from outside are captured: every replay uses (and may
  // mutate) them as they are then. Anything that needs a value back on the controller
  // (fetch_shard, synchronize, Future::get) is refused inside with a UsageError, and so is
  // a tensor made inside used after it; a borrow made inside must be dropped inside.
  Recording record(const std::vector<DTensor>& examples,
                   const std::function<std::vector<DTensor>(const std::vector<DTensor>&)>& body,
                   CallSite where = std::source_location::current());

  // Waits for all issued work; raises one RemoteError naming every failure no Future has
  // reported (the first as root, then a count and a list of the others) and marks them
  // all observed.
  void synchronize();
  void synchronize(std::chrono::duration<double> timeout);
  // Ends every worker's event loop and starts fresh ones: all meshes, tensors, streams
  // and unobserved failures are gone (using an old handle, a mesh's slice() included,
  // raises UsageError).
  void restart_workers();

  // Frees the memory every worker keeps cached for reuse (the CPU data plane's output
  // pool, the accelerator's memory pool; tensors still alive keep theirs), after the work
  // issued so far, and waits; returns the bytes freed on all workers together.
  std::uint64_t release_cached_memory();

  // Every worker writes its flight recorder (its last MESHRT_FLIGHT_RECORDER commands,
  // with state and times) to its log; returns them, rank by rank.
  std::string dump_flight_recorder();
  // The timeline (docs/running.md, "A timeline of the run"). write_trace writes every
  // rank's timeline recorded so far to `path` as one Chrome-trace JSON file and returns the
  // events written; it does not wait for issued work (synchronize() first for all of it),
  // so it also shows a job that is stuck. start_trace and stop_trace record part of a run
  // (MESHRT_TRACE records all of it): both wait for the work issued before them, so what
  // is issued in between, and only that, is recorded. Refused inside a recording.
  std::uint64_t write_trace(const std::string& path);
  void start_trace();
  void stop_trace();
  // Ends the whole job now (MPI_Abort), after telling the workers why.
  [[noreturn]] void abort(const std::string& reason);

  int world_size() const;
  // Ranks that run workers (all ranks, or all but 0 with a dedicated controller).
  const NDSlice& worker_ranks() const;
  // How many values (tensors, meshes, streams) rank `rank`'s worker holds, as of its
  // latest status (call synchronize() first for an exact figure).
  std::uint64_t live_values(int rank) const;
  // The control messages and bytes the controller has sent and received so far, by kind
  // (exact: one message per destination of each send). Each worker's own counts are in
  // its answer to the state query (dump_state / the desync report), under "traffic".
  ControlTraffic control_traffic() const;

 private:
  friend class Runtime;
  friend class DTensor;
  friend class Mesh;
  friend class Stream;
  explicit Controller(std::shared_ptr<detail::ControllerState> state);
  std::shared_ptr<detail::ControllerState> state_;
};

}  // namespace meshrt
