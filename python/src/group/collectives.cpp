// broadcast_obj, all_gather_obj, gather_obj, scatter_obj and barrier.
#include <pybind11/stl.h>

#include <cstring>
#include <limits>
#include <span>

#include "group/agreement.hpp"
#include "group/codec_format.hpp"
#include "group/group_ops.hpp"

namespace meshrt::python {

using namespace group_ops;  // NOLINT(google-build-using-namespace): the group's own vocabulary

// One message per receiver: the root's part (its flags, and its object or the error it
// met encoding it) is the C++ broadcast's first message, whose header each receiver
// checks against its call. What only a receiver asked for (its out=, its allow_pickle) is
// checked on that receiver: it raises once the root's arrays are off the wire, and the
// group stays usable (the root does not wait to hear back).
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
  const Site site{&pg, op, src};
  const auto n = static_cast<std::size_t>(g.world_size());
  std::string_view object;
  if (root) {
    std::uint8_t flags = allow_pickle ? kAllowPickle : 0;
    const LocalError local = before_collective([&] {
      codec::encode(obj, allow_pickle, pg.enc);
      flags |= kHasObject;
    });
    if (local) flags = static_cast<std::uint8_t>((flags & kAllowPickle) | kHasError);
    write_part(pg.mine, flags, nullptr, local.text, &pg.enc.bytes);
    {
      py::gil_scoped_release release;
      detail::BufferSink unused(pg.inbox);  // the root receives nothing
      g.broadcast_bytes(broadcast_tag(src), false, pg.mine, unused, src, dl.first());
    }
    if (local) {
      local.rethrow();
      std::vector<Part> parts(n);
      parts[static_cast<std::size_t>(src)] = read_part(pg.mine, site.where());
      raise_member_errors(pg, op, parts, src);
    }
    object = read_part(pg.mine, site.where()).object;
  } else {
    pg.parts.resize(n);
    std::string& got = pg.parts[static_cast<std::size_t>(src)];
    {
      py::gil_scoped_release release;
      detail::BufferSink sink(got);
      g.broadcast_bytes(broadcast_tag(src), false, {}, sink, src, dl.first());
    }
    Part part = read_part(got, site.where_from());
    if (part.flags & kHasError) {
      // The root's encoding failed: every receiver raises what the root raises.
      std::vector<Part> parts(n);
      parts[static_cast<std::size_t>(src)] = std::move(part);
      raise_member_errors(pg, op, parts, src);
    }
    object = part.object;
  }
  const codec::Summary summary = codec::summarize(object, site.where());

  codec::Decoded decoded;
  std::exception_ptr failed;
  if (!root) {
    try {
      if (summary.pickled && !allow_pickle) {
        throw UsageError(fmt::format(
            "{} on {}: the root {} pickled its object (it passed allow_pickle=True), but {} did not pass "
            "allow_pickle=True; pickle runs code when it decodes, so the safe codec refuses it unless "
            "both sides pass allow_pickle=True; the object was taken off the wire, the group is still usable",
            op, pg.me(), pg.peer(src), pg.peer(g.rank())));
      }
      std::optional<codec::OutTarget> target;
      if (!out.is_none()) {
        target = codec::out_target(out);
        const std::optional<codec::ArraySpec> sent = codec::top_level_array(object, site.where());
        if (!sent || !(*sent == target->spec)) {
          throw UsageError(fmt::format(
              "{} on {}: type or size mismatch: the root {} sent {}, but {} passed out= of {}; the object was taken "
              "off the wire, the group is still usable",
              op, pg.me(), pg.peer(src), sent ? sent->to_string() : "an object that is not an array", pg.peer(g.rank()),
              target->spec.to_string()));
        }
      }
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

namespace {

void check_root(PyGroup& pg, const StatelessGroup& g, const char* op, int root) {
  if (root < 0 || root >= g.world_size()) {
    throw UsageError(fmt::format("{} on {}: root rank {} is not a group rank (expected 0..{})", op, pg.me(), root,
                                 g.world_size() - 1));
  }
}

constexpr int kEveryMember = std::numeric_limits<int>::min();

// all_gather_obj (root kEveryMember: every member decodes every object) and gather_obj (only the
// root decodes; the others return None). Every member's arrays go to every member either
// way: the C++ group's collectives move a part to all (a point-to-point message here
// could be taken for one the program sent before).
py::object gather_objects(PyGroup& pg, const char* op, py::handle obj, int root, std::optional<double> timeout,
                          bool allow_pickle) {
  Busy busy(pg, op);
  StatelessGroup& g = pg.group(op);
  const Deadline dl(timeout, g, op);
  if (root != kEveryMember) check_root(pg, g, op, root);
  std::uint8_t flags = allow_pickle ? kAllowPickle : 0;
  const LocalError local = before_collective([&] {
    codec::encode(obj, allow_pickle, pg.enc);
    flags |= kHasObject;
  });
  if (local) flags = static_cast<std::uint8_t>((flags & kAllowPickle) | kHasError);
  write_part(pg.mine, flags, nullptr, local.text, &pg.enc.bytes);
  const std::vector<Part> parts =
      exchange_parts(pg, g, op, root == kEveryMember ? all_gather_tag() : gather_tag(root), dl);
  local.rethrow();
  raise_member_errors(pg, op, parts, root);

  const int me = g.rank();
  const bool decodes_all = root == kEveryMember;
  const bool decodes = decodes_all || me == root;
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
  check_pickle_consent(pg, op, parts, pickled_by, decodes_all ? std::vector<int>{} : std::vector<int>{root});

  std::vector<codec::Decoded> decoded(n);
  std::exception_ptr failed;
  for (std::size_t p = 0; p < n && !failed && decodes; ++p) {
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
          if (k < sizes.size() && (static_cast<int>(p) == me || failed || !decodes)) {
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
      pg.broken = fmt::format("a failure in {} while its arrays were moving", op);
      throw;
    }
    pg.scratch = {};
  }
  pg.enc.buffers.clear();
  if (failed) std::rethrow_exception(failed);
  if (!decodes) return py::none();
  py::list result(n);
  for (std::size_t p = 0; p < n; ++p) {
    result[p] = static_cast<int>(p) == me ? py::reinterpret_borrow<py::object>(obj) : decoded[p].value;
  }
  return result;
}

// The root's part in scatter_obj: for each member, the length of its encoded object and
// the object (nothing for the root's own, which does not travel).
void put_u64(std::string& s, std::uint64_t v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof v);
}

std::vector<std::string_view> split_objects(std::string_view b, std::size_t n, const codec::Where& where) {
  std::vector<std::string_view> out;
  std::size_t at = 0;
  for (std::size_t i = 0; i < n; ++i) {
    std::uint64_t len = 0;
    if (b.size() - at < sizeof len) {
      throw ProtocolError(
          fmt::format("{}: the root's part of {} bytes ends before object {} of {}", where(), b.size(), i, n));
    }
    std::memcpy(&len, b.data() + at, sizeof len);
    at += sizeof len;
    if (len > b.size() - at) {
      throw ProtocolError(
          fmt::format("{}: object {} of the root's part declares {} bytes, {} remain", where(), i, len, b.size() - at));
    }
    out.push_back(b.substr(at, static_cast<std::size_t>(len)));
    at += static_cast<std::size_t>(len);
  }
  if (at != b.size()) {
    throw ProtocolError(fmt::format("{}: {} bytes left over after the root's {} objects", where(), b.size() - at, n));
  }
  return out;
}

}  // namespace

py::list all_gather_obj(PyGroup& pg, py::handle obj, std::optional<double> timeout, bool allow_pickle) {
  return py::reinterpret_borrow<py::list>(
      gather_objects(pg, "all_gather_obj", obj, kEveryMember, timeout, allow_pickle));
}

py::object gather_obj(PyGroup& pg, py::handle obj, int dst, std::optional<double> timeout, bool allow_pickle) {
  return gather_objects(pg, "gather_obj", obj, dst, timeout, allow_pickle);
}

py::object scatter_obj(PyGroup& pg, py::handle objs, int src, std::optional<double> timeout, bool allow_pickle) {
  const char* op = "scatter_obj";
  Busy busy(pg, op);
  StatelessGroup& g = pg.group(op);
  const Deadline dl(timeout, g, op);
  check_root(pg, g, op, src);
  const int me = g.rank();
  const auto n = static_cast<std::size_t>(g.world_size());
  const bool root = me == src;
  std::uint8_t flags = allow_pickle ? kAllowPickle : 0;
  // The root's encoded objects, one per member, and their arrays in member order.
  std::vector<codec::Encoded> encoded;
  std::string all;
  py::object own;
  const LocalError local = before_collective([&] {
    if (!root) return;
    if (!PyList_Check(objs.ptr()) && !PyTuple_Check(objs.ptr())) {
      throw UsageError(fmt::format("expected a list or tuple of {} objects, one per member, found {}", n,
                                   codec::format::type_name(objs)));
    }
    py::sequence seq = py::reinterpret_borrow<py::sequence>(objs);
    if (seq.size() != n) {
      throw UsageError(fmt::format("expected {} objects, one per member, found {}", n, seq.size()));
    }
    encoded.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      if (static_cast<int>(i) == me) {
        own = seq[i];
        put_u64(all, 0);
        continue;
      }
      try {
        codec::encode(seq[i], allow_pickle, encoded[i]);
      } catch (const UsageError& e) {
        throw UsageError(fmt::format("the object for group rank {}: {}", i, e.what()));
      }
      put_u64(all, encoded[i].bytes.size());
      all += encoded[i].bytes;
    }
    flags |= kHasObject;
  });
  if (local) flags = static_cast<std::uint8_t>((flags & kAllowPickle) | kHasError);
  write_part(pg.mine, flags, nullptr, local.text, &all);
  const std::vector<Part> parts = exchange_parts(pg, g, op, scatter_tag(src), dl);
  local.rethrow();
  raise_member_errors(pg, op, parts, src);

  // Every member reads the same root's part: every object's size and arrays, and which
  // members get a pickled one.
  const Site site{&pg, op, src};
  const std::vector<std::string_view> objects =
      split_objects(parts[static_cast<std::size_t>(src)].object, n, site.where_from());
  std::vector<codec::Summary> summaries(n);
  std::vector<int> pickled_for;
  for (std::size_t i = 0; i < n; ++i) {
    if (static_cast<int>(i) == src) continue;
    summaries[i] = codec::summarize(objects[i], site.where_from());
    if (summaries[i].pickled) pickled_for.push_back(static_cast<int>(i));
  }
  if (!pickled_for.empty()) check_pickle_consent(pg, op, parts, {src}, pickled_for);

  codec::Decoded decoded;
  std::exception_ptr failed;
  if (!root) {
    try {
      decoded = codec::decode(objects[static_cast<std::size_t>(me)], allow_pickle, nullptr, site.where(), site.peer());
    } catch (...) {
      failed = std::current_exception();  // this rank still takes part in moving the arrays
    }
  }
  // The root's arrays go to every member in turn (a broadcast each), taken by the member
  // they are for.
  bool moved = false;
  {
    py::gil_scoped_release release;
    try {
      for (std::size_t i = 0; i < n; ++i) {
        const auto& sizes = summaries[i].buffer_sizes;
        for (std::size_t k = 0; k < sizes.size(); ++k) {
          moved = true;
          DiscardSink discard(pg.scratch);
          const bool into = static_cast<int>(i) == me && !failed;
          FixedSink fixed(into ? decoded.targets[k].data : nullptr, into ? decoded.targets[k].size : 0);
          std::span<const char> payload;
          if (root) payload = {encoded[i].buffers[k].data, encoded[i].buffers[k].size};
          g.broadcast_bytes(buffer_tag(), true, payload, into ? static_cast<detail::PayloadSink&>(fixed) : discard, src,
                            dl.next());
        }
      }
    } catch (...) {
      pg.broken = "a failure in scatter_obj while its arrays were moving";
      throw;
    }
  }
  if (moved) pg.scratch = {};
  encoded.clear();  // the caller's arrays are not held past the call
  if (failed) std::rethrow_exception(failed);
  if (root) return own;
  return decoded.value;
}

void barrier(PyGroup& pg, std::optional<double> timeout) {
  const char* op = "barrier";
  Busy busy(pg, op);
  StatelessGroup& g = pg.group(op);
  const Deadline dl(timeout, g, op);
  py::gil_scoped_release release;
  g.barrier(dl.first());
}

}  // namespace meshrt::python
