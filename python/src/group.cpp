// StatelessGroup in Python (DESIGN section 11) over the C++ group (include/meshrt/group.hpp).
//
// A Python call is one C++ operation for the object's structure (codec.hpp; small arrays
// and bytes inside it), then one C++ operation per large array or bytes, received straight
// into the new object's memory. The structure's operation is typed ("Python codec"), so
// a C++ member that sends another type is refused as in C++. The collectives exchange
// every member's part in that first operation: the root's object, and each member's
// allow_pickle, out= and any error it met encoding. So every member sees the same facts
// and raises the same error (an object the codec refuses, pickle without consent, an out=
// whose type or size differs from the root's array) before any array moves, and the group
// stays usable. A failure once the arrays are moving makes the group unusable.
//
// MPI starts on demand (MPI_THREAD_MULTIPLE) when the program has not started it, and is
// finalised at interpreter exit; meshrt.run and mpi4py accept an MPI started this way.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <mpi.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "bindings.hpp"
#include "codec.hpp"
#include "common/checks.hpp"
#include "meshrt/error.hpp"
#include "meshrt/group.hpp"

namespace meshrt::python {
namespace {

using Clock = std::chrono::steady_clock;
using Seconds = std::chrono::duration<double>;

// ---- MPI ------------------------------------------------------------------------------

const char* thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE:
      return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED:
      return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED:
      return "MPI_THREAD_SERIALIZED";
    default:
      return "MPI_THREAD_MULTIPLE";
  }
}

// Runs after the interpreter has finished (Py_AtExit), so after meshrt.run's runtime and
// every group object that the interpreter frees.
void finalize_mpi() {
  int finalized = 0;
  MESHRT_MPI_IGNORE(MPI_Finalized(&finalized));  // teardown: nothing is left to report to
  if (!finalized) MESHRT_MPI_IGNORE(MPI_Finalize());
}

void ensure_mpi(const char* op) {
  int initialized = 0, finalized = 0;
  MESHRT_MPI_CHECK(MPI_Initialized(&initialized));
  MESHRT_MPI_CHECK(MPI_Finalized(&finalized));
  if (finalized) {
    throw UsageError(fmt::format("{}: expected MPI to be running, found it finalised in this process", op));
  }
  int level = 0;
  if (!initialized) {
    {
      py::gil_scoped_release release;
      MESHRT_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &level));
    }
    Py_AtExit(finalize_mpi);
  } else {
    MESHRT_MPI_CHECK(MPI_Query_thread(&level));
  }
  if (level < MPI_THREAD_MULTIPLE) {
    throw UsageError(
        fmt::format("{}: expected MPI initialised with MPI_THREAD_MULTIPLE, found {} (with mpi4py, set "
                    "mpi4py.rc.thread_level = \"multiple\" before importing mpi4py.MPI)",
                    op, thread_level_name(level)));
  }
}

// Without the trailing NUL and newline some libraries include.
std::string trimmed(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == '\0' || s.back() == ' ')) s.pop_back();
  return s;
}

std::string mpi_library_version() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int len = 0;
  MESHRT_MPI_CHECK(MPI_Get_library_version(text, &len));
  return trimmed(detail::mpi_text(text, len));
}

const char* mpi_vendor() {
#if defined(OMPI_MAJOR_VERSION)
  return "Open MPI";
#elif defined(MPICH_VERSION)
  return "MPICH";
#else
  return "unknown";
#endif
}

// ---- waiting --------------------------------------------------------------------------

// One deadline for a whole Python call (its C++ operations share it). The first operation
// gets the call's timeout itself, so its error names the number the caller passed.
class Deadline {
 public:
  Deadline(std::optional<double> timeout, const StatelessGroup& g, const char* op) {
    if (timeout && !(*timeout >= 0)) {
      throw UsageError(
          fmt::format("{}: timeout: expected seconds >= 0 (None: the group's default, math.inf: no "
                      "limit), found {}",
                      op, *timeout));
    }
    first_ = timeout ? *timeout : g.default_timeout().count();
    unlimited_ = !(first_ < 1e9);
    if (!unlimited_) at_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(Seconds(first_));
  }
  Timeout first() const { return Seconds(unlimited_ ? kNoLimit : first_); }
  Timeout next() const {
    if (unlimited_) return Seconds(kNoLimit);
    return std::max(Seconds(0), std::chrono::duration_cast<Seconds>(at_ - Clock::now()));
  }

 private:
  static constexpr double kNoLimit = 1e10;  // the C++ group reads >= 1e9 s as no limit
  double first_ = 0;
  bool unlimited_ = false;
  Clock::time_point at_{};
};

// ---- payload sinks --------------------------------------------------------------------

// Exactly `size` bytes into memory allocated beforehand (an array's).
class FixedSink final : public detail::PayloadSink {
 public:
  FixedSink(char* data, std::size_t size) : data_(data), size_(size) {}
  char* prepare(std::size_t size) override {
    if (size != size_) {
      throw ProtocolError(
          fmt::format("an array's data: expected {} bytes (as its structure said), found {}", size_, size));
    }
    return data_;
  }

 private:
  char* data_;
  std::size_t size_;
};

// Anything, into a scratch buffer that is thrown away.
class DiscardSink final : public detail::PayloadSink {
 public:
  explicit DiscardSink(std::vector<char>& scratch) : scratch_(scratch) {}
  char* prepare(std::size_t size) override {
    scratch_.resize(std::max<std::size_t>(size, 1));
    return scratch_.data();
  }

 private:
  std::vector<char>& scratch_;
};

// ---- the wire tags --------------------------------------------------------------------

const detail::TypeTag& named_tag(const std::string& name) {
  static auto* tags = new std::map<std::string, detail::TypeTag>();
  auto it = tags->find(name);
  if (it == tags->end()) it = tags->emplace(name, detail::TypeTag{name, detail::fnv1a(name)}).first;
  return it->second;
}
const detail::TypeTag& object_tag() {
  static const detail::TypeTag& t = named_tag("Python codec");
  return t;
}
const detail::TypeTag& buffer_tag() {
  static const detail::TypeTag& t = named_tag("Python array bytes");
  return t;
}
const detail::TypeTag& all_gather_tag() {
  static const detail::TypeTag& t = named_tag("Python codec (all_gather_obj)");
  return t;
}
const detail::TypeTag& broadcast_tag(int root) {
  static auto* by_root = new std::vector<const detail::TypeTag*>();
  const auto r = static_cast<std::size_t>(root);
  if (r >= by_root->size()) by_root->resize(r + 1, nullptr);
  auto& tag = (*by_root)[r];
  if (tag == nullptr) tag = &named_tag(fmt::format("Python codec (broadcast_obj from root {})", root));
  return *tag;
}

// ---- a member's part of a collective --------------------------------------------------

enum PartFlags : std::uint8_t { kAllowPickle = 1, kHasOut = 2, kHasObject = 4, kHasError = 8 };

struct Part {
  std::uint8_t flags = 0;
  codec::ArraySpec out;  // kHasOut
  std::string error;     // kHasError
  std::string_view object;
};

template <class T>
void put(std::string& s, const T& v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof v);
}
void put_text(std::string& s, std::string_view t) {
  put(s, static_cast<std::uint32_t>(t.size()));
  s.append(t);
}

void write_part(std::string& s, std::uint8_t flags, const codec::ArraySpec* out, const std::string& error,
                const std::string* object) {
  s.clear();
  put(s, flags);
  if (flags & kHasOut) {
    put_text(s, out->dtype);
    put(s, static_cast<std::uint32_t>(out->shape.size()));
    for (std::int64_t d : out->shape) put(s, d);
  }
  if (flags & kHasError) put_text(s, error);
  if (flags & kHasObject) s.append(*object);
}

Part read_part(std::string_view b, const codec::Where& where) {
  std::size_t at = 0;
  auto take = [&](std::size_t n) {
    if (n > b.size() - at) {
      throw ProtocolError(
          fmt::format("{}: a member's part of {} bytes is truncated at byte {} (not sent by a meshrt "
                      "Python group?)",
                      where(), b.size(), at));
    }
    const char* p = b.data() + at;
    at += n;
    return p;
  };
  auto u32 = [&] {
    std::uint32_t v;
    std::memcpy(&v, take(4), 4);
    return v;
  };
  auto text = [&] {
    const std::uint32_t n = u32();
    return std::string(take(n), n);
  };
  Part p;
  p.flags = static_cast<std::uint8_t>(*take(1));
  if (p.flags & kHasOut) {
    p.out.dtype = text();
    const std::uint32_t nd = u32();
    if (nd > 64) throw ProtocolError(fmt::format("{}: a member's out= declares {} dimensions", where(), nd));
    for (std::uint32_t i = 0; i < nd; ++i) {
      std::int64_t d;
      std::memcpy(&d, take(8), 8);
      p.out.shape.push_back(d);
    }
  }
  if (p.flags & kHasError) p.error = text();
  if (p.flags & kHasObject) p.object = b.substr(at);
  return p;
}

// ---- the group ------------------------------------------------------------------------

struct PyGroup {
  std::optional<StatelessGroup> g;
  std::string broken;  // why the Python protocol broke (the C++ group may not know)
  bool busy = false;
  // Reused across calls.
  codec::Encoded enc;
  std::string mine;
  std::vector<std::string> parts;
  std::string inbox;
  std::vector<char> scratch;

  StatelessGroup& group(const char* op) {
    if (!g || g->comm() == MPI_COMM_NULL) throw UsageError(fmt::format("{}: the group has been closed", op));
    if (!broken.empty()) {
      throw UsageError(fmt::format("{} on {}: the group is unusable after {}; create a new group", op, me(), broken));
    }
    return *g;
  }
  std::string peer(int r) const { return fmt::format("group rank {} (parent rank {})", r, g->parent_rank(r)); }
  std::string me() const { return fmt::format("{} of {}", peer(g->rank()), g->world_size()); }
  std::string peers(const std::vector<int>& rs) const {
    std::vector<int> parents;
    for (int r : rs) parents.push_back(g->parent_rank(r));
    if (rs.size() == 1) return peer(rs[0]);
    return fmt::format("group ranks [{}] (parent ranks [{}])", fmt::join(rs, ", "), fmt::join(parents, ", "));
  }
};

// Where an operation runs, and from whom, for error messages: formatted only when one is
// raised (a message costs more than a small object's whole transfer).
struct Site {
  const PyGroup* pg;
  const char* op;
  int from;
  std::string here() const { return fmt::format("{} on {}", op, pg->me()); }
  codec::Where where() const {
    return [this] { return here(); };
  }
  codec::Where where_from() const {
    return [this] { return fmt::format("{} from {}", here(), pg->peer(from)); };
  }
  codec::Where peer() const {
    return [this] { return pg->peer(from); };
  }
};

// One operation at a time per group: a second thread (or code that runs while an object
// is encoded, such as a __reduce__) gets a UsageError instead of corrupting the protocol.
class Busy {
 public:
  Busy(PyGroup& pg, const char* op) : pg_(pg) {
    if (pg.busy) {
      throw UsageError(
          fmt::format("{}: another operation is running on this group (a group runs one operation at "
                      "a time; use one group per thread)",
                      op));
    }
    pg.busy = true;
  }
  ~Busy() { pg_.busy = false; }
  Busy(const Busy&) = delete;
  Busy& operator=(const Busy&) = delete;

 private:
  PyGroup& pg_;
};

// A C++ error of the first operation of broadcast_obj names the C++ collective it runs on
// (all_gather_obj); the caller called broadcast_obj.
template <class F>
void renamed(const char* op, F&& f) {
  auto rename = [&](const char* what) {
    std::string s = what;
    const std::string from = "all_gather_obj";
    if (s.rfind(from, 0) == 0) s = op + s.substr(from.size());
    return s;
  };
  try {
    f();
  } catch (const TimeoutError& e) {
    throw TimeoutError(rename(e.what()), e.missing_ranks(), e.group_unusable());
  } catch (const UsageError& e) {
    throw UsageError(rename(e.what()));
  }
}

// The collective's first operation: every member's part, by group rank.
std::vector<Part> exchange_parts(PyGroup& pg, StatelessGroup& g, const char* op, const detail::TypeTag& tag,
                                 const Deadline& dl) {
  const auto n = static_cast<std::size_t>(g.world_size());
  pg.parts.resize(n);
  std::vector<detail::BufferSink> sinks;
  sinks.reserve(n);
  std::vector<detail::PayloadSink*> ptrs;
  for (auto& p : pg.parts) ptrs.push_back(&sinks.emplace_back(p));
  renamed(op, [&] {
    py::gil_scoped_release release;
    g.all_gather_bytes(tag, false, pg.mine, ptrs, dl.first());
  });
  std::vector<Part> parts;
  for (std::size_t p = 0; p < n; ++p) {
    const Site from{&pg, op, static_cast<int>(p)};
    parts.push_back(read_part(pg.parts[p], from.where_from()));
  }
  return parts;
}

// An error a member meets before a collective (encoding its object, checking its out=):
// it still takes part in the collective's first operation, so that every member learns
// of it and raises instead of waiting. A UsageError is raised alike on every member; any
// other exception (a Python one from an object's own code) is re-raised on this member
// as it was, the others raise a UsageError quoting it.
struct LocalError {
  std::string text;
  std::exception_ptr other;
  explicit operator bool() const { return !text.empty(); }
  void rethrow() const {
    if (other) std::rethrow_exception(other);
  }
};

template <class F>
LocalError before_collective(F&& f) {
  LocalError e;
  try {
    f();
  } catch (const UsageError& u) {
    e.text = u.what();
  } catch (py::error_already_set& p) {
    e.text = p.what();
    e.other = std::current_exception();
  } catch (const std::exception& x) {
    e.text = x.what();
    e.other = std::current_exception();
  }
  return e;
}

// Raises on every member alike if any member met an error before the collective.
void raise_member_errors(PyGroup& pg, const char* op, const std::vector<Part>& parts, int root) {
  std::vector<std::string> errors;
  for (std::size_t p = 0; p < parts.size(); ++p) {
    if (!(parts[p].flags & kHasError)) continue;
    const int r = static_cast<int>(p);
    errors.push_back(fmt::format("{}{}{}: {}", r == pg.g->rank() ? "this rank, " : "", pg.peer(r),
                                 r == root ? " (the root)" : "", parts[p].error));
  }
  if (!errors.empty()) {
    throw UsageError(
        fmt::format("{} on {}: {}; nothing was sent, the group is still usable", op, pg.me(), fmt::join(errors, "; ")));
  }
}

// Pickled parts need every receiving member's consent; raises on every member alike.
void check_pickle_consent(PyGroup& pg, const char* op, const std::vector<Part>& parts,
                          const std::vector<int>& pickled_by) {
  if (pickled_by.empty()) return;
  std::vector<int> refusing;
  for (std::size_t p = 0; p < parts.size(); ++p) {
    const int r = static_cast<int>(p);
    const bool receives = pickled_by.size() > 1 || pickled_by[0] != r;
    if (receives && !(parts[p].flags & kAllowPickle)) refusing.push_back(r);
  }
  if (refusing.empty()) return;
  throw UsageError(fmt::format(
      "{} on {}: {} pickled {} object (it passed allow_pickle=True), but {} did not pass allow_pickle=True; pickle "
      "runs code when it decodes, so the safe codec refuses it unless both sides pass allow_pickle=True; nothing "
      "was sent, the group is still usable",
      op, pg.me(), pg.peers(pickled_by), pickled_by.size() == 1 ? "its" : "their", pg.peers(refusing)));
}

py::object send_obj(PyGroup& pg, py::handle obj, int dst, std::optional<double> timeout, bool allow_pickle) {
  const char* op = "send_obj";
  Busy busy(pg, op);
  StatelessGroup& g = pg.group(op);
  const Deadline dl(timeout, g, op);
  codec::encode(obj, allow_pickle, pg.enc);
  {
    py::gil_scoped_release release;
    g.send_bytes(object_tag(), false, pg.enc.bytes, dst, dl.first());
    try {
      for (const codec::Buffer& b : pg.enc.buffers) g.send_bytes(buffer_tag(), true, {b.data, b.size}, dst, dl.next());
    } catch (...) {
      pg.broken = "a failure in send_obj while its arrays were moving";
      throw;
    }
  }
  pg.enc.buffers.clear();  // the caller's arrays are not held past the call
  return py::none();
}

py::object recv_obj(PyGroup& pg, int src, std::optional<double> timeout, bool allow_pickle, py::handle out) {
  const char* op = "recv_obj";
  Busy busy(pg, op);
  StatelessGroup& g = pg.group(op);
  const Deadline dl(timeout, g, op);
  std::optional<codec::OutTarget> target;
  if (!out.is_none()) target = codec::out_target(out);
  {
    detail::BufferSink sink(pg.inbox);
    py::gil_scoped_release release;
    g.recv_bytes(object_tag(), false, sink, src, dl.first());
  }
  const Site site{&pg, op, src};
  codec::Summary summary;
  try {
    summary = codec::summarize(pg.inbox, site.where());
  } catch (...) {
    pg.broken = "a recv_obj whose object did not decode (its arrays may follow)";
    throw;
  }
  codec::Decoded decoded;
  std::exception_ptr failed;
  try {
    decoded = codec::decode(pg.inbox, allow_pickle, target ? &*target : nullptr, site.where(), site.peer());
  } catch (...) {
    failed = std::current_exception();  // the arrays are still taken off the wire: the group stays usable
  }
  if (!summary.buffer_sizes.empty()) {
    py::gil_scoped_release release;
    try {
      for (std::size_t i = 0; i < summary.buffer_sizes.size(); ++i) {
        DiscardSink discard(pg.scratch);
        FixedSink fixed(failed ? nullptr : decoded.targets[i].data, failed ? 0 : decoded.targets[i].size);
        g.recv_bytes(buffer_tag(), true, failed ? static_cast<detail::PayloadSink&>(discard) : fixed, src, dl.next());
      }
    } catch (...) {
      pg.broken = "a recv_obj whose arrays did not arrive";
      throw;
    }
    pg.scratch = {};
  }
  if (failed) std::rethrow_exception(failed);
  return decoded.value;
}

py::object broadcast_obj(PyGroup& pg, py::handle obj, int src, std::optional<double> timeout, bool allow_pickle,
                         py::handle out) {
  const char* op = "broadcast_obj";
  Busy busy(pg, op);
  StatelessGroup& g = pg.group(op);
  const Deadline dl(timeout, g, op);
  if (src < 0 || src >= g.world_size()) {
    throw UsageError(fmt::format("{} on {}: root rank {} is not a group rank (expected 0..{})", op, pg.me(), src,
                                 g.world_size() - 1));
  }
  const bool root = g.rank() == src;
  std::uint8_t flags = allow_pickle ? kAllowPickle : 0;
  std::optional<codec::OutTarget> target;
  const LocalError local = before_collective([&] {
    if (root) {
      codec::encode(obj, allow_pickle, pg.enc);
      flags |= kHasObject;
    } else if (!out.is_none()) {
      target = codec::out_target(out);
      flags |= kHasOut;
    }
  });
  if (local) flags = static_cast<std::uint8_t>((flags & kAllowPickle) | kHasError);
  write_part(pg.mine, flags, target ? &target->spec : nullptr, local.text, &pg.enc.bytes);
  const std::vector<Part> parts = exchange_parts(pg, g, op, broadcast_tag(src), dl);
  local.rethrow();
  raise_member_errors(pg, op, parts, src);

  // The same checks on every member, from the same parts.
  const Site site{&pg, op, src};
  const std::string_view object = parts[static_cast<std::size_t>(src)].object;
  const codec::Summary summary = codec::summarize(object, site.where());
  if (summary.pickled) check_pickle_consent(pg, op, parts, {src});
  std::vector<std::string> mismatches;
  std::optional<codec::ArraySpec> sent;
  bool sent_known = false;
  for (std::size_t p = 0; p < parts.size(); ++p) {
    if (!(parts[p].flags & kHasOut)) continue;
    if (!sent_known) {
      sent = codec::top_level_array(object, site.where());
      sent_known = true;
    }
    if (!sent || !(*sent == parts[p].out)) {
      mismatches.push_back(fmt::format("{} passed out= of {}", pg.peer(static_cast<int>(p)), parts[p].out.to_string()));
    }
  }
  if (!mismatches.empty()) {
    throw UsageError(
        fmt::format("{} on {}: type or size mismatch: the root {} sent {}, but {}; nothing was "
                    "sent, the group is still usable",
                    op, pg.me(), pg.peer(src), sent ? sent->to_string() : "an object that is not an array",
                    fmt::join(mismatches, ", ")));
  }

  codec::Decoded decoded;
  std::exception_ptr failed;
  if (!root) {
    try {
      decoded = codec::decode(object, allow_pickle, target ? &*target : nullptr, site.where(), site.peer());
    } catch (...) {
      failed = std::current_exception();  // this rank still takes part in moving the arrays
    }
  }
  if (!summary.buffer_sizes.empty()) {
    py::gil_scoped_release release;
    try {
      for (std::size_t i = 0; i < summary.buffer_sizes.size(); ++i) {
        DiscardSink discard(pg.scratch);
        const bool into = !root && !failed;
        FixedSink fixed(into ? decoded.targets[i].data : nullptr, into ? decoded.targets[i].size : 0);
        std::span<const char> payload;
        if (root) payload = {pg.enc.buffers[i].data, pg.enc.buffers[i].size};
        g.broadcast_bytes(buffer_tag(), true, payload, into ? static_cast<detail::PayloadSink&>(fixed) : discard, src,
                          dl.next());
      }
    } catch (...) {
      pg.broken = "a failure in broadcast_obj while its arrays were moving";
      throw;
    }
    pg.scratch = {};
  }
  if (root) {
    pg.enc.buffers.clear();  // the caller's arrays are not held past the call
    return py::reinterpret_borrow<py::object>(obj);
  }
  if (failed) std::rethrow_exception(failed);
  return decoded.value;
}

py::list all_gather_obj(PyGroup& pg, py::handle obj, std::optional<double> timeout, bool allow_pickle) {
  const char* op = "all_gather_obj";
  Busy busy(pg, op);
  StatelessGroup& g = pg.group(op);
  const Deadline dl(timeout, g, op);
  std::uint8_t flags = allow_pickle ? kAllowPickle : 0;
  const LocalError local = before_collective([&] {
    codec::encode(obj, allow_pickle, pg.enc);
    flags |= kHasObject;
  });
  if (local) flags = static_cast<std::uint8_t>((flags & kAllowPickle) | kHasError);
  write_part(pg.mine, flags, nullptr, local.text, &pg.enc.bytes);
  const std::vector<Part> parts = exchange_parts(pg, g, op, all_gather_tag(), dl);
  local.rethrow();
  raise_member_errors(pg, op, parts, -1);

  const int me = g.rank();
  const auto n = parts.size();
  std::vector<codec::Summary> summaries(n);
  std::vector<int> pickled_by;
  std::size_t rounds = 0;
  for (std::size_t p = 0; p < n; ++p) {
    const Site from{&pg, op, static_cast<int>(p)};
    summaries[p] = codec::summarize(parts[p].object, from.where_from());
    if (summaries[p].pickled) pickled_by.push_back(static_cast<int>(p));
    rounds = std::max(rounds, summaries[p].buffer_sizes.size());
  }
  check_pickle_consent(pg, op, parts, pickled_by);

  std::vector<codec::Decoded> decoded(n);
  std::exception_ptr failed;
  for (std::size_t p = 0; p < n && !failed; ++p) {
    if (static_cast<int>(p) == me) continue;
    try {
      const Site from{&pg, op, static_cast<int>(p)};
      decoded[p] = codec::decode(parts[p].object, allow_pickle, nullptr, from.where(), from.peer());
    } catch (...) {
      failed = std::current_exception();  // this rank still takes part in moving the arrays
    }
  }
  if (rounds > 0) {
    py::gil_scoped_release release;
    try {
      // Round k moves every member's k-th array (nothing from a member with fewer).
      std::vector<DiscardSink> discards;
      std::vector<FixedSink> fixed;
      std::vector<detail::PayloadSink*> sinks(n);
      for (std::size_t k = 0; k < rounds; ++k) {
        discards.clear();
        fixed.clear();
        discards.reserve(n);
        fixed.reserve(n);
        for (std::size_t p = 0; p < n; ++p) {
          const auto& sizes = summaries[p].buffer_sizes;
          if (static_cast<int>(p) == me || (failed && k < sizes.size())) {
            sinks[p] = &discards.emplace_back(pg.scratch);
          } else if (k < sizes.size()) {
            sinks[p] = &fixed.emplace_back(decoded[p].targets[k].data, decoded[p].targets[k].size);
          } else {
            sinks[p] = &fixed.emplace_back(nullptr, 0);
          }
        }
        std::span<const char> payload;
        if (k < pg.enc.buffers.size()) payload = {pg.enc.buffers[k].data, pg.enc.buffers[k].size};
        g.all_gather_bytes(buffer_tag(), true, payload, sinks, dl.next());
      }
    } catch (...) {
      pg.broken = "a failure in all_gather_obj while its arrays were moving";
      throw;
    }
    pg.scratch = {};
  }
  pg.enc.buffers.clear();
  if (failed) std::rethrow_exception(failed);
  py::list result(n);
  for (std::size_t p = 0; p < n; ++p) {
    result[p] = static_cast<int>(p) == me ? py::reinterpret_borrow<py::object>(obj) : decoded[p].value;
  }
  return result;
}

GroupOptions options_for(std::optional<double> timeout, const char* op) {
  GroupOptions o;
  if (timeout) {
    if (!(*timeout >= 0)) {
      throw UsageError(
          fmt::format("{}: timeout: expected seconds >= 0 (0 or math.inf: no limit), found {}", op, *timeout));
    }
    o.timeout = Seconds(std::isinf(*timeout) ? 0.0 : *timeout);
  }
  return o;
}

std::unique_ptr<PyGroup> create(const std::vector<int>& members, std::optional<double> timeout) {
  const char* op = "StatelessGroup.create";
  ensure_mpi(op);
  const GroupOptions o = options_for(timeout, op);
  auto pg = std::make_unique<PyGroup>();
  py::gil_scoped_release release;
  pg->g.emplace(StatelessGroup::create(members, MPI_COMM_WORLD, o));
  return pg;
}

std::unique_ptr<PyGroup> from_mpi4py(py::handle comm, std::optional<double> timeout) {
  const char* op = "StatelessGroup.from_mpi4py";
  py::module_ mpi = py::module_::import("mpi4py.MPI");
  const auto vendor = mpi.attr("get_vendor")().cast<py::tuple>();
  const std::string their_vendor = py::str(vendor[0]);
  const std::string theirs = trimmed(py::str(mpi.attr("Get_library_version")()).cast<std::string>());
  const std::string ours = mpi_library_version();
  if (their_vendor != mpi_vendor() || theirs != ours) {
    throw UsageError(fmt::format(
        "{}: mpi4py is built for {} ({}), meshrt for {} ({}): a communicator of one MPI library cannot be used by "
        "another; build mpi4py and meshrt against the same MPI",
        op, their_vendor, theirs.substr(0, theirs.find('\n')), mpi_vendor(), ours.substr(0, ours.find('\n'))));
  }
  if (!py::isinstance(comm, mpi.attr("Intracomm"))) {
    throw UsageError(fmt::format("{}: expected an mpi4py.MPI.Intracomm, found {}", op,
                                 std::string(py::str(py::type::handle_of(comm).attr("__qualname__")))));
  }
  ensure_mpi(op);
  const MPI_Comm c = MPI_Comm_f2c(static_cast<MPI_Fint>(comm.attr("py2f")().cast<int>()));
  if (c == MPI_COMM_NULL) throw UsageError(fmt::format("{}: expected a communicator, found MPI.COMM_NULL", op));
  const GroupOptions o = options_for(timeout, op);
  auto pg = std::make_unique<PyGroup>();
  py::gil_scoped_release release;
  pg->g.emplace(StatelessGroup::from_comm(c, o));
  return pg;
}

}  // namespace

void bind_group(py::module_& m) {
  m.def(
      "world_rank",
      [] {
        ensure_mpi("meshrt.world_rank");
        int r = 0;
        MESHRT_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &r));
        return r;
      },
      "This process's rank in MPI_COMM_WORLD (starts MPI if the program has not).");
  m.def(
      "world_size",
      [] {
        ensure_mpi("meshrt.world_size");
        int n = 0;
        MESHRT_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &n));
        return n;
      },
      "The number of processes in MPI_COMM_WORLD (starts MPI if the program has not).");
  m.def("_mpi_library_version", &mpi_library_version, "MPI_Get_library_version of the MPI meshrt is built with.");
  m.def("_mpi_vendor", &mpi_vendor, "The MPI meshrt is built with, as mpi4py.MPI.get_vendor() names it.");

  py::class_<PyGroup>(m, "StatelessGroup",
                      "Object collectives over MPI for any subset of ranks, without global state (vLLM's "
                      "StatelessProcessGroup over MPI). Objects travel through a safe codec; pickle only where both "
                      "sides pass allow_pickle=True.")
      .def_static("create", &create, py::arg("members"), py::arg("timeout") = py::none(),
                  "A group of the world ranks `members` (members[i] becomes group rank i). Only the members call "
                  "it, each with the same list. timeout: every call's default in seconds (None: "
                  "MESHRT_GROUP_TIMEOUT; 0 or math.inf: no limit). Starts MPI if the program has not.")
      .def_static("from_mpi4py", &from_mpi4py, py::arg("comm"), py::arg("timeout") = py::none(),
                  "A group over every rank of an mpi4py intracommunicator (on a duplicate of it); every rank of "
                  "comm calls it. mpi4py must use the MPI library meshrt is built with.")
      .def_property_readonly("rank", [](PyGroup& pg) { return pg.group("rank").rank(); })
      .def_property_readonly("size", [](PyGroup& pg) { return pg.group("size").world_size(); })
      .def_property_readonly(
          "world_size", [](PyGroup& pg) { return pg.group("world_size").world_size(); },
          "The group's size (vLLM's name).")
      .def_property_readonly(
          "members", [](PyGroup& pg) { return pg.group("members").members(); },
          "The members' ranks in the parent (MPI_COMM_WORLD for create, comm for from_mpi4py), by group rank.")
      .def_property_readonly(
          "usable", [](PyGroup& pg) { return pg.g && pg.g->usable() && pg.broken.empty(); },
          "False once a timeout or a failure mid-transfer has left messages in flight (later calls raise).")
      .def_property_readonly(
          "timeout", [](PyGroup& pg) { return pg.group("timeout").default_timeout().count(); },
          "Every call's default timeout in seconds.")
      .def("send_obj", &send_obj, py::arg("obj"), py::arg("dst"), py::arg("timeout") = py::none(), py::kw_only(),
           py::arg("allow_pickle") = false, "Sends obj to group rank dst; returns once it has left this rank.")
      .def("recv_obj", &recv_obj, py::arg("src"), py::arg("timeout") = py::none(), py::kw_only(),
           py::arg("allow_pickle") = false, py::arg("out") = py::none(),
           "The next object group rank src sent to this rank. out: an array to receive a sent array into.")
      .def("broadcast_obj", &broadcast_obj, py::arg("obj"), py::arg("src"), py::arg("timeout") = py::none(),
           py::kw_only(), py::arg("allow_pickle") = false, py::arg("out") = py::none(),
           "Every member calls it with the same src; returns src's object on every member (obj itself on src; "
           "obj is ignored elsewhere). out: on the others, an array to receive the root's array into (its dtype "
           "and shape must match, else a UsageError on every member).")
      .def("all_gather_obj", &all_gather_obj, py::arg("obj"), py::arg("timeout") = py::none(), py::kw_only(),
           py::arg("allow_pickle") = false, "Every member's object, in group rank order (obj itself at this rank's).")
      .def(
          "barrier",
          [](PyGroup& pg, std::optional<double> timeout) {
            const char* op = "barrier";
            Busy busy(pg, op);
            StatelessGroup& g = pg.group(op);
            const Deadline dl(timeout, g, op);
            py::gil_scoped_release release;
            g.barrier(dl.first());
          },
          py::arg("timeout") = py::none(), "Returns once every member has called it.")
      .def(
          "close", [](PyGroup& pg) { pg.g.reset(); }, "Frees the group's communicator now (later calls raise).")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyGroup& pg, py::args) { pg.g.reset(); })
      .def("__repr__", [](PyGroup& pg) {
        if (!pg.g || pg.g->comm() == MPI_COMM_NULL) return std::string("meshrt.StatelessGroup(closed)");
        return fmt::format("meshrt.StatelessGroup(rank {} of {}, members [{}]{})", pg.g->rank(), pg.g->world_size(),
                           fmt::join(pg.g->members(), ", "), pg.g->usable() && pg.broken.empty() ? "" : ", unusable");
      });
}

}  // namespace meshrt::python
