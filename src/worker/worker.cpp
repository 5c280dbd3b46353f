#include "meshrt/worker.hpp"

#include <fmt/format.h>

#include <boost/core/demangle.hpp>

#include <chrono>
#include <deque>
#include <optional>
#include <typeinfo>
#include <unordered_map>
#include <variant>

#include "common/checks.hpp"
#include "meshrt/comm.hpp"
#include "meshrt/device.hpp"
#include "meshrt/functions.hpp"
#include "meshrt/log.hpp"
#include "meshrt/protocol.hpp"
#include "worker/channel.hpp"
#include "worker/monitor.hpp"
#include "worker/streams.hpp"

namespace meshrt {
namespace {

using namespace protocol;
using Clock = std::chrono::steady_clock;

struct StreamValue {
  std::uint64_t id = 0;
  bool is_default = true;
  detail::StreamHandle handle;
};

// A worker's value for a ref: a tensor, the marker of a failed dependency, a mesh or a
// stream.
using EnvValue = std::variant<Tensor, DependentOnError, std::shared_ptr<WorkerMesh>, StreamValue>;

// Thrown while looking up the inputs of a command that depends on a failure: the
// command's outputs are re-marked silently (the controller already knows).
struct Poisoned {
  DependentOnError marker;
};

}  // namespace

struct Worker::Impl {
  explicit Impl(WorkerOptions o)
      : opt(o),
        channel(o.control),
        own_monitor(o.monitor ? nullptr : std::make_unique<detail::Monitor>(o.rank, 1000)),
        monitor(o.monitor ? *o.monitor : *own_monitor) {
    monitor.reset_queue();
  }

  WorkerOptions opt;
  detail::Channel channel;
  std::unique_ptr<detail::Monitor> own_monitor;
  detail::Monitor& monitor;
  std::unordered_map<std::uint64_t, EnvValue> env;
  struct Queued {
    std::uint64_t seq;
    Command command;
  };
  std::deque<Queued> queue;
  bool current_failed = false;
  std::uint64_t current_seq = 0;

  struct InFlight {
    std::unique_ptr<Pending> op;
    std::optional<Ref> result;  // defined when the operation completes
    std::uint64_t seq = 0;
  };
  std::optional<InFlight> in_flight;

  Ident first_uncompleted = 0;
  Ident last_status_sent = 0;
  Clock::time_point last_status_time = Clock::now();
  std::optional<WorkerExit> exit;
  detail::Bytes rx;

  // ------------------------------------------------------------------ replies

  void reply(const Reply& r) {
    auto bytes = std::make_shared<detail::Bytes>(encode(r));
    channel.send(detail::kControllerRank, detail::kReplyTag, std::move(bytes));
  }

  void send_status(bool force) {
    if (!force && first_uncompleted <= last_status_sent) return;
    reply(Status{first_uncompleted, static_cast<std::uint64_t>(env.size())});
    last_status_sent = first_uncompleted;
    last_status_time = Clock::now();
  }

  void report_failure(Ident ident, const std::string& function, const std::exception& e) {
    current_failed = true;
    MESHRT_LOG(info) << "function " << function << " (ident " << ident << ") failed: " << e.what();
    reply(RemoteFunctionFailed{ident, e.what(), opt.rank, function, boost::core::demangle(typeid(e).name())});
  }

  // ------------------------------------------------------------------ values

  void define(Ref r, EnvValue v) { env.insert_or_assign(r.id, std::move(v)); }

  const EnvValue& get(Ref r, std::string_view role) const {
    auto it = env.find(r.id);
    if (it == env.end()) {
      throw UsageError(fmt::format("rank {}: {} ref {} is not defined on this worker (deleted, or never sent here)",
                                   opt.rank, role, r.id));
    }
    return it->second;
  }

  template <class T>
  const T& get_as(Ref r, std::string_view role) const {
    const EnvValue& v = get(r, role);
    if (const auto* marker = std::get_if<DependentOnError>(&v)) throw Poisoned{*marker};
    if (const auto* t = std::get_if<T>(&v)) return *t;
    throw UsageError(fmt::format("rank {}: {} ref {} holds a value of another kind", opt.rank, role, r.id));
  }

  // A tensor input, or the marker that stands in for it.
  Input input(Ref r) const {
    const EnvValue& v = get(r, "tensor");
    if (const auto* marker = std::get_if<DependentOnError>(&v)) return *marker;
    if (const auto* t = std::get_if<Tensor>(&v)) return *t;
    throw UsageError(fmt::format("rank {}: ref {} is not a tensor", opt.rank, r.id));
  }

  // Replaces every Ref in an argument tree by its tensor.
  Value resolve(const Value& v) const {
    return v.map([this](const Value& leaf) -> Value {
      if (!leaf.is_ref()) return leaf;
      return Value(get_as<Tensor>(leaf.as_ref(), "argument"));
    });
  }

  CallContext context(Ref mesh_ref, Ref stream_ref) const {
    const StreamValue& stream = get_as<StreamValue>(stream_ref, "stream");
    if (mesh_ref.id == 0) return CallContext(opt.rank, {}, {}, stream.id, Device::cpu(), stream.handle.native());
    const auto& mesh = get_as<std::shared_ptr<WorkerMesh>>(mesh_ref, "mesh");
    // Kernels get this rank's own device of the kind the mesh is placed on.
    const auto kind = mesh_kinds.find(mesh_ref.id);
    const Device where = kind == mesh_kinds.end() || kind->second == Device::Kind::Cpu
                             ? Device::cpu()
                             : device::rank_device(kind->second);
    // A cuda mesh's kernels launch on the CUDA stream of this meshrt stream (never the
    // legacy default stream); CPU meshes keep the handle's (a CUDA stream only for the
    // non-default streams of a cuda job), emulated ones enqueue through the device layer.
    void* native = where.is_cuda()  ? stream.handle.device(Device::Kind::Cuda).native()
                   : where.is_cpu() ? stream.handle.native()
                                    : nullptr;
    return CallContext(opt.rank, mesh->names(), mesh->coordinates(), stream.id, where, native);
  }
  std::unordered_map<std::uint64_t, Device::Kind> mesh_kinds;

  // ------------------------------------------------------------------ commands

  void execute(Command& command) {
    std::visit([this](auto& c) { run(c); }, command);
  }

  void run(CreateDeviceMesh& c) {
    define(c.result, std::make_shared<WorkerMesh>(c.names, c.ranks, opt.world));
    mesh_kinds[c.result.id] = c.device;
  }

  void run(CreateStream& c) {
    define(c.result, StreamValue{c.result.id, c.is_default, detail::make_stream(c.is_default, c.result.id)});
  }

  template <class Body>
  void invocation(Ident ident, const std::string& function, const std::vector<Ref>& results,
                  const std::vector<Ref>& mutates, Body&& body) {
    try {
      body();
    } catch (const Poisoned& p) {
      for (Ref r : results) define(r, p.marker);
      for (Ref r : mutates) define(r, p.marker);
    } catch (const std::exception& e) {
      for (Ref r : results) define(r, DependentOnError{ident});
      for (Ref r : mutates) define(r, DependentOnError{ident});
      report_failure(ident, function, e);
    }
    first_uncompleted = std::max(first_uncompleted, ident + 1);
    monitor.completed_ident(first_uncompleted);
  }

  void run(CallFunction& c) {
    invocation(c.ident, c.function, c.results, c.mutates, [&] {
      CallContext ctx = context(c.mesh, c.stream);
      std::vector<Value> args;
      args.reserve(c.args.size());
      for (const Value& a : c.args) args.push_back(resolve(a));
      const functions::Function& fn = functions::lookup(c.function);
      Args kernel_args(c.function, std::move(args));
      std::vector<Tensor> outputs = fn.kernel(ctx, kernel_args);
      if (outputs.size() != c.results.size()) {
        throw UsageError(fmt::format("{} returned {} tensors on rank {}; its shape function declared {}", c.function,
                                     outputs.size(), opt.rank, c.results.size()));
      }
      for (std::size_t i = 0; i < outputs.size(); ++i) define(c.results[i], std::move(outputs[i]));
    });
  }

  void run(FetchValue& c) {
    const std::string function = c.function.value_or("fetch");
    invocation(c.ident, function, {}, c.mutates, [&] {
      Value value = resolve(c.value);
      if (c.function) {
        CallContext ctx = context(Ref{0}, c.stream);
        Args args(*c.function, std::vector<Value>{std::move(value)});
        std::vector<Tensor> outputs = functions::lookup(*c.function).kernel(ctx, args);
        value = outputs.size() == 1 ? Value(outputs[0]) : Value(Value::List(outputs.begin(), outputs.end()));
      }
      // Device tensors travel as host copies, made in the order of the fetch's device
      // stream (after the kernels that wrote them). TODO(issue 12): poll the copy's event
      // from the loop instead of waiting for it here.
      value = value.map([&c](const Value& leaf) {
        if (!leaf.is_tensor() || leaf.as_tensor().device().is_cpu()) return leaf;
        const Tensor& t = leaf.as_tensor();
        const device::Stream s = device::stream_for(c.stream.id, t.device());
        device::Fetch f = device::fetch(t, s);
        f.done.synchronize();
        if (auto error = s.error())
          throw SystemError(fmt::format("fetch of {}: device error: {}", t.to_string(), *error));
        return Value(std::move(f.host));
      });
      reply(FetchResult{c.ident, std::move(value)});
      // The controller counts a FetchResult as the invocation's completion on this rank:
      // no Status needs to follow it.
      last_status_sent = std::max(last_status_sent, c.ident + 1);
    });
  }

  void run(Reduce& c) {
    const auto& mesh = std::get<std::shared_ptr<WorkerMesh>>(get(c.mesh, "mesh"));
    // Until the collective is posted this rank may block in the first use of the
    // dimension's communicator, which needs every member of the mesh.
    std::vector<int> members;
    for (auto r : mesh->ranks()) members.push_back(static_cast<int>(r));
    monitor.describe(current_seq,
                     fmt::format("{} over '{}', joining (a dimension's first use sets up its "
                                 "communicator with every mesh member)",
                                 meshrt::name(c.reduction), c.dim),
                     std::move(members), c.factory.nbytes());
    Input in = input(c.tensor);
    // Accelerator tensors (and the factory of a broken one) go over the device layer's
    // communicators on the command's device stream.
    if (c.factory.device().is_accelerator()) {
      in_flight = InFlight{
          start_reduce_device(*mesh, c.dim, c.reduction, c.scatter, c.inplace, std::move(in), c.factory, c.stream.id),
          c.result};
      return;
    }
    in_flight =
        InFlight{start_reduce(*mesh, c.dim, c.reduction, c.scatter, c.inplace, std::move(in), c.factory), c.result};
  }

  void run(SendTensor& c) {
    monitor.describe(current_seq, "joining the send", peers_of(Command{c}), c.factory.nbytes());
    const bool sends = c.from_ranks.contains(opt.rank);
    const bool receives = c.to_ranks.contains(opt.rank);
    Input in = sends ? input(c.tensor) : Input(Tensor());
    const std::optional<Ref> result = receives ? std::optional<Ref>(c.result) : std::nullopt;
    if (c.factory.device().is_accelerator()) {
      in_flight = InFlight{
          start_send_tensor_device(opt.p2p, opt.rank, c.from_ranks, c.to_ranks, std::move(in), c.factory, c.stream.id),
          result};
      return;
    }
    in_flight =
        InFlight{start_send_tensor(opt.p2p, opt.rank, c.from_ranks, c.to_ranks, std::move(in), c.factory), result};
  }

  void finish_in_flight() {
    monitor.finished(in_flight->seq, false);
    Outcome out = in_flight->op->take();
    if (in_flight->result) {
      if (out.broken)
        define(*in_flight->result, *out.broken);
      else
        define(*in_flight->result, std::move(out.tensor));
    }
    in_flight.reset();
  }

  struct BorrowRecord {
    Ref from, to;
    detail::BorrowEvents events;
  };
  std::unordered_map<std::uint64_t, BorrowRecord> borrows;

  const detail::StreamHandle* stream_handle(Ref r) const {
    auto it = env.find(r.id);
    if (it == env.end()) return nullptr;
    const auto* s = std::get_if<StreamValue>(&it->second);
    return s ? &s->handle : nullptr;
  }

  void run(BorrowCreate& c) {
    // The borrow shares the value (or its failure marker). On the CPU streams run in
    // order; on CUDA an event orders the borrower after the origin's work.
    define(c.result, get(c.tensor, "borrowed tensor"));
    const detail::StreamHandle* from = stream_handle(c.from_stream);
    borrows[c.result.id] =
        BorrowRecord{c.from_stream, c.to_stream, from ? detail::borrow_create(*from) : detail::BorrowEvents{}};
  }
  void run(BorrowFirstUse& c) {
    auto it = borrows.find(c.borrow.id);
    if (it == borrows.end()) return;
    if (const detail::StreamHandle* to = stream_handle(it->second.to)) detail::borrow_first_use(it->second.events, *to);
  }
  void run(BorrowDrop& c) {
    auto it = borrows.find(c.borrow.id);
    if (it == borrows.end()) return;
    const detail::StreamHandle* from = stream_handle(it->second.from);
    const detail::StreamHandle* to = stream_handle(it->second.to);
    if (from && to) detail::borrow_drop(it->second.events, *from, *to);
    borrows.erase(it);
  }

  void run(DeleteRefs& c) {
    for (Ref r : c.refs) {
      env.erase(r.id);
      mesh_kinds.erase(r.id);
    }
  }

  void run(CommandGroup&) {}  // flattened when it arrives (enqueue)

  void run(RequestStatus& c) {
    first_uncompleted = std::max(first_uncompleted, c.ident + 1);
    monitor.completed_ident(first_uncompleted);
    send_status(true);
  }

  void run(Exit& c) { exit = c.restart ? WorkerExit::Restart : WorkerExit::Shutdown; }

  // Runs one command; a failure outside any invocation (a broken collective set-up, a
  // bad ref) is logged and reported with ident 0 so it is never silent.
  void step(Queued q) {
    Command& command = q.command;
    current_seq = q.seq;
    monitor.running(q.seq);
    current_failed = false;
    try {
      execute(command);
      if (in_flight) {
        in_flight->seq = q.seq;
        monitor.describe(q.seq, in_flight->op->describe(), peers_of(command), 0);
        return;
      }
    } catch (const Poisoned&) {
      // A mesh or stream that depends on a failure: nothing to run.
    } catch (const std::exception& e) {
      MESHRT_LOG(error) << "rank " << opt.rank << ": " << name(command) << " failed: " << e.what();
      // Ident 0: tied to no invocation; the controller raises it at the next synchronize.
      reply(RemoteFunctionFailed{0, fmt::format("{} failed: {}", name(command), e.what()), opt.rank,
                                 std::string(name(command)), boost::core::demangle(typeid(e).name())});
      current_failed = true;
    }
    monitor.finished(q.seq, current_failed);
  }

  // World ranks taking part in a collective or send with this rank.
  std::vector<int> peers_of(const Command& command) const {
    std::vector<int> peers;
    if (const auto* r = std::get_if<Reduce>(&command)) {
      const auto& mesh = std::get<std::shared_ptr<WorkerMesh>>(get(r->mesh, "mesh"));
      peers = mesh->line_world_ranks(mesh->dim_index(r->dim));
    } else if (const auto* s = std::get_if<SendTensor>(&command)) {
      for (std::int64_t i = 0; i < s->from_ranks.len(); ++i) {
        if (s->from_ranks[i] == opt.rank) peers.push_back(static_cast<int>(s->to_ranks[i]));
        if (s->to_ranks[i] == opt.rank) peers.push_back(static_cast<int>(s->from_ranks[i]));
      }
    }
    return peers;
  }

  // What the flight recorder keeps of a command.
  static detail::CommandRecord record_of(const Command& command) {
    detail::CommandRecord r;
    r.kind = name(command).data();
    std::visit(
        [&r](const auto& c) {
          using C = std::decay_t<decltype(c)>;
          if constexpr (std::is_same_v<C, CallFunction>) {
            r.ident = c.ident;
            r.name = c.function;
            r.mesh = c.mesh.id;
            r.stream = c.stream.id;
            if (!c.results.empty()) r.result = c.results.front().id;
          } else if constexpr (std::is_same_v<C, FetchValue>) {
            r.ident = c.ident;
            r.name = c.function.value_or("");
            r.stream = c.stream.id;
          } else if constexpr (std::is_same_v<C, Reduce>) {
            r.name =
                std::string(meshrt::name(c.reduction)) + (c.scatter ? " scatter" : "") + (c.inplace ? " in place" : "");
            r.result = c.result.id;
            r.mesh = c.mesh.id;
            r.stream = c.stream.id;
            r.dim = c.dim;
            r.bytes = c.factory.nbytes();
          } else if constexpr (std::is_same_v<C, SendTensor>) {
            r.result = c.result.id;
            r.stream = c.stream.id;
            r.bytes = c.factory.nbytes();
          } else if constexpr (std::is_same_v<C, RequestStatus>) {
            r.ident = c.ident;
          } else if constexpr (std::is_same_v<C, CreateDeviceMesh> || std::is_same_v<C, CreateStream> ||
                               std::is_same_v<C, BorrowCreate>) {
            r.result = c.result.id;
          }
        },
        command);
    return r;
  }

  // Queues a command (a group's commands one by one) and records it.
  void enqueue(Command command) {
    if (auto* group = std::get_if<CommandGroup>(&command)) {
      for (Command& c : group->commands) enqueue(std::move(c));
      return;
    }
    const std::uint64_t seq = monitor.queued(record_of(command));
    queue.push_back(Queued{seq, std::move(command)});
  }

  bool receive() {
    bool any = false;
    while (channel.try_receive(detail::kControllerRank, detail::kCommandTag, rx)) {
      any = true;
      try {
        enqueue(decode_command(rx));
      } catch (const ProtocolError& e) {
        MESHRT_LOG(error) << "rank " << opt.rank << ": dropped an undecodable command of " << rx.size()
                          << " bytes: " << e.what();
        reply(RemoteFunctionFailed{0, fmt::format("undecodable command: {}", e.what()), opt.rank, "<protocol>",
                                   "meshrt::ProtocolError"});
      }
    }
    return any;
  }

  WorkerExit loop() {
    detail::Backoff backoff;
    const auto interval = std::chrono::duration<double>(opt.status_interval_seconds);
    while (!exit) {
      bool worked = receive();
      if (in_flight && in_flight->op->test()) {
        finish_in_flight();
        worked = true;
      }
      while (!in_flight && !queue.empty() && !exit) {
        Queued q = std::move(queue.front());
        queue.pop_front();
        step(std::move(q));
        worked = true;
      }
      // Status when the worker moved: about once a second while busy, and at once when it
      // runs out of work, so a controller waiting on it rarely needs to ask (one message per
      // batch of commands).
      if ((worked && queue.empty() && !in_flight) || Clock::now() - last_status_time > interval) send_status(false);
      channel.reap();
      if (worked)
        backoff.reset();
      else
        backoff.pause();
    }
    send_status(false);
    channel.drain(std::chrono::seconds(30));
    return *exit;
  }
};

Worker::Worker(WorkerOptions options) : impl_(std::make_unique<Impl>(options)) {}
Worker::~Worker() = default;

WorkerExit Worker::run() {
  return impl_->loop();
}

void Worker::serve(const WorkerOptions& options) {
  for (;;) {
    WorkerExit kind;
    {
      Worker worker(options);
      kind = worker.run();
    }
    if (kind == WorkerExit::Shutdown) return;
    // A fresh loop: the old one's values, meshes and communicators are gone.
    detail::Channel channel(options.control);
    channel.send(detail::kControllerRank, detail::kReplyTag,
                 std::make_shared<detail::Bytes>(protocol::encode(protocol::Reply{protocol::Restarted{}})));
    channel.drain(std::chrono::seconds(30));
  }
}

}  // namespace meshrt
