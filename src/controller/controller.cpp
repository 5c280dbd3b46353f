#include "meshrt/controller.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <boost/container/small_vector.hpp>

#include <algorithm>
#include <chrono>
#include <exception>
#include <memory>
#include <numeric>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "controller/state.hpp"
#include "meshrt/functions.hpp"
#include "meshrt/internal/device.hpp"
#include "meshrt/internal/settings.hpp"
#include "meshrt/log.hpp"

namespace meshrt {

using detail::ControllerState;
using detail::MeshState;
using detail::Node;
using detail::StreamState;
using detail::TensorState;

namespace {

std::shared_ptr<ControllerState> lock(const std::weak_ptr<ControllerState>& w) {
  detail::refuse_on_worker_thread("a Mesh, DTensor or Stream method");
  auto s = w.lock();
  if (!s) throw UsageError("this handle outlived its controller session");
  return s;
}

std::shared_ptr<MeshState> make_mesh(ControllerState& ctl, Device::Kind kind, std::vector<std::string> names,
                                     NDSlice ranks) {
  if (std::find(names.begin(), names.end(), std::string()) != names.end()) {
    throw UsageError(
        fmt::format("mesh dimension names must be non-empty, found an empty one in ['{}']", fmt::join(names, "', '")));
  }
  std::set<std::string> unique(names.begin(), names.end());
  if (unique.size() != names.size()) {
    throw UsageError(fmt::format("mesh dimension names must be unique, found [{}]", fmt::join(names, ", ")));
  }
  if (names.size() != ranks.ndim()) {
    throw UsageError(
        fmt::format("a mesh needs one name per dimension: {} names for {} dimensions", names.size(), ranks.ndim()));
  }
  // The key names the layout exactly: the placement, each name with its length, then the ranks.
  std::string key = fmt::format("{}#", static_cast<int>(kind));
  for (const std::string& n : names) key += fmt::format("{}:{};", n.size(), n);
  key += fmt::format("{}|{}|{}", ranks.offset(), fmt::join(ranks.sizes(), ","), fmt::join(ranks.strides(), ","));
  if (auto existing = ctl.find_mesh(key)) return existing;
  auto m = std::make_shared<MeshState>();
  m->controller = ctl.weak_from_this();
  m->epoch = ctl.epoch();
  m->ref = ctl.new_ref();
  m->names = std::move(names);
  m->dests = detail::to_dests(ranks);
  m->ranks = std::move(ranks);
  m->kind = kind;
  ctl.remember_mesh(key, m);
  return m;
}

bool same_layout(const MeshState& a, const MeshState& b) {
  return a.names == b.names && a.ranks == b.ranks;
}

// Whether `sub`'s ranks are all ranks of `home` (the value lives there).
bool covers(const MeshState& home, const MeshState& sub) {
  return std::includes(home.dests.begin(), home.dests.end(), sub.dests.begin(), sub.dests.end());
}

std::shared_ptr<TensorState> new_tensor(ControllerState& ctl, TensorMeta meta, std::shared_ptr<MeshState> home,
                                        std::shared_ptr<StreamState> stream, std::shared_ptr<Node> node) {
  auto t = std::make_shared<TensorState>();
  t->controller = ctl.weak_from_this();
  t->epoch = ctl.epoch();
  t->ref = ctl.new_tensor_ref();
  ctl.note_new(t);
  t->meta = std::move(meta);
  t->home = std::move(home);
  t->stream = std::move(stream);
  t->node() = std::move(node);
  return t;
}

}  // namespace

void detail::use_tensor(ControllerState& ctl, TensorState& t, const MeshState& mesh, const StreamState& stream,
                        bool mutate, std::string_view what) {
  ctl.check_epoch(t.epoch, "tensor");
  ctl.note_use(t, what);
  if (t.dropped) {
    throw UsageError(fmt::format("{}: the tensor was dropped at {}; it cannot be used any more", what,
                                 detail::describe(t.dropped_at)));
  }
  if (t.borrow.dropped) {
    throw UsageError(
        fmt::format("{}: the tensor (borrowed on stream '{}' at {}) was dropped; it cannot be used any more "
                    "(dropped at {}; use the origin, or borrow it again)",
                    what, t.stream->name, detail::describe(t.borrow.where), detail::describe(t.borrow.dropped_at)));
  }
  if (t.stream.get() != &stream) {
    throw UsageError(
        fmt::format("{}: the tensor belongs to stream '{}', the work runs on stream '{}'; borrow it "
                    "with stream('{}').borrow(t) first",
                    what, t.stream->name, stream.name, stream.name));
  }
  if (!covers(*t.home, mesh)) {
    throw UsageError(fmt::format("{}: the tensor lives on ranks [{}], the work runs on ranks [{}]", what,
                                 fmt::join(t.home->dests, ", "), fmt::join(mesh.dests, ", ")));
  }
  if (t.lent().mutably) {
    throw UsageError(
        fmt::format("{}: the tensor is borrowed mutably by stream '{}'; drop that borrow first", what, t.lent().to));
  }
  if (mutate && t.lent().active > 0) {
    throw UsageError(
        fmt::format("{}: the tensor is borrowed by {} other stream(s); it cannot be changed until they "
                    "drop it",
                    what, t.lent().active));
  }
  if (mutate && t.borrow.origin && !t.borrow.is_mutable) {
    throw UsageError(
        fmt::format("{}: this borrow on stream '{}' is immutable; borrow with mutable_borrow=true to change "
                    "the tensor",
                    what, t.stream->name));
  }
  if (t.borrow.origin && !t.borrow.first_use_sent) {
    t.borrow.first_use_sent = true;
    // A borrow made before a recording is first used now, not by each replay.
    if (t.recorded != 0)
      ctl.append(t.home->dests, protocol::BorrowFirstUse{t.ref});
    else
      ctl.append_now(t.home->dests, protocol::BorrowFirstUse{t.ref});
  }
}

namespace {

// A shape function is user code run at the call site: whatever it throws is a mistake in
// this call (or in the function), so it becomes a UsageError naming the function (the
// caller's at_site adds the line). A UsageError passes through unchanged.
Signature infer_at_call(const functions::Function& f, const ArgMetas& args) {
  try {
    return functions::infer(f, args);
  } catch (const UsageError&) {
    throw;
  } catch (const std::exception& e) {
    throw UsageError(fmt::format("{} (registered at {}): its shape function threw: {}", f.name, f.where(), e.what()));
  } catch (...) {
    throw UsageError(
        fmt::format("{} (registered at {}): its shape function threw an exception that is not a "
                    "std::exception",
                    f.name, f.where()));
  }
}

// A FetchResult travels in one control message, whose size MPI counts in an int (the
// MPI transport's send refuses more, src/control/mpi_transport.cpp). The frame around
// the tensor's bytes (header, ident, meta of at most 64 dimensions) takes well under
// kFrameRoom.
constexpr std::uint64_t kControlMessageLimit = detail::kControlMessageLimit;
constexpr std::uint64_t kFrameRoom = 4096;

// What a call whose host data is over the control plane's limit is told to do instead.
constexpr std::string_view kLoadOnWorkers =
    "load the data on the workers with a kernel (a function that reads or makes it on each rank), or send it in "
    "pieces of at most that size (several from_host or scatter calls of slices)";

// Refuses host data of `bytes` in one command (`what()`: what holds it, formatted only
// then): a command travels in one control message, which MPI counts in an int.
template <class What>
void check_host_bytes(const What& what, std::uint64_t bytes) {
  if (bytes <= detail::payload_limit()) return;
  throw UsageError(fmt::format(
      "{}: {} bytes, expected at most {} bytes of host data in one call (a command is one control message, at "
      "most {} bytes with its frame: MPI counts it in an int); {}",
      what(), bytes, detail::payload_limit(), detail::kControlMessageLimit, kLoadOnWorkers));
}

// Call-site mistakes name the line of the controller program that made them.
template <class F>
auto at_site(const CallSite& where, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const UsageError& e) {
    throw UsageError(fmt::format("{} (at {})", e.what(), detail::describe(where)));
  }
}

}  // namespace

// ------------------------------------------------------------------ Arg

Arg::Arg(const Tensor& t) : value_(t.defined() && t.nbytes() > detail::payload_limit() ? t : t.clone()) {}

Arg::Arg(const DTensor& t) {
  if (!t.state_) throw UsageError("an undefined DTensor was passed as an argument");
  value_ = Value(t.state_->ref);
  tensors_.push_back(t);
}

Arg::Arg(const Object& o) {
  if (!o.state_) throw UsageError("an undefined Object (dropped, or never made) was passed as an argument");
  value_ = Value(o.state_->ref);
  tensors_.push_back(DTensor(o.state_, o.mesh_));
}

Arg::Arg(std::initializer_list<Arg> items) {
  Value::List list;
  for (const Arg& a : items) {
    list.push_back(a.value_);
    tensors_.insert(tensors_.end(), a.tensors_.begin(), a.tensors_.end());
  }
  value_ = Value(std::move(list));
}

Arg Arg::list(std::vector<Arg> items) {
  Value::List values;
  values.reserve(items.size());
  Arg out(Value{});
  for (Arg& a : items) {
    values.push_back(std::move(a.value_));
    out.tensors_.insert(out.tensors_.end(), a.tensors_.begin(), a.tensors_.end());
  }
  out.value_ = Value(std::move(values));
  return out;
}

// ------------------------------------------------------------------ Stream

const std::string& Stream::name() const {
  return state_->name;
}

DTensor Stream::borrow(const DTensor& t, bool mutable_borrow, CallSite where) const {
  return at_site(where, [&] {
    auto ctl = lock(state_->controller);
    if (!t.state_) throw UsageError("borrow: an undefined DTensor");
    TensorState& origin = *t.state_;
    ctl->check_epoch(origin.epoch, "tensor");
    ctl->check_epoch(state_->epoch, "stream");
    ctl->note_use(origin, "borrow");
    if (origin.borrow.origin) throw UsageError("borrow: the tensor is itself a borrow; borrow its origin instead");
    if (origin.stream == state_) {
      throw UsageError(fmt::format("borrow: the tensor already belongs to stream '{}'", state_->name));
    }
    if (origin.borrow.dropped || origin.dropped) throw UsageError("borrow: the tensor was dropped");
    if (origin.lent().mutably) {
      throw UsageError(fmt::format("borrow: the tensor is already borrowed mutably by stream '{}'", origin.lent().to));
    }
    if (mutable_borrow && origin.lent().active > 0) {
      throw UsageError(fmt::format("borrow: a mutable borrow needs no other active borrow; the tensor has {}",
                                   origin.lent().active));
    }
    ctl->ensure_stream(*state_);
    ctl->ensure_stream(*origin.stream);
    auto b = new_tensor(*ctl, origin.meta, origin.home, state_,
                        ctl->make_node(0, fmt::format("borrow on stream '{}'", state_->name), where, {origin.node()}));
    b->borrow.origin = t.state_;
    b->borrow.is_mutable = mutable_borrow;
    b->borrow.where = where;
    const bool already = origin.lent().active > 0;
    origin.lent().active++;
    if (mutable_borrow) {
      origin.lent().mutably = true;
      origin.lent().to = state_->name;
    }
    ctl->append(origin.home->dests, protocol::BorrowCreate{.result = b->ref,
                                                           .tensor = origin.ref,
                                                           .from_stream = origin.stream->ref,
                                                           .to_stream = state_->ref,
                                                           .already_borrowed = already});
    return DTensor(b, t.mesh_);
  });
}

// ------------------------------------------------------------------ DTensor

const TensorMeta& DTensor::meta() const {
  return state_->meta;
}
Mesh DTensor::mesh() const {
  return Mesh(mesh_);
}

Mesh Object::mesh() const {
  if (!state_) throw UsageError("Object::mesh: the handle is undefined (dropped, or never made)");
  return Mesh(mesh_);
}
Stream Object::stream() const {
  if (!state_) throw UsageError("Object::stream: the handle is undefined (dropped, or never made)");
  return Stream(state_->stream);
}
void Object::drop() noexcept {
  state_.reset();
  mesh_.reset();
}
Stream DTensor::stream() const {
  return Stream(state_->stream);
}

namespace {

// What reduce_impl and collective_impl share once their rule is known: its verdict, in
// place only over the tensor's whole mesh, the tensor's use, the mesh and stream made
// known, and a node of the call's own ident: the tensor's new node in place, or out of
// place a new tensor on `result_on` (returned; null in place).
struct PreparedCollective {
  protocol::Ident ident;
  std::shared_ptr<TensorState> result;
};

template <class Ctl>
PreparedCollective prepare_collective(Ctl& ctl, const std::shared_ptr<TensorState>& t, MeshState& mesh,
                                      const ReductionRule& rule, bool inplace, const detail::Words& what,
                                      const CallSite& where, const std::shared_ptr<MeshState>& result_on) {
  if (!rule.allowed()) throw UsageError(fmt::format("{}: {}", what.str(), rule.error));
  if (inplace && !same_layout(*t->home, mesh)) {
    throw UsageError(
        fmt::format("{}: in place needs the tensor's whole mesh; this handle covers a slice of it", what.str()));
  }
  use_tensor(ctl, *t, mesh, *t->stream, inplace, what);
  ctl.ensure_mesh(mesh);
  ctl.ensure_stream(*t->stream);
  PreparedCollective out{.ident = ctl.new_ident(), .result = nullptr};
  std::shared_ptr<Node> node = ctl.make_node(out.ident, what, where, {t->node()});
  if (inplace)
    t->node() = std::move(node);
  else
    out.result = new_tensor(ctl, rule.out_meta(t->meta), result_on, t->stream, std::move(node));
  return out;
}

// DTensor::reduce and reduce_: the same rules (in place allows all_reduce and all_to_all
// only) and one Reduce command, with an ident of its own so a failure in flight names
// this call. Out of place it returns the result, a new tensor; in place it returns null,
// and the command redefines `t`'s own ref.
std::shared_ptr<TensorState> reduce_impl(const std::shared_ptr<TensorState>& t, const std::shared_ptr<MeshState>& on,
                                         std::string_view dim, Reduction reduction, bool scatter, bool inplace,
                                         const CallSite& where) {
  if (!t) throw UsageError(inplace ? "reduce_: an undefined DTensor" : "reduce: an undefined DTensor");
  auto ctl = lock(t->controller);
  MeshState& mesh = *on;
  const std::int64_t d = mesh.dim_index(dim);
  const std::int64_t n = mesh.ranks.sizes()[static_cast<std::size_t>(d)];
  const TensorMeta& in = t->meta;
  const detail::Words& what = mesh.reduce_words(d, reduction, scatter, inplace);
  const ReductionRule rule = reduction_rule(in, n, reduction, scatter, inplace, in.device().kind());
  const auto [ident, result] = prepare_collective(*ctl, t, mesh, rule, inplace, what, where, on);
  ctl->append(mesh.dests,
              protocol::Reduce{.result = inplace ? t->ref : result->ref,
                               .tensor = t->ref,
                               .factory = in,
                               .mesh = mesh.ref,
                               .stream = t->stream->ref,
                               .dim = std::string(dim),
                               .reduction = reduction,
                               .scatter = scatter,
                               .inplace = inplace,
                               .ident = ident},
              ident);
  return result;
}

// The dimensions of a Collective: `dims` in the mesh's order, every dimension for none; a
// dimension not in the mesh or given twice is a UsageError naming the mesh's.
std::vector<std::string> dimension_set(const MeshState& mesh, std::span<const std::string> dims,
                                       std::string_view call) {
  std::vector<bool> in_set(mesh.names.size(), false);
  for (const std::string& d : dims) {
    const auto i = static_cast<std::size_t>(mesh.dim_index(d));
    if (in_set[i]) {
      throw UsageError(fmt::format("{}: expected each mesh dimension at most once, found '{}' twice in [{}]", call, d,
                                   fmt::join(dims, ", ")));
    }
    in_set[i] = true;
  }
  std::vector<std::string> out;
  for (std::size_t i = 0; i < mesh.names.size(); ++i)
    if (dims.empty() || in_set[i]) out.push_back(mesh.names[i]);
  return out;
}

// What a Collective says: "reduce sum over 'host', 'gpu'", "broadcast over 'gpu' from gpu=1".
std::string collective_words(std::string_view call, const std::vector<std::string>& dims, Reduction reduction,
                             bool combines, bool scatter, std::int64_t root) {
  std::string out(call);
  if (combines) out += fmt::format(" {}", name(reduction));
  if (scatter) out += " with scatter";
  out += fmt::format(" over '{}'", fmt::join(dims, "', '"));
  if (root >= 0)
    out += fmt::format(" {} {}={}", call == "broadcast" || call == "scatter" ? "from" : "to", dims[0], root);
  return out;
}

// One Collective command (docs/ARCHITECTURE.md section 3.6), as reduce_impl: over the line
// of `dims` (several as one), rooted at `root` (-1: none). The result, out of place, lives
// on `result_mesh` (the root's slice for a rooted reduce or gather; `on` otherwise).
std::shared_ptr<TensorState> collective_impl(const std::shared_ptr<TensorState>& t,
                                             const std::shared_ptr<MeshState>& on, std::string_view call,
                                             CollectiveKind kind, std::span<const std::string> given,
                                             Reduction reduction, bool scatter, bool inplace, std::int64_t root,
                                             const std::shared_ptr<MeshState>& result_mesh, const CallSite& where) {
  if (!t) throw UsageError(fmt::format("{}: an undefined DTensor", call));
  auto ctl = lock(t->controller);
  MeshState& mesh = *on;
  const std::vector<std::string> dims = dimension_set(mesh, given, call);
  std::int64_t n = 1;
  for (const std::string& d : dims) n *= mesh.ranks.sizes()[static_cast<std::size_t>(mesh.dim_index(d))];
  const TensorMeta& in = t->meta;
  const detail::Words what(collective_words(
      call, dims, reduction, kind == CollectiveKind::Reduce && reduction != Reduction::Stack, scatter, root));
  const ReductionRule rule = collective_rule(in, n, kind, reduction, scatter, inplace, root, in.device().kind());
  const auto [ident, result] = prepare_collective(*ctl, t, mesh, rule, inplace, what, where, result_mesh);
  ctl->append(mesh.dests,
              protocol::Collective{.kind = kind,
                                   .result = inplace ? t->ref : result->ref,
                                   .tensor = t->ref,
                                   .factory = in,
                                   .mesh = mesh.ref,
                                   .stream = t->stream->ref,
                                   .dims = dims,
                                   .reduction = reduction,
                                   .scatter = scatter,
                                   .inplace = inplace,
                                   .root = root,
                                   .ident = ident},
              ident);
  return result;
}

std::vector<std::string> to_strings(std::initializer_list<std::string_view> dims) {
  return {dims.begin(), dims.end()};
}

}  // namespace

DTensor DTensor::reduce(std::string_view dim, Reduction reduction, bool scatter, CallSite where) const {
  return at_site(where,
                 [&] { return DTensor(reduce_impl(state_, mesh_, dim, reduction, scatter, false, where), mesh_); });
}

namespace {
// reduce(..., out): `result` copied into `out` in place by meshrt.copy_.
DTensor& write_into(DTensor& out, const DTensor& result, const CallSite& where) {
  if (!out.defined()) throw UsageError("reduce: expected out to be a defined DTensor, found an undefined one");
  if (!(out.meta() == result.meta())) {
    throw UsageError(fmt::format("reduce: expected out of the result's meta {}, found {}", result.meta().to_string(),
                                 out.meta().to_string()));
  }
  if (!(out.mesh() == result.mesh())) {
    throw UsageError(fmt::format("reduce: expected out on the result's mesh (ranks [{}]), found one on ranks [{}]",
                                 fmt::join(result.mesh().ranks().to_vector(), ", "),
                                 fmt::join(out.mesh().ranks().to_vector(), ", ")));
  }
  (void)result.mesh().call(FunctionName("meshrt.copy_", where), out, result);
  return out;
}
}  // namespace

DTensor& DTensor::reduce(std::string_view dim, Reduction reduction, bool scatter, DTensor& out, CallSite where) const {
  return at_site(where, [&]() -> DTensor& { return write_into(out, reduce(dim, reduction, scatter, where), where); });
}

DTensor& DTensor::reduce(const std::vector<std::string>& dims, Reduction reduction, bool scatter, DTensor& out,
                         CallSite where) const {
  return at_site(where, [&]() -> DTensor& { return write_into(out, reduce(dims, reduction, scatter, where), where); });
}

DTensor& DTensor::reduce(std::initializer_list<std::string_view> dims, Reduction reduction, bool scatter, DTensor& out,
                         CallSite where) const {
  return reduce(to_strings(dims), reduction, scatter, out, where);
}

DTensor& DTensor::reduce_(std::string_view dim, Reduction reduction, bool scatter, CallSite where) {
  return at_site(where, [&]() -> DTensor& {
    reduce_impl(state_, mesh_, dim, reduction, scatter, true, where);
    return *this;
  });
}

DTensor DTensor::reduce(const std::vector<std::string>& dims, Reduction reduction, bool scatter, CallSite where) const {
  return at_site(where, [&] {
    return DTensor(collective_impl(state_, mesh_, "reduce", CollectiveKind::Reduce, dims, reduction, scatter, false, -1,
                                   mesh_, where),
                   mesh_);
  });
}

DTensor DTensor::reduce(std::initializer_list<std::string_view> dims, Reduction reduction, bool scatter,
                        CallSite where) const {
  return reduce(to_strings(dims), reduction, scatter, where);
}

DTensor& DTensor::reduce_(const std::vector<std::string>& dims, Reduction reduction, bool scatter, CallSite where) {
  return at_site(where, [&]() -> DTensor& {
    collective_impl(state_, mesh_, "reduce_", CollectiveKind::Reduce, dims, reduction, scatter, true, -1, mesh_, where);
    return *this;
  });
}

DTensor& DTensor::reduce_(std::initializer_list<std::string_view> dims, Reduction reduction, bool scatter,
                          CallSite where) {
  return reduce_(to_strings(dims), reduction, scatter, where);
}

namespace {
// A root outside `dim` is a UsageError naming the dimension's coordinates.
void check_root(const Mesh& mesh, std::string_view call, std::string_view dim, std::int64_t root) {
  const std::int64_t n = mesh.size(dim);
  if (root < 0 || root >= n) {
    throw UsageError(fmt::format("{} over '{}': expected a coordinate in 0..{} (the size of '{}' is {}), found {}",
                                 call, dim, n - 1, dim, n, root));
  }
}
}  // namespace

DTensor DTensor::reduce(std::string_view dim, Reduction reduction, Dst dst, CallSite where) const {
  return at_site(where, [&] {
    if (!state_) throw UsageError("reduce: an undefined DTensor");
    const std::string call = reduction == Reduction::Stack ? "gather" : "reduce";
    check_root(Mesh(mesh_), call, dim, dst.index);
    std::shared_ptr<MeshState> on = Mesh(mesh_).slice(dim, dst.index).state_;
    const std::string d(dim);
    return DTensor(collective_impl(state_, mesh_, call, CollectiveKind::Reduce, std::span(&d, 1), reduction, false,
                                   false, dst.index, on, where),
                   on);
  });
}

DTensor DTensor::gather(std::string_view dim, std::int64_t dst, CallSite where) const {
  return reduce(dim, Reduction::Stack, Dst{dst}, where);
}

DTensor DTensor::broadcast(std::string_view dim, std::int64_t src, CallSite where) const {
  return at_site(where, [&] {
    if (!state_) throw UsageError("broadcast: an undefined DTensor");
    check_root(Mesh(mesh_), "broadcast", dim, src);
    const std::string d(dim);
    return DTensor(collective_impl(state_, mesh_, "broadcast", CollectiveKind::Broadcast, std::span(&d, 1),
                                   Reduction::Sum, false, false, src, mesh_, where),
                   mesh_);
  });
}

DTensor DTensor::scatter(std::string_view dim, std::int64_t src, CallSite where) const {
  return at_site(where, [&] {
    if (!state_) throw UsageError("scatter: an undefined DTensor");
    check_root(Mesh(mesh_), "scatter", dim, src);
    const std::string d(dim);
    return DTensor(collective_impl(state_, mesh_, "scatter", CollectiveKind::Scatter, std::span(&d, 1), Reduction::Sum,
                                   false, false, src, mesh_, where),
                   mesh_);
  });
}

// ------------------------------------------------------------------ MeshPermutation

MeshPermutation MeshPermutation::rotate(std::string dim, std::int64_t shift) {
  return MeshPermutation(Kind::Rotate, std::move(dim), {}, shift, {});
}
MeshPermutation MeshPermutation::transpose(std::string dim_a, std::string dim_b) {
  return MeshPermutation(Kind::Transpose, std::move(dim_a), std::move(dim_b), 0, {});
}
MeshPermutation MeshPermutation::mapping(std::vector<std::int64_t> to) {
  return MeshPermutation(Kind::Mapping, {}, {}, 0, std::move(to));
}

std::string MeshPermutation::to_string() const {
  switch (kind_) {
    case Kind::Rotate:
      return fmt::format("rotate '{}' by {}", dim_a_, shift_);
    case Kind::Transpose:
      return fmt::format("transpose '{}' and '{}'", dim_a_, dim_b_);
    case Kind::Mapping:
      return fmt::format("mapping [{}]", fmt::join(to_, ", "));
  }
  return "?";
}

std::vector<std::int64_t> MeshPermutation::resolve(const std::vector<std::string>& names,
                                                   const std::vector<std::int64_t>& sizes) const {
  std::int64_t n = 1;
  for (std::int64_t s : sizes) n *= s;
  auto dim = [&](const std::string& d) -> std::size_t {
    const auto it = std::find(names.begin(), names.end(), d);
    if (it == names.end()) {
      throw UsageError(fmt::format("to_mesh ({}): unknown mesh dimension '{}'; the mesh has [{}]", to_string(), d,
                                   fmt::join(names, ", ")));
    }
    return static_cast<std::size_t>(it - names.begin());
  };
  std::vector<std::int64_t> out(static_cast<std::size_t>(n));
  if (kind_ == Kind::Mapping) {
    if (static_cast<std::int64_t>(to_.size()) != n) {
      throw UsageError(fmt::format("to_mesh ({}): expected a target position for each of the {} ranks, found {}",
                                   to_string(), n, to_.size()));
    }
    std::vector<bool> seen(static_cast<std::size_t>(n), false);
    for (std::size_t k = 0; k < to_.size(); ++k) {
      const std::int64_t t = to_[k];
      if (t < 0 || t >= n || seen[static_cast<std::size_t>(t)]) {
        throw UsageError(fmt::format("to_mesh ({}): expected a permutation of 0..{}, found {} at source position {}{}",
                                     to_string(), n - 1, t, k, t >= 0 && t < n ? " a second time" : " (out of range)"));
      }
      seen[static_cast<std::size_t>(t)] = true;
    }
    return to_;
  }
  const std::size_t a = dim(dim_a_);
  const std::size_t b = kind_ == Kind::Transpose ? dim(dim_b_) : a;
  if (kind_ == Kind::Transpose && sizes[a] != sizes[b]) {
    throw UsageError(fmt::format("to_mesh ({}): expected dimensions of one size, found '{}' = {} and '{}' = {}",
                                 to_string(), dim_a_, sizes[a], dim_b_, sizes[b]));
  }
  // Row-major strides of the positions.
  std::vector<std::int64_t> stride(sizes.size(), 1);
  for (std::size_t d = sizes.size(); d-- > 1;) stride[d - 1] = stride[d] * sizes[d];
  for (std::int64_t k = 0; k < n; ++k) {
    const std::int64_t ca = k / stride[a] % sizes[a];
    std::int64_t t = k;
    if (kind_ == Kind::Rotate) {
      const std::int64_t moved = ((ca + shift_) % sizes[a] + sizes[a]) % sizes[a];
      t += (moved - ca) * stride[a];
    } else {
      const std::int64_t cb = k / stride[b] % sizes[b];
      t += (cb - ca) * stride[a] + (ca - cb) * stride[b];
    }
    out[static_cast<std::size_t>(k)] = t;
  }
  return out;
}

// ------------------------------------------------------------------ to_mesh

namespace {

// "[host=2, gpu=2]"
std::string mesh_words(const MeshState& m) {
  std::string out = "[";
  for (std::size_t d = 0; d < m.names.size(); ++d)
    out += fmt::format("{}{}={}", d == 0 ? "" : ", ", m.names[d], m.ranks.sizes()[d]);
  return out + "]";
}

// A broadcast to_mesh from `from` onto `to`, a mesh `from` is a slice of: for each target
// position (row-major), the source position whose coordinates agree with it on the
// source's dimensions. UsageError where `to` is not such a mesh (docs/guide.md, "Sends").
std::vector<std::int64_t> broadcast_sources(const MeshState& from, const MeshState& to,
                                            const MeshPermutation* permutation) {
  const std::vector<std::int64_t>& fs = from.ranks.sizes();
  const std::vector<std::int64_t>& ts = to.ranks.sizes();
  const auto refuse = [&](std::string_view found) {
    return UsageError(fmt::format(
        "to_mesh: expected a target mesh of the same sizes as the source {}, or one the source is a slice of (as "
        "mesh.slice(dim, i) makes, which the missing dimensions broadcast over); found {}",
        mesh_words(from), found));
  };
  // The target dimension of each source dimension: by name, in the source's order.
  std::vector<std::size_t> dim_of(fs.size());
  std::size_t next = 0;
  for (std::size_t d = 0; d < fs.size(); ++d) {
    const auto it = std::find(to.names.begin() + static_cast<std::ptrdiff_t>(next), to.names.end(), from.names[d]);
    if (it == to.names.end() || ts[static_cast<std::size_t>(it - to.names.begin())] != fs[d]) {
      throw refuse(fmt::format("the target {}, which has no dimension '{}' of size {} after the ones before it",
                               mesh_words(to), from.names[d], fs[d]));
    }
    next = static_cast<std::size_t>(it - to.names.begin());
    dim_of[d] = next++;
  }
  if (permutation) {
    throw UsageError(
        fmt::format("to_mesh ({}): expected a target mesh of the same sizes as the source {}, found {}: "
                    "a permutation does not combine with a broadcast; permute on the source's mesh "
                    "first (x.to_mesh(x.mesh(), p)), then broadcast",
                    permutation->to_string(), mesh_words(from), mesh_words(to)));
  }
  // `from` is the slice of `to` at the coordinates of from's first rank along the others.
  const auto not_slice = [&](NDSlice::Int k) {
    return refuse(
        fmt::format("the target {} (ranks {}), of which the source (ranks {}) is no slice: its rank {} "
                    "(position {}) is not where the target's coordinates put it",
                    mesh_words(to), to.ranks.to_string(), from.ranks.to_string(), from.ranks[k], k));
  };
  if (!to.ranks.contains(from.ranks[0])) throw not_slice(0);
  // Row-major coordinates of position k over `sizes`.
  const auto unravel = [](NDSlice::Int k, const std::vector<std::int64_t>& sizes) {
    std::vector<NDSlice::Int> c(sizes.size());
    for (std::size_t d = sizes.size(); d-- > 0;) {
      c[d] = k % sizes[d];
      k /= sizes[d];
    }
    return c;
  };
  std::vector<NDSlice::Int> coords = to.ranks.coordinates(from.ranks[0]);
  for (NDSlice::Int k = 0; k < from.ranks.len(); ++k) {
    const std::vector<NDSlice::Int> c = unravel(k, fs);
    for (std::size_t d = 0; d < fs.size(); ++d) coords[dim_of[d]] = c[d];
    if (to.ranks.location(coords) != from.ranks[k]) throw not_slice(k);
  }
  std::vector<std::int64_t> sources(static_cast<std::size_t>(to.ranks.len()));
  for (std::size_t j = 0; j < sources.size(); ++j) {
    const std::vector<NDSlice::Int> c = unravel(static_cast<NDSlice::Int>(j), ts);
    std::int64_t k = 0;
    for (std::size_t d = 0; d < fs.size(); ++d) k = k * fs[d] + c[dim_of[d]];
    sources[j] = k;
  }
  return sources;
}

}  // namespace

DTensor DTensor::to_mesh(const Mesh& target, CallSite where) const {
  return at_site(where, [&] { return send_to_mesh(target, nullptr, where); });
}

DTensor DTensor::to_mesh(const Mesh& target, const MeshPermutation& p, CallSite where) const {
  return at_site(where, [&] { return send_to_mesh(target, &p, where); });
}

DTensor DTensor::rotate(std::string_view dim, std::int64_t shift, CallSite where) const {
  return at_site(where, [&] {
    if (!state_) throw UsageError("rotate: an undefined DTensor");
    const MeshPermutation p = MeshPermutation::rotate(std::string(dim), shift);
    return send_to_mesh(Mesh(mesh_), &p, where);
  });
}

DTensor DTensor::send_to_mesh(const Mesh& target, const MeshPermutation* permutation, const CallSite& where) const {
  if (!state_) throw UsageError("to_mesh: an undefined DTensor");
  auto ctl = lock(state_->controller);
  const MeshState& from = *mesh_;
  const MeshState& to = *target.state_;
  ctl->check_epoch(to.epoch, "mesh");
  std::vector<std::int64_t> to_order, from_order;
  if (from.ranks.sizes() != to.ranks.sizes()) {
    from_order = broadcast_sources(from, to, permutation);
    bool identity = from_order.size() == static_cast<std::size_t>(from.ranks.len());
    for (std::size_t j = 0; identity && j < from_order.size(); ++j)
      identity = from_order[j] == static_cast<std::int64_t>(j);
    if (identity) from_order.clear();  // dimensions of size 1 only: positional
  } else if (permutation) {
    to_order = permutation->resolve(from.names, from.ranks.sizes());
    bool identity = true;
    for (std::size_t k = 0; k < to_order.size(); ++k)
      identity = identity && to_order[k] == static_cast<std::int64_t>(k);
    if (identity) to_order.clear();  // positional: the plain command
  }
  const MeshState::SendWords& words = mesh_->send_words(to);
  const detail::Words what = permutation
                                 ? detail::Words(fmt::format("{} ({})", words.what.str(), permutation->to_string()))
                             : !from_order.empty() ? detail::Words(fmt::format("{} (broadcast)", words.what.str()))
                                                   : words.what;
  use_tensor(*ctl, *state_, from, *state_->stream, false, what);
  ctl->ensure_stream(*state_->stream);
  const protocol::Ident ident = ctl->new_ident();
  auto result = new_tensor(*ctl, state_->meta, target.state_, state_->stream,
                           ctl->make_node(ident, what, where, {state_->node()}));
  ctl->append(words.dests,
              protocol::SendTensor{.result = result->ref,
                                   .from_ranks = from.ranks,
                                   .to_ranks = to.ranks,
                                   .tensor = state_->ref,
                                   .factory = state_->meta,
                                   .stream = state_->stream->ref,
                                   .to_order = std::move(to_order),
                                   .from_order = std::move(from_order),
                                   .ident = ident},
              ident);
  return DTensor(result, target.state_);
}

DTensor DTensor::slice_mesh(std::string_view dim, std::int64_t index) const {
  if (!state_) throw UsageError("slice_mesh: an undefined DTensor");
  return DTensor(state_, Mesh(mesh_).slice(dim, index).state_);
}

namespace {
// drop() of a tensor that is not a borrow: its value is deleted on the workers after the
// work issued on it so far, now rather than when the last handle goes.
void drop_value(ControllerState& ctl, TensorState& t, const CallSite& where) {
  if (t.dropped) {
    throw UsageError(fmt::format("drop: the tensor was already dropped at {}", detail::describe(t.dropped_at)));
  }
  if (t.recorded != 0) {
    throw UsageError(
        "drop: the tensor is a value of a recorded step, which each replay makes and frees; only borrows are "
        "dropped inside a recording");
  }
  if (ctl.recording()) {
    throw UsageError(
        "drop: inside a recording only borrows are dropped; drop the tensor after the recording (or its replays)");
  }
  if (t.lent().active > 0) {
    throw UsageError(fmt::format("drop: the tensor is borrowed ({} active borrow{}); drop the borrows first",
                                 t.lent().active, t.lent().active == 1 ? "" : "s"));
  }
  t.dropped = true;
  t.dropped_at = where;
  ctl.defer_delete(t.home->dests, t.ref, t.meta.nbytes());
}
}  // namespace

void DTensor::drop(CallSite where) {
  return at_site(where, [&] {
    if (!state_) throw UsageError("drop: an undefined DTensor");
    auto ctl = lock(state_->controller);
    TensorState& b = *state_;
    ctl->check_epoch(b.epoch, "tensor");
    if (!b.borrow.origin) {
      drop_value(*ctl, b, where);
      return;
    }
    if (b.borrow.dropped) {
      throw UsageError(
          fmt::format("drop: the borrow was already dropped at {}", detail::describe(b.borrow.dropped_at)));
    }
    b.borrow.dropped = true;
    b.borrow.dropped_at = where;
    TensorState& origin = *b.borrow.origin;
    origin.lent().active--;
    if (b.borrow.is_mutable) {
      origin.lent().mutably = false;
      // The origin now holds what the borrower wrote.
      origin.node() = ctl->make_node(0, fmt::format("drop of borrow on stream '{}'", b.stream->name), where,
                                     {origin.node(), b.node()});
    }
    ctl->append(b.home->dests, protocol::BorrowDrop{b.ref});
  });
}

// ------------------------------------------------------------------ Mesh

const std::vector<std::string>& Mesh::names() const {
  return state_->names;
}
std::vector<std::int64_t> Mesh::sizes() const {
  return state_->ranks.sizes();
}
std::int64_t Mesh::size(std::string_view dim) const {
  return state_->ranks.sizes()[static_cast<std::size_t>(state_->dim_index(dim))];
}
std::int64_t Mesh::size(const std::vector<std::string>& dims) const {
  std::int64_t n = 1;
  for (const std::string& d : dimension_set(*state_, dims, "Mesh::size"))
    n *= state_->ranks.sizes()[static_cast<std::size_t>(state_->dim_index(d))];
  return n;
}
std::int64_t Mesh::size(std::initializer_list<std::string_view> dims) const {
  return size(to_strings(dims));
}
const NDSlice& Mesh::ranks() const {
  return state_->ranks;
}

Mesh Mesh::slice(std::string_view dim, std::int64_t index) const {
  auto ctl = lock(state_->controller);
  ctl->check_epoch(state_->epoch, "mesh");
  const auto d = static_cast<std::size_t>(state_->dim_index(dim));
  std::vector<std::string> names = state_->names;
  names.erase(names.begin() + static_cast<std::ptrdiff_t>(d));
  return Mesh(make_mesh(*ctl, state_->kind, std::move(names), state_->ranks.at(d, index)));
}

Mesh Mesh::slice(std::string_view dim, std::int64_t begin, std::int64_t end, std::int64_t step) const {
  auto ctl = lock(state_->controller);
  ctl->check_epoch(state_->epoch, "mesh");
  const auto d = static_cast<std::size_t>(state_->dim_index(dim));
  return Mesh(make_mesh(*ctl, state_->kind, state_->names, state_->ranks.select(d, begin, end, step)));
}

Mesh Mesh::rename(std::string_view from, std::string to) const {
  auto ctl = lock(state_->controller);
  ctl->check_epoch(state_->epoch, "mesh");
  const auto d = static_cast<std::size_t>(state_->dim_index(from));
  std::vector<std::string> names = state_->names;
  names[d] = std::move(to);
  return Mesh(make_mesh(*ctl, state_->kind, std::move(names), state_->ranks));
}

Mesh Mesh::split(std::string_view dim, std::vector<std::pair<std::string, std::int64_t>> parts) const {
  auto ctl = lock(state_->controller);
  ctl->check_epoch(state_->epoch, "mesh");
  const auto d = static_cast<std::size_t>(state_->dim_index(dim));
  const NDSlice& r = state_->ranks;
  std::int64_t product = 1;
  std::pair<std::string, std::int64_t>* inferred = nullptr;
  for (auto& part : parts) {
    const auto& [n, s] = part;
    if (s == -1 && !inferred) {
      inferred = &part;
      continue;
    }
    if (s < 1) {
      throw UsageError(
          fmt::format("split of '{}': part '{}' has size {}, expected >= 1 (or -1 for one part, "
                      "inferred)",
                      dim, n, s));
    }
    product *= s;
  }
  if (inferred) {
    if (r.sizes()[d] % product != 0) {
      throw UsageError(
          fmt::format("split of '{}': the other parts' sizes multiply to {}, which does not divide "
                      "its size {}; part '{}' (-1) cannot be inferred",
                      dim, product, r.sizes()[d], inferred->first));
    }
    inferred->second = r.sizes()[d] / product;
    product = r.sizes()[d];
  }
  if (product != r.sizes()[d]) {
    throw UsageError(
        fmt::format("split of '{}': the parts' sizes multiply to {}, expected {}", dim, product, r.sizes()[d]));
  }
  std::vector<std::string> names;
  std::vector<std::int64_t> sizes, strides;
  for (std::size_t i = 0; i < r.ndim(); ++i) {
    if (i != d) {
      names.push_back(state_->names[i]);
      sizes.push_back(r.sizes()[i]);
      strides.push_back(r.strides()[i]);
      continue;
    }
    // Row-major within the split dimension: the last part moves fastest.
    std::vector<std::int64_t> part_strides(parts.size());
    std::int64_t stride = r.strides()[i];
    for (std::size_t k = parts.size(); k-- > 0;) {
      part_strides[k] = stride;
      stride *= parts[k].second;
    }
    for (std::size_t k = 0; k < parts.size(); ++k) {
      names.push_back(parts[k].first);
      sizes.push_back(parts[k].second);
      strides.push_back(part_strides[k]);
    }
  }
  return Mesh(
      make_mesh(*ctl, state_->kind, std::move(names), NDSlice(r.offset(), std::move(sizes), std::move(strides))));
}

Mesh Mesh::flatten(std::string name) const {
  auto ctl = lock(state_->controller);
  ctl->check_epoch(state_->epoch, "mesh");
  const NDSlice& r = state_->ranks;
  // Flattening keeps row-major order only when each stride is the next one times its size.
  std::int64_t expected = 1;
  bool contiguous = true;
  for (std::size_t i = r.ndim(); i-- > 0;) {
    if (r.sizes()[i] == 1) continue;
    if (expected == 1 && contiguous) expected = r.strides()[i];
    if (r.strides()[i] != expected) contiguous = false;
    expected = r.strides()[i] * r.sizes()[i];
  }
  if (!contiguous) {
    throw UsageError(
        fmt::format("flatten: the mesh {} is not evenly strided in row-major order; only such meshes "
                    "flatten to one dimension",
                    r.to_string()));
  }
  std::int64_t stride = 1;
  for (std::size_t i = r.ndim(); i-- > 0;) {
    if (r.sizes()[i] > 1) {
      stride = r.strides()[i];
      break;
    }
  }
  return Mesh(make_mesh(*ctl, state_->kind, {std::move(name)}, NDSlice(r.offset(), {r.len()}, {stride})));
}

DTensor Mesh::rank(std::string_view dim, CallSite where) const {
  lock(state_->controller)->check_epoch(state_->epoch, "mesh");
  state_->dim_index(dim);
  return call(FunctionName("meshrt.mesh_coordinate", where), Arg(std::string(dim)));
}

Future<void> Mesh::barrier(CallSite where) const {
  return at_site(where, [&] { return barrier_impl({}, where); });
}
Future<void> Mesh::barrier(std::string_view dim, CallSite where) const {
  return at_site(where, [&] { return barrier_impl({std::string(dim)}, where); });
}
Future<void> Mesh::barrier(const std::vector<std::string>& dims, CallSite where) const {
  return at_site(where, [&] { return barrier_impl(dims, where); });
}
Future<void> Mesh::barrier(std::initializer_list<std::string_view> dims, CallSite where) const {
  return at_site(where, [&] { return barrier_impl(to_strings(dims), where); });
}

// One Collective of kind Barrier on the default stream: no tensor, no result; its future
// is a completion (docs/ARCHITECTURE.md section 3.6).
Future<void> Mesh::barrier_impl(std::vector<std::string> given, const CallSite& where) const {
  auto ctl = lock(state_->controller);
  ctl->check_epoch(state_->epoch, "mesh");
  const std::vector<std::string> dims = dimension_set(*state_, given, "barrier");
  const detail::Words what(dims.empty() ? std::string("barrier")
                                        : collective_words("barrier", dims, Reduction::Sum, false, false, -1));
  // Its future would name an invocation a replay renumbers, and waiting on it is what a
  // recorded step cannot do.
  ctl->refuse_in_recording(what.str());
  std::shared_ptr<StreamState> stream = ctl->stream("default");
  ctl->ensure_mesh(*state_);
  ctl->ensure_stream(*stream);
  const protocol::Ident ident = ctl->new_ident();
  auto f = std::make_shared<detail::FutureState>();
  f->controller = state_->controller;
  f->ident = ident;
  f->what = what.str();
  f->node = ctl->make_node(ident, what, where, std::span<const std::shared_ptr<Node>>());
  ctl->append(state_->dests,
              protocol::Collective{.kind = CollectiveKind::Barrier,
                                   .result = Ref{},
                                   .tensor = Ref{},
                                   .factory = TensorMeta(),
                                   .mesh = state_->ref,
                                   .stream = stream->ref,
                                   .dims = dims,
                                   .reduction = Reduction::Sum,
                                   .scatter = false,
                                   .inplace = false,
                                   .root = -1,
                                   .ident = ident},
              ident);
  ctl->flush();
  return Future<void>(f);
}

DTensor Mesh::one(std::vector<DTensor> outputs) const {
  if (outputs.empty()) return DTensor();  // an in-place function: its effect is on its arguments
  if (outputs.size() != 1) {
    throw UsageError(
        fmt::format("call: the function returns {} tensors; use call_n to get all of them", outputs.size()));
  }
  return std::move(outputs.front());
}

std::vector<DTensor> Mesh::call_n(FunctionName fn, std::vector<Arg> args) const {
  const CallSite where = fn.where;
  return at_site(where, [&] { return call_n_impl(std::move(fn), std::move(args)); });
}

DTensor Mesh::from_host(const Tensor& t, CallSite where) const {
  return at_site(where, [&] {
    if (!t.defined()) throw UsageError("from_host: expected a defined tensor, found an undefined one");
    check_host_bytes([&] { return fmt::format("from_host: the tensor {}", t.meta().to_string()); }, t.nbytes());
    return one(call_n_impl(FunctionName("meshrt.from_host", where), {Arg(t)}));  // Arg copies t
  });
}

DTensor Mesh::scatter(std::string_view dim, const Tensor& t, CallSite where) const {
  return at_site(where, [&] {
    const std::int64_t parts = size(dim);  // names the mesh's dimensions when `dim` is not one
    if (!t.defined() || t.shape().empty() || t.shape()[0] % parts != 0) {
      throw UsageError(
          fmt::format("scatter over '{}': expected a tensor whose first axis splits into {} equal shards, found {}",
                      dim, parts, t.defined() ? t.meta().to_string() : std::string("an undefined tensor")));
    }
    // Every shard's rank gets the whole tensor (its kernel cuts the shard there).
    check_host_bytes([&] { return fmt::format("scatter over '{}': the tensor {}", dim, t.meta().to_string()); },
                     t.nbytes());
    return one(call_n_impl(FunctionName("meshrt.shard", where), {Arg(t), Arg(std::string(dim)), Arg(parts)}));
  });
}

namespace {

// "mesh [dp=2, tp=2] on ranks [0, 1, 2, 3]"
std::string mesh_text(const MeshState& m) {
  std::vector<std::string> dims;
  for (std::size_t i = 0; i < m.names.size(); ++i) dims.push_back(fmt::format("{}={}", m.names[i], m.ranks.sizes()[i]));
  return fmt::format("mesh [{}] on ranks [{}]", fmt::join(dims, ", "), fmt::join(m.dests, ", "));
}

}  // namespace

// A worker object belongs to the mesh that made it: its ranks hold it in that mesh's
// coordinates, and no other mesh's call may name it.
void detail::check_objects(const std::vector<DTensor>& args, const MeshState& mesh, std::string_view what) {
  for (const DTensor& a : args) {
    const TensorState& t = *ControllerState::state_of(a);
    if (!t.object || same_layout(*t.home, mesh)) continue;
    throw UsageError(fmt::format(
        "{}: a worker object made on {} was passed to a call on {}; an object belongs to the mesh that made it: "
        "call on that mesh, or make an object on this one",
        what, mesh_text(*t.home), mesh_text(mesh)));
  }
}

Object Mesh::call_object(FunctionName fn, std::vector<Arg> args) const {
  const CallSite where = fn.where;
  return at_site(where, [&] { return call_object_impl(std::move(fn), std::move(args)); });
}

Object Mesh::call_object_impl(FunctionName fn, std::vector<Arg> args) const {
  auto ctl = lock(state_->controller);
  ctl->check_epoch(state_->epoch, "mesh");
  ctl->refuse_in_recording(fmt::format("call_object of {}", fn.name));
  const functions::Function& f = functions::lookup(fn.name);
  if (!f.make_object) {
    throw UsageError(
        fmt::format("call_object: {} (registered at {}) returns tensors, not an object: register an object constructor "
                    "(MESHRT_REGISTER_OBJECT, or a Python function with @meshrt.function) and call that",
                    fn.name, f.where()));
  }
  std::vector<DTensor> tensors;
  for (const Arg& a : args) {
    for (const DTensor& t : a.tensors()) tensors.push_back(t);
  }
  check_objects(tensors, *state_, fn.name);
  std::shared_ptr<StreamState> stream;
  for (const DTensor& t : tensors) {
    if (!stream)
      stream = t.state_->stream;
    else if (stream != t.state_->stream) {
      throw UsageError(fmt::format("{}: arguments on streams '{}' and '{}'; borrow them onto one stream", fn.name,
                                   stream->name, t.state_->stream->name));
    }
    // The constructor runs on the worker's thread, outside the stream's device work: it can
    // read host memory only.
    if (!t.state_->object && state_->kind != Device::Kind::Cpu) {
      throw UsageError(fmt::format(
          "call_object: {}: a tensor argument on a mesh placed on {}: an object constructor takes tensors on a cpu "
          "mesh only; pass the tensor to a kernel that stores what it needs in the object",
          fn.name, state_->kind == Device::Kind::Cuda ? "cuda" : "the emulated accelerator"));
    }
  }
  if (!stream) stream = ctl->default_stream();
  std::size_t payload = 0;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::size_t bytes = protocol::encoded_size(args[i].value());
    check_host_bytes([&] { return fmt::format("{}: argument {}", fn.name, i); }, bytes);
    payload += bytes;
  }
  check_host_bytes([&] { return fmt::format("{}: the call's {} arguments together", fn.name, args.size()); }, payload);
  std::vector<std::shared_ptr<Node>> inputs;
  for (const DTensor& t : tensors) {
    use_tensor(*ctl, *t.state_, *state_, *stream, false, fn.name);
    inputs.push_back(t.state_->node());
  }
  ctl->ensure_mesh(*state_);
  ctl->ensure_stream(*stream);
  const protocol::Ident ident = ctl->new_ident();
  auto node = ctl->make_node(ident, ctl->function_words(fn.name), fn.where, std::move(inputs));
  auto object = new_tensor(*ctl, TensorMeta(), state_, stream, node);
  object->object = true;
  std::vector<Value> wire;
  wire.reserve(args.size());
  for (Arg& a : args) wire.push_back(a.value());
  ctl->append(state_->dests,
              protocol::CallFunction{.ident = ident,
                                     .results = {object->ref},
                                     .mutates = {},
                                     .function = std::move(fn.name),
                                     .args = std::move(wire),
                                     .stream = stream->ref,
                                     .mesh = state_->ref,
                                     .keeps_object = true},
              ident, payload);
  return Object(std::move(object), state_);
}

std::vector<DTensor> Mesh::call_n_impl(FunctionName fn, std::vector<Arg> args) const {
  auto ctl = lock(state_->controller);
  // The stream is the one the tensor arguments are on.
  std::shared_ptr<StreamState> stream;
  for (const Arg& a : args) {
    for (const DTensor& t : a.tensors()) {
      if (!stream)
        stream = t.state_->stream;
      else if (stream != t.state_->stream) {
        throw UsageError(fmt::format("{}: tensor arguments on streams '{}' and '{}'; borrow them onto one stream",
                                     fn.name, stream->name, t.state_->stream->name));
      }
    }
  }
  if (!stream) stream = ctl->default_stream();
  return call_on_impl(Stream(stream), std::move(fn), std::move(args));
}

std::vector<DTensor> Mesh::call_on(const Stream& stream, FunctionName fn, std::vector<Arg> args) const {
  const CallSite where = fn.where;
  return at_site(where, [&] { return call_on_impl(stream, std::move(fn), std::move(args)); });
}

std::vector<DTensor> Mesh::call_on_impl(const Stream& stream, FunctionName fn, std::vector<Arg> args) const {
  auto ctl = lock(state_->controller);
  ctl->check_epoch(state_->epoch, "mesh");
  const functions::Function& f = functions::lookup(fn.name);
  std::vector<DTensor> tensors;
  const std::vector<Value> metas = ControllerState::argument_metas(args, tensors);
  std::vector<std::shared_ptr<Node>> inputs;
  check_objects(tensors, *state_, fn.name);
  // The arguments travel in the command: host tensors and strings are refused here when
  // over the control plane's limit, not by the batcher's thread after the call returned.
  std::size_t payload = 0;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const Value& v = args[i].value();
    const std::size_t bytes = protocol::encoded_size(v);
    check_host_bytes(
        [&] {
          return fmt::format("{}: argument {} ({})", fn.name, i,
                             v.is_tensor() ? "the host tensor " + v.as_tensor().meta().to_string()
                                           : std::string(v.is_string() ? "a string" : "a list or dict"));
        },
        bytes);
    payload += bytes;
  }
  check_host_bytes([&] { return fmt::format("{}: the call's {} arguments together", fn.name, args.size()); }, payload);
  // On the controller a device means "each rank's own device of this kind" (index 0).
  const Signature sig = infer_at_call(f, ArgMetas(fn.name, metas, Device::of(state_->kind, 0)));
  // Which tensors the call mutates: the tensor arguments at the positions sig.mutates names.
  std::vector<Ref> mutates;
  std::vector<TensorState*> mutated;
  for (std::size_t pos : sig.mutates) {
    const Value& v = args[pos].value();
    if (!v.is_ref()) {
      throw UsageError(
          fmt::format("{}: the shape function says argument {} is mutated, but it is not a tensor", fn.name, pos));
    }
    for (const DTensor& t : args[pos].tensors()) {
      mutates.push_back(t.state_->ref);
      mutated.push_back(t.state_.get());
    }
  }
  // A declared view shares its argument's storage from now on: making one is a mutating
  // use of the argument (borrow rules; the argument fails with the call on the workers).
  std::vector<std::pair<std::size_t, TensorState*>> viewed;
  if (!sig.views.empty()) {
    ctl->refuse_views_in_recording(fn.name);
    for (const View& v : sig.views) {
      if (!args[v.input].value().is_ref()) {
        throw UsageError(
            fmt::format("{}: its shape function declares output {} a view of argument {}, which is a host tensor; "
                        "expected a DTensor argument (a view shares the workers' storage of a value)",
                        fn.name, v.output, v.input));
      }
      TensorState& base = *args[v.input].tensors().front().state_;
      if (base.borrow.origin) {
        throw UsageError(fmt::format(
            "{}: its shape function declares output {} a view of argument {}, which is a borrow on stream '{}'; a "
            "view of a borrow would outlive its drop: make the view of the origin, then borrow the view",
            fn.name, v.output, v.input, base.stream->name));
      }
      viewed.emplace_back(v.output, &base);
      if (std::find(mutated.begin(), mutated.end(), &base) == mutated.end()) {
        mutates.push_back(base.ref);
        mutated.push_back(&base);
      }
    }
  }
  for (const DTensor& t : tensors) {
    const bool mutate = std::find(mutated.begin(), mutated.end(), t.state_.get()) != mutated.end();
    use_tensor(*ctl, *t.state_, *state_, *stream.state_, mutate, fn.name);
    inputs.push_back(t.state_->node());
  }
  ctl->ensure_mesh(*state_);
  ctl->ensure_stream(*stream.state_);
  const protocol::Ident ident = ctl->new_ident();
  auto node = ctl->make_node(ident, ctl->function_words(fn.name), fn.where, std::move(inputs));
  std::vector<DTensor> outputs;
  std::vector<Ref> results;
  for (const TensorMeta& m : sig.outputs) {
    auto t = new_tensor(*ctl, m, state_, stream.state_, node);
    results.push_back(t->ref);
    outputs.push_back(DTensor(t, state_));
  }
  for (const auto& [output, base] : viewed) outputs[output].state_->share_with(base->share());
  for (TensorState* t : mutated) t->node() = node;
  std::vector<Value> wire;
  wire.reserve(args.size());
  for (Arg& a : args) wire.push_back(a.value());
  ctl->append(state_->dests,
              protocol::CallFunction{.ident = ident,
                                     .results = std::move(results),
                                     .mutates = std::move(mutates),
                                     .function = std::move(fn.name),
                                     .args = std::move(wire),
                                     .stream = stream.state_->ref,
                                     .mesh = state_->ref},
              ident, payload);
  return outputs;
}

// ------------------------------------------------------------------ Futures

namespace detail {

bool future_done(FutureState& f) {
  refuse_on_worker_thread("Future::done");
  if (f.finished) return true;
  if (f.composite) {
    return std::all_of(f.parts.begin(), f.parts.end(), [](const auto& p) { return future_done(*p); });
  }
  auto ctl = f.controller.lock();
  if (!ctl) return true;
  ctl->flush_deferred();
  ctl->poll_replies();
  // As in wait_for: the first check asks only the workers with later work queued behind
  // the ident (one whose last command it is reports by itself, a fetch's rank with its
  // result); a later check asks every laggard.
  ctl->request_status(f.ident, f.checked);
  f.checked = true;
  return ctl->frontier() >= f.ident;
}

namespace {

// when_all's wait: every part in turn under one deadline; the first failure in the list's
// order, renamed by its position so that the caller knows which future it was.
std::exception_ptr wait_all(FutureState& f, std::optional<std::chrono::duration<double>> timeout) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  std::exception_ptr first;
  for (std::size_t i = 0; i < f.parts.size(); ++i) {
    std::optional<std::chrono::duration<double>> left;
    if (timeout) {
      left = std::max(std::chrono::duration<double>::zero(),
                      *timeout - std::chrono::duration<double>(Clock::now() - start));
    }
    std::exception_ptr e = future_wait(*f.parts[i], left);
    if (!e || first) continue;
    if (!f.leaves.empty()) {  // a fetch of several tensors: the part's error names its rank
      first = e;
      continue;
    }
    try {
      std::rethrow_exception(e);
    } catch (const RemoteError& r) {
      first = std::make_exception_ptr(
          RemoteError(fmt::format("when_all: future {} of {} failed: {}", i + 1, f.parts.size(), r.what()), r.ident(),
                      r.function(), r.ranks(), r.worker_message(), r.issued_at()));
    } catch (...) {
      first = e;
    }
  }
  f.finished = true;
  f.error = first;
  return first;
}

}  // namespace

std::exception_ptr future_wait(FutureState& f, std::optional<std::chrono::duration<double>> timeout) {
  refuse_on_worker_thread("Future::get");
  if (f.finished) return f.error;
  if (f.composite) return wait_all(f, timeout);
  auto ctl = f.controller.lock();
  if (!ctl) return std::make_exception_ptr(UsageError("the future outlived its controller session"));
  const Subject subject(f.what, f.ident);
  ctl->wait_for(f.ident, timeout, subject);
  f.finished = true;
  ctl->forget_fetch(f.ident);
  f.error = ctl->failure_of(f.node, subject);
  if (!f.error && !f.value && f.rank >= 0) {
    f.error = std::make_exception_ptr(
        Error(fmt::format("{}: rank {} completed it without sending a value", subject.str(), f.rank)));
  }
  return f.error;
}

const Value& future_value(const FutureState& f) {
  return *f.value;
}

std::shared_ptr<FutureState> future_all(std::vector<std::shared_ptr<FutureState>> parts) {
  auto f = std::make_shared<FutureState>();
  f->composite = true;
  for (const auto& p : parts) {
    if (!p) throw UsageError("when_all: expected futures from meshrt calls, found a moved-from or empty Future");
  }
  f->parts = std::move(parts);
  return f;
}

const std::vector<std::shared_ptr<FutureState>>& future_parts(const FutureState& f) {
  return f.parts;
}

std::vector<Tensor> future_tensors(const FutureState& f) {
  std::vector<Tensor> out;
  if (f.leaves.empty()) {
    for (const auto& p : f.parts) out.push_back(value_to_tensor(*p->value));
    return out;
  }
  for (const auto& [part, at] : f.leaves) {
    const Value& v = *f.parts[part]->value;
    out.push_back(value_to_tensor(v.is_list() ? v.as_list().at(at) : v));
  }
  return out;
}

Tensor value_to_tensor(const Value& v) {
  if (!v.is_tensor()) throw UsageError(fmt::format("expected a tensor from the fetch, found {}", v.to_string()));
  return v.as_tensor();
}

}  // namespace detail

Future<void> when_all(std::vector<Future<void>> futures) {
  std::vector<std::shared_ptr<detail::FutureState>> parts;
  parts.reserve(futures.size());
  for (Future<void>& f : futures) parts.push_back(std::move(f.state_));
  return Future<void>(detail::future_all(std::move(parts)));
}

// ------------------------------------------------------------------ Controller

Controller::Controller(std::shared_ptr<ControllerState> state) : state_(std::move(state)) {}
Controller::~Controller() = default;

Mesh Controller::world_mesh(std::vector<std::pair<std::string, std::int64_t>> dims, DeviceKind kind, CallSite where) {
  detail::refuse_on_worker_thread("Controller::world_mesh");
  // Without the job's accelerator being cuda no GPU was chosen per rank (or there is none):
  // refused here, not at the first fetch with the CUDA driver's words.
  if (kind == DeviceKind::Cuda && accelerator() != DeviceKind::Cuda) {
    throw UsageError(fmt::format(
        "world_mesh: a mesh placed on cuda needs a job whose accelerator is cuda, found accelerator {} (MESHRT_"
        "ACCELERATOR={}: auto picks cuda when meshrt was built with CUDA and a GPU is visible); place the mesh on "
        "ctl.accelerator(), or run the GPU code path without a GPU on the emulated accelerator: "
        "MESHRT_ACCELERATOR=emulated and DeviceKind::Emulated (kind=\"emulated\" in Python) (at {})",
        device::name(device::configured_accelerator()), settings::kAccelerator.get(), detail::describe(where)));
  }
  std::vector<std::string> names;
  std::vector<std::int64_t> sizes;
  std::int64_t product = 1;
  for (auto& [n, s] : dims) {
    names.push_back(n);
    sizes.push_back(s);
    product *= s;
  }
  const NDSlice& w = state_->worker_ranks();
  if (product != w.len()) {
    throw UsageError(
        fmt::format("world_mesh: expected sizes that hold the {} worker ranks, found [{}] ({} ranks) (at {})", w.len(),
                    fmt::join(sizes, ", "), product, detail::describe(where)));
  }
  return Mesh(make_mesh(*state_, kind, std::move(names), NDSlice::row_major(std::move(sizes), w.offset())));
}

Stream Controller::stream(const std::string& name) {
  detail::refuse_on_worker_thread("Controller::stream");
  return Stream(state_->stream(name));
}

DeviceKind Controller::accelerator() const {
  return device::device_kind(device::configured_accelerator());
}

Stream Controller::default_stream() {
  detail::refuse_on_worker_thread("Controller::default_stream");
  return stream("default");
}

namespace {

using Coords = std::vector<std::pair<std::string, std::int64_t>>;

// Each coordinate names a dimension of at least one of the meshes, once, inside its size.
void check_coords(std::span<const MeshState* const> meshes, const Coords& coords) {
  for (auto c = coords.begin(); c != coords.end(); ++c) {
    const auto& [dim, index] = *c;
    // A handful of coordinates: a scan, not a set, for the common one-coordinate fetch.
    if (std::any_of(coords.begin(), c, [&](const auto& earlier) { return earlier.first == dim; }))
      throw UsageError(fmt::format("fetch_shard: dimension '{}' given twice", dim));
    bool found = false;
    for (const MeshState* m : meshes) {
      const auto it = std::find(m->names.begin(), m->names.end(), dim);
      if (it == m->names.end()) continue;
      found = true;
      const std::int64_t size = m->ranks.sizes()[static_cast<std::size_t>(it - m->names.begin())];
      if (index < 0 || index >= size) {
        throw UsageError(
            fmt::format("fetch_shard: coordinate {} of dimension '{}' is outside the mesh (size {}); expected 0 to {}",
                        index, dim, size, size - 1));
      }
    }
    if (!found) (void)meshes.front()->dim_index(dim);  // the UsageError naming the mesh's dimensions
  }
}

// The rank at `coords` of `mesh`: 0 along the dimensions not named (docs/guide.md,
// "Fetching and futures"); coordinates of dimensions the mesh lacks are another tensor's.
int rank_at(const MeshState& mesh, const Coords& coords) {
  boost::container::small_vector<std::int64_t, 4> at(mesh.names.size(), 0);
  for (const auto& [dim, index] : coords) {
    const auto it = std::find(mesh.names.begin(), mesh.names.end(), dim);
    if (it != mesh.names.end()) at[static_cast<std::size_t>(it - mesh.names.begin())] = index;
  }
  return static_cast<int>(mesh.ranks.location(std::span<const std::int64_t>(at.data(), at.size())));
}

}  // namespace

Future<std::vector<Tensor>> Controller::fetch_shards(const std::vector<DTensor>& ts, Coords coords, CallSite where) {
  detail::refuse_on_worker_thread("Controller::fetch_shards");
  return at_site(where, [&] {
    state_->refuse_in_recording("fetch_shard");
    ControllerState& ctl = *state_;
    std::vector<const MeshState*> meshes;
    for (std::size_t i = 0; i < ts.size(); ++i) {
      if (!ts[i].state_)
        throw UsageError(fmt::format("fetch_shard: tensor {} of {} is an undefined DTensor", i, ts.size()));
      meshes.push_back(ts[i].mesh_.get());
      if (const std::uint64_t bytes = ts[i].state_->meta.nbytes(); bytes > kControlMessageLimit - kFrameRoom) {
        throw UsageError(fmt::format(
            "fetch_shard: tensor {} of {} ({}) is {} bytes, expected at most {} bytes in one fetch; fetch it in pieces",
            i, ts.size(), ts[i].state_->meta.to_string(), bytes, kControlMessageLimit - kFrameRoom));
      }
    }
    if (ts.empty()) return Future<std::vector<Tensor>>(detail::future_all({}));
    check_coords(meshes, coords);
    // One FetchValue per (rank, stream) with every leaf it holds: one command and one reply
    // per rank however many leaves there are.
    struct Group {
      int rank;
      StreamState* stream;
      std::vector<std::size_t> leaves;
    };
    std::vector<Group> groups;
    std::vector<std::pair<std::size_t, std::size_t>> place(ts.size());
    for (std::size_t i = 0; i < ts.size(); ++i) {
      const int rank = rank_at(*meshes[i], coords);
      StreamState* stream = ts[i].state_->stream.get();
      auto g = std::find_if(groups.begin(), groups.end(),
                            [&](const Group& x) { return x.rank == rank && x.stream == stream; });
      if (g == groups.end()) g = groups.insert(groups.end(), Group{rank, stream, {}});
      place[i] = {static_cast<std::size_t>(g - groups.begin()), g->leaves.size()};
      g->leaves.push_back(i);
      use_tensor(ctl, *ts[i].state_, *meshes[i], *ts[i].state_->stream, false, "fetch_shard");
    }
    std::vector<std::shared_ptr<detail::FutureState>> parts;
    for (const Group& g : groups) {
      ctl.ensure_stream(*ts[g.leaves.front()].state_->stream);
      const protocol::Ident ident = ctl.new_ident();
      auto f = std::make_shared<detail::FutureState>();
      f->controller = state_;
      f->ident = ident;
      f->rank = g.rank;
      f->what =
          fmt::format("fetch of {} tensor{} from rank {}", g.leaves.size(), g.leaves.size() == 1 ? "" : "s", g.rank);
      std::vector<std::shared_ptr<Node>> inputs;
      Value::List refs;
      for (std::size_t i : g.leaves) {
        inputs.push_back(ts[i].state_->node());
        refs.push_back(Value(ts[i].state_->ref));
      }
      f->node = ctl.make_node(ident, fmt::format("fetch from rank {}", g.rank), where, inputs);
      ctl.register_fetch(ident, f);
      ctl.append({g.rank},
                 protocol::FetchValue{.ident = ident,
                                      .mutates = {},
                                      .function = std::nullopt,
                                      .value = Value(std::move(refs)),
                                      .stream = ts[g.leaves.front()].state_->stream->ref},
                 ident);
      parts.push_back(std::move(f));
    }
    ctl.flush();
    auto all = detail::future_all(std::move(parts));
    all->leaves = std::move(place);
    return Future<std::vector<Tensor>>(std::move(all));
  });
}

Future<Tensor> Controller::fetch_shard(const DTensor& t, std::vector<std::pair<std::string, std::int64_t>> coords,
                                       std::optional<std::string> preprocess, CallSite where) {
  detail::refuse_on_worker_thread("Controller::fetch_shard");
  return at_site(where, [&] {
    state_->refuse_in_recording("fetch_shard");
    if (!t.state_) throw UsageError("fetch_shard: an undefined DTensor");
    ControllerState& ctl = *state_;
    const MeshState& mesh = *t.mesh_;
    const MeshState* const only[] = {&mesh};
    check_coords(only, coords);
    // The preprocess function's signature (its shape function on the tensor's meta) says
    // whether it mutates its argument: then the fetch is a mutating use, like a call's.
    bool mutates = false;
    if (preprocess) {
      const functions::Function& f = functions::lookup(*preprocess);
      const Signature sig = infer_at_call(f, ArgMetas(*preprocess, {Value(t.state_->meta)}));
      mutates = !sig.mutates.empty();
    } else if (const std::uint64_t bytes = t.state_->meta.nbytes(); bytes > kControlMessageLimit - kFrameRoom) {
      // Refused here, not after the worker has serialised it. (With a preprocess function
      // the result's size is the function's; the worker checks that one.)
      throw UsageError(
          fmt::format("fetch_shard: the tensor {} is {} bytes, expected at most {} bytes in one fetch (a fetch "
                      "is one control message, at most {} bytes with its frame); fetch it in pieces (e.g. slice it "
                      "with a function, or use a preprocess function that reduces it)",
                      t.state_->meta.to_string(), bytes, kControlMessageLimit - kFrameRoom, kControlMessageLimit));
    }
    const int rank = rank_at(mesh, coords);
    use_tensor(ctl, *t.state_, mesh, *t.state_->stream, mutates,
               preprocess ? fmt::format("fetch_shard via {}", *preprocess) : std::string("fetch_shard"));
    ctl.ensure_stream(*t.state_->stream);
    const protocol::Ident ident = ctl.new_ident();
    auto f = std::make_shared<detail::FutureState>();
    f->controller = state_;
    f->ident = ident;
    f->rank = rank;
    f->what = "fetch";
    f->node = ctl.make_node(
        ident,
        preprocess ? detail::Words(fmt::format("fetch from rank {} via {}", rank, *preprocess)) : ctl.fetch_words(rank),
        where, {t.state_->node()});
    ctl.register_fetch(ident, f);
    // The fetch runs on one rank: only that rank's local tensor changes, but the value
    // (every handle of it) now depends on the fetch, so a failed preprocess poisons it.
    std::vector<Ref> mutated;
    if (mutates) {
      t.state_->node() = f->node;
      mutated.push_back(t.state_->ref);
    }
    ctl.append({rank},
               protocol::FetchValue{.ident = ident,
                                    .mutates = std::move(mutated),
                                    .function = preprocess,
                                    .value = Value(t.state_->ref),
                                    .stream = t.state_->stream->ref},
               ident);
    ctl.flush();
    return Future<Tensor>(f);
  });
}

Future<Tensor> Controller::fetch_call(const Mesh& target, FunctionName fn, std::vector<Arg> args,
                                      std::vector<std::pair<std::string, std::int64_t>> coords) {
  detail::refuse_on_worker_thread("Controller::fetch_call");
  const CallSite where = fn.where;
  const Stream dflt = default_stream();
  return at_site(where, [&] {
    state_->refuse_in_recording("fetch_call");
    ControllerState& ctl = *state_;
    const MeshState& mesh = *target.state_;
    ctl.check_epoch(mesh.epoch, "mesh");
    const functions::Function& f = functions::lookup(fn.name);
    std::vector<DTensor> tensors;
    const std::vector<Value> metas = ControllerState::argument_metas(args, tensors);
    check_objects(tensors, mesh, fn.name);
    std::size_t payload = 0;
    for (const Arg& a : args) payload += protocol::encoded_size(a.value());
    check_host_bytes([&] { return fmt::format("fetch of {}: its {} arguments together", fn.name, args.size()); },
                     payload);
    const Signature sig = infer_at_call(f, ArgMetas(fn.name, metas, Device::of(mesh.kind, 0)));
    if (sig.outputs.size() != 1 || !sig.mutates.empty() || !sig.views.empty()) {
      throw UsageError(fmt::format(
          "fetch of {}: expected a function with one output that mutates no argument and declares no view, found "
          "{} output{}, {} mutated, {} view{}; call it with Mesh::call, then fetch_shard its result",
          fn.name, sig.outputs.size(), sig.outputs.size() == 1 ? "" : "s", sig.mutates.size(), sig.views.size(),
          sig.views.size() == 1 ? "" : "s"));
    }
    const MeshState* const only[] = {&mesh};
    check_coords(only, coords);
    const int rank = rank_at(mesh, coords);
    const std::shared_ptr<StreamState> on = tensors.empty() ? dflt.state_ : tensors.front().state_->stream;
    StreamState& stream = *on;
    std::vector<std::shared_ptr<Node>> inputs;
    for (const DTensor& t : tensors) {
      use_tensor(ctl, *t.state_, mesh, stream, false, fmt::format("fetch of {}", fn.name));
      inputs.push_back(t.state_->node());
    }
    ctl.ensure_stream(stream);
    const protocol::Ident ident = ctl.new_ident();
    // Python's ctl.fetch runs its function through meshrt.fetch_value: name the function.
    const std::string shown = fn.name == "meshrt.fetch_value" && !args.empty() && args[0].value().is_string()
                                  ? args[0].value().as_string()
                                  : fn.name;
    auto fut = std::make_shared<detail::FutureState>();
    fut->controller = state_;
    fut->ident = ident;
    fut->rank = rank;
    fut->what = "fetch of " + shown;
    fut->node = ctl.make_node(ident, fmt::format("fetch of {} from rank {}", shown, rank), where, std::move(inputs));
    ctl.register_fetch(ident, fut);
    // A list value: the function's arguments (a fetch_shard's preprocess gets one ref).
    Value::List wire;
    wire.reserve(args.size());
    for (Arg& a : args) wire.push_back(a.value());
    ctl.append(
        {rank},
        protocol::FetchValue{
            .ident = ident, .mutates = {}, .function = fn.name, .value = Value(std::move(wire)), .stream = stream.ref},
        ident);
    ctl.flush();
    return Future<Tensor>(fut);
  });
}

void Controller::synchronize() {
  detail::refuse_on_worker_thread("Controller::synchronize");
  ControllerState& ctl = *state_;
  ctl.refuse_in_recording("synchronize");
  ctl.wait_for_issued(std::nullopt, "synchronize");
  ctl.raise_unobserved_failures();
}

void Controller::synchronize(std::chrono::duration<double> timeout) {
  detail::refuse_on_worker_thread("Controller::synchronize");
  ControllerState& ctl = *state_;
  ctl.refuse_in_recording("synchronize");
  ctl.wait_for_issued(timeout, "synchronize");
  synchronize();
}

std::uint64_t Controller::release_cached_memory() {
  detail::refuse_on_worker_thread("Controller::release_cached_memory");
  state_->refuse_in_recording("release_cached_memory");
  // A CPU mesh of every worker, made for this: the call runs on each of them, and a sum
  // brings the bytes freed to one coordinate.
  Mesh all = world_mesh({{"worker", state_->worker_ranks().len()}});
  const DTensor freed = all.call("meshrt.release_cached_memory").reduce("worker", Reduction::Sum);
  return static_cast<std::uint64_t>(fetch_shard(freed, {{"worker", 0}}).get().item());
}

void Controller::restart_workers() {
  detail::refuse_on_worker_thread("Controller::restart_workers");
  state_->restart_workers();
}

std::string Controller::dump_flight_recorder() {
  detail::refuse_on_worker_thread("Controller::dump_flight_recorder");
  return state_->dump_flight_recorder();
}

std::uint64_t Controller::write_trace(const std::string& path) {
  detail::refuse_on_worker_thread("Controller::write_trace");
  state_->refuse_in_recording("write_trace");
  state_->flush_deferred();
  state_->flush();
  return state_->write_trace(path);
}

namespace {
// Waits for the work issued so far (failures stay for the futures and synchronize()), then
// every rank starts or stops recording: what is issued in between is recorded, exactly.
void switch_trace(ControllerState& ctl, bool on, const char* what) {
  ctl.refuse_in_recording(what);
  ctl.wait_for_issued(std::nullopt, what);
  ctl.switch_trace(on);
}
}  // namespace

void Controller::start_trace() {
  detail::refuse_on_worker_thread("Controller::start_trace");
  switch_trace(*state_, true, "start_trace");
}

void Controller::stop_trace() {
  detail::refuse_on_worker_thread("Controller::stop_trace");
  switch_trace(*state_, false, "stop_trace");
}

void Controller::abort(const std::string& reason) {
  detail::refuse_on_worker_thread("Controller::abort");
  state_->abort_job(reason);
}

int Controller::world_size() const {
  return state_->world_size();
}
const NDSlice& Controller::worker_ranks() const {
  return state_->worker_ranks();
}
std::uint64_t Controller::live_values(int rank) const {
  detail::refuse_on_worker_thread("Controller::live_values");
  return state_->live_values(rank);
}

ControlTraffic Controller::control_traffic() const {
  detail::refuse_on_worker_thread("Controller::control_traffic");
  return state_->traffic();
}

}  // namespace meshrt
