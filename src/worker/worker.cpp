#include "meshrt/internal/worker.hpp"

#include <fmt/format.h>

#include <cxxabi.h>

#include <boost/algorithm/string/predicate.hpp>
#include <boost/core/demangle.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <typeinfo>
#include <utility>
#include <variant>

#include "common/backoff.hpp"
#include "common/checks.hpp"
#include "common/trace.hpp"
#include "meshrt/functions.hpp"
#include "meshrt/internal/comm.hpp"
#include "meshrt/internal/control.hpp"
#include "meshrt/internal/device.hpp"
#include "meshrt/internal/mpi_session.hpp"
#include "meshrt/internal/protocol.hpp"
#include "meshrt/internal/settings.hpp"
#include "meshrt/log.hpp"
#include "worker/borrows.hpp"
#include "worker/env.hpp"
#include "worker/idle.hpp"
#include "worker/in_flight.hpp"
#include "worker/inbox.hpp"
#include "worker/kernel_call.hpp"
#include "worker/monitor.hpp"
#include "worker/recorder_words.hpp"
#include "worker/recordings.hpp"
#include "worker/reporter.hpp"

namespace meshrt {
namespace {

using namespace protocol;

// `o` with its flight recorder: the Runtime's, or `own` when it gave none.
WorkerOptions with_monitor(WorkerOptions o, detail::Monitor* own) {
  if (o.monitor == nullptr) o.monitor = own;
  return o;
}

// Initial-exec: read for every kernel call (RunningKernel), where a shared library's
// thread-local costs a __tls_get_addr call; 8 bytes of the static TLS block.
[[gnu::tls_model("initial-exec")]] thread_local detail::WorkerThread* this_thread_worker = nullptr;

// Marks the calling thread as running a worker's loop (for detail::worker_thread) while it lives.
struct OnWorkerThread {
  detail::WorkerThread info;
  detail::WorkerThread* outer;
  explicit OnWorkerThread(int rank) : info{.rank = rank, .function = {}}, outer(this_thread_worker) {
    this_thread_worker = &info;
  }
  ~OnWorkerThread() { this_thread_worker = outer; }
  OnWorkerThread(const OnWorkerThread&) = delete;
  OnWorkerThread& operator=(const OnWorkerThread&) = delete;
};

// Names `function` as the one running on this worker's thread while it lives.
struct RunningKernel {
  detail::WorkerThread* worker = this_thread_worker;  // one read of the thread-local
  std::string_view outer;
  explicit RunningKernel(std::string_view function) : outer(worker ? worker->function : std::string_view()) {
    if (worker) worker->function = function;
  }
  ~RunningKernel() {
    if (worker) worker->function = outer;
  }
  RunningKernel(const RunningKernel&) = delete;
  RunningKernel& operator=(const RunningKernel&) = delete;
};

}  // namespace

const detail::WorkerThread* detail::worker_thread() noexcept {
  return this_thread_worker;
}

// A worker takes the commands its inbox receives, in order, and runs each against its
// environment: invocations call kernels (checked against their shape functions), a
// collective or send goes in flight until the loop's polls complete it (later commands on
// other streams that do not touch its values run meanwhile: InFlight::admits), borrows
// order streams. What failed or depends on a failure becomes a marker. The reporter tells the
// controller what completed and what failed; the flight recorder shows what ran.
struct Worker::Impl {
  explicit Impl(const WorkerOptions& o)
      : own_monitor(o.monitor ? nullptr : std::make_unique<detail::Monitor>(o.rank, 1000)),
        opt(with_monitor(o, own_monitor.get())),
        channel(o.transport ? o.transport : control::mpi_transport(o.control)) {
    monitor().reset_queue();
  }

  std::unique_ptr<detail::Monitor> own_monitor;  // when the options bring none
  const WorkerOptions opt;                       // opt.monitor is set
  std::shared_ptr<control::Transport> channel;
  detail::Env env{opt.rank};
  detail::Inbox inbox{*channel, *opt.monitor, opt.rank};
  detail::InFlight in_flight{*opt.monitor, opt};
  detail::CollectiveWords words;
  detail::Borrows borrows;
  detail::KernelCall kernels{opt.rank};
  detail::Reporter reporter{*channel, *opt.monitor, opt};
  // The command running now: its flight-recorder seq, and whether it failed.
  struct Running {
    std::uint64_t seq = 0;
    bool failed = false;
    bool on_device = false;  // a call whose host tasks still run (the reporter finishes it)
  } current;
  // The replay running now (docs/ARCHITECTURE.md section 3.9): its recording's commands run
  // in place, one flight-recorder entry for all of them, their idents passed once per run
  // of them. It pauses at a command that waits for the operation in flight.
  struct Replay {
    detail::Inbox::Queued q;  // the CallRecording and its recording
    std::size_t next = 0;     // the next step
    bool failed = false;      // a command of it failed
    Ident passed = 0;         // the highest ident that ran, not yet passed to the reporter
  };
  std::optional<Replay> replay;
  std::optional<WorkerExit> exit;

  detail::Monitor& monitor() const noexcept { return *opt.monitor; }

  // ------------------------------------------------------------------ replies

  void report_failure(Ident ident, const std::string& function, const std::exception& e) {
    report_failure(ident, function, e.what(), boost::core::demangle(typeid(e).name()));
  }
  void report_failure(Ident ident, const std::string& function, const std::string& message, const std::string& type) {
    current.failed = true;
    MESHRT_LOG(info) << "function " << function << " (ident " << ident << ") failed: " << message;
    reporter.reply(RemoteFunctionFailed{
        .ident = ident, .error = message, .rank = opt.rank, .function = function, .exception_type = type});
  }

  // Everything up to `ident` ran: told to the reporter at once, or by a replay when it
  // pauses or ends (one report for its commands).
  void passed(Ident ident) {
    if (replay) {
      replay->passed = std::max(replay->passed, ident);
    } else {
      reporter.passed(ident);
    }
  }
  // Reduce, Collective and SendTensor carry an ident like an invocation: reported past once
  // they end.
  void complete(Ident ident) {
    if (ident != 0) passed(ident);
  }
  // A Reduce or SendTensor that failed before it started: its result (on this rank) is
  // the marker, so what depends on it is poisoned rather than undefined.
  void poison_result(const Command& command, DependentOnError marker) {
    if (const auto* r = std::get_if<Reduce>(&command)) env.define(r->result, marker);
    if (const auto* c = std::get_if<Collective>(&command); c && c->result.id != 0 && defines_result_here(*c))
      env.define(c->result, marker);
    if (const auto* s = std::get_if<SendTensor>(&command); s && s->to_ranks.contains(opt.rank))
      env.define(s->result, marker);
  }
  // The meshrt stream a command's device work goes to, if it has one.
  static std::optional<std::uint64_t> stream_of(const Command& command) {
    return std::visit(
        [](const auto& c) -> std::optional<std::uint64_t> {
          if constexpr (requires { c.stream.id; }) {
            return c.stream.id;
          } else {
            return std::nullopt;
          }
        },
        command);
  }
  // Whether this rank holds a Collective's result (a rooted reduce's is the root's only);
  // when its mesh or dimensions are bad, as if it did: a marker there poisons what the
  // controller may still ask of it.
  bool defines_result_here(const Collective& c) const {
    try {
      return defines_result(*env.mesh(c.mesh, "mesh").mesh, operation(c));
    } catch (const std::exception&) {
      return true;
    }
  }
  static CollectiveOp operation(const Collective& c) {
    return CollectiveOp{.kind = c.kind,
                        .dims = c.dims,
                        .reduction = c.reduction,
                        .scatter = c.scatter,
                        .inplace = c.inplace,
                        .root = c.root};
  }
  static Ident ident_of(const Command& command) {
    if (const auto* r = std::get_if<Reduce>(&command)) return r->ident;
    if (const auto* c = std::get_if<Collective>(&command)) return c->ident;
    if (const auto* s = std::get_if<SendTensor>(&command)) return s->ident;
    return 0;
  }

  // ------------------------------------------------------------------ values

  // A kernel's context on this rank, or the marker its stream or mesh depends on. The last
  // one is kept while calls name the same mesh and stream (a mesh's and a stream's values
  // never change, and a kernel can change nothing of its context but the signature, set for
  // each call): building it copies the mesh's names and coordinates.
  std::variant<CallContext*, DependentOnError> context(Ref mesh_ref, Ref stream_ref) {
    if (kept_context.valid && kept_context.mesh == mesh_ref.id && kept_context.stream == stream_ref.id)
      return &kept_context.context;
    const auto stream = env.find<detail::StreamValue>(stream_ref, "stream");
    if (!stream) return stream.failed;
    // CPU kernels get no native stream: making one would create a CUDA context for a
    // CPU-only program.
    if (mesh_ref.id == 0) {
      kept_context.context = CallContext(opt.rank, {}, {}, {}, stream->id, Device::cpu(), nullptr);
    } else {
      const auto mesh = env.find<detail::MeshValue>(mesh_ref, "mesh");
      if (!mesh) return mesh.failed;
      // Kernels get this rank's own device of the kind the mesh is placed on.
      const Device where = mesh->kind == Device::Kind::Cpu ? Device::cpu() : device::rank_device(mesh->kind);
      // A cuda mesh's kernels launch on the CUDA stream of this meshrt stream (never the
      // legacy default stream); CPU meshes get none (no CUDA context for CPU work), emulated
      // ones enqueue through the device layer.
      void* native = where.is_cuda() ? stream->handle.device(Device::Kind::Cuda).native() : nullptr;
      kept_context.context = CallContext(opt.rank, mesh->mesh->names(), mesh->mesh->coordinates(),
                                         mesh->mesh->ranks().sizes(), stream->id, where, native);
    }
    kept_context.mesh = mesh_ref.id;
    kept_context.stream = stream_ref.id;
    kept_context.valid = true;
    return &kept_context.context;
  }
  struct KeptContext {
    std::uint64_t mesh = 0, stream = 0;
    bool valid = false;
    CallContext context;
  } kept_context;

  // A fetch's preprocess runs where the value is: on its accelerator device and that
  // device's stream of the fetch's meshrt stream (a CUDA kernel given no stream would run
  // on the legacy default stream, unordered with the work that made the value).
  std::variant<CallContext, DependentOnError> value_context(Ref stream_ref, const Value& value) const {
    const auto stream = env.find<detail::StreamValue>(stream_ref, "stream");
    if (!stream) return stream.failed;
    Device where = Device::cpu();
    value.for_each_leaf([&](const Value& leaf) {
      if (where.is_cpu() && leaf.is_tensor() && leaf.as_tensor().device().is_accelerator())
        where = leaf.as_tensor().device();
    });
    void* native = where.is_cuda() ? device::stream_for(stream->id, where).native() : nullptr;
    return CallContext(opt.rank, {}, {}, {}, stream->id, where, native);
  }

  // ------------------------------------------------------------------ commands

  void execute(Command& command) {
    std::visit([this](auto& c) { run(c); }, command);
  }

  void run(CreateDeviceMesh& c) {
    env.define(c.result, detail::MeshValue{std::make_shared<WorkerMesh>(c.names, c.ranks, opt.world), c.device});
  }

  void run(CreateStream& c) {
    env.define(c.result,
               detail::StreamValue{c.result.id, c.is_default, detail::make_stream(c.is_default, c.result.id)});
  }

  // Runs an invocation's `body`, which returns the marker of a failed input instead of
  // running. What it defines or mutates becomes a marker when it fails or depends on one.
  template <class Body>
  void invocation(Ident ident, const std::string& function, const std::vector<Ref>& results,
                  const std::vector<Ref>& mutates, Body&& body) {
    auto fail = [&](DependentOnError marker) {
      for (Ref r : results) env.define(r, marker);
      for (Ref r : mutates) env.define(r, marker);
    };
    std::optional<DependentOnError> poisoned;
    try {
      poisoned = body();
    } catch (const std::exception& e) {
      fail(DependentOnError{ident});
      report_failure(ident, function, e);
    } catch (...) {
      // A kernel may throw anything (`throw 42`): that fails the call, not the worker.
      fail(DependentOnError{ident});
      const std::type_info* type = abi::__cxa_current_exception_type();
      const std::string type_name = type ? boost::core::demangle(type->name()) : "an unknown type";
      report_failure(ident, function,
                     fmt::format("{} on rank {} threw an exception of type {}, not derived from std::exception",
                                 function, opt.rank, type_name),
                     type_name);
    }
    if (poisoned && poisoned->ident != 0) {
      fail(*poisoned);  // the controller knows that invocation failed
    } else if (poisoned) {
      // The input failed outside any invocation (a collective or send that failed in
      // flight): the controller cannot trace that, so this invocation reports it.
      fail(DependentOnError{ident});
      report_failure(ident, function,
                     fmt::format("an input on rank {} failed outside any invocation (a collective or send; "
                                 "its error was reported when it failed)",
                                 opt.rank),
                     "meshrt::RemoteError");
    }
    passed(ident);
  }

  void run(CallFunction& c) {
    invocation(c.ident, c.function, c.results, c.mutates, [&]() -> std::optional<DependentOnError> {
      auto found = context(c.mesh, c.stream);
      if (const auto* marker = std::get_if<DependentOnError>(&found)) return *marker;
      CallContext& ctx = **std::get_if<CallContext*>(&found);
      ctx.set_signature(nullptr);  // the kept context's last call's, until this call's is known
      std::vector<Value> args;
      if (!c.args.empty()) args.reserve(c.args.size());
      for (const Value& a : c.args) {
        auto arg = env.resolve(a);
        if (const auto* marker = std::get_if<DependentOnError>(&arg)) return *marker;
        args.push_back(std::move(*std::get_if<Value>(&arg)));
      }
      const functions::Function& fn = functions::lookup(c.function);
      Args kernel_args(c.function, std::move(args));
      if (c.keeps_object) return make_object(c, fn, ctx, kernel_args);
      const Signature& expected = kernels.expected(fn, kernel_args, ctx.device());
      ctx.set_signature(&expected);
      std::vector<Tensor> outputs;
      // On an accelerator the kernel's host tasks run later on its stream: their errors
      // are the call's (the reporter holds its completion until they have run).
      std::shared_ptr<device::TaskFailures> tasks =
          ctx.device().is_accelerator() ? std::make_shared<device::TaskFailures>() : nullptr;
      {
        const RunningKernel running(c.function);
        // A CPU kernel's scope would name no task failures, as outside any scope (the
        // worker's loop runs in none): it is opened only for an accelerator's.
        std::optional<device::TaskScope> scope;
        if (tasks) scope.emplace(tasks);
        outputs = fn.kernel(ctx, kernel_args);
      }
      kernels.check(c.function, expected, outputs, kernel_args);
      for (std::size_t i = 0; i < outputs.size(); ++i) env.define(c.results[i], std::move(outputs[i]));
      if (tasks && tasks->tasks.load(std::memory_order_relaxed) > 0) {
        detail::PendingWork pending{.ident = c.ident,
                                    .function = c.function,
                                    .mutates = c.mutates,
                                    .value = {},
                                    .copies = {},
                                    .is_call = true,
                                    .results = c.results,
                                    .seq = current.seq,
                                    .tasks = std::move(tasks)};
        pending.copies.push_back(tasks_done(ctx));
        reporter.call_pending(std::move(pending));
        current.on_device = true;
      }
      return std::nullopt;
    });
  }

  // Mesh::call_object: the constructor's object, kept on this rank under results[0]. Its
  // device work (none is expected) is not waited for: an object is no tensor.
  std::optional<DependentOnError> make_object(const CallFunction& c, const functions::Function& fn, CallContext& ctx,
                                              Args& args) {
    if (!fn.make_object) {
      throw UsageError(
          fmt::format("{} on rank {}: expected an object constructor for call_object, found a function "
                      "that returns tensors only",
                      c.function, opt.rank));
    }
    if (c.results.size() != 1) {
      throw ProtocolError(fmt::format("rank {}: call_object of {}: expected 1 result ref, found {}", opt.rank,
                                      c.function, c.results.size()));
    }
    WorkerObject object;
    {
      const RunningKernel running(c.function);
      object = fn.make_object(ctx, args);
    }
    if (!object.defined()) {
      throw UsageError(fmt::format("{} on rank {}: its object constructor returned no object (an empty WorkerObject)",
                                   c.function, opt.rank));
    }
    env.define(c.results[0], std::move(object));
    return std::nullopt;
  }

  // An event after the host tasks a kernel enqueued on its call's stream.
  static std::pair<device::Event, device::Stream> tasks_done(const CallContext& ctx) {
    const device::Stream s = device::stream_for(ctx.stream_id(), ctx.device());
    device::Event done = device::backend(ctx.device().kind()).create_event(s.device());
    done.record(s);
    return {std::move(done), s};
  }

  void run(FetchValue& c) {
    const std::string function = c.function.value_or("fetch");
    invocation(c.ident, function, {}, c.mutates, [&]() -> std::optional<DependentOnError> {
      auto resolved = env.resolve(c.value);
      if (const auto* marker = std::get_if<DependentOnError>(&resolved)) return *marker;
      Value& value = *std::get_if<Value>(&resolved);
      std::shared_ptr<device::TaskFailures> tasks;
      if (c.function) {
        auto found = value_context(c.stream, value);
        if (const auto* marker = std::get_if<DependentOnError>(&found)) return *marker;
        CallContext& ctx = *std::get_if<CallContext>(&found);
        // A list is Controller::fetch_call's arguments; fetch_shard's preprocess gets its ref.
        Args args(*c.function, value.is_list() ? std::move(value.as_list()) : std::vector<Value>{std::move(value)});
        const RunningKernel running(*c.function);
        if (ctx.device().is_accelerator()) tasks = std::make_shared<device::TaskFailures>();
        const device::TaskScope scope(tasks);
        std::vector<Tensor> outputs = functions::lookup(*c.function).kernel(ctx, args);
        value = outputs.size() == 1 ? Value(outputs[0]) : Value(Value::List(outputs.begin(), outputs.end()));
      }
      // Device tensors travel as host copies, made in the order of the fetch's device
      // stream (after the kernels that wrote them, the preprocess's host tasks too) into
      // pinned memory. The loop polls the copies' events (Reporter::poll): later commands
      // run meanwhile.
      detail::PendingWork pending{
          .ident = c.ident, .function = function, .mutates = c.mutates, .value = {}, .copies = {}};
      if (tasks && tasks->tasks.load(std::memory_order_relaxed) > 0) pending.tasks = std::move(tasks);
      pending.value = value.map([&](const Value& leaf) {
        if (!leaf.is_tensor() || leaf.as_tensor().device().is_cpu()) return leaf;
        const Tensor& t = leaf.as_tensor();
        const device::Stream s = device::stream_for(c.stream.id, t.device());
        device::Fetch f = device::fetch(t, s);
        pending.copies.emplace_back(std::move(f.done), s);
        return Value(std::move(f.host));
      });
      reporter.fetched(std::move(pending));
      return std::nullopt;
    });
  }

  void run(Reduce& c) {
    WorkerMesh& mesh = *env.mesh(c.mesh, "mesh").mesh;
    words.posting(monitor(), current.seq, c, mesh);
    Input in = env.input(c.tensor);
    // Accelerator tensors (and the factory of a broken one) go over the device layer's
    // communicators on the command's device stream.
    detail::Footprint footprint{
        .stream = c.stream.id,
        .reads = {c.tensor.id},
        .writes = c.inplace ? detail::Footprint::Ids{c.result.id, c.tensor.id} : detail::Footprint::Ids{c.result.id}};
    if (c.factory.device().is_accelerator()) {
      in_flight.start(
          start_reduce_device(mesh, c.dim, c.reduction, c.scatter, c.inplace, std::move(in), c.factory, c.stream.id),
          c.result, current.seq, "Reduce", c.ident, std::nullopt, std::move(footprint));
    } else {
      std::unique_ptr<Pending> op = start_reduce(mesh, c.dim, c.reduction, c.scatter, c.inplace, std::move(in),
                                                 c.factory, in_flight.cpu_completion());
      words.posted(monitor(), current.seq, c, *op, mesh);
      if (finish_at_start(*op, c.result)) return;
      in_flight.start(std::move(op), c.result, current.seq, "Reduce", c.ident, c.factory.nbytes(),
                      std::move(footprint));
      reporter.hold(c.ident);
      return;
    }
    reporter.hold(c.ident);
    words.posted(monitor(), current.seq, c, in_flight.op(), mesh);
  }

  // A CPU operation that completed inside its start (the worker blocks in MPI with a core
  // per rank) defines its result here and ends like any command that ran (run_command):
  // no tracking in flight, no hold of its ident, no poll. An operation to fail still goes
  // through InFlight, which reports it.
  bool finish_at_start(Pending& op, std::optional<Ref> result) {
    if (!op.done_at_start()) return false;
    Outcome out = op.take();
    if (result) {
      if (out.broken)
        env.define(*result, *out.broken);
      else
        env.define(*result, std::move(out.tensor));
    }
    return true;
  }

  void run(Collective& c) {
    WorkerMesh& mesh = *env.mesh(c.mesh, "mesh").mesh;
    words.posting(monitor(), current.seq, c, mesh);
    const CollectiveOp op = operation(c);
    const bool reads = reads_input(mesh, op);
    const bool defines = defines_result(mesh, op);
    Input in = reads ? env.input(c.tensor) : Input(Tensor());
    detail::Footprint footprint{.stream = c.stream.id, .reads = {}, .writes = {}};
    if (reads) footprint.reads.push_back(c.tensor.id);
    if (defines) footprint.writes.push_back(c.result.id);
    if (c.inplace) footprint.writes.push_back(c.tensor.id);
    const std::optional<Ref> result = defines ? std::optional<Ref>(c.result) : std::nullopt;
    // A barrier moves no tensor: it runs over MPI whatever its mesh is placed on.
    if (c.kind != CollectiveKind::Barrier && c.factory.device().is_accelerator()) {
      in_flight.start(start_collective_device(mesh, op, std::move(in), c.factory, c.stream.id), result, current.seq,
                      "Collective", c.ident, std::nullopt, std::move(footprint));
    } else {
      std::unique_ptr<Pending> p = start_collective(mesh, op, std::move(in), c.factory, in_flight.cpu_completion());
      words.posted(monitor(), current.seq, c, *p, mesh);
      if (finish_at_start(*p, result)) return;
      in_flight.start(std::move(p), result, current.seq, "Collective", c.ident,
                      c.kind == CollectiveKind::Barrier ? 0 : c.factory.nbytes(), std::move(footprint));
      reporter.hold(c.ident);
      return;
    }
    reporter.hold(c.ident);
    words.posted(monitor(), current.seq, c, in_flight.op(), mesh);
  }

  void run(SendTensor& c) {
    words.posting(monitor(), current.seq, c, opt.rank);
    const bool sends = c.from_ranks.contains(opt.rank);
    const bool receives = c.to_ranks.contains(opt.rank);
    Input in = sends ? env.input(c.tensor) : Input(Tensor());
    const std::optional<Ref> result = receives ? std::optional<Ref>(c.result) : std::nullopt;
    detail::Footprint footprint{.stream = c.stream.id, .reads = {}, .writes = {}};
    if (sends) footprint.reads.push_back(c.tensor.id);
    if (receives) footprint.writes.push_back(c.result.id);
    if (c.factory.device().is_accelerator()) {
      in_flight.start(start_send_tensor_device(opt.p2p, opt.rank, c.from_ranks, c.to_ranks, std::move(in), c.factory,
                                               c.stream.id, c.to_order, c.from_order),
                      result, current.seq, "SendTensor", c.ident, std::nullopt, std::move(footprint));
    } else {
      std::unique_ptr<Pending> op = start_send_tensor(opt.p2p, opt.rank, c.from_ranks, c.to_ranks, std::move(in),
                                                      c.factory, in_flight.cpu_completion(), c.to_order, c.from_order);
      words.posted(monitor(), current.seq, c, *op, opt.rank);
      if (finish_at_start(*op, result)) return;
      in_flight.start(std::move(op), result, current.seq, "SendTensor", c.ident, c.factory.nbytes(),
                      std::move(footprint));
      reporter.hold(c.ident);
      return;
    }
    reporter.hold(c.ident);
    words.posted(monitor(), current.seq, c, in_flight.op(), opt.rank);
  }

  void run(BorrowCreate& c) { borrows.create(c, env); }
  void run(BorrowFirstUse& c) { borrows.first_use(c, env); }
  void run(BorrowDrop& c) { borrows.drop(c, env); }

  void run(DeleteRefs& c) {
    for (Ref r : c.refs) {
      env.undefine(r.id);
      if (r.id == kept_context.mesh || r.id == kept_context.stream) kept_context.valid = false;
    }
  }

  void run(CommandGroup&) {}     // flattened when it arrives (Inbox)
  void run(DefineRecording&) {}  // kept by the Inbox
  void run(CallRecording&) {}    // run in place (begin_replay)

  void run(RequestStatus& c) { reporter.asked(c.ident, env.size()); }

  void run(Exit& c) { exit = c.restart ? WorkerExit::Restart : WorkerExit::Shutdown; }

  // A command that failed outside an invocation's body: its result is the marker, and the
  // controller hears of it (ident 0, tied to no invocation, is raised at the next synchronize).
  void fail_command(const Command& command, std::string_view message, std::string type) {
    poison_result(command, DependentOnError{ident_of(command)});
    MESHRT_LOG(error) << "rank " << opt.rank << ": " << name(command) << " failed: " << message;
    reporter.reply(RemoteFunctionFailed{.ident = ident_of(command),
                                        .error = fmt::format("{} failed: {}", name(command), message),
                                        .rank = opt.rank,
                                        .function = std::string(name(command)),
                                        .exception_type = std::move(type)});
    current.failed = true;
  }

  // Runs `command`: true when it went in flight (a collective or send, which completes, or
  // fails, in the loop's polls); current.failed and current.on_device say how it ended
  // otherwise. A failure outside an invocation's body (a collective that cannot start, a bad ref)
  // is logged and reported with the command's ident (Reduce, SendTensor: the controller
  // names its call site) or 0, so it is never silent.
  bool run_command(Command& command) {
    current.failed = false;
    current.on_device = false;
    // MESHRT_TRACE on CUDA: the device work this command enqueues on its stream is one span.
    const std::optional<std::uint64_t> traced = detail::trace::enabled() ? stream_of(command) : std::nullopt;
    if (traced) device::trace_command_begin(*traced);
    struct CloseSpan {
      std::optional<std::uint64_t> stream;
      ~CloseSpan() {
        if (stream) device::trace_command_end(*stream);
      }
    } close_span{traced};
    try {
      const bool started = std::holds_alternative<Reduce>(command) || std::holds_alternative<SendTensor>(command) ||
                           std::holds_alternative<Collective>(command);
      execute(command);
      if (started && in_flight.active()) return true;
    } catch (const std::exception& e) {
      fail_command(command, e.what(), boost::core::demangle(typeid(e).name()));
    } catch (...) {
      fail_command(command, "an exception not derived from std::exception", "unknown");
    }
    complete(ident_of(command));
    return false;
  }

  // Runs one queued command (a replay: begin_replay), in place in the queue. Its end is
  // told to the flight recorder with the next command's start (one lock and one clock read
  // for both), or by settle() when the run of commands stops.
  void step(detail::Inbox::Queued& q) {
    current.seq = q.seq;
    if (q.seq && ended.seq) {
      monitor().finished_then_running(std::exchange(ended.seq, 0), ended.failed, q.seq);
    } else if (q.seq) {
      monitor().running(q.seq);
    }
    if (run_command(q.command)) return;
    if (q.seq) {
      if (current.on_device) {
        monitor().on_device(q.seq);
      } else {
        ended = {.seq = q.seq, .failed = current.failed};
      }
    }
  }
  // The last command that ended, not yet finished in the flight recorder (0: none).
  struct Ended {
    std::uint64_t seq = 0;
    bool failed = false;
  } ended;
  void settle() {
    if (ended.seq) monitor().finished(std::exchange(ended.seq, 0), ended.failed);
  }

  void begin_replay(detail::Inbox::Queued q) {
    settle();
    current.seq = q.seq;
    monitor().running(q.seq);
    replay.emplace(Replay{.q = std::move(q)});
  }

  // Runs the replay's next commands: false when the next one waits for the operation in
  // flight, true when the replay ended or the status interval passed.
  bool advance_replay() {
    Replay& r = *replay;
    detail::Recording& recording = *r.q.recording;
    const auto& call = *std::get_if<CallRecording>(&r.q.command);
    const std::size_t steps = recording.steps();
    current.seq = r.q.seq;
    while (r.next < steps) {
      Command& command = recording.step(r.next, call);
      if (in_flight.active() && !in_flight.admits(command)) {
        pass_replayed();
        return false;
      }
      const std::uint32_t place = recording.place(r.next++);
      if (place != 0)
        monitor().replay_step(r.q.seq, place, [&](detail::CommandRecord& slot) { record(command, slot); });
      run_command(command);
      if (current.failed) {
        r.failed = true;
        monitor().replay_failed(r.q.seq);
      }
      // A collective that completed inside its call is finished at once.
      if (in_flight.active()) in_flight.poll(env, reporter);
      if (r.next < steps && reporter.due()) {
        pass_replayed();
        return true;
      }
    }
    pass_replayed();
    // A call's host tasks still running finish the entry again when they end (Reporter).
    monitor().replay_finished(r.q.seq, r.failed);
    replay.reset();
    return true;
  }

  void pass_replayed() {
    if (replay->passed != 0) reporter.passed(std::exchange(replay->passed, 0));
  }

  // A device fault (device::device_fault) loses the device's context, as an illegal
  // address loses a GPU's: nothing on this rank's device can be trusted, and its peers
  // would wait in collectives it cannot join. So the rank ends the job, named, as for a
  // crash.
  [[noreturn]] void device_fault_ends_rank(const std::string& fault) {
    const std::string report = fmt::format(
        "meshrt: rank {} on {}: device fault: {}; the device's context is lost (as after an illegal address on a "
        "GPU), so this rank cannot go on: ending the job (MPI_Abort) so that no rank waits for it. What it did "
        "last:\n{}",
        opt.rank, monitor().host(), fault, monitor().recent(16));
    std::fputs(report.c_str(), stderr);
    std::fflush(stderr);
    detail::end_job_after_report(1);
  }

  WorkerExit loop() {
    // Worker 0 shares rank 0 with the controller: it sleeps on the doorbell the
    // controller rings with each command it sends here, instead of yielding a core the
    // controller needs (common/backoff.hpp, kDoorbell). A worker with a core of its own
    // yields longer before it sleeps (kOwnCore), one on an oversubscribed node less
    // (kControl): worker_idle_policy.
    const bool doorbell = opt.rank == control::kControllerRank;
    detail::Backoff backoff(detail::worker_idle_policy(opt));
    detail::Backoff flight(detail::kInFlight);
    while (!exit) {
      // Read before the poll: a command sent after it rings past `rung`, and the wait
      // below returns at once.
      const std::uint64_t rung = doorbell ? channel->rings(control::Tag::Command) : 0;
      bool worked = inbox.receive(reporter);
      if (reporter.receive_tree()) worked = true;
      if (reporter.holding() && reporter.poll(env)) worked = true;
      if (in_flight.active() && in_flight.poll(env, reporter)) worked = true;
      device::release_completed();
      if (std::optional<std::string> fault = device::device_fault()) device_fault_ends_rank(*fault);
      // While a collective or send is in flight, the commands that do not depend on it run.
      // A replay's commands come before the queue's.
      while ((replay || !inbox.empty()) && !exit) {
        if (!replay && inbox.front_is_replay()) {
          begin_replay(inbox.pop());
          worked = true;
        }
        if (replay) {
          if (!advance_replay()) break;
        } else if (!in_flight.active() || in_flight.admits(inbox.front())) {
          step(inbox.next());
          inbox.drop();
        } else {
          break;
        }
        worked = true;
        // A collective that completed inside its call (blocking in MPI) is finished at
        // once: the batch's next command runs without a turn's polls in between. The
        // status interval still ends the run, so long blocking commands still report.
        if (in_flight.active()) {
          settle();
          in_flight.poll(env, reporter);
        }
        if (reporter.due()) break;
      }
      settle();
      // Status when the worker moved: about once a second while busy, and at once when it
      // runs out of work, so a controller waiting on it rarely needs to ask (one message per
      // batch of commands).
      reporter.report(worked && inbox.empty() && !replay && !in_flight.active(), env.size());
      channel->reap();
      if (worked) {
        backoff.reset();
        flight.reset();
        continue;
      }
      if (in_flight.active()) {
        in_flight.pause(flight);
        continue;
      }
      // Idle with nothing in flight: the one time the device's memory is trimmed (a trim
      // may wait for the device, which a collective may hold up for a peer).
      device::trim_idle();
      if (doorbell) {
        backoff.pause([&](std::chrono::microseconds d) { channel->wait_ring(control::Tag::Command, rung, d); });
      } else {
        const mpi_session::LentTurn lent;  // the watch's turn at MPI below MPI_THREAD_MULTIPLE
        backoff.pause();
      }
    }
    reporter.finish(env, backoff);
    channel->drain(std::chrono::seconds(30));
    return *exit;
  }
};

Worker::Worker(WorkerOptions options) : impl_(std::make_unique<Impl>(options)) {}
Worker::~Worker() = default;

WorkerExit Worker::run() {
  const OnWorkerThread marked(impl_->opt.rank);
  return impl_->loop();
}

void Worker::serve(const WorkerOptions& first) {
  WorkerOptions options = first;
  for (;; ++options.epoch) {
    WorkerExit kind;
    {
      Worker worker(options);
      kind = worker.run();
    }
    if (kind == WorkerExit::Shutdown) return;
    // A fresh loop: the old one's values, meshes and communicators are gone.
    const std::shared_ptr<control::Transport> channel =
        options.transport ? options.transport : control::mpi_transport(options.control);
    channel->send(control::kControllerRank, control::Tag::Reply,
                  std::make_shared<control::Bytes>(protocol::encode(protocol::Reply{protocol::Restarted{}})));
    channel->drain(std::chrono::seconds(30));
  }
}

detail::BackoffPolicy detail::worker_idle_policy(const WorkerOptions& options) {
  if (options.rank == control::kControllerRank) return kDoorbell;
  return options.block_in_mpi ? kOwnCore : kControl;
}

bool worker_blocks_in_mpi(std::string_view setting, int ranks_on_node, long online_cores) {
  if (boost::algorithm::iequals(setting, "auto")) return ranks_on_node <= online_cores;
  if (const std::optional<bool> b = settings::parse_bool(setting)) return *b;
  throw UsageError(fmt::format(
      "MESHRT_WORKER_BLOCKING={}: expected auto, or 1/0 (true/false, yes/no, on/off) to force the blocking MPI call on "
      "or off",
      setting));
}

}  // namespace meshrt
