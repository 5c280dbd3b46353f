#include "meshrt/internal/worker.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cxxabi.h>

#include <boost/algorithm/string/predicate.hpp>
#include <boost/container/deque.hpp>
#include <boost/container/options.hpp>
#include <boost/core/demangle.hpp>

#include <algorithm>
#include <chrono>
#include <deque>
#include <map>
#include <optional>
#include <typeinfo>
#include <unordered_map>
#include <variant>

#include "common/backoff.hpp"
#include "common/checks.hpp"
#include "meshrt/functions.hpp"
#include "meshrt/internal/comm.hpp"
#include "meshrt/internal/control.hpp"
#include "meshrt/internal/device.hpp"
#include "meshrt/internal/protocol.hpp"
#include "meshrt/internal/settings.hpp"
#include "meshrt/log.hpp"
#include "worker/idle.hpp"
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
        channel(o.transport ? o.transport : control::mpi_transport(o.control)),
        own_monitor(o.monitor ? nullptr : std::make_unique<detail::Monitor>(o.rank, 1000)),
        monitor(o.monitor ? *o.monitor : *own_monitor) {
    monitor.reset_queue();
  }

  WorkerOptions opt;
  std::shared_ptr<control::Transport> channel;
  std::unique_ptr<detail::Monitor> own_monitor;
  detail::Monitor& monitor;
  std::unordered_map<std::uint64_t, EnvValue> env;
  // Nodes of deleted entries (their values released), reused by the next definitions. A
  // loop's results are defined one per command and deleted by the batch (the controller
  // sends small deletes together), so each batch freed as many nodes at once as the
  // thread's malloc cache does not hold, and the next definitions took malloc's slow path.
  std::vector<decltype(env)::node_type> spare_nodes;
  static constexpr std::size_t kSpareNodes = 256;
  struct Queued {
    std::uint64_t seq;
    Command command;
  };
  // The commands received and not yet started, in order. Not a std::deque: a Queued is
  // ~360 bytes, and libstdc++'s deque holds one such element per 512-byte node, so every
  // command cost a node's allocation and free, and the frees of a 256-command batch
  // overflowed the thread's malloc cache into malloc's slow path (8 B all_reduce under
  // callgrind: worker 0 ran ~580 fewer instructions per operation with a queue that
  // allocates per block). Boost's deque takes its block size: 32 commands (~11 KB) per
  // block. A vector consumed from its head did as well per command, but it kept the room
  // of its longest queue: a controller far ahead (meshrt-bench soak's slice loop queues
  // ~30,000 commands on a worker) left the worker 18 MB larger, where blocks go back as
  // they empty.
  using CommandQueue =
      boost::container::deque<Queued, void, boost::container::deque_options_t<boost::container::block_size<32u>>>;
  CommandQueue queue;
  static constexpr std::size_t kMaxQueued = 4096;  // receive() takes no more batches past it
  bool current_failed = false;
  std::uint64_t current_seq = 0;

  struct InFlight {
    std::unique_ptr<Pending> op;
    std::optional<Ref> result;  // defined when the operation completes
    std::uint64_t seq = 0;
    // On meshrt's comm thread (Completion::Auto at kThreadMinBytes and up, CPU tensors):
    // its Pending wakes a waiter in idle() the moment it completes.
    bool on_comm_thread = false;
    std::string kind;  // the command ("Reduce", "SendTensor"), for a failure report
    Ident ident = 0;   // the command's ident: complete (or failed) when the operation ends
  };
  std::optional<InFlight> in_flight;

  Ident first_uncompleted = 0;
  Ident last_status_sent = 0;
  Clock::time_point last_status_time = Clock::now();
  std::optional<WorkerExit> exit;
  control::Bytes rx;
  Clock::time_point arrived{};  // when the message being queued came

  // ------------------------------------------------------------------ replies

  void send_reply(const Reply& r) {
    auto bytes = std::make_shared<control::Bytes>(encode(r));
    channel->send(control::kControllerRank, control::Tag::Reply, std::move(bytes));
    // With the tree only failures and fetch results take this path (counted_direct).
    if (tree) counted_direct();
  }

  // A device fetch whose copies are still in flight: its FetchResult goes once every
  // copy's event completed (polled by the loop, poll_outgoing).
  struct PendingFetch {
    Ident ident = 0;
    std::string function;
    std::vector<Ref> mutates;
    Value value;  // device leaves already replaced by their pinned host copies
    std::vector<std::pair<device::Event, device::Stream>> copies;
  };
  // Replies behind a pending fetch wait in order: the controller counts a FetchResult or a
  // failure for ident i as "everything up to i done on this rank" (controller/completion),
  // so nothing that names a later ident may overtake the fetch's own result.
  std::deque<std::variant<PendingFetch, Reply>> outgoing;

  void reply(const Reply& r) {
    if (outgoing.empty()) {
      send_reply(r);
    } else {
      outgoing.emplace_back(r);
    }
  }

  // What Status may claim: never past a fetch whose result has not been sent
  // (DESIGN section 3's completion rule: the fetch's value must be there when it completes).
  Ident reportable() const {
    for (const auto& o : outgoing) {
      if (const auto* f = std::get_if<PendingFetch>(&o)) return std::min(first_uncompleted, f->ident);
    }
    return first_uncompleted;
  }

  void send_status(bool force) {
    if (tree) return;  // the subtree's report goes up the tree (report_up)
    const Ident done = reportable();
    if (!force && done <= last_status_sent) return;
    // A Status passes held replies: it claims nothing at or past the first pending fetch,
    // and every held reply names an ident at or past it.
    send_reply(Status{.first_uncompleted_ident = done, .live_values = static_cast<std::uint64_t>(env.size())});
    last_status_sent = std::max(last_status_sent, done);
    last_status_time = Clock::now();
  }

  void report_failure(Ident ident, const std::string& function, const std::exception& e) {
    report_failure(ident, function, e.what(), boost::core::demangle(typeid(e).name()));
  }
  void report_failure(Ident ident, const std::string& function, const std::string& message, const std::string& type) {
    current_failed = true;
    MESHRT_LOG(info) << "function " << function << " (ident " << ident << ") failed: " << message;
    reply(RemoteFunctionFailed{
        .ident = ident, .error = message, .rank = opt.rank, .function = function, .exception_type = type});
  }

  // Reduce and SendTensor carry an ident like an invocation: reported past once they end.
  void complete(Ident ident) {
    if (ident == 0) return;
    first_uncompleted = std::max(first_uncompleted, ident + 1);
    monitor.completed_ident(first_uncompleted);
  }
  // A Reduce or SendTensor that failed before it started: its result (on this rank) is
  // the marker, so what depends on it is poisoned rather than undefined.
  void poison_result(const Command& command, DependentOnError marker) {
    if (const auto* r = std::get_if<Reduce>(&command)) define(r->result, marker);
    if (const auto* s = std::get_if<SendTensor>(&command); s && s->to_ranks.contains(opt.rank))
      define(s->result, marker);
  }
  static Ident ident_of(const Command& command) {
    if (const auto* r = std::get_if<Reduce>(&command)) return r->ident;
    if (const auto* s = std::get_if<SendTensor>(&command)) return s->ident;
    return 0;
  }

  // ------------------------------------------------------------------ fan-in
  // docs/ARCHITECTURE.md section 8. With a status tree this rank reports, instead of its
  // own Status, the minimum first-uncompleted ident of its subtree to its parent: once
  // the subtree has passed the last RequestStatus it ran (the controller sends that to
  // every worker, so every node of the tree answers it once), and about once a second
  // when the minimum moved; not at every move, which would triple the controller's
  // receives per fetch (a step moves it at the call, the reduction and the RequestStatus).
  // Failures and fetch results still go straight to the controller, as one message
  // gains nothing from a hop; but a report through a parent can overtake a failure sent
  // directly (MPI orders per sender only), and a Status past a failed invocation that
  // arrives first resolves a value the failure must break (section 3.3). So each report
  // counts, per rank, the direct replies sent so far, and the controller holds a report
  // until those have arrived.
  const bool tree = opt.status_parent != kNoStatusTree;
  const control::Tag tree_tag = control::tree_status_tag(opt.epoch);
  // Per child, the minimum its subtree last reported (0 until it reports: nothing
  // below a silent child counts as complete). Fresh each session.
  std::vector<std::pair<int, Ident>> child_min = [this] {
    std::vector<std::pair<int, Ident>> c;
    for (int r : opt.status_children) c.emplace_back(r, 0);
    return c;
  }();
  std::map<int, std::uint64_t> direct_unreported;  // (rank, direct replies sent) not yet passed up
  std::uint64_t direct_sent = 0;
  Ident asked = 0;           // the highest RequestStatus this rank ran
  bool ask_pending = false;  // not yet answered up the tree
  Ident tree_last_sent = 0;

  void counted_direct() { direct_unreported[opt.rank] = ++direct_sent; }

  Ident subtree_min() const {
    Ident m = reportable();  // never past this rank's pending fetch (reportable)
    for (const auto& [rank, v] : child_min) m = std::min(m, v);
    return m;
  }

  // Takes the children's reports; false when there were none.
  bool receive_tree() {
    bool any = false;
    int from = -1;
    while (channel->try_receive(control::kAnySource, tree_tag, rx, &from)) {
      any = true;
      try {
        const Reply r = decode_reply(rx);
        const auto* t = std::get_if<TreeStatus>(&r);
        if (t == nullptr) throw ProtocolError(fmt::format("expected a TreeStatus, found {}", name(r)));
        if (t->epoch != opt.epoch) continue;  // a child's earlier session: stale
        auto child =
            std::find_if(child_min.begin(), child_min.end(), [from](const auto& c) { return c.first == from; });
        if (child == child_min.end()) {
          throw ProtocolError(fmt::format("rank {} reports to rank {}, which is not its parent (children: {})", from,
                                          opt.rank, fmt::join(opt.status_children, ",")));
        }
        child->second = std::max(child->second, t->first_uncompleted_ident);
        for (std::size_t i = 0; i < t->direct_ranks.size(); ++i) {
          auto& c = direct_unreported[t->direct_ranks[i]];
          c = std::max(c, t->direct_counts[i]);
        }
      } catch (const ProtocolError& e) {
        MESHRT_LOG(error) << "rank " << opt.rank << ": dropped a status report from rank " << from << ": " << e.what();
      }
    }
    return any;
  }

  void report_up(bool timer) {
    const Ident m = subtree_min();
    if (ask_pending && m > asked) {
      ask_pending = false;
    } else if (!(timer && m > tree_last_sent)) {
      return;
    }
    TreeStatus t{.first_uncompleted_ident = m, .epoch = opt.epoch, .direct_ranks = {}, .direct_counts = {}};
    for (const auto& [rank, count] : direct_unreported) {
      t.direct_ranks.push_back(rank);
      t.direct_counts.push_back(count);
    }
    direct_unreported.clear();
    auto bytes = std::make_shared<control::Bytes>(encode(Reply{std::move(t)}));
    if (opt.status_parent == kStatusToController) {
      channel->send(control::kControllerRank, control::Tag::Reply, std::move(bytes));
    } else {
      channel->send(opt.status_parent, tree_tag, std::move(bytes));
    }
    tree_last_sent = m;
    last_status_time = Clock::now();
  }

  // ------------------------------------------------------------------ values

  void define(Ref r, EnvValue v) {
    if (spare_nodes.empty()) {
      env.insert_or_assign(r.id, std::move(v));
      return;
    }
    if (auto it = env.find(r.id); it != env.end()) {
      it->second = std::move(v);
      return;
    }
    auto node = std::move(spare_nodes.back());
    spare_nodes.pop_back();
    node.key() = r.id;
    node.mapped() = std::move(v);
    env.insert(std::move(node));
  }
  void undefine(std::uint64_t id) {
    auto node = env.extract(id);
    if (node.empty()) return;
    node.mapped() = EnvValue();  // the value goes now, the node stays for the next one
    if (spare_nodes.size() < kSpareNodes) spare_nodes.push_back(std::move(node));
  }

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
    // CPU kernels get no native stream: making one would create a CUDA context for a
    // CPU-only program (DESIGN section 9).
    if (mesh_ref.id == 0) return CallContext(opt.rank, {}, {}, {}, stream.id, Device::cpu(), nullptr);
    const auto& mesh = get_as<std::shared_ptr<WorkerMesh>>(mesh_ref, "mesh");
    // Kernels get this rank's own device of the kind the mesh is placed on.
    const auto kind = mesh_kinds.find(mesh_ref.id);
    const Device where = kind == mesh_kinds.end() || kind->second == Device::Kind::Cpu
                             ? Device::cpu()
                             : device::rank_device(kind->second);
    // A cuda mesh's kernels launch on the CUDA stream of this meshrt stream (never the
    // legacy default stream); CPU meshes get none (no CUDA context for CPU work), emulated
    // ones enqueue through the device layer.
    void* native = where.is_cuda() ? stream.handle.device(Device::Kind::Cuda).native() : nullptr;
    return CallContext(opt.rank, mesh->names(), mesh->coordinates(), mesh->ranks().sizes(), stream.id, where, native);
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
    auto fail = [&](DependentOnError marker) {
      for (Ref r : results) define(r, marker);
      for (Ref r : mutates) define(r, marker);
    };
    try {
      body();
    } catch (const Poisoned& p) {
      if (p.marker.ident != 0) {
        fail(p.marker);  // the controller knows that invocation failed
      } else {
        // The input failed outside any invocation (a collective or send that failed in
        // flight): the controller cannot trace that, so this invocation reports it.
        fail(DependentOnError{ident});
        report_failure(ident, function,
                       fmt::format("an input on rank {} failed outside any invocation (a collective or send; "
                                   "its error was reported when it failed)",
                                   opt.rank),
                       "meshrt::RemoteError");
      }
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
      // What the controller expects (its shape function on the inputs' metas), computed
      // before the kernel runs: a mutating kernel may change its inputs.
      const Signature& expected = expected_signature(fn, kernel_args, ctx.device());
      std::vector<Tensor> outputs = fn.kernel(ctx, kernel_args);
      check_outputs(c.function, expected, outputs);
      for (std::size_t i = 0; i < outputs.size(); ++i) define(c.results[i], std::move(outputs[i]));
    });
  }

  // The last signature each function's shape function gave on this worker, with the
  // argument metas and device it was given: a program calls the same function with the
  // same metas in loops, and running the shape function again for every output check
  // cost ~2,400 instructions per call, half of a call's cost on the worker (meshrt-bench
  // soak under callgrind). Shape functions are pure (the controller and every worker
  // run them on the same metas and must agree), so a hit is the same answer.
  struct Inferred {
    ArgMetas args;
    Signature signature;
  };
  std::unordered_map<const functions::Function*, Inferred> inferred;

  // Whether `v` (an argument, tensors in it) has the metas `meta` (what the shape function
  // saw): without building the metas.
  static bool same_meta(const Value& meta, const Value& v) {
    if (v.is_tensor()) return meta.is_meta() && meta.as_meta() == v.as_tensor().meta();
    if (v.is_list()) {
      if (!meta.is_list() || meta.as_list().size() != v.as_list().size()) return false;
      for (std::size_t i = 0; i < v.as_list().size(); ++i) {
        if (!same_meta(meta.as_list()[i], v.as_list()[i])) return false;
      }
      return true;
    }
    if (v.is_dict()) {
      if (!meta.is_dict() || meta.as_dict().size() != v.as_dict().size()) return false;
      for (std::size_t i = 0; i < v.as_dict().size(); ++i) {
        if (meta.as_dict()[i].first != v.as_dict()[i].first ||
            !same_meta(meta.as_dict()[i].second, v.as_dict()[i].second))
          return false;
      }
      return true;
    }
    return meta == v;
  }

  const Signature& expected_signature(const functions::Function& fn, const Args& args, const Device& device) {
    if (auto it = inferred.find(&fn); it != inferred.end()) {
      const ArgMetas& seen = it->second.args;
      bool same = seen.device() == device && seen.size() == args.size();
      for (std::size_t i = 0; same && i < args.size(); ++i) same = same_meta(seen.value(i), args.value(i));
      if (same) return it->second.signature;
    }
    std::vector<Value> metas;
    metas.reserve(args.size());
    for (std::size_t i = 0; i < args.size(); ++i) {
      metas.push_back(args.value(i).map(
          [](const Value& leaf) { return leaf.is_tensor() ? Value(leaf.as_tensor().meta()) : leaf; }));
    }
    ArgMetas seen(fn.name, std::move(metas), device);
    Signature signature = functions::infer(fn, seen);
    auto& entry = inferred.insert_or_assign(&fn, Inferred{std::move(seen), std::move(signature)}).first->second;
    return entry.signature;
  }

  // On the controller a device means "each rank's own device of this kind"
  // (docs/ARCHITECTURE.md section 7): an output matches its declared meta when shape, dtype
  // and device kind agree, and an accelerator output is on this rank's own device.
  static bool matches(const TensorMeta& got, const TensorMeta& want) {
    if (got.shape() != want.shape() || got.dtype() != want.dtype()) return false;
    if (got.device().kind() != want.device().kind()) return false;
    return got.device().is_cpu() || got.device() == device::rank_device(got.device().kind());
  }

  // A kernel's outputs must be what its shape function declared: the controller planned
  // every later command (collectives, sends, fetches) with those metas, and peers join
  // collectives with them.
  void check_outputs(const std::string& function, const Signature& expected, const std::vector<Tensor>& outputs) const {
    if (outputs.size() != expected.outputs.size()) {
      throw UsageError(fmt::format("{} returned {} tensors on rank {}; its shape function declared {}", function,
                                   outputs.size(), opt.rank, expected.outputs.size()));
    }
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      const TensorMeta& want = expected.outputs[i];
      const Tensor& got = outputs[i];
      if (!got.defined() || !matches(got.meta(), want)) {
        throw UsageError(fmt::format("{} returned on rank {} as output {}: expected {} (its shape function), found {}",
                                     function, opt.rank, i, want.to_string(),
                                     got.defined() ? got.meta().to_string() : "an undefined tensor"));
      }
    }
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
      // stream (after the kernels that wrote them) into pinned memory. The loop polls the
      // copies' events (poll_outgoing): later commands run meanwhile.
      PendingFetch pending{.ident = c.ident, .function = function, .mutates = c.mutates, .value = {}, .copies = {}};
      pending.value = value.map([&](const Value& leaf) {
        if (!leaf.is_tensor() || leaf.as_tensor().device().is_cpu()) return leaf;
        const Tensor& t = leaf.as_tensor();
        const device::Stream s = device::stream_for(c.stream.id, t.device());
        device::Fetch f = device::fetch(t, s);
        pending.copies.emplace_back(std::move(f.done), s);
        return Value(std::move(f.host));
      });
      if (pending.copies.empty()) {
        reply(FetchResult{.ident = c.ident, .value = std::move(pending.value)});
      } else {
        outgoing.emplace_back(std::move(pending));
      }
      // The controller counts a FetchResult as the invocation's completion on this rank:
      // no Status needs to follow it.
      last_status_sent = std::max(last_status_sent, c.ident + 1);
    });
  }

  // The flight recorder's words for the last Reduce, reused by a loop of the same
  // collective: formatting them cost ~5,000 instructions per collective, about as much
  // as the rest of this worker's part in an 8 B all_reduce (callgrind, meshrt-bench
  // runtime-collectives).
  struct ReduceWords {
    std::uint64_t mesh = 0;
    std::string dim;
    Reduction reduction = Reduction::Sum;
    bool scatter = false, inplace = false;
    std::uint64_t bytes = 0;
    Device::Kind kind = Device::Kind::Cpu;
    std::string joining, running;  // before and after the collective is posted
    std::vector<int> members, peers;
    bool matches(const Reduce& c) const {
      return !joining.empty() && mesh == c.mesh.id && dim == c.dim && reduction == c.reduction &&
             scatter == c.scatter && inplace == c.inplace && bytes == c.factory.nbytes() &&
             kind == c.factory.device().kind();
    }
  } reduce_words;

  // The same for the last SendTensor: a loop of the same send (a pipeline's to_mesh)
  // reuses its words and peers. Formatting them on every send, and copying the command to
  // find its peers, cost ~3,800 instructions, a fifth of worker 0's part in an 8 B
  // to_mesh (callgrind, meshrt-bench runtime-collectives).
  struct SendWords {
    NDSlice from = NDSlice::row_major({}), to = NDSlice::row_major({});
    std::vector<std::int64_t> order;
    std::uint64_t bytes = 0;
    Device::Kind kind = Device::Kind::Cpu;
    std::string running;  // set by step() once the send started
    std::vector<int> peers;
    bool matches(const SendTensor& c) const {
      return bytes == c.factory.nbytes() && kind == c.factory.device().kind() && from == c.from_ranks &&
             to == c.to_ranks && order == c.to_order;
    }
  } send_words;

  // Sends what is ready at the head of `outgoing`, in order; true when something went.
  bool poll_outgoing() {
    bool moved = false;
    while (!outgoing.empty()) {
      if (const auto* r = std::get_if<Reply>(&outgoing.front())) {
        send_reply(*r);
      } else if (!finish_fetch(std::get<PendingFetch>(outgoing.front()))) {
        break;
      }
      outgoing.pop_front();
      moved = true;
    }
    return moved;
  }

  // Sends a pending fetch's result (or its failure) once its copies completed; false
  // while one is still in flight. A faulted stream fails the fetch with the device's
  // message, as the copy's value cannot be trusted.
  bool finish_fetch(PendingFetch& f) {
    std::optional<std::string> error;
    try {
      for (const auto& [done, stream] : f.copies) {
        if (!done.query()) return false;
      }
      for (const auto& [done, stream] : f.copies) {
        if (auto e = stream.error()) {
          error = fmt::format("{} on rank {}: the copy to the host on {} failed: device error: {}", f.function,
                              opt.rank, stream.to_string(), *e);
          break;
        }
      }
    } catch (const std::exception& e) {
      error = fmt::format("{} on rank {}: polling the copy to the host failed: {}", f.function, opt.rank, e.what());
    }
    if (error) {
      for (Ref r : f.mutates) define(r, DependentOnError{f.ident});
      MESHRT_LOG(info) << "function " << f.function << " (ident " << f.ident << ") failed: " << *error;
      send_reply(RemoteFunctionFailed{.ident = f.ident,
                                      .error = std::move(*error),
                                      .rank = opt.rank,
                                      .function = f.function,
                                      .exception_type = "meshrt::SystemError"});
    } else {
      send_reply(FetchResult{.ident = f.ident, .value = std::move(f.value)});
    }
    return true;
  }

  void run(Reduce& c) {
    const auto& mesh = std::get<std::shared_ptr<WorkerMesh>>(get(c.mesh, "mesh"));
    // Until the collective is posted this rank may block in the first use of the
    // dimension's communicator, which needs every member of the mesh.
    if (!reduce_words.matches(c)) {
      ReduceWords w{.mesh = c.mesh.id,
                    .dim = c.dim,
                    .reduction = c.reduction,
                    .scatter = c.scatter,
                    .inplace = c.inplace,
                    .bytes = c.factory.nbytes(),
                    .kind = c.factory.device().kind()};
      w.joining =
          fmt::format("{} over '{}', joining (a dimension's first use sets up its communicator with every mesh member)",
                      meshrt::name(c.reduction), c.dim);
      for (auto r : mesh->ranks()) w.members.push_back(static_cast<int>(r));
      reduce_words = std::move(w);
    }
    // Once the same collective ran before, its communicator exists and nothing is left to
    // join: it is described as running from the start, and step() describes it again only
    // the first time, when it makes the running words (a collective that completes inside
    // its call is done before step() could).
    if (!reduce_words.running.empty())
      monitor.describe(current_seq, reduce_words.running, reduce_words.peers, c.factory.nbytes());
    else
      monitor.describe(current_seq, reduce_words.joining, reduce_words.members, c.factory.nbytes());
    Input in = input(c.tensor);
    // Accelerator tensors (and the factory of a broken one) go over the device layer's
    // communicators on the command's device stream.
    if (c.factory.device().is_accelerator()) {
      in_flight = InFlight{
          start_reduce_device(*mesh, c.dim, c.reduction, c.scatter, c.inplace, std::move(in), c.factory, c.stream.id),
          c.result};
      return;
    }
    in_flight = InFlight{
        start_reduce(*mesh, c.dim, c.reduction, c.scatter, c.inplace, std::move(in), c.factory, cpu_completion()),
        c.result};
    in_flight->on_comm_thread = on_comm_thread(c.factory.nbytes());
  }

  void run(SendTensor& c) {
    if (!send_words.matches(c)) {
      send_words = SendWords{.from = c.from_ranks,
                             .to = c.to_ranks,
                             .order = c.to_order,
                             .bytes = c.factory.nbytes(),
                             .kind = c.factory.device().kind()};
    }
    if (!send_words.running.empty())
      monitor.describe(current_seq, send_words.running, send_words.peers, c.factory.nbytes());
    else
      monitor.describe(current_seq, "joining the send", peers_of(c), c.factory.nbytes());
    const bool sends = c.from_ranks.contains(opt.rank);
    const bool receives = c.to_ranks.contains(opt.rank);
    Input in = sends ? input(c.tensor) : Input(Tensor());
    const std::optional<Ref> result = receives ? std::optional<Ref>(c.result) : std::nullopt;
    if (c.factory.device().is_accelerator()) {
      in_flight = InFlight{start_send_tensor_device(opt.p2p, opt.rank, c.from_ranks, c.to_ranks, std::move(in),
                                                    c.factory, c.stream.id, c.to_order),
                           result};
      return;
    }
    in_flight = InFlight{start_send_tensor(opt.p2p, opt.rank, c.from_ranks, c.to_ranks, std::move(in), c.factory,
                                           cpu_completion(), c.to_order),
                         result};
    in_flight->on_comm_thread = on_comm_thread(c.factory.nbytes());
  }

  // How this worker runs a CPU collective or send.
  // - Without the status tree, on a node with a core per rank: the blocking MPI call, on
  //   this thread. Commands wait behind a collective in flight anyway, and queries go to
  //   the watch thread, so all a loop could do meanwhile is send its once-a-second Status.
  //   Blocking saves the hand-off to the comm thread and back (two wake-ups per operation)
  //   and Open MPI's non-blocking set-up and test loop (libnbc: ~3,300 instructions for an
  //   8 B MPI_Iallreduce under callgrind). meshrt-bench runtime-collectives, 2 ranks,
  //   quiet, two interleaved runs each of the worker mode before (Auto) and this, both
  //   with the controller sleeping on worker 0's reply doorbell: all_reduce 8 B 5.4-7.4 ->
  //   4.4-4.6 us, 4 KiB 10.9-14.9 -> 6.1 us, 256 KiB 95-108 -> 68-69 us; all_gather
  //   256 KiB 36-46 -> 21-28 us; all_to_all 256 KiB 38-47 -> 21 us; to_mesh 256 KiB 43-45
  //   -> 28-35 us, 1 MiB 126-137 -> 100-138 us (MPI by hand 99-117), 2 MiB 231-247 ->
  //   184-243 us (183-229); 8 B all_gather and to_mesh level. Before the doorbell the
  //   controller's yielding beside worker 0 hid the difference ("the same figures",
  //   README).
  // - With the status tree (large jobs): Completion::Auto, so that a node keeps relaying
  //   its children's reports while a collective of its own is in flight.
  // - On a node with more ranks than cores (opt.block_in_mpi false: an oversubscribed CI
  //   machine or laptop): Completion::Auto, whose waits back off to sleeps, because a rank
  //   blocked in MPI for a late peer keeps polling (MPICH never yields) the core that peer
  //   needs. With blocking there, MPICH's 4-rank runtime_2x2 on 2 cores fell behind its
  //   own 300 ms timeout test once in six runs (none in six before).
  Completion cpu_completion() const { return !tree && opt.block_in_mpi ? Completion::Blocking : Completion::Auto; }
  bool on_comm_thread(std::size_t bytes) const {
    return cpu_completion() == Completion::Auto && bytes >= kThreadMinBytes;
  }

  // Whether the operation in flight moved: it completed (and is finished) or failed.
  bool poll_in_flight() {
    bool done = false;
    try {
      done = in_flight->op->test();
    } catch (...) {
      fail_in_flight();
      return true;
    }
    if (done) finish_in_flight();
    return done;
  }

  void finish_in_flight() {
    Outcome out;
    try {
      out = in_flight->op->take();
    } catch (...) {
      fail_in_flight();
      return;
    }
    monitor.finished(in_flight->seq, false);
    if (in_flight->result) {
      if (out.broken)
        define(*in_flight->result, *out.broken);
      else
        define(*in_flight->result, std::move(out.tensor));
    }
    complete(in_flight->ident);
    in_flight.reset();
  }

  // Between two polls of the loop while a collective is in flight and nothing else moved
  // (with the status tree or more ranks than cores; otherwise the worker blocks in the
  // call, cpu_completion).
  // Commands wait until it completes; the channel is still polled (status, queries).
  // - On the comm thread: wait in the Pending's idle() (a condition variable), which
  //   returns the moment the job is done, for at most kControl.max_sleep between polls:
  //   no spinning or yielding beside the comm thread and the peer ranks on a small machine.
  // - Non-blocking (MPI_I*, below kThreadMinBytes): it progresses only inside MPI calls,
  //   so kInFlight: spin 20 us, yield until 2 ms, then short sleeps (waited/32).
  // Measured with meshrt-bench runtime-collectives, 2 ranks, Open MPI 4.1 over shared
  // memory with single copy on, on the project's 2-core machine loaded by parallel builds
  // (load 4-8), medians of 3 interleaved runs of 3 repetitions, the worker before this
  // change (the idle policy throughout: yield 2 ms, then doubling sleeps up to 1 ms)
  // against variants of it, time per operation:
  // - kDataPlaneWait for non-blocking ops (yield only until 200 us): 8 B 10-25% faster
  //   (all_reduce 7.3 -> 6.1 us, in place 8.1 -> 6.0, all_to_all 5.0 -> 4.1), but at
  //   256 KiB ~3x slower (all_gather 64 -> 187 us, two sessions): hence kInFlight's yielding.
  //   Its 20 us spin against 5 us and none (the same runs' medians): all_reduce 8 B
  //   6.1 / 7.2 / 13.5 us, all_to_all 4 KiB 6.8 / 6.9 / 16.4, 32 KiB 18.4 / 33.6 / 37.4,
  //   all_gather 256 KiB 62 / 69 / 97.
  // - comm-thread jobs straight to idle(), against polling them with kDataPlaneWait:
  //   within noise (1 MiB all_reduce 864 -> 902 us, all_gather 198 -> 196, to_mesh
  //   157 -> 162); kept because it leaves the cores to the comm thread and the peers.
  //   1-16 MiB against before: within noise (1 MiB all_gather 200 -> 198 us, to_mesh
  //   157 -> 155, reduce_scatter 503 -> 499; 16 MiB to_mesh 3.8 -> 3.0 ms, all_gather
  //   3.7 -> 4.0 ms).
  // - Rejected, measured in sessions of the same kind: non-blocking at every size (1-2 MiB 1.6-3x
  //   slower: libnbc needs many progress calls), the comm thread yielding 100 us for the
  //   next job before blocking (1 MiB all_gather 177 -> 424 us: it takes a core).
  void pause_in_flight(detail::Backoff& flight) {
    if (in_flight->on_comm_thread) {
      in_flight->op->idle(detail::kControl.max_sleep);
      return;
    }
    flight.pause([this](std::chrono::microseconds d) { in_flight->op->idle(d); });
  }

  // The pending collective or send threw from test() or take() (an input that does not
  // match its factory, an MPI or device error): that command fails, the worker goes on.
  // Its result becomes a failure marker and the controller hears of it as a failure
  // outside any invocation (ident 0), raised at the next synchronize.
  void fail_in_flight() {
    std::string message, type;
    try {
      throw;
    } catch (const std::exception& e) {
      message = e.what();
      type = boost::core::demangle(typeid(e).name());
    } catch (...) {
      message = "an exception not derived from std::exception";
      type = "unknown";
    }
    std::string what;
    try {
      what = in_flight->op->describe();
    } catch (...) {
      what = "the operation in flight";
    }
    MESHRT_LOG(error) << "rank " << opt.rank << ": " << what << " failed: " << message;
    const Ident ident = in_flight->ident;
    if (in_flight->result) define(*in_flight->result, DependentOnError{ident});
    reply(RemoteFunctionFailed{.ident = ident,
                               .error = fmt::format("{} failed on rank {}: {}", what, opt.rank, message),
                               .rank = opt.rank,
                               .function = in_flight->kind,
                               .exception_type = type});
    monitor.finished(in_flight->seq, true);
    complete(ident);
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
      undefine(r.id);
      mesh_kinds.erase(r.id);
    }
  }

  void run(CommandGroup&) {}  // flattened when it arrives (enqueue)

  void run(RequestStatus& c) {
    first_uncompleted = std::max(first_uncompleted, c.ident + 1);
    monitor.completed_ident(first_uncompleted);
    if (tree) {
      asked = std::max(asked, c.ident);
      ask_pending = true;  // answered by report_up once the whole subtree passed it
    }
    send_status(true);
  }

  void run(Exit& c) { exit = c.restart ? WorkerExit::Restart : WorkerExit::Shutdown; }

  // Runs one command; a failure outside any invocation (a broken collective set-up, a
  // bad ref) is logged and reported with ident 0 so it is never silent.
  void step(Queued q) {
    Command& command = q.command;
    current_seq = q.seq;
    if (q.seq) monitor.running(q.seq);
    current_failed = false;
    try {
      execute(command);
      if (in_flight) {
        in_flight->seq = q.seq;
        in_flight->kind = std::string(name(command));
        in_flight->ident = ident_of(command);
        if (std::holds_alternative<Reduce>(command)) {
          // run(Reduce) left reduce_words matching this command.
          if (reduce_words.running.empty()) {  // run(Reduce) described it as joining
            reduce_words.running = in_flight->op->describe();
            reduce_words.peers = peers_of(command);
            monitor.describe(q.seq, reduce_words.running, reduce_words.peers, 0);
          }
        } else if (const auto* send = std::get_if<SendTensor>(&command)) {
          // run(SendTensor) left send_words matching this command.
          if (send_words.running.empty()) {  // run(SendTensor) described it as joining
            send_words.running = in_flight->op->describe();
            send_words.peers = peers_of(*send);
            monitor.describe(q.seq, send_words.running, send_words.peers, 0);
          }
        } else {
          monitor.describe(q.seq, in_flight->op->describe(), peers_of(command), 0);
        }
        return;
      }
    } catch (const Poisoned& p) {
      // A mesh or stream that depends on a failure: nothing to run.
      poison_result(command, p.marker);
    } catch (const std::exception& e) {
      poison_result(command, DependentOnError{ident_of(command)});
      MESHRT_LOG(error) << "rank " << opt.rank << ": " << name(command) << " failed: " << e.what();
      // With the command's ident (Reduce, SendTensor) the controller names its call site;
      // ident 0 (tied to no invocation) is raised at the next synchronize.
      reply(RemoteFunctionFailed{.ident = ident_of(command),
                                 .error = fmt::format("{} failed: {}", name(command), e.what()),
                                 .rank = opt.rank,
                                 .function = std::string(name(command)),
                                 .exception_type = boost::core::demangle(typeid(e).name())});
      current_failed = true;
    } catch (...) {
      MESHRT_LOG(error) << "rank " << opt.rank << ": " << name(command) << " failed with a non-std::exception";
      poison_result(command, DependentOnError{ident_of(command)});
      reply(RemoteFunctionFailed{
          .ident = ident_of(command),
          .error = fmt::format("{} failed: an exception not derived from std::exception", name(command)),
          .rank = opt.rank,
          .function = std::string(name(command)),
          .exception_type = "unknown"});
      current_failed = true;
    }
    complete(ident_of(command));
    if (q.seq) monitor.finished(q.seq, current_failed);
  }

  // World ranks taking part in a collective or send with this rank.
  std::vector<int> peers_of(const Command& command) const {
    std::vector<int> peers;
    if (const auto* r = std::get_if<Reduce>(&command)) {
      const auto& mesh = std::get<std::shared_ptr<WorkerMesh>>(get(r->mesh, "mesh"));
      peers = mesh->line_world_ranks(mesh->dim_index(r->dim));
    } else if (const auto* s = std::get_if<SendTensor>(&command)) {
      peers = peers_of(*s);
    }
    return peers;
  }
  std::vector<int> peers_of(const SendTensor& s) const {
    std::vector<int> peers;
    for (std::int64_t i = 0; i < s.from_ranks.len(); ++i) {
      const std::int64_t to = s.to_order.empty() ? i : s.to_order[static_cast<std::size_t>(i)];
      if (s.from_ranks[i] == opt.rank) peers.push_back(static_cast<int>(s.to_ranks[to]));
      if (s.to_ranks[to] == opt.rank) peers.push_back(static_cast<int>(s.from_ranks[i]));
    }
    return peers;
  }

  // What the flight recorder keeps of a command.
  // Writes what the flight recorder shows of a queued command into its slot (cleared).
  static void record(const Command& command, detail::CommandRecord& r) {
    r.kind = name(command).data();
    std::visit(
        [&r](const auto& c) {
          using C = std::decay_t<decltype(c)>;
          if constexpr (std::is_same_v<C, CallFunction>) {
            r.ident = c.ident;
            r.name.assign(c.function);
            r.mesh = c.mesh.id;
            r.stream = c.stream.id;
            if (!c.results.empty()) r.result = c.results.front().id;
          } else if constexpr (std::is_same_v<C, FetchValue>) {
            r.ident = c.ident;
            if (c.function) r.name.assign(*c.function);
            r.stream = c.stream.id;
          } else if constexpr (std::is_same_v<C, Reduce>) {
            r.ident = c.ident;
            r.name.assign(meshrt::name(c.reduction));
            if (c.scatter) r.name.append(" scatter");
            if (c.inplace) r.name.append(" in place");
            r.result = c.result.id;
            r.mesh = c.mesh.id;
            r.stream = c.stream.id;
            r.dim.assign(c.dim);
            r.bytes = c.factory.nbytes();
          } else if constexpr (std::is_same_v<C, SendTensor>) {
            r.ident = c.ident;
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
  }

  // Queues a command (a group's commands one by one) and records it.
  // By rvalue and emplaced: a Command is ~350 bytes, and each move of a batch's commands
  // (into a parameter, a Queued, the queue) showed in worker 0's profile.
  void enqueue(Command&& command) {
    if (auto* group = std::get_if<CommandGroup>(&command)) {
      for (Command& c : group->commands) enqueue(std::move(c));
      return;
    }
    // Deletes are not recorded (seq 0): they can neither hang nor fail, a loop of
    // collectives sends one per output and so filled half the recorder's ring with them,
    // and their three locked updates per delete showed in worker 0's profile.
    const std::uint64_t seq =
        std::holds_alternative<DeleteRefs>(command)
            ? 0
            : monitor.queued(arrived, [&command](detail::CommandRecord& slot) { record(command, slot); });
    queue.emplace_back(seq, std::move(command));
  }

  // Fan-out (docs/ARCHITECTURE.md section 8): the number of the next envelope this rank runs,
  // and the envelopes that overtook it (one from the controller can pass one still
  // travelling through a parent): run in the controller's order, not arrival order.
  std::uint64_t next_envelope = 1;
  std::map<std::uint64_t, control::Bytes> early;

  // Forwards an envelope to this rank's children before anything in it runs, then queues
  // its payload in order.
  void route(const control::Bytes& frame) {
    protocol::Envelope e = protocol::decode_envelope(frame);
    const auto self = std::find(e.ranks.begin(), e.ranks.end(), opt.rank);
    if (self == e.ranks.end()) {
      throw ProtocolError(fmt::format("envelope for ranks {} reached rank {}, which is not one of them",
                                      fmt::join(e.ranks, ","), opt.rank));
    }
    const auto position = self - e.ranks.begin();
    const auto [first, end] = protocol::tree_children(e.ranks.size(), e.fanout, position);
    if (first < end) {
      channel->send(std::vector<int>(e.ranks.begin() + static_cast<std::ptrdiff_t>(first),
                                     e.ranks.begin() + static_cast<std::ptrdiff_t>(end)),
                    control::Tag::Command, std::make_shared<control::Bytes>(frame));
    }
    const std::uint64_t seq = e.seqs[static_cast<std::size_t>(position)];
    if (seq < next_envelope) {
      throw ProtocolError(
          fmt::format("envelope number {} reached rank {} after number {} ran", seq, opt.rank, next_envelope - 1));
    }
    early.emplace(seq, std::move(e.payload));
    run_early();
  }

  // Queues the envelopes that are next in number.
  void run_early() {
    while (!early.empty() && early.begin()->first == next_envelope) {
      const control::Bytes payload = std::move(early.begin()->second);
      early.erase(early.begin());
      ++next_envelope;
      try {
        enqueue(decode_command(payload));
      } catch (const ProtocolError& error) {
        undecodable(error, payload.size(), -1);  // the next envelopes still run
      }
    }
  }

  void undecodable(const ProtocolError& e, std::size_t size, int from) {
    MESHRT_LOG(error) << "rank " << opt.rank << ": dropped an undecodable command of " << size << " bytes"
                      << (from >= 0 ? fmt::format(" from rank {}", from) : std::string()) << ": " << e.what();
    reply(RemoteFunctionFailed{.ident = 0,
                               .error = fmt::format("undecodable command: {}", e.what()),
                               .rank = opt.rank,
                               .function = "<protocol>",
                               .exception_type = "meshrt::ProtocolError"});
  }

  bool receive() {
    bool any = false;
    // From any rank: with fan-out on, batches come from the controller or a parent.
    int from = -1;
    // With kMaxQueued commands waiting, the next batches wait in MPI, encoded (a few dozen
    // bytes a command against ~600 decoded): a controller far ahead (meshrt-bench soak's
    // slice loop queued ~30,000 commands on a worker) otherwise sets the worker's memory
    // by how far ahead it got. Everything queued here was already forwarded to this
    // rank's fan-out children, so none of them waits on what is left in MPI.
    while (queue.size() < kMaxQueued && channel->try_receive(control::kAnySource, control::Tag::Command, rx, &from)) {
      any = true;
      arrived = Clock::now();
      try {
        if (protocol::is_envelope(rx)) {
          route(rx);
        } else {
          // A bare batch comes straight from the controller, as the next number (the
          // controller envelopes every batch to a rank once one reached it through a
          // parent), so it never waits and may release envelopes that overtook it.
          ++next_envelope;
          enqueue(decode_command(rx));
          if (!early.empty()) run_early();
        }
      } catch (const ProtocolError& e) {
        undecodable(e, rx.size(), from);
      }
    }
    return any;
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
    const auto interval = std::chrono::duration<double>(opt.status_interval_seconds);
    while (!exit) {
      // Read before the poll: a command sent after it rings past `rung`, and the wait
      // below returns at once.
      const std::uint64_t rung = doorbell ? channel->rings(control::Tag::Command) : 0;
      bool worked = receive();
      if (tree && receive_tree()) worked = true;
      if (!outgoing.empty() && poll_outgoing()) worked = true;
      if (in_flight && poll_in_flight()) worked = true;
      while (!in_flight && !queue.empty() && !exit) {
        Queued q = std::move(queue.front());
        queue.pop_front();
        step(std::move(q));
        worked = true;
        // A collective that completed inside its call (the worker blocks in MPI,
        // cpu_completion) is finished at once, not at the loop's next turn: the batch's
        // next command runs without a turn's polls in between (8 B all_reduce under
        // callgrind: worker 0 ~850 fewer instructions per operation). The status
        // interval still ends the run, so a batch of long blocking commands still
        // reports about once a second.
        if (in_flight) poll_in_flight();
        if (Clock::now() - last_status_time > interval) break;
      }
      // Status when the worker moved: about once a second while busy, and at once when it
      // runs out of work, so a controller waiting on it rarely needs to ask (one message per
      // batch of commands).
      if ((worked && queue.empty() && !in_flight) || Clock::now() - last_status_time > interval) send_status(false);
      if (tree) report_up(Clock::now() - last_status_time > interval);
      channel->reap();
      if (worked) {
        backoff.reset();
        flight.reset();
      } else if (in_flight) {
        pause_in_flight(flight);
      } else if (doorbell) {
        backoff.pause([&](std::chrono::microseconds d) { channel->wait_ring(control::Tag::Command, rung, d); });
      } else {
        backoff.pause();
      }
    }
    // Fetches still copying finish first (their events complete even on a faulted stream).
    while (!outgoing.empty()) {
      if (!poll_outgoing()) backoff.pause();
    }
    send_status(false);
    if (tree) {
      // The controller's last RequestStatus (shutdown's) is answered through this node,
      // so it leaves only once its subtree has answered it. A child that never does is
      // hung: the controller's shutdown times out and ends the job.
      while (ask_pending && subtree_min() <= asked) {
        if (!receive_tree()) backoff.pause();
      }
      report_up(false);
    }
    channel->drain(std::chrono::seconds(30));
    return *exit;
  }
};

Worker::Worker(WorkerOptions options) : impl_(std::make_unique<Impl>(options)) {}
Worker::~Worker() = default;

WorkerExit Worker::run() {
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
