#include <dlfcn.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <boost/core/demangle.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <map>
#include <mutex>

#include "common/edit_distance.hpp"
#include "common/hash.hpp"
#include "meshrt/functions.hpp"
#include "meshrt/log.hpp"

namespace meshrt {

// ------------------------------------------------------------------ CallContext

CallContext::CallContext(int rank, std::vector<std::string> dim_names, std::vector<std::int64_t> coordinates,
                         std::vector<std::int64_t> sizes, std::uint64_t stream_id, Device device, void* native_stream)
    : rank_(rank),
      dim_names_(std::move(dim_names)),
      coordinates_(std::move(coordinates)),
      sizes_(std::move(sizes)),
      stream_id_(stream_id),
      device_(device),
      native_stream_(native_stream) {
  if (dim_names_.size() != coordinates_.size() || dim_names_.size() != sizes_.size()) {
    throw UsageError(fmt::format(
        "CallContext: expected one coordinate and one size per dimension [{}], found {} coordinates and {} sizes",
        fmt::join(dim_names_, ", "), coordinates_.size(), sizes_.size()));
  }
  for (std::size_t i = 0; i < sizes_.size(); ++i) {
    if (coordinates_[i] < 0 || coordinates_[i] >= sizes_[i]) {
      throw UsageError(fmt::format("CallContext: expected a coordinate in [0, {}) along '{}', found {}", sizes_[i],
                                   dim_names_[i], coordinates_[i]));
    }
  }
  // A CUDA kernel given no stream would launch on the legacy default stream, unordered
  // with the non-blocking streams the rest of the work runs on.
  if (device_.is_cuda() && native_stream_ == nullptr) {
    throw UsageError(fmt::format(
        "CallContext on {}: expected the CUDA stream of meshrt stream {} (device::stream_for(...).native()), found "
        "none (its kernels would run on the legacy default stream)",
        device_.to_string(), stream_id_));
  }
}

namespace {
std::size_t dim_index(const std::vector<std::string>& names, std::string_view dim, int rank) {
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (names[i] == dim) return i;
  }
  throw UsageError(
      fmt::format("rank {}: expected a mesh dimension in [{}], found '{}'", rank, fmt::join(names, ", "), dim));
}
}  // namespace

std::int64_t CallContext::coordinate(std::string_view dim) const {
  return coordinates_[dim_index(dim_names_, dim, rank_)];
}

std::int64_t CallContext::size(std::string_view dim) const {
  return sizes_[dim_index(dim_names_, dim, rank_)];
}

// ------------------------------------------------------------------ argument access

namespace detail {

std::string ArgAccess::who() const {
  // Only on the error path: the registry's description gives the parameter names.
  try {
    if (const functions::Function* f = functions::find(function_)) return f->short_signature();
  } catch (const UsageError&) {
    // A broken table is reported elsewhere; the bare name still says which function.
  }
  return function_;
}

std::string ArgAccess::param_name(std::size_t i) const {
  try {
    if (const functions::Function* f = functions::find(function_)) {
      if (i < f->description.params.size()) return fmt::format(" ({})", f->description.params[i].name);
    }
  } catch (const UsageError&) {
  }
  return "";
}

void ArgAccess::fail(std::string_view message) const {
  throw UsageError(fmt::format("{}: {}", who(), message));
}

void ArgAccess::fail_arg(std::size_t i, std::string_view message) const {
  throw UsageError(fmt::format("{}: argument {}{}: {}", who(), i, param_name(i), message));
}

void ArgAccess::expect_count(std::size_t min, std::size_t max) const {
  if (values_.size() < min || values_.size() > max) {
    fail(min == max ? fmt::format("expected {} argument{}, found {}", min, min == 1 ? "" : "s", values_.size())
                    : fmt::format("expected {} to {} arguments, found {}", min, max, values_.size()));
  }
}

const Value& ArgAccess::value(std::size_t i) const {
  if (i >= values_.size()) fail(fmt::format("expected an argument {}, found only {} arguments", i, values_.size()));
  return values_[i];
}

// The Value accessors already say "expected X, found Y"; prefix the function and position.
#define MESHRT_ARG_(i, expr)      \
  try {                           \
    return expr;                  \
  } catch (const UsageError& e) { \
    fail_arg(i, e.what());        \
  }

double ArgAccess::number(std::size_t i) const {
    MESHRT_ARG_(i, value(i).as_number())} std::int64_t ArgAccess::integer(std::size_t i) const {
  MESHRT_ARG_(i, value(i).as_int())
}
bool ArgAccess::boolean(std::size_t i) const {
  MESHRT_ARG_(i, value(i).as_bool())
}
const std::string& ArgAccess::string(std::size_t i) const {MESHRT_ARG_(i, value(i).as_string())}
#undef MESHRT_ARG_

DType ArgAccess::dtype(std::size_t i) const {
  const Value& v = value(i);
  if (v.is_string()) {
    for (int d = 0; d < kNumDTypes; ++d) {
      if (name(static_cast<DType>(d)) == v.as_string()) return static_cast<DType>(d);
    }
  }
  if (!v.is_string()) {
    fail_arg(
        i, fmt::format("expected a dtype such as \"float32\", found {} {}", Value::kind_name(v.kind()), v.to_string()));
  }
  std::vector<std::string_view> names;  // a misspelt name: say which exist
  for (int d = 0; d < kNumDTypes; ++d) names.push_back(name(static_cast<DType>(d)));
  fail_arg(i, fmt::format("expected a dtype, one of {}, found {}", fmt::join(names, ", "), v.to_string()));
}

std::vector<std::int64_t> ArgAccess::shape(std::size_t i) const {
  const Value& v = value(i);
  std::vector<std::int64_t> out;
  if (v.is_int()) {
    out.push_back(v.as_int());
  } else if (v.is_list()) {
    for (const Value& d : v.as_list()) {
      if (!d.is_int()) fail_arg(i, fmt::format("expected a shape (a list of ints), found {}", v.to_string()));
      out.push_back(d.as_int());
    }
  } else {
    fail_arg(i,
             fmt::format("expected a shape (a list of ints), found {} {}", Value::kind_name(v.kind()), v.to_string()));
  }
  for (std::size_t d = 0; d < out.size(); ++d) {
    if (out[d] < 0) fail_arg(i, fmt::format("expected a shape of sizes >= 0, found {} at dimension {}", out[d], d));
  }
  return out;
}

}  // namespace detail

namespace {
// "expected a tensor, found ..."; for a list of numbers (a std::vector given as an
// argument) also the form that passes host numbers as a tensor.
std::string not_a_tensor(const Value& v) {
  std::string out = fmt::format("expected a tensor, found {} {}", Value::kind_name(v.kind()), v.to_string());
  bool numbers = v.is_list() && !v.as_list().empty();
  if (numbers) {
    for (const Value& e : v.as_list()) numbers = numbers && e.is_number();
  }
  if (numbers) {
    out += fmt::format(
        "; host numbers go as a meshrt::Tensor, e.g. meshrt::Tensor::from<float>({{{}}}, values) (sent to every "
        "rank), or through mesh.from_host(t) and mesh.scatter(dim, t)",
        v.as_list().size());
  }
  return out;
}
}  // namespace

Tensor& Args::tensor(std::size_t i) {
  (void)value(i);  // throws naming the function if i is out of range
  Value& v = values_[i];
  if (!v.is_tensor()) fail_arg(i, not_a_tensor(v));
  return v.as_tensor();
}

const Tensor& Args::tensor(std::size_t i) const {
  const Value& v = value(i);
  if (!v.is_tensor()) fail_arg(i, not_a_tensor(v));
  return v.as_tensor();
}

WorkerObject Args::object_value(std::size_t i) const {
  const Value& v = value(i);
  if (!v.is_object()) fail_arg(i, fmt::format("expected a worker object (its handle), found {}", v.to_string()));
  return v.as_object();
}

void Args::fail_object_type(std::size_t i, const std::type_info& want, const std::type_info& found) const {
  fail_arg(i, fmt::format("expected a worker object of type {}, found one of type {}",
                          boost::core::demangle(want.name()), boost::core::demangle(found.name())));
}

TensorMeta ArgMetas::tensor(std::size_t i) const {
  const Value& v = value(i);
  if (v.is_meta()) return v.as_meta();
  if (v.is_tensor()) return v.as_tensor().meta();
  fail_arg(i, not_a_tensor(v));
}

// ------------------------------------------------------------------ registry

namespace functions {
namespace {

struct Table {
  std::mutex mutex;
  // Bumped by every registration and refusal: a thread's cached lookup is valid while
  // it is unchanged (functions are never removed, so a found address stays valid).
  std::atomic<std::uint64_t> version{0};
  // std::map: sorted names for names() and the hash, and stable addresses for lookup().
  std::map<std::string, Function, std::less<>> functions;
  std::vector<std::string> refused;  // duplicate registrations from static initialisers
  std::string loading;               // the library being dlopened, for Function::library
};

// A function-local static: registrars in other translation units may run before any
// namespace-scope object of this file is constructed.
Table& table() {
  static Table* t = new Table();  // never destroyed: registrars of unloaded code may outlive statics
  return *t;
}

std::string where(const char* file, int line, const std::string& library) {
  return library.empty() ? fmt::format("{}:{}", file, line) : fmt::format("{}:{} in {}", file, line, library);
}

// The kernel, with a typed read of a tensor argument as the wrong element type reported
// as that argument: "f(x, y): argument 1 (y): tensor data: expected data<double>() for a
// float64[2] on cpu tensor, found data<float>()".
Kernel named_access(Kernel kernel) {
  return [kernel = std::move(kernel)](CallContext& ctx, Args& args) -> std::vector<Tensor> {
    (void)meshrt::detail::take_refused_access();
    try {
      return kernel(ctx, args);
    } catch (const UsageError& e) {
      const void* refused = meshrt::detail::take_refused_access();
      if (refused == nullptr) throw;
      for (std::size_t i = 0; i < args.size(); ++i) {
        const Value& v = args.value(i);
        if (v.is_tensor() && v.as_tensor().raw_data() == refused) args.fail_arg(i, e.what());
      }
      throw;
    }
  };
}

// Caller holds the lock.
void add_locked(Table& t, std::string name, Kernel kernel, ShapeFunction shape, const char* file, int line,
                Description description, ObjectKernel make_object = {}) {
  if (name.empty())
    throw UsageError(fmt::format("register_function at {}:{}: expected a non-empty name, found ''", file, line));
  if (!kernel || !shape) {
    throw UsageError(fmt::format("register_function '{}' at {}:{}: expected a kernel and a shape function, found {}",
                                 name, file, line, !kernel ? "no kernel" : "no shape function"));
  }
  if (const auto it = t.functions.find(name); it != t.functions.end()) {
    throw UsageError(fmt::format("remote function '{}' registered twice: first at {}, again at {}; rename one", name,
                                 it->second.where(), where(file, line, t.loading)));
  }
  Function f{name,      named_access(std::move(kernel)), std::move(shape),      file, line,
             t.loading, std::move(description),          std::move(make_object)};
  t.functions.emplace(std::move(name), std::move(f));
  t.version.fetch_add(1, std::memory_order_release);
}

void check_locked(const Table& t) {
  if (!t.refused.empty()) {
    throw UsageError(fmt::format("the remote function table is broken: {}", fmt::join(t.refused, "; ")));
  }
}

}  // namespace

std::string Function::where() const {
  return functions::where(file.c_str(), line, library);
}

std::string Function::signature() const {
  if (description.empty()) return name;
  std::vector<std::string> params;
  for (const Param& p : description.params) params.push_back(fmt::format("{}: {}", p.name, p.kind));
  return fmt::format("{}({}) -> {}", name, fmt::join(params, ", "),
                     description.returns.empty() ? "none" : description.returns);
}

std::string Function::short_signature() const {
  if (description.empty()) return name;
  std::vector<std::string> params;
  for (const Param& p : description.params) params.push_back(p.name);
  return fmt::format("{}({})", name, fmt::join(params, ", "));
}

void register_function(std::string name, Kernel kernel, ShapeFunction shape, const char* file, int line,
                       Description description, ObjectKernel make_object) {
  Table& t = table();
  std::lock_guard lock(t.mutex);
  add_locked(t, std::move(name), std::move(kernel), std::move(shape), file, line, std::move(description),
             std::move(make_object));
}

namespace {

// An object constructor's kernel and shape function: Mesh::call on it is a mistake, named
// at the call (the shape function runs there).
[[noreturn]] void refuse_call(const std::string& name) {
  throw UsageError(fmt::format(
      "{} constructs worker objects and returns no tensors: call it with mesh.call_object (Mesh::call_object)", name));
}

void add_object_locked(Table& t, std::string name, ObjectKernel make_object, const char* file, int line,
                       Description description) {
  if (!make_object) {
    throw UsageError(fmt::format("register_object_function '{}' at {}:{}: expected an object constructor, found none",
                                 name, file, line));
  }
  Kernel kernel = [name](CallContext&, Args&) -> std::vector<Tensor> { refuse_call(name); };
  ShapeFunction shape = [name](const ArgMetas&) -> Signature { refuse_call(name); };
  add_locked(t, std::move(name), std::move(kernel), std::move(shape), file, line, std::move(description),
             std::move(make_object));
}

}  // namespace

void register_object_function(std::string name, ObjectKernel make_object, const char* file, int line,
                              Description description) {
  Table& t = table();
  std::lock_guard lock(t.mutex);
  add_object_locked(t, std::move(name), std::move(make_object), file, line, std::move(description));
}

detail::Registrar::Registrar(const char* name, ObjectKernel make_object, const char* file, int line,
                             Description description) noexcept {
  try {
    Table& t = table();
    std::lock_guard lock(t.mutex);
    try {
      add_object_locked(t, name ? name : "", std::move(make_object), file, line, std::move(description));
    } catch (const UsageError& e) {
      t.refused.emplace_back(e.what());
      t.version.fetch_add(1, std::memory_order_release);
    }
  } catch (...) {
    // Out of memory during static initialisation: nothing sensible is left to do.
  }
}

detail::Registrar::Registrar(const char* name, Kernel kernel, ShapeFunction shape, const char* file, int line,
                             Description description) noexcept {
  try {
    Table& t = table();
    std::lock_guard lock(t.mutex);
    try {
      add_locked(t, name ? name : "", std::move(kernel), std::move(shape), file, line, std::move(description));
    } catch (const UsageError& e) {
      t.refused.emplace_back(e.what());
      t.version.fetch_add(1, std::memory_order_release);
    }
  } catch (...) {
    // Out of memory during static initialisation: nothing sensible is left to do.
  }
}

void check_table() {
  Table& t = table();
  std::lock_guard lock(t.mutex);
  check_locked(t);
}

const Function* find(std::string_view name) {
  // Each thread keeps its last few hits: programs call the same few functions in loops,
  // and a locked map search would be paid by every call, on the controller and again on
  // every worker. The last hit is tried first (a loop calls one function in turn), and the
  // names are views of the table's keys (never removed), so the cache needs no
  // construction or destruction per thread.
  struct Hit {
    std::string_view name;
    const Function* function = nullptr;
  };
  struct Hits {
    std::uint64_t version = 0;
    std::array<Hit, 8> hits{};
    std::size_t last = 0;  // the latest hit
    std::size_t next = 0;  // the entry the next miss replaces
  };
  thread_local constinit Hits cache;
  Table& t = table();
  const std::uint64_t version = t.version.load(std::memory_order_acquire);
  if (cache.version == version) {
    if (const Hit& h = cache.hits[cache.last]; h.function != nullptr && h.name == name) return h.function;
    for (std::size_t i = 0; i < cache.hits.size(); ++i) {
      const Hit& h = cache.hits[i];
      if (h.function != nullptr && h.name == name) {
        cache.last = i;
        return h.function;
      }
    }
  }
  std::lock_guard lock(t.mutex);
  check_locked(t);
  const auto it = t.functions.find(name);
  if (it == t.functions.end()) return nullptr;
  const std::uint64_t now = t.version.load(std::memory_order_relaxed);
  if (cache.version != now) cache = Hits{.version = now};
  cache.hits[cache.next] = Hit{it->first, &it->second};
  cache.last = cache.next;
  cache.next = (cache.next + 1) % cache.hits.size();
  return &it->second;
}

namespace {

// lookup()'s error, out of line: a found name costs only find().
[[noreturn, gnu::cold, gnu::noinline]] void unknown_function(std::string_view name) {
  Table& t = table();
  std::lock_guard lock(t.mutex);
  // Suggest the closest names (a typo is the usual cause), else list what exists.
  std::vector<std::pair<std::size_t, std::string>> scored;
  for (const auto& [n, f] : t.functions) scored.emplace_back(meshrt::detail::edit_distance(name, n), n);
  std::sort(scored.begin(), scored.end());
  std::vector<std::string> close;
  for (const auto& [d, n] : scored) {
    if (d <= std::max<std::size_t>(2, name.size() / 3) && close.size() < 3) close.push_back(n);
  }
  if (!close.empty()) {
    throw UsageError(fmt::format("unknown function '{}'; did you mean {}? ({} functions registered)", name,
                                 fmt::join(close, ", "), t.functions.size()));
  }
  std::vector<std::string> all;
  for (const auto& [n, f] : t.functions) all.push_back(n);
  throw UsageError(fmt::format("unknown function '{}'; registered: {}", name, fmt::join(all, ", ")));
}

}  // namespace

const Function& lookup(std::string_view name) {
  if (const Function* f = find(name)) [[likely]]
    return *f;
  unknown_function(name);
}

std::vector<std::string> names() {
  Table& t = table();
  std::lock_guard lock(t.mutex);
  check_locked(t);
  std::vector<std::string> out;
  out.reserve(t.functions.size());
  for (const auto& [n, f] : t.functions) out.push_back(n);
  return out;
}

std::uint64_t table_hash() {
  std::uint64_t h = meshrt::detail::kFnv1aBasis;
  for (const std::string& n : names()) {
    // A NUL after each name, so {"ab","c"} and {"a","bc"} differ.
    h = meshrt::detail::fnv1a_64(std::string_view("\0", 1), meshrt::detail::fnv1a_64(n, h));
  }
  return h;
}

std::vector<std::string> load_library(const std::string& path) {
  Table& t = table();
  std::vector<std::string> before;
  std::size_t refused_before = 0;
  {
    std::lock_guard lock(t.mutex);
    for (const auto& [n, f] : t.functions) before.push_back(n);
    refused_before = t.refused.size();
    t.loading = path;
  }
  // The registrars run inside dlopen, on this thread, and take the lock themselves.
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  std::lock_guard lock(t.mutex);
  t.loading.clear();
  if (handle == nullptr) {
    const char* err = dlerror();
    throw UsageError(fmt::format("load_library: expected a loadable shared library at '{}', found: {}", path,
                                 err ? err : "unknown dlopen error"));
  }
  if (t.refused.size() > refused_before) {
    // The library's duplicates are refused and must not poison the table for everyone.
    std::vector<std::string> mine(t.refused.begin() + static_cast<std::ptrdiff_t>(refused_before), t.refused.end());
    t.refused.resize(refused_before);
    throw UsageError(fmt::format("load_library '{}': {}", path, fmt::join(mine, "; ")));
  }
  std::vector<std::string> added;
  for (const auto& [n, f] : t.functions) {
    if (!std::binary_search(before.begin(), before.end(), n)) added.push_back(n);
  }
  MESHRT_LOG(info) << "load_library " << path << ": added " << added.size()
                   << " function(s): " << fmt::format("{}", fmt::join(added, ", "));
  return added;
}

Signature infer(const Function& f, const ArgMetas& args) {
  Signature s = f.shape(args);
  for (const std::size_t m : s.mutates) {
    if (m >= args.size() || !(args.value(m).is_meta() || args.value(m).is_tensor())) {
      throw UsageError(
          fmt::format("{} (registered at {}): its shape function declares argument {} mutated; expected the "
                      "index of a tensor argument among {} arguments",
                      f.name, f.where(), m, args.size()));
    }
  }
  for (std::size_t k = 0; k < s.views.size(); ++k) {
    const View& v = s.views[k];
    if (v.output >= s.outputs.size() || v.input >= args.size() ||
        !(args.value(v.input).is_meta() || args.value(v.input).is_tensor())) {
      throw UsageError(fmt::format(
          "{} (registered at {}): its shape function declares output {} a view of argument {}; expected the index "
          "of one of its {} outputs and of a tensor argument among {} arguments",
          f.name, f.where(), v.output, v.input, s.outputs.size(), args.size()));
    }
    const TensorMeta in = args.tensor(v.input);
    const TensorMeta& out = s.outputs[v.output];
    if (out.device().kind() != in.device().kind() || out.nbytes() > in.nbytes()) {
      throw UsageError(fmt::format(
          "{} (registered at {}): its shape function declares output {} ({}) a view of argument {} ({}); a view "
          "lies inside its argument's storage, so expected the same device and at most {} bytes",
          f.name, f.where(), v.output, out.to_string(), v.input, in.to_string(), in.nbytes()));
    }
    for (std::size_t j = 0; j < k; ++j) {
      if (s.views[j].output == v.output) {
        throw UsageError(
            fmt::format("{} (registered at {}): its shape function declares output {} a view twice; "
                        "expected one argument per output",
                        f.name, f.where(), v.output));
      }
    }
  }
  return s;
}

}  // namespace functions
}  // namespace meshrt
