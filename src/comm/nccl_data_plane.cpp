// The NCCL data plane for CUDA tensors (built only with MESHRT_HAVE_NCCL). Operations are
// enqueued on the caller's CUDA stream; Pending::test queries an event recorded after
// them, so the worker's loop never blocks on the GPU.
#include <fmt/format.h>

#include <climits>

#include "comm/plan.hpp"
#include "common/assert.hpp"
#include "common/checks.hpp"
#include "meshrt/comm.hpp"

namespace meshrt {
namespace {

ncclDataType_t nccl_datatype(DType dtype) {
  switch (dtype) {
    case DType::Bool:  // one byte holding 0 or 1: min (all) and max (any) work on it
    case DType::UInt8:
      return ncclUint8;
    case DType::Int32:
      return ncclInt32;
    case DType::Int64:
      return ncclInt64;
    case DType::Float16:
      return ncclFloat16;
    case DType::BFloat16:
      return ncclBfloat16;
    case DType::Float32:
      return ncclFloat32;
    case DType::Float64:
      return ncclFloat64;
  }
  throw UsageError(fmt::format("expected a valid dtype, found code {}", static_cast<int>(dtype)));
}

ncclRedOp_t nccl_op(Reduction r) {
  switch (r) {
    case Reduction::Sum:
      return ncclSum;
    case Reduction::Avg:
      return ncclAvg;
    case Reduction::Product:
      return ncclProd;
    case Reduction::Min:
      return ncclMin;
    case Reduction::Max:
      return ncclMax;
    default:
      break;
  }
  // plan_reduce refuses bitwise reductions on NCCL (reduction_rule) before we get here.
  MESHRT_INTERNAL(fmt::format("nccl_op: expected a reduction NCCL has, found {}", name(r)));
}

// Makes `device` current for the scope of one enqueue.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    MESHRT_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) MESHRT_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceScope() { (void)cudaSetDevice(previous_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
};

class NcclPending final : public Pending {
 public:
  ~NcclPending() override {
    if (event_) (void)cudaEventDestroy(event_);
  }

  // Records the completion event on `stream`, after everything enqueued so far.
  void record(cudaStream_t stream) {
    MESHRT_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    MESHRT_CUDA_CHECK(cudaEventRecord(event_, stream));
  }

  bool test() override {
    if (finished()) return true;
    if (event_) {
      const cudaError_t rc = cudaEventQuery(event_);
      if (rc == cudaErrorNotReady) return false;
      MESHRT_CUDA_CHECK(rc);
    }
    sent = Tensor();
    scratch = Tensor();
    finish(std::move(result));
    return true;
  }

  std::string describe() const override { return text; }
  void defer(std::string message) { fail_after_completion(std::move(message)); }

  std::string text;  // NCCL operations cost microseconds to launch: formatting is cheap beside
  Tensor sent;
  Tensor scratch;
  Outcome result;

 private:
  cudaEvent_t event_ = nullptr;
};

}  // namespace

std::unique_ptr<Pending> start_reduce_nccl(WorkerMesh& mesh, std::string_view dim, Reduction reduction, bool scatter,
                                           bool inplace, Input input, const TensorMeta& factory,
                                           CudaStream stream_handle) {
  const detail::ReducePlan plan =
      detail::plan_reduce(mesh, dim, reduction, scatter, inplace, factory, detail::Backend::Nccl);
  DeviceScope device(factory.device().index());
  auto stream = static_cast<cudaStream_t>(stream_handle);
  auto p = std::make_unique<NcclPending>();
  p->text = detail::describe_reduce(mesh, plan.dim, plan.collective, reduction, factory.nbytes(), "NCCL");
  detail::Joined in =
      detail::join_input(std::move(input), factory, plan.collective, detail::where_reduce(mesh, plan.dim));
  if (!in.mismatch.empty()) p->defer(in.mismatch);
  p->result.broken = in.broken;

  ncclComm_t comm = mesh.nccl_comm(plan.dim);
  const ncclDataType_t type = nccl_datatype(factory.dtype());
  const auto numel = static_cast<std::size_t>(factory.numel());
  const auto n = static_cast<std::size_t>(plan.n);
  void* src = in.tensor.raw_data();
  if (reduction == Reduction::Stack && !scatter) {
    Tensor out = plan.out_meta(factory).empty();
    MESHRT_NCCL_CHECK(ncclAllGather(src, out.raw_data(), numel, type, comm, stream));
    p->result.tensor = std::move(out);
  } else if (reduction == Reduction::Stack) {
    // NCCL has no in-place all-to-all: in place goes through a scratch output that is
    // copied back on the same stream.
    Tensor out = plan.out_meta(factory).empty();
    const std::size_t chunk = numel / n;
    const std::size_t chunk_bytes = factory.nbytes() / n;
    auto* in_bytes = static_cast<char*>(src);
    auto* out_bytes = static_cast<char*>(out.raw_data());
    MESHRT_NCCL_CHECK(ncclGroupStart());
    for (std::size_t r = 0; r < n; ++r) {
      MESHRT_NCCL_CHECK(ncclSend(in_bytes + r * chunk_bytes, chunk, type, static_cast<int>(r), comm, stream));
      MESHRT_NCCL_CHECK(ncclRecv(out_bytes + r * chunk_bytes, chunk, type, static_cast<int>(r), comm, stream));
    }
    MESHRT_NCCL_CHECK(ncclGroupEnd());
    if (inplace) {
      MESHRT_CUDA_CHECK(cudaMemcpyAsync(src, out.raw_data(), factory.nbytes(), cudaMemcpyDeviceToDevice, stream));
      p->scratch = std::move(out);
      p->result.tensor = in.tensor;
    } else {
      p->result.tensor = std::move(out);
    }
  } else if (scatter) {
    Tensor out = plan.out_meta(factory).empty();
    MESHRT_NCCL_CHECK(ncclReduceScatter(src, out.raw_data(), numel / n, type, nccl_op(reduction), comm, stream));
    p->result.tensor = std::move(out);
  } else {
    Tensor out = inplace ? in.tensor : plan.out_meta(factory).empty();
    MESHRT_NCCL_CHECK(ncclAllReduce(src, out.raw_data(), numel, type, nccl_op(reduction), comm, stream));
    p->result.tensor = std::move(out);
  }
  p->sent = std::move(in.tensor);
  p->record(stream);
  return p;
}

std::unique_ptr<Pending> start_send_tensor_nccl(WorkerMesh& mesh, const NDSlice& from_ranks, const NDSlice& to_ranks,
                                                Input input, const TensorMeta& factory, CudaStream stream_handle,
                                                std::span<const std::int64_t> to_order) {
  // from_ranks and to_ranks are world ranks, as for the MPI path; NCCL addresses peers by
  // their index in `mesh`, which must hold every rank of both.
  const int me = mesh.world_rank();
  const NDSlice& members = mesh.ranks();
  const detail::SendPlan plan =
      detail::plan_send(me, static_cast<int>(INT_MAX), from_ranks, to_ranks, factory, detail::Backend::Nccl, to_order);
  auto p = std::make_unique<NcclPending>();
  p->text = detail::describe_send(plan, me, factory.nbytes(), "NCCL");
  if (plan.send_to < 0 && plan.recv_from < 0) {
    (void)p->test();
    return p;
  }
  for (int r : {plan.send_to, plan.recv_from}) {
    if (r >= 0 && !members.contains(r)) {
      throw UsageError(
          fmt::format("send_tensor over NCCL: expected every peer in the mesh {} ({}), found rank {} "
                      "outside it (world rank {})",
                      mesh.to_string(), members.to_string(), r, me));
    }
  }
  DeviceScope device(factory.device().index());
  auto stream = static_cast<cudaStream_t>(stream_handle);
  const auto count = static_cast<std::size_t>(factory.numel());
  const ncclDataType_t type = nccl_datatype(factory.dtype());
  if (plan.send_to >= 0) {
    detail::Joined in = detail::join_input(std::move(input), factory, "send_tensor",
                                           fmt::format(" (world rank {}, sending to rank {})", me, plan.send_to));
    if (!in.mismatch.empty()) p->defer(std::move(in.mismatch));
    if (plan.self) {
      Tensor copy = factory.empty();
      MESHRT_CUDA_CHECK(
          cudaMemcpyAsync(copy.raw_data(), in.tensor.raw_data(), factory.nbytes(), cudaMemcpyDeviceToDevice, stream));
      p->result.tensor = std::move(copy);
      p->result.broken = in.broken;
      p->sent = std::move(in.tensor);
      p->record(stream);
      return p;
    }
    p->sent = std::move(in.tensor);
  }
  ncclComm_t comm = mesh.nccl_mesh_comm();
  MESHRT_NCCL_CHECK(ncclGroupStart());
  if (plan.recv_from >= 0) {
    p->result.tensor = factory.empty();
    MESHRT_NCCL_CHECK(ncclRecv(p->result.tensor.raw_data(), count, type,
                               static_cast<int>(members.index(plan.recv_from)), comm, stream));
  }
  if (plan.send_to >= 0) {
    MESHRT_NCCL_CHECK(
        ncclSend(p->sent.raw_data(), count, type, static_cast<int>(members.index(plan.send_to)), comm, stream));
  }
  MESHRT_NCCL_CHECK(ncclGroupEnd());
  p->record(stream);
  return p;
}

}  // namespace meshrt
