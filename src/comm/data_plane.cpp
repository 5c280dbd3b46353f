// The MPI data plane for CPU tensors: Reduce as all_reduce / all_gather / all_to_all /
// reduce_scatter over a mesh dimension's communicator, SendTensor as point-to-point.
#include <fmt/format.h>

#include <array>
#include <cstring>

#include "comm/mpi_types.hpp"
#include "comm/output_pool.hpp"
#include "comm/plan.hpp"
#include "common/checks.hpp"
#include "meshrt/comm.hpp"

namespace meshrt {

Outcome Pending::take() {
  if (!finished_) {
    throw UsageError("Pending::take: expected a completed operation (test() returned true), found one in flight: " +
                     describe());
  }
  if (taken_) throw UsageError("Pending::take: expected an outcome not yet taken, found it taken: " + describe());
  taken_ = true;
  if (!deferred_error_.empty()) throw UsageError(deferred_error_);
  return std::move(outcome_);
}

namespace {

// One MPI operation in flight: up to two requests (a send and a receive), the tensors
// that must stay alive until they complete, and the avg division still to do.
class MpiPending final : public Pending {
 public:
  bool test() override {
    if (finished()) return true;
    int flag = 0;
    MESHRT_MPI_CHECK(MPI_Testall(nreqs, reqs.data(), &flag, MPI_STATUSES_IGNORE));
    if (!flag) return false;
    complete();
    return true;
  }

  std::string describe() const override {
    if (mesh) return detail::describe_reduce(*mesh, dim, collective, reduction, bytes, "MPI");
    return detail::describe_send(send, my_rank, bytes, "MPI");
  }

  void complete() {
    if (divide_by > 1) detail::divide_in_place(result.tensor.raw_data(), result.tensor.numel(), result.tensor.dtype(),
                                               divide_by);
    sent = Tensor();
    finish(std::move(result));
  }

  void defer(std::string message) { fail_after_completion(std::move(message)); }

  // Described lazily: formatting on every operation would cost more than an 8-byte
  // all_reduce. The mesh outlives every operation on it (the worker deletes a mesh only
  // after the commands that use it).
  const WorkerMesh* mesh = nullptr;
  std::size_t dim = 0;
  const char* collective = "";
  Reduction reduction = Reduction::Sum;
  detail::SendPlan send;
  int my_rank = -1;
  std::size_t bytes = 0;

  std::array<MPI_Request, 2> reqs{MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  int nreqs = 0;
  Tensor sent;  // the input, kept alive while MPI reads it
  Outcome result;
  std::int64_t divide_by = 0;
};

int as_count(std::int64_t n) { return static_cast<int>(n); }  // plan_* checked the range

}  // namespace

std::unique_ptr<Pending> start_reduce(WorkerMesh& mesh, std::string_view dim, Reduction reduction, bool scatter,
                                      bool inplace, Input input, const TensorMeta& factory, Completion completion) {
  const detail::ReducePlan plan =
      detail::plan_reduce(mesh, dim, reduction, scatter, inplace, factory, detail::Backend::Mpi);
  auto p = std::make_unique<MpiPending>();
  p->mesh = &mesh;
  p->dim = plan.dim;
  p->collective = plan.collective;
  p->reduction = reduction;
  p->bytes = factory.nbytes();

  detail::Joined in = detail::join_input(std::move(input), factory, plan.collective,
                                         std::string_view{});  // text completed below if needed
  if (!in.mismatch.empty()) p->defer(in.mismatch + detail::where_reduce(mesh, plan.dim));
  p->result.broken = in.broken;

  const MPI_Comm comm = mesh.dim_comm(plan.dim);
  const MPI_Datatype type = detail::mpi_datatype(factory.dtype());
  const bool blocking = completion == Completion::Blocking;
  const std::int64_t numel = factory.numel();
  void* src = in.tensor.raw_data();
  MPI_Request* req = &p->reqs[0];

  if (reduction == Reduction::Stack && !scatter) {
    Tensor out = detail::output_tensor(plan.out_meta(factory));
    const int count = as_count(numel);
    if (blocking) MESHRT_MPI_CHECK(MPI_Allgather(src, count, type, out.raw_data(), count, type, comm));
    else MESHRT_MPI_CHECK(MPI_Iallgather(src, count, type, out.raw_data(), count, type, comm, req));
    p->result.tensor = std::move(out);
  } else if (reduction == Reduction::Stack) {
    const int count = as_count(numel / plan.n);
    Tensor out = inplace ? in.tensor : detail::output_tensor(plan.out_meta(factory));
    // In place is allowed (the prototype refused it: a known bug, not ported).
    const void* send_buf = inplace ? MPI_IN_PLACE : src;
    const MPI_Datatype send_type = inplace ? MPI_DATATYPE_NULL : type;
    if (blocking) MESHRT_MPI_CHECK(MPI_Alltoall(send_buf, count, send_type, out.raw_data(), count, type, comm));
    else MESHRT_MPI_CHECK(MPI_Ialltoall(send_buf, count, send_type, out.raw_data(), count, type, comm, req));
    p->result.tensor = std::move(out);
  } else {
    const MPI_Op op = detail::mpi_op(reduction, factory.dtype());
    if (scatter) {
      Tensor out = detail::output_tensor(plan.out_meta(factory));
      const int count = as_count(numel / plan.n);
      if (blocking) MESHRT_MPI_CHECK(MPI_Reduce_scatter_block(src, out.raw_data(), count, type, op, comm));
      else MESHRT_MPI_CHECK(MPI_Ireduce_scatter_block(src, out.raw_data(), count, type, op, comm, req));
      p->result.tensor = std::move(out);
    } else {
      // In place, the output is the input's storage (for a broken input: the zeros).
      Tensor out = inplace ? in.tensor : detail::output_tensor(plan.out_meta(factory));
      const void* send_buf = inplace ? MPI_IN_PLACE : src;
      const int count = as_count(numel);
      if (blocking) MESHRT_MPI_CHECK(MPI_Allreduce(send_buf, out.raw_data(), count, type, op, comm));
      else MESHRT_MPI_CHECK(MPI_Iallreduce(send_buf, out.raw_data(), count, type, op, comm, req));
      p->result.tensor = std::move(out);
    }
    if (reduction == Reduction::Avg) p->divide_by = plan.n;
  }
  p->sent = std::move(in.tensor);
  if (blocking) {
    p->complete();
  } else {
    p->nreqs = 1;
  }
  return p;
}

namespace {
// One tag for every SendTensor: MPI does not reorder messages of one (communicator,
// source, tag), and every rank issues SendTensor commands in the controller's order.
constexpr int kSendTensorTag = 0x5e4d;
}  // namespace

std::unique_ptr<Pending> start_send_tensor(MPI_Comm p2p, int my_rank, const NDSlice& from_ranks,
                                           const NDSlice& to_ranks, Input input, const TensorMeta& factory,
                                           Completion completion) {
  int comm_size = 0;
  MESHRT_MPI_CHECK(MPI_Comm_size(p2p, &comm_size));
  const detail::SendPlan plan = detail::plan_send(my_rank, comm_size, from_ranks, to_ranks, factory,
                                                  detail::Backend::Mpi);
  auto p = std::make_unique<MpiPending>();
  p->send = plan;
  p->my_rank = my_rank;
  p->bytes = factory.nbytes();
  if (plan.send_to < 0 && plan.recv_from < 0) {
    p->complete();  // no part in this command: an undefined outcome
    return p;
  }
  if (plan.send_to >= 0) {
    detail::Joined in = detail::join_input(std::move(input), factory, "send_tensor",
                                           fmt::format(" (world rank {}, sending to rank {})", my_rank, plan.send_to));
    if (!in.mismatch.empty()) p->defer(std::move(in.mismatch));
    if (plan.self) {
      // The local copy is a new tensor (the prototype handed back the input and then
      // overwrote it with the receive: a known bug, not ported). Only here can a
      // receiver know its value is broken: it is its own sender.
      p->result.tensor = detail::output_tensor(factory);
      std::memcpy(p->result.tensor.raw_data(), in.tensor.raw_data(), factory.nbytes());
      p->result.broken = in.broken;
      p->complete();
      return p;
    }
    p->sent = std::move(in.tensor);
  }
  const MPI_Datatype type = detail::mpi_datatype(factory.dtype());
  const int count = as_count(factory.numel());
  // Receive first, then send: with both posted before waiting, a ring of ranks that each
  // send and receive cannot deadlock however large the message.
  if (plan.recv_from >= 0) {
    p->result.tensor = detail::output_tensor(factory);
    MESHRT_MPI_CHECK(MPI_Irecv(p->result.tensor.raw_data(), count, type, plan.recv_from, kSendTensorTag, p2p,
                               &p->reqs[static_cast<std::size_t>(p->nreqs++)]));
  }
  if (plan.send_to >= 0) {
    MESHRT_MPI_CHECK(MPI_Isend(p->sent.raw_data(), count, type, plan.send_to, kSendTensorTag, p2p,
                               &p->reqs[static_cast<std::size_t>(p->nreqs++)]));
  }
  if (completion == Completion::Blocking) {
    MESHRT_MPI_CHECK(MPI_Waitall(p->nreqs, p->reqs.data(), MPI_STATUSES_IGNORE));
    p->complete();
  }
  return p;
}

Outcome reduce(WorkerMesh& mesh, std::string_view dim, Reduction reduction, bool scatter, bool inplace, Input input,
               const TensorMeta& factory) {
  auto p = start_reduce(mesh, dim, reduction, scatter, inplace, std::move(input), factory, kDefaultCompletion);
  return wait(*p);
}

Outcome send_tensor(MPI_Comm p2p, int my_rank, const NDSlice& from_ranks, const NDSlice& to_ranks, Input input,
                    const TensorMeta& factory) {
  auto p = start_send_tensor(p2p, my_rank, from_ranks, to_ranks, std::move(input), factory, kDefaultCompletion);
  return wait(*p);
}

}  // namespace meshrt
