#include "comm/plan.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <climits>

namespace meshrt::detail {

std::string where_reduce(const WorkerMesh& mesh, std::size_t dim) {
  return fmt::format(" (dimension '{}' of mesh {}, world rank {})", mesh.names()[dim], mesh.to_string(),
                     mesh.world_rank());
}

std::string where_send(int my_rank, int send_to) {
  return fmt::format(" (world rank {}, sending to rank {})", my_rank, send_to);
}

std::string where_collective(const WorkerMesh& mesh, std::uint64_t mask) {
  return fmt::format(" (dimension{} {} of mesh {}, world rank {})", std::popcount(mask) == 1 ? "" : "s",
                     mesh.dims_names(mask), mesh.to_string(), mesh.world_rank());
}

CollectivePlan plan_collective(const WorkerMesh& mesh, const CollectiveOp& op, const TensorMeta& factory,
                               Backend backend) {
  CollectivePlan plan;
  plan.mask = mesh.dims_mask(op.dims);
  plan.n = mesh.dims_size(plan.mask);
  plan.position = mesh.dims_position(plan.mask);
  if (op.kind == CollectiveKind::Barrier) {
    plan.collective = "barrier";
    return plan;
  }
  const bool on_device = factory.device().is_accelerator();
  if (on_device != (backend == Backend::Device)) {
    throw UsageError(fmt::format("{} over {}: expected a{} tensor, found {}{}", name(op.kind),
                                 backend == Backend::Device ? "the device data plane" : "MPI",
                                 backend == Backend::Device ? "n accelerator" : " CPU", factory.to_string(),
                                 where_collective(mesh, plan.mask)));
  }
  ReductionRule rule = collective_rule(factory, plan.n, op.kind, op.reduction, op.scatter, op.inplace, op.root,
                                       backend == Backend::Device ? Device::Kind::Cuda : Device::Kind::Cpu);
  if (!rule.allowed()) throw UsageError(rule.error + where_collective(mesh, plan.mask));
  plan.collective = rule.collective;
  plan.reshaped = std::move(rule.reshaped);
  if (backend == Backend::Mpi || factory.device().is_emulated()) check_count(factory.numel(), plan.collective);
  return plan;
}

ReducePlan plan_reduce(const WorkerMesh& mesh, std::string_view dim_name, Reduction reduction, bool scatter,
                       bool inplace, const TensorMeta& factory, Backend backend) {
  ReducePlan plan;
  plan.dim = mesh.dim_index(dim_name);
  plan.n = mesh.size(plan.dim);
  const bool on_cuda = factory.device().is_accelerator();  // cuda or emulated: the device data plane
  if (backend == Backend::Mpi && on_cuda) {
    throw UsageError(
        fmt::format("{} over MPI: expected a CPU tensor, found {}; CUDA tensors go through the NCCL data "
                    "plane (start_reduce_device){}",
                    name(reduction), factory.to_string(), where_reduce(mesh, plan.dim)));
  }
  if (backend == Backend::Device && !on_cuda) {
    throw UsageError(fmt::format("{} over NCCL: expected a CUDA tensor, found {}{}", name(reduction),
                                 factory.to_string(), where_reduce(mesh, plan.dim)));
  }
  // The rules the controller checked already (a worker cannot trust a frame): one
  // function, so both sides agree.
  ReductionRule rule = reduction_rule(factory, plan.n, reduction, scatter, inplace,
                                      backend == Backend::Device ? Device::Kind::Cuda : Device::Kind::Cpu);
  if (!rule.allowed()) throw UsageError(rule.error + where_reduce(mesh, plan.dim));
  plan.collective = rule.collective;
  plan.reshaped = std::move(rule.reshaped);
  // NCCL's counts are size_t; MPI's (the emulated accelerator's collectives too) are int.
  if (backend == Backend::Mpi || factory.device().is_emulated()) check_count(factory.numel(), plan.collective);
  return plan;
}

Joined check_input(Input&& input, const TensorMeta& factory, std::string_view op) {
  Joined j;
  if (auto* t = std::get_if<Tensor>(&input)) {
    if (t->defined() && t->meta() == factory) {
      j.tensor = std::move(*t);
      return j;
    }
    j.mismatch = fmt::format(
        "{}: expected an input {} as the controller computed, found {}; this rank joined with "
        "zeros so that its peers complete",
        op, factory.to_string(), t->defined() ? t->meta().to_string() : "an undefined tensor");
  } else {
    j.broken = std::get<DependentOnError>(input);
  }
  return j;
}

Joined join_input(Input&& input, const TensorMeta& factory, std::string_view op) {
  Joined j = check_input(std::move(input), factory, op);
  if (!j.tensor.defined()) j.tensor = factory.zeros();
  return j;
}

std::string describe_reduce(const WorkerMesh& mesh, std::size_t dim, const char* collective, Reduction reduction,
                            std::size_t bytes, std::string_view backend) {
  std::string peers;
  for (int r : mesh.line_world_ranks(dim)) peers += (peers.empty() ? "" : ",") + std::to_string(r);
  return fmt::format("{} {} over dimension '{}' of mesh {}, {} bytes, peers world ranks {} ({})", collective,
                     name(reduction), mesh.names()[dim], mesh.to_string(), bytes, peers, backend);
}

std::string describe_collective(const WorkerMesh& mesh, const CollectiveOp& op, std::uint64_t mask,
                                const char* collective, std::size_t bytes, std::string_view backend) {
  std::string peers;
  for (int r : mesh.dims_world_ranks(mask)) peers += (peers.empty() ? "" : ",") + std::to_string(r);
  std::string what = collective;
  const bool combines = op.kind == CollectiveKind::Reduce && op.reduction != Reduction::Stack;
  if (combines) what += fmt::format(" {}", name(op.reduction));
  if (op.root >= 0) what += fmt::format(" {} position {}", op.kind == CollectiveKind::Reduce ? "to" : "from", op.root);
  return fmt::format("{} over dimension{} {} of mesh {}, {} bytes, peers world ranks {} ({})", what,
                     std::popcount(mask) == 1 ? "" : "s", mesh.dims_names(mask), mesh.to_string(), bytes, peers,
                     backend);
}

namespace {
// The position of `value` in `s`, or -1. 1-D slices (the usual SendTensor between
// sub-meshes) take no allocation: this runs on every send.
NDSlice::Int position(const NDSlice& s, NDSlice::Int value) {
  if (s.ndim() == 1) {
    const NDSlice::Int rest = value - s.offset();
    const NDSlice::Int stride = s.strides()[0];
    if (rest < 0 || rest % stride != 0 || rest / stride >= s.sizes()[0]) return -1;
    return rest / stride;
  }
  return s.contains(value) ? s.index(value) : -1;
}

NDSlice::Int slice_max(const NDSlice& s) {
  NDSlice::Int m = s.offset();
  for (std::size_t d = 0; d < s.ndim(); ++d) m += (s.sizes()[d] - 1) * s.strides()[d];
  return m;
}
}  // namespace

SendPlan plan_send(int my_rank, int comm_size, const NDSlice& from_ranks, const NDSlice& to_ranks,
                   const TensorMeta& factory, Backend backend, std::span<const std::int64_t> to_order,
                   std::span<const std::int64_t> from_order) {
  if (!to_order.empty() && static_cast<NDSlice::Int>(to_order.size()) != to_ranks.len()) {
    throw UsageError(
        fmt::format("send_tensor: expected a to_order of {} positions (the ranks), found {} (world rank {})",
                    to_ranks.len(), to_order.size(), my_rank));
  }
  if (!from_order.empty() && (!to_order.empty() || static_cast<NDSlice::Int>(from_order.size()) != to_ranks.len())) {
    throw UsageError(
        fmt::format("send_tensor: expected a from_order of {} positions (the target ranks) and no to_order, found {} "
                    "and {} (world rank {})",
                    to_ranks.len(), from_order.size(), to_order.size(), my_rank));
  }
  if (from_order.empty() && from_ranks.len() != to_ranks.len()) {
    throw UsageError(
        fmt::format("send_tensor: expected from_ranks and to_ranks of equal length, found {} ({}) and "
                    "{} ({}) (world rank {})",
                    from_ranks.len(), from_ranks.to_string(), to_ranks.len(), to_ranks.to_string(), my_rank));
  }
  for (const NDSlice* s : {&from_ranks, &to_ranks}) {
    if (slice_max(*s) >= comm_size) {
      throw UsageError(
          fmt::format("send_tensor: expected ranks below the communicator size {}, found rank {} in {} "
                      "(world rank {})",
                      comm_size, slice_max(*s), s->to_string(), my_rank));
    }
  }
  if (backend == Backend::Mpi && factory.device().is_accelerator()) {
    throw UsageError(
        fmt::format("send_tensor over MPI: expected a CPU tensor, found {}; CUDA tensors go through "
                    "NCCL (start_send_tensor_device) (world rank {})",
                    factory.to_string(), my_rank));
  }
  if (backend == Backend::Device && !factory.device().is_accelerator()) {
    throw UsageError(fmt::format("send_tensor over NCCL: expected a CUDA tensor, found {} (world rank {})",
                                 factory.to_string(), my_rank));
  }
  if (backend == Backend::Mpi || factory.device().is_emulated()) check_count(factory.numel(), "send_tensor");
  SendPlan plan;
  const NDSlice::Int send_index = position(from_ranks, my_rank);
  if (!from_order.empty()) {
    // A broadcast send: this rank receives from its one source, and as a source sends to
    // every target position that names it (itself first, where it is one: a local copy).
    const NDSlice::Int recv_index = position(to_ranks, my_rank);
    if (recv_index >= 0) {
      plan.recv_from = static_cast<int>(from_ranks[from_order[static_cast<std::size_t>(recv_index)]]);
      plan.self = plan.recv_from == my_rank;
      if (plan.self) plan.send_to = my_rank;
    }
    if (send_index < 0) return plan;
    for (std::size_t j = 0; j < from_order.size(); ++j) {
      if (from_order[j] != send_index) continue;
      const auto to = static_cast<int>(to_ranks[static_cast<NDSlice::Int>(j)]);
      if (to == my_rank) continue;
      if (plan.send_to < 0)
        plan.send_to = to;
      else
        plan.also_to.push_back(to);
    }
    return plan;
  }
  if (to_order.empty()) {
    if (send_index >= 0) plan.send_to = static_cast<int>(to_ranks[send_index]);
    const NDSlice::Int recv_index = position(to_ranks, my_rank);
    if (recv_index >= 0) {
      plan.recv_from = static_cast<int>(from_ranks[recv_index]);
      // A rank appears at most once in each slice, so it is its own peer exactly when it
      // sends and receives through the same position.
      plan.self = recv_index == send_index;
    }
    return plan;
  }
  // A permutation send: the source of target position k is the i with to_order[i] == k.
  if (send_index >= 0) plan.send_to = static_cast<int>(to_ranks[to_order[static_cast<std::size_t>(send_index)]]);
  const NDSlice::Int recv_index = position(to_ranks, my_rank);
  if (recv_index >= 0) {
    const auto it = std::find(to_order.begin(), to_order.end(), recv_index);
    plan.recv_from = static_cast<int>(from_ranks[static_cast<NDSlice::Int>(it - to_order.begin())]);
    plan.self = plan.recv_from == my_rank;
  }
  return plan;
}

std::string describe_send(const SendPlan& plan, int my_rank, std::size_t bytes, std::string_view backend) {
  if (plan.self && plan.also_to.empty())
    return fmt::format("send_tensor to itself (rank {}), {} bytes, local copy", my_rank, bytes);
  std::vector<int> to;
  if (plan.send_to >= 0 && !plan.self) to.push_back(plan.send_to);
  to.insert(to.end(), plan.also_to.begin(), plan.also_to.end());
  std::string parts = plan.self ? "local copy" : "";
  if (!to.empty())
    parts +=
        fmt::format("{}send to rank{} {}", parts.empty() ? "" : " and ", to.size() > 1 ? "s" : "", fmt::join(to, ","));
  if (plan.recv_from >= 0 && !plan.self)
    parts += fmt::format("{}receive from rank {}", parts.empty() ? "" : " and ", plan.recv_from);
  if (parts.empty()) parts = "no part";
  return fmt::format("send_tensor on rank {}: {}, {} bytes ({})", my_rank, parts, bytes, backend);
}

void check_count(std::int64_t count, std::string_view what) {
  if (count > INT_MAX) {
    throw UsageError(
        fmt::format("{}: expected at most {} elements in one message (MPI's counts are int, the emulated accelerator's "
                    "included; NCCL's are not), "
                    "found {}",
                    what, INT_MAX, count));
  }
}

}  // namespace meshrt::detail
