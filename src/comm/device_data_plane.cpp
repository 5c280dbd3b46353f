// The data plane for accelerator tensors (cuda or emulated) over the device layer's
// communicators (docs/ARCHITECTURE.md section 7): a Reduce over the communicator of the mesh
// dimension's line (made from the MPI split of that line), a SendTensor over one made
// over exactly its moving ranks (from ∪ to less the ranks sent only to themselves); both
// cached by rank set across meshes. Everything is enqueued on the command's device
// stream; Pending::test polls an event recorded after it and the communicator's
// asynchronous error, so the worker's loop never blocks on the device.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <tuple>
#include <vector>

#include "comm/mesh_impl.hpp"
#include "comm/plan.hpp"
#include "common/checks.hpp"
#include "meshrt/internal/comm.hpp"
#include "meshrt/internal/device.hpp"
#include "meshrt/internal/settings.hpp"

namespace meshrt {
namespace {

device::Accelerator accelerator_of(Device::Kind kind) {
  return kind == Device::Kind::Cuda ? device::Accelerator::Cuda : device::Accelerator::Emulated;
}

// A send's communicator over its moving ranks is made on p2p: the members' agreement and
// MPI_Comm_create_group each have a tag there (the CPU sends use another).
constexpr int kAgreeSendTag = 0x6d66;
constexpr int kCreateSendTag = 0x6d65;

// Device communicators by (kind, world ranks in member order). Only the worker thread
// uses them: one creation at a time, in the order commands arrive (the same everywhere).
using CommKey = std::tuple<int, std::vector<int>>;
// Never destroyed at exit (that would run after MPI_Finalize): free_device_communicators
// empties it while MPI is up.
std::mutex g_comms_mutex;
auto& g_comms = *new std::map<CommKey, std::shared_ptr<device::Communicator>>();

// Rank sets whose communicator failed on this rank (why, for the error), for the rest of
// the job (communicators outlive session restarts). A failure is seen by one rank alone
// (its own timeout or device error): its peers may still hold their communicator and post
// into it, so this rank never makes a new one alone, which would wait for peers that do
// not come; nor can it tell its peers, which may be stuck.
auto& g_failed = *new std::map<CommKey, std::string>();

void refuse_if_failed(const CommKey& key) {
  std::string why;
  {
    std::lock_guard lock(g_comms_mutex);
    const auto it = g_failed.find(key);
    if (it == g_failed.end()) return;
    why = it->second;
  }
  throw UsageError(fmt::format(
      "device communicator over world ranks {}: expected a live one, found the one this rank had failed ({}); its "
      "peers may still hold theirs, so this rank does not make a new one alone (it would wait for peers that never "
      "join); a new job makes fresh communicators",
      fmt::join(std::get<1>(key), ","), why));
}

std::shared_ptr<device::Communicator> cached(Device::Kind kind, std::vector<int> world_ranks, MPI_Comm members,
                                             int device) {
  CommKey key{static_cast<int>(kind), std::move(world_ranks)};
  {
    std::lock_guard lock(g_comms_mutex);
    if (auto it = g_comms.find(key); it != g_comms.end()) return it->second;
  }
  refuse_if_failed(key);
  std::shared_ptr<device::Communicator> comm;
  try {
    comm = device::create_communicator(accelerator_of(kind), members, device, settings::kGroupTimeout.get());
  } catch (const UsageError&) {
    throw;  // every member refuses alike (the same table of devices): none is left inside
  } catch (const std::exception& e) {
    // A member that came late, or failed elsewhere, may still be inside this creation's
    // collectives on `members`: made again here, this rank's would not line up with its.
    std::lock_guard lock(g_comms_mutex);
    g_failed.insert_or_assign(key, fmt::format("its creation failed: {}", e.what()));
    throw;
  }
  std::lock_guard lock(g_comms_mutex);
  return g_comms.try_emplace(std::move(key), std::move(comm)).first->second;
}

// A failed communicator is aborted from this (the worker) thread and dropped; its rank
// set is remembered as failed (g_failed).
void drop(const std::shared_ptr<device::Communicator>& comm, const std::string& why) {
  comm->abort();
  std::lock_guard lock(g_comms_mutex);
  for (auto it = g_comms.begin(); it != g_comms.end(); ++it) {
    if (it->second == comm) {
      g_failed.insert_or_assign(it->first, why);
      g_comms.erase(it);
      return;
    }
  }
}

// Buffers of an operation whose communicator was aborted while it waited: the emulated
// accelerator cannot cancel the posted MPI request, so a peer that joins late would still
// write into them. Kept until the process ends (rare, and small next to a hang).
void abandon(std::vector<Tensor> buffers) {
  static std::mutex mutex;
  static auto& kept = *new std::vector<Tensor>();
  std::lock_guard lock(mutex);
  for (Tensor& t : buffers) kept.push_back(std::move(t));
}

// MESHRT_DEVICE_TIMEOUT, read once (the settings are the environment's, fixed at start).
std::chrono::duration<double> device_timeout() {
  static const std::chrono::duration<double> timeout = settings::kDeviceTimeout.get();
  return timeout;
}

class DevicePending final : public Pending {
 public:
  bool test() override {
    if (finished()) return true;
    // Completion first: an operation whose event completed has run. An error its
    // communicator reports after that (a peer that failed since) is later work's to fail.
    if (done.defined() && !done.query()) {
      if (comm) {
        if (auto error = comm->async_error()) {
          drop(comm, *error);
          return fail(*error);
        }
      }
      check_deadline();
      return false;
    }
    if (auto error = stream.defined() ? stream.error() : std::nullopt) return fail(*error);
    keep.clear();
    finish(std::move(result));
    return true;
  }
  std::string describe() const override { return text; }
  void defer(std::string message) { fail_after_completion(std::move(message)); }
  void record() {
    done = device::backend(kind).create_event(stream.device());
    done.record(stream);
  }
  // Marks where the communication starts on the stream: its deadline runs from when the
  // stream reaches it, so work queued before it (this rank's own kernels) never counts.
  void mark_start() {
    started = device::backend(kind).create_event(stream.device());
    started.record(stream);
  }

  std::string text;
  Device::Kind kind = Device::Kind::Emulated;
  device::Stream stream;
  device::Event done;
  std::shared_ptr<device::Communicator> comm;
  std::vector<Tensor> keep;  // buffers the device still uses
  Outcome result;
  device::Event started;  // recorded just before the communication (mark_start)

 private:
  // The worker reports the failure after describe() (the operation, its mesh dimension
  // and peers): the message does not repeat it.
  bool fail(const std::string& error) {
    fail_after_completion(fmt::format("device error: {}", error));
    keep.clear();
    finish(Outcome{});
    return true;
  }

  // Past the deadline: aborts the communicator from this thread (the worker's, which
  // issues its work: ncclCommAbort's rule), drops it, and fails the command with a
  // TimeoutError (the worker names the operation, its dimension and peers).
  void check_deadline() {
    if (!comm || !started.defined()) return;
    const auto timeout = device_timeout();
    if (timeout == std::chrono::duration<double>::max()) return;
    const auto now = std::chrono::steady_clock::now();
    if (!reached) {
      if (started.query()) reached = now;
      return;
    }
    const std::chrono::duration<double> waited = now - *reached;
    if (waited < timeout) return;
    const std::string what = comm->describe();
    drop(comm, fmt::format("timed out after {:g} s", timeout.count()));
    comm.reset();
    if (result.tensor.defined()) keep.push_back(std::move(result.tensor));
    abandon(std::move(keep));
    keep.clear();
    throw TimeoutError(fmt::format(
        "timed out: expected every peer to join within {:g} s (MESHRT_DEVICE_TIMEOUT), found it still waiting after "
        "{:.1f} s; aborted {} (a peer that never joins, or is stuck before it)",
        timeout.count(), waited.count(), what));
  }
  std::optional<std::chrono::steady_clock::time_point> reached;  // when the stream reached `started`
};

// The rank's own view of a factory: on the controller a device means "each rank's own
// device of this kind".
TensorMeta local_factory(const TensorMeta& factory) {
  return factory.with_device(device::rank_device(factory.device().kind()));
}

// join_input for device tensors: a broken or mismatched input joins with zeros made on
// the stream (Tensor::zeros would be unordered with it).
detail::Joined join_device(Input&& input, const TensorMeta& factory, const device::Stream& stream,
                           std::string_view op) {
  detail::Joined j = detail::check_input(std::move(input), factory, op);
  if (!j.tensor.defined()) j.tensor = device::zeros(factory, stream);
  return j;
}

// The ranks of a send that have a peer other than themselves (p2p ranks, increasing): the
// members of its communicator. Every rank of from ∪ to computes the same set; a rank sent
// only to itself copies locally and joins no creation (from ∪ to would include it, and its
// peers would wait in MPI_Comm_create_group for a rank that never comes).
std::vector<int> moving_ranks(const NDSlice& from_ranks, const NDSlice& to_ranks,
                              std::span<const std::int64_t> to_order, std::span<const std::int64_t> from_order) {
  std::vector<int> members;
  const auto pair = [&](NDSlice::Int source, NDSlice::Int target) {
    const auto from = static_cast<int>(from_ranks[source]);
    const auto to = static_cast<int>(to_ranks[target]);
    if (from == to) return;
    members.push_back(from);
    members.push_back(to);
  };
  if (!from_order.empty()) {
    for (NDSlice::Int j = 0; j < to_ranks.len(); ++j) pair(from_order[static_cast<std::size_t>(j)], j);
  } else {
    for (NDSlice::Int i = 0; i < from_ranks.len(); ++i)
      pair(i, to_order.empty() ? i : static_cast<NDSlice::Int>(to_order[static_cast<std::size_t>(i)]));
  }
  std::sort(members.begin(), members.end());
  members.erase(std::unique(members.begin(), members.end()), members.end());
  return members;
}

// Runs this rank's part of an operation on its communicator, once made: its stream,
// inputs and outputs, and the enqueue. Whatever fails there leaves the communicator
// broken for this rank (NCCL: an error at enqueue is fatal to it; and a part never
// posted leaves the peers' parts unmatched), so it is aborted and dropped before the
// error goes on; the peers fail on their deadline.
template <class Part>
void enqueue_or_drop(DevicePending& p, Part&& part) {
  try {
    part();
  } catch (const std::exception& e) {
    drop(p.comm, fmt::format("this rank's part failed at or before its enqueue: {}", e.what()));
    p.comm.reset();
    throw;
  } catch (...) {
    drop(p.comm, "this rank's part failed at or before its enqueue");
    p.comm.reset();
    throw;
  }
}

// The table's collective (docs/ARCHITECTURE.md section 3.6) of `in` over `p`'s communicator
// of `n` ranks, on its stream; the output into p.result.
void enqueue_table(DevicePending& p, std::int64_t n_ranks, const TensorMeta& out_meta, Reduction reduction,
                   bool scatter, bool inplace, const Tensor& in, const TensorMeta& factory) {
  device::Backend& b = device::backend(p.kind);
  const auto numel = static_cast<std::size_t>(factory.numel());
  const auto n = static_cast<std::size_t>(n_ranks);
  const void* src = in.raw_data();
  const DType dtype = factory.dtype();
  Tensor out;
  if (reduction == Reduction::Stack && !scatter) {
    out = b.empty(out_meta, p.stream);
    p.comm->all_gather(src, out.raw_data(), numel, dtype, p.stream);
  } else if (reduction == Reduction::Stack) {
    // No in-place all-to-all on the device: in place goes through a scratch output
    // copied back on the same stream.
    Tensor scratch = b.empty(out_meta, p.stream);
    p.comm->all_to_all(src, scratch.raw_data(), numel / n, dtype, p.stream);
    if (inplace) {
      device::copy(in, scratch, p.stream);
      p.keep.push_back(scratch);
      out = in;
    } else {
      out = scratch;
    }
  } else if (scatter) {
    out = b.empty(out_meta, p.stream);
    p.comm->reduce_scatter(src, out.raw_data(), numel / n, dtype, reduction, p.stream);
  } else {
    out = inplace ? in : b.empty(out_meta, p.stream);
    p.comm->all_reduce(src, out.raw_data(), numel, dtype, reduction, p.stream);
  }
  p.keep.push_back(in);
  p.result.tensor = std::move(out);
}

}  // namespace

void free_device_communicators() noexcept {
  std::map<CommKey, std::shared_ptr<device::Communicator>> gone;
  {
    std::lock_guard lock(g_comms_mutex);
    gone.swap(g_comms);
    g_failed.clear();  // the job ends
  }
  for (auto& [key, comm] : gone) comm->destroy();
}

std::unique_ptr<Pending> start_reduce_device(WorkerMesh& mesh, std::string_view dim, Reduction reduction, bool scatter,
                                             bool inplace, Input input, const TensorMeta& controller_factory,
                                             std::uint64_t stream_id) {
  const TensorMeta factory = local_factory(controller_factory);
  const detail::ReducePlan plan =
      detail::plan_reduce(mesh, dim, reduction, scatter, inplace, factory, detail::Backend::Device);
  auto p = std::make_unique<DevicePending>();
  p->kind = factory.device().kind();
  p->text = detail::describe_reduce(mesh, plan.dim, plan.collective, reduction, factory.nbytes(),
                                    name(factory.device().kind()));
  // The communicator first: its creation is collective (the line's MPI split, the
  // device's init), so nothing one rank alone can fail (a stream, the zeros of a broken
  // input, an output) comes before it.
  p->comm = cached(p->kind, mesh.line_world_ranks(plan.dim), mesh.dim_comm(plan.dim), factory.device().index());
  enqueue_or_drop(*p, [&] {
    p->stream = device::stream_for(stream_id, factory.device());
    detail::Joined in = join_device(std::move(input), factory, p->stream, plan.collective);
    if (!in.mismatch.empty()) p->defer(in.mismatch + detail::where_reduce(mesh, plan.dim));
    p->result.broken = in.broken;
    p->mark_start();
    enqueue_table(*p, plan.n, plan.out_meta(factory), reduction, scatter, inplace, in.tensor, factory);
    p->record();
  });
  return p;
}

std::unique_ptr<Pending> start_collective_device(WorkerMesh& mesh, const CollectiveOp& op, Input input,
                                                 const TensorMeta& controller_factory, std::uint64_t stream_id) {
  if (op.kind == CollectiveKind::Barrier) {
    throw UsageError(
        fmt::format("barrier on the device data plane: expected a CPU operation (a barrier moves no "
                    "tensor and runs over MPI), found it given an accelerator tensor {} (world rank {})",
                    controller_factory.to_string(), mesh.world_rank()));
  }
  const TensorMeta factory = local_factory(controller_factory);
  const detail::CollectivePlan plan = detail::plan_collective(mesh, op, factory, detail::Backend::Device);
  auto p = std::make_unique<DevicePending>();
  p->kind = factory.device().kind();
  p->text = detail::describe_collective(mesh, op, plan.mask, plan.collective, factory.nbytes(), name(p->kind));
  // The communicator first, as for a Reduce: its creation is collective.
  p->comm = cached(p->kind, mesh.dims_world_ranks(plan.mask), mesh.dims_comm(plan.mask), factory.device().index());
  enqueue_or_drop(*p, [&] {
    p->stream = device::stream_for(stream_id, factory.device());
    const bool table = op.kind == CollectiveKind::Reduce && op.root < 0;
    const bool root = plan.is_root(op.root);
    const int root_rank = static_cast<int>(op.root);
    detail::Joined in;
    // Every rank's input counts for the table and a rooted reduce or gather; the root's
    // alone for a broadcast or scatter, where the others have none to give.
    if (op.kind == CollectiveKind::Reduce || root) {
      in = join_device(std::move(input), factory, p->stream, plan.collective);
      if (!in.mismatch.empty()) p->defer(in.mismatch + detail::where_collective(mesh, plan.mask));
      if (table || root) p->result.broken = in.broken;  // where this rank's result is its own
      p->keep.push_back(in.tensor);
    }
    device::Backend& b = device::backend(p->kind);
    p->mark_start();
    const auto numel = static_cast<std::size_t>(factory.numel());
    const DType dtype = factory.dtype();
    Tensor out;
    if (table) {
      enqueue_table(*p, plan.n, plan.out_meta(factory), op.reduction, op.scatter, op.inplace, in.tensor, factory);
      p->record();
      return;
    }
    if (op.kind == CollectiveKind::Reduce && op.reduction == Reduction::Stack) {
      // A gather: one group of sends to the root, which copies its own block.
      const std::size_t block = factory.nbytes();
      std::vector<device::Communicator::PeerOp> ops;
      if (root) {
        out = b.empty(plan.out_meta(factory), p->stream);
        char* base = static_cast<char*>(out.raw_data());
        for (int r = 0; r < static_cast<int>(plan.n); ++r) {
          if (r != root_rank) ops.push_back({false, r, base + static_cast<std::size_t>(r) * block, numel});
        }
        if (block > 0)
          b.copy_async(base + static_cast<std::size_t>(root_rank) * block, in.tensor.raw_data(), block, p->stream);
      } else {
        ops.push_back({true, root_rank, in.tensor.raw_data(), numel});
      }
      p->comm->send_recv(ops, dtype, p->stream);
    } else if (op.kind == CollectiveKind::Reduce) {
      if (root) out = b.empty(factory, p->stream);
      p->comm->reduce(in.tensor.raw_data(), root ? out.raw_data() : nullptr, numel, dtype, op.reduction, root_rank,
                      p->stream);
    } else if (op.kind == CollectiveKind::Broadcast) {
      out = b.empty(factory, p->stream);
      p->comm->broadcast(root ? in.tensor.raw_data() : nullptr, out.raw_data(), numel, dtype, root_rank, p->stream);
    } else {
      // A scatter: one group of sends from the root, which copies its own part.
      const TensorMeta& part = plan.out_meta(factory);
      const std::size_t part_bytes = part.nbytes();
      const auto part_count = static_cast<std::size_t>(part.numel());
      out = b.empty(part, p->stream);
      std::vector<device::Communicator::PeerOp> ops;
      if (root) {
        char* base = static_cast<char*>(in.tensor.raw_data());
        for (int r = 0; r < static_cast<int>(plan.n); ++r) {
          if (r != root_rank) ops.push_back({true, r, base + static_cast<std::size_t>(r) * part_bytes, part_count});
        }
        if (part_bytes > 0)
          b.copy_async(out.raw_data(), base + static_cast<std::size_t>(root_rank) * part_bytes, part_bytes, p->stream);
      } else {
        ops.push_back({false, root_rank, out.raw_data(), part_count});
      }
      p->comm->send_recv(ops, dtype, p->stream);
    }
    p->result.tensor = std::move(out);
    p->record();
  });
  return p;
}

std::unique_ptr<Pending> start_send_tensor_device(MPI_Comm p2p, int my_rank, const NDSlice& from_ranks,
                                                  const NDSlice& to_ranks, Input input,
                                                  const TensorMeta& controller_factory, std::uint64_t stream_id,
                                                  std::span<const std::int64_t> to_order,
                                                  std::span<const std::int64_t> from_order) {
  const TensorMeta factory = local_factory(controller_factory);
  int size = 0;
  MESHRT_MPI_CHECK(MPI_Comm_size(p2p, &size));
  const detail::SendPlan plan =
      detail::plan_send(my_rank, size, from_ranks, to_ranks, factory, detail::Backend::Device, to_order, from_order);
  auto p = std::make_unique<DevicePending>();
  p->kind = factory.device().kind();
  p->text = detail::describe_send(plan, my_rank, factory.nbytes(), name(p->kind));
  if (plan.send_to < 0 && plan.recv_from < 0) {
    (void)p->test();  // no part in it: no stream, no communicator
    return p;
  }
  device::Backend& b = device::backend(p->kind);
  if (plan.self && plan.also_to.empty()) {
    p->stream = device::stream_for(stream_id, factory.device());
    detail::Joined in = join_device(std::move(input), factory, p->stream, "send_tensor");
    if (!in.mismatch.empty()) p->defer(in.mismatch + detail::where_send(my_rank, plan.send_to));
    p->result.broken = in.broken;
    Tensor copy = b.empty(factory, p->stream);
    device::copy(copy, in.tensor, p->stream);
    p->result.tensor = std::move(copy);
    p->record();
    return p;
  }
  // The communicator over exactly the moving ranks (ranks of p2p, in increasing order):
  // only they join its creation, before anything this rank alone can fail.
  const std::vector<int> members = moving_ranks(from_ranks, to_ranks, to_order, from_order);
  const auto index = [&](int r) {
    return static_cast<int>(std::lower_bound(members.begin(), members.end(), r) - members.begin());
  };
  std::shared_ptr<device::Communicator> comm;
  {
    CommKey key{static_cast<int>(p->kind), members};
    {
      std::lock_guard lock(g_comms_mutex);
      if (auto it = g_comms.find(key); it != g_comms.end()) comm = it->second;
    }
    // Before the group's creation below, which its peers would have to join.
    if (!comm) refuse_if_failed(key);
  }
  if (!comm) {
    // After the members' agreement (MESHRT_GROUP_TIMEOUT): a member that does not come is
    // named, and none waits for it without end. p2p's ranks are world ranks.
    MPI_Comm sub = create_agreed(
        fmt::format("the communicator of a send over world ranks {}", fmt::join(members, ",")), p2p, my_rank, members,
        [](int r) { return r; }, kAgreeSendTag, kCreateSendTag);
    try {
      comm = cached(p->kind, members, sub, factory.device().index());
    } catch (...) {
      MPI_Comm_free(&sub);
      throw;
    }
    MPI_Comm_free(&sub);  // the device communicator dup'd what it needs
  }
  p->comm = comm;
  enqueue_or_drop(*p, [&] {
    p->stream = device::stream_for(stream_id, factory.device());
    Tensor sent;
    if (plan.send_to >= 0) {
      detail::Joined in = join_device(std::move(input), factory, p->stream, "send_tensor");
      if (!in.mismatch.empty()) p->defer(in.mismatch + detail::where_send(my_rank, plan.send_to));
      if (plan.self) p->result.broken = in.broken;
      sent = std::move(in.tensor);
    }
    std::vector<device::Communicator::PeerOp> ops;
    if (plan.self) {
      // A broadcast source that is also a target keeps a copy of its own.
      Tensor copy = b.empty(factory, p->stream);
      device::copy(copy, sent, p->stream);
      p->result.tensor = std::move(copy);
    } else if (plan.recv_from >= 0) {
      p->result.tensor = b.empty(factory, p->stream);
      ops.push_back(
          {false, index(plan.recv_from), p->result.tensor.raw_data(), static_cast<std::size_t>(factory.numel())});
    }
    if (plan.send_to >= 0 && !plan.self)
      ops.push_back({true, index(plan.send_to), sent.raw_data(), static_cast<std::size_t>(factory.numel())});
    for (int to : plan.also_to)
      ops.push_back({true, index(to), sent.raw_data(), static_cast<std::size_t>(factory.numel())});
    if (plan.send_to >= 0) p->keep.push_back(sent);
    p->mark_start();
    comm->send_recv(ops, factory.dtype(), p->stream);
    p->record();
  });
  return p;
}

}  // namespace meshrt
