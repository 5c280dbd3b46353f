// Controller in Python (main's argument in meshrt.run): meshes, streams, fetches,
// recordings, synchronize and the job-wide tools (traces, flight recorder, abort).
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "api/classes.hpp"
#include "bindings.hpp"
#include "support/call_args.hpp"
#include "support/caller.hpp"
#include "support/convert.hpp"
#include "support/tracebacks.hpp"

namespace meshrt::python {
namespace {

// A Controller method without arguments, bound as every controller call runs: the GIL
// released, the controller lock held (support/gil.hpp).
template <class R>
auto on_controller(R (Controller::*method)()) {
  return [method](const ControllerHandle& h) {
    Controller& ctl = h.get();
    return released([&] { return (ctl.*method)(); });
  };
}

}  // namespace

void bind_controller(py::module_& m) {
  auto cls = api_class<ControllerClass>(m, "Controller");
  cls.def(py::init([]() -> std::shared_ptr<ControllerHandle> {
            throw UsageError(
                "meshrt.Controller(): expected a Controller from meshrt.run, found a call of the class: a program "
                "does not make its controller, meshrt.run(main) passes one to main on rank 0 (def main(ctl): ...)");
          }),
          "Not called by programs: meshrt.run(main) passes main its Controller (raises UsageError).")
      .def(
          "world_mesh",
          [](const ControllerHandle& h, py::handle dims, py::handle kind) {
            const auto where = caller_site();
            auto d = to_dims(dims, "world_mesh", where);
            const DeviceKind k = to_kind(kind, where);
            Controller& ctl = h.get();
            return released([&] { return at_site(where, [&] { return ctl.world_mesh(std::move(d), k, where); }); });
          },
          py::arg("dims"), py::arg("kind") = "cpu",
          "The mesh of every worker rank: dims {\"dp\": 2, \"tp\": 2} or [(\"dp\", 2), (\"tp\", 2)]; kind \"cpu\", "
          "\"emulated\", \"cuda\" or ctl.accelerator.")
      .def_property_readonly(
          "accelerator", [](const ControllerHandle& h) { return h.get().accelerator(); },
          "The job's accelerator (MESHRT_ACCELERATOR), DeviceKind.CPU when there is none.")
      .def(
          "stream",
          [](const ControllerHandle& h, const std::string& name) {
            Controller& ctl = h.get();
            return released([&] { return ctl.stream(name); });
          },
          py::arg("name"), "The stream name (created on first use).")
      .def_property_readonly("default_stream", on_controller(&Controller::default_stream))
      .def(
          "fetch_shard",
          [](const ControllerHandle& h, const py::object& t, std::optional<std::string> preprocess, py::kwargs coords) {
            const auto where = caller_site();
            std::vector<std::pair<std::string, std::int64_t>> c;
            for (auto [k, v] : coords) {
              const std::string dim = py::str(k);
              c.emplace_back(dim, to_int(v, fmt::format("fetch_shard: coordinate {}", dim), where));
            }
            Controller& ctl = h.get();
            if (py::isinstance<DTensor>(t)) {
              const DTensor& one = t.cast<const DTensor&>();
              return PyFuture{
                  released([&] { return ctl.fetch_shard(one, std::move(c), std::move(preprocess), where); }), nullptr};
            }
            if (preprocess) {
              throw UsageError(fmt::format(
                  "fetch_shard: expected one DTensor with preprocess=\"{}\", found a {}; fetch each tensor through "
                  "it on its own (at {})",
                  *preprocess, qualified_name(py::type::handle_of(t)), describe(where)));
            }
            // A pytree: its DTensors in one fetch, the structure rebuilt around their tensors.
            const py::tuple flat = py::module_::import("meshrt._futures").attr("flatten")(t);
            const std::vector<DTensor> leaves = flat[0].cast<std::vector<DTensor>>();
            PyFuture out{released([&] { return ctl.fetch_shards(leaves, std::move(c), where); }), nullptr};
            out.finish = std::make_shared<KeptObject>(py::reinterpret_borrow<py::object>(flat[1]));
            return out;
          },
          py::arg("t"), py::pos_only(), py::arg("preprocess") = py::none(),
          "fetch_shard(t, dp=0, tp=1): a Future of t's local tensor at those coordinates (0 along the dimensions "
          "not named), optionally through a registered function on the worker. t may be a tuple, list or dict of "
          "DTensors (nested): one Future of the same structure of tensors, fetched in one round trip (one command "
          "and one reply per rank).")
      .def(
          "fetch",
          [](const ControllerHandle& h, py::args args, py::kwargs kwargs) {
            const auto where = caller_site();
            if (args.size() == 0) usage(where, "fetch: expected a function and its arguments, found none");
            const std::string fn = function_name(args[0], where, "fetch");
            std::vector<Arg> a = to_args(items(args), 1, fn, where);
            std::optional<Mesh> mesh;
            std::vector<std::pair<std::string, std::int64_t>> c;
            for (auto [k, v] : kwargs) {
              const std::string key = py::str(k);
              if (key == "mesh") {
                if (!py::isinstance<Mesh>(v))
                  usage(where, fmt::format("fetch: expected mesh= a Mesh, found {}", found(v)));
                mesh = v.cast<Mesh>();
              } else {
                c.emplace_back(key, to_int(v, fmt::format("fetch: coordinate {}", key), where));
              }
            }
            for (const Arg& arg : a) {
              for (const DTensor& t : arg.tensors()) {
                if (!mesh) mesh = t.mesh();
                if (t.meta().device().is_accelerator()) {
                  usage(where, fmt::format("fetch of {}: expected tensor arguments on a cpu mesh, found {} (the value "
                                           "is made on the host; on an accelerator mesh, fetch_shard the tensor, or "
                                           "pass what the function needs as plain values)",
                                           fn, t.meta().to_string()));
                }
              }
            }
            if (!mesh) {
              usage(where, fmt::format("fetch of {}: expected a DTensor argument or mesh=, found neither (which mesh's "
                                       "rank runs it?)",
                                       fn));
            }
            a.insert(a.begin(), Arg(fn));
            Controller& ctl = h.get();
            PyFuture out{released([&] {
                           return ctl.fetch_call(*mesh, FunctionName("meshrt.fetch_value", where), std::move(a),
                                                 std::move(c));
                         }),
                         nullptr};
            out.finish = std::make_shared<KeptObject>(py::module_::import("meshrt._functions").attr("_fetched"));
            return out;
          },
          "fetch(fn, *args, mesh=None, dp=0, tp=1): a Future of the Python value remote function fn returns on the "
          "one rank at those coordinates (0 along the dimensions not named) of mesh (the mesh of its DTensor "
          "arguments), through the safe codec; an exception object it returns comes back as a value.")
      .def(
          "record",
          [](const ControllerHandle& h, py::handle examples, const py::function& body) {
            const auto where = caller_site();
            const std::vector<DTensor> ex = to_tensors(examples, "record: examples", where);
            Controller& ctl = h.get();
            auto r = Holder<PyRecording>(new PyRecording());
            // With the GIL held and without the controller lock: the body's calls take it
            // one by one, as outside a recording.
            r->recording = at_site(where, [&] {
              return ctl.record(
                  ex,
                  [&](const std::vector<DTensor>& formals) {
                    py::tuple args(formals.size());
                    for (std::size_t i = 0; i < formals.size(); ++i) args[i] = py::cast(formals[i]);
                    const py::object out = body(*args);
                    r->form = out.is_none()                  ? PyRecording::Form::None
                              : py::isinstance<DTensor>(out) ? PyRecording::Form::One
                                                             : PyRecording::Form::Tuple;
                    return to_tensors(out, "record: the function's result", where);
                  },
                  where);
            });
            return r;
          },
          py::arg("examples"), py::arg("body"),
          "record([x], lambda x: ...): runs body once on formal tensors like the examples and keeps the commands "
          "it issues; the Recording returned replays them with one command. Fetches and synchronize inside are "
          "refused; tensors from outside are captured.")
      .def(
          "synchronize",
          [](const ControllerHandle& h, std::optional<double> timeout) {
            Controller& ctl = h.get();
            released([&] { timeout ? ctl.synchronize(*seconds(timeout)) : ctl.synchronize(); });
          },
          py::arg("timeout") = py::none(),
          "Waits for all issued work (Ctrl-C interrupts); raises one RemoteError for the failures no Future "
          "reported.")
      .def("restart_workers", on_controller(&Controller::restart_workers),
           "Fresh worker loops: every mesh, tensor and stream made before is gone (using one raises UsageError).")
      .def("release_cached_memory", on_controller(&Controller::release_cached_memory),
           "Frees the memory the workers keep cached; returns the bytes freed on all of them together.")
      .def("dump_flight_recorder", on_controller(&Controller::dump_flight_recorder),
           "Every worker's last commands (also written to its log), rank by rank.")
      .def(
          "write_trace",
          [](const ControllerHandle& h, const py::object& path) {
            Controller& ctl = h.get();
            const std::string file = py::str(py::module_::import("os").attr("fspath")(path));
            return released([&] { return ctl.write_trace(file); });
          },
          py::arg("path"),
          "Writes every rank's timeline recorded so far to `path` (Chrome-trace JSON, for Perfetto's UI or "
          "chrome://tracing); returns the events written. Does not wait for issued work.")
      .def("start_trace", on_controller(&Controller::start_trace),
           "Waits for the work issued so far, then every rank starts recording its timeline (MESHRT_TRACE "
           "records the whole run).")
      .def("stop_trace", on_controller(&Controller::stop_trace),
           "Waits for the work issued so far, then every rank stops recording its timeline.")
      .def(
          "abort",
          [](const ControllerHandle& h, const std::string& reason) {
            Controller& ctl = h.get();
            released([&] { ctl.abort(reason); });
          },
          py::arg("reason"), "Ends the whole job now (MPI_Abort), after telling the workers why.")
      .def_property_readonly("world_size", [](const ControllerHandle& h) { return h.get().world_size(); })
      .def_property_readonly("worker_ranks", [](const ControllerHandle& h) { return ranks_of(h.get().worker_ranks()); })
      .def(
          "live_values",
          [](const ControllerHandle& h, int rank) {
            Controller& ctl = h.get();
            return released([&] { return ctl.live_values(rank); });
          },
          py::arg("rank"), "How many values rank's worker holds, as of its latest status (synchronize first).")
      .def(
          "control_traffic",
          [](const ControllerHandle& h) {
            Controller& ctl = h.get();
            const std::string json = released([&] { return ctl.control_traffic().to_json(); });
            return py::module_::import("json").attr("loads")(json);
          },
          "The control messages and bytes sent and received so far, by kind: {\"sent\": {\"Command\": "
          "{\"messages\": n, \"bytes\": b}, ...}, \"received\": {...}}.");
}

}  // namespace meshrt::python
