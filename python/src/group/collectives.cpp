// broadcast_obj, all_gather_obj and barrier.
#include <pybind11/stl.h>

#include <cstring>
#include <span>

#include "group/agreement.hpp"
#include "group/group_ops.hpp"

namespace meshrt::python {

using namespace group_ops;  // NOLINT(google-build-using-namespace): the group's own vocabulary

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

void barrier(PyGroup& pg, std::optional<double> timeout) {
  const char* op = "barrier";
  Busy busy(pg, op);
  StatelessGroup& g = pg.group(op);
  const Deadline dl(timeout, g, op);
  py::gil_scoped_release release;
  g.barrier(dl.first());
}

}  // namespace meshrt::python
