#include "group/agreement.hpp"

#include <pybind11/gil.h>

#include <cstring>
#include <map>

namespace meshrt::python::group_ops {

char* FixedSink::prepare(std::size_t size) {
  if (size != size_) {
    throw ProtocolError(
        fmt::format("an array's data: expected {} bytes (as its structure said), found {}", size_, size));
  }
  return data_;
}

namespace {

const detail::TypeTag& named_tag(const std::string& name) {
  static auto* tags = new std::map<std::string, detail::TypeTag>();
  auto it = tags->find(name);
  if (it == tags->end()) it = tags->emplace(name, detail::TypeTag{name, detail::fnv1a(name)}).first;
  return it->second;
}
}  // namespace

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
namespace {
// One tag per operation and root, made once.
const detail::TypeTag& rooted_tag(std::vector<const detail::TypeTag*>& by_root, const char* what, int root) {
  const auto r = static_cast<std::size_t>(root);
  if (r >= by_root.size()) by_root.resize(r + 1, nullptr);
  auto& tag = by_root[r];
  if (tag == nullptr) tag = &named_tag(fmt::format("Python codec ({} root {})", what, root));
  return *tag;
}
}  // namespace

const detail::TypeTag& broadcast_tag(int root) {
  static auto* by_root = new std::vector<const detail::TypeTag*>();
  return rooted_tag(*by_root, "broadcast_obj from", root);
}
const detail::TypeTag& gather_tag(int root) {
  static auto* by_root = new std::vector<const detail::TypeTag*>();
  return rooted_tag(*by_root, "gather_obj to", root);
}
const detail::TypeTag& scatter_tag(int root) {
  static auto* by_root = new std::vector<const detail::TypeTag*>();
  return rooted_tag(*by_root, "scatter_obj from", root);
}

namespace {

template <class T>
void put(std::string& s, const T& v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof v);
}
void put_text(std::string& s, std::string_view t) {
  put(s, static_cast<std::uint32_t>(t.size()));
  s.append(t);
}

}  // namespace

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
                          const std::vector<int>& pickled_by, const std::vector<int>& decoders) {
  if (pickled_by.empty()) return;
  std::vector<int> refusing;
  auto check = [&](int r) {
    const bool receives = pickled_by.size() > 1 || pickled_by[0] != r;
    if (receives && !(parts[static_cast<std::size_t>(r)].flags & kAllowPickle)) refusing.push_back(r);
  };
  if (decoders.empty()) {
    for (std::size_t p = 0; p < parts.size(); ++p) check(static_cast<int>(p));
  } else {
    for (int r : decoders) check(r);
  }
  if (refusing.empty()) return;
  throw UsageError(fmt::format(
      "{} on {}: {} pickled {} object (it passed allow_pickle=True), but {} did not pass allow_pickle=True; pickle "
      "runs code when it decodes, so the safe codec refuses it unless both sides pass allow_pickle=True; nothing "
      "was sent, the group is still usable",
      op, pg.me(), pg.peers(pickled_by), pickled_by.size() == 1 ? "its" : "their", pg.peers(refusing)));
}

}  // namespace meshrt::python::group_ops
