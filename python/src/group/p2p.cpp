// send_obj and recv_obj.
#include <pybind11/stl.h>

#include <cstring>
#include <span>

#include "group/agreement.hpp"
#include "group/group_ops.hpp"

namespace meshrt::python {

using namespace group_ops;  // NOLINT(google-build-using-namespace): the group's own vocabulary

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

}  // namespace meshrt::python
