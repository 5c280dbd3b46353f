// meshrt-bench device-collectives: the device layer's communicator (all_reduce,
// all_gather, reduce_scatter, all_to_all, send) on the job's accelerator against the same
// call made by hand with the backend's own library in the same run, 8 B to 256 MiB:
//   emulated (the default without a GPU; MESHRT_ACCELERATOR=emulated): the same MPI call on
//            host buffers (the emulated communicator runs MPI on its stream's thread, so
//            the ratio is what the device layer's stream and communicator cost);
//   cuda     (MESHRT_ACCELERATOR=cuda or auto on a GPU node): the same NCCL call on a CUDA
//            stream over a communicator made by hand (ncclGetUniqueId, MPI_Bcast,
//            ncclCommInitRank), on the same device buffers.
// Each operation is enqueued and its stream synchronized, on both sides. The "mpi" column
// of the table is the by-hand side (MPI or NCCL). float32, Sum; bytes as nccl-tests count
// them (the whole array); send: rank i -> i + n/2.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bench.hpp"
#include "meshrt/config.hpp"
#include "meshrt/internal/device.hpp"
#if MESHRT_HAVE_NCCL
#include <cuda_runtime_api.h>
#include <nccl.h>
#endif

namespace meshrt::bench {
namespace {

using device::Accelerator;

struct Setup {
  Accelerator accelerator = Accelerator::Emulated;
  int device = 0;
  device::Stream stream;
  std::unique_ptr<device::Communicator> comm;
  MPI_Comm mpi = MPI_COMM_NULL;  // the by-hand MPI side's communicator
#if MESHRT_HAVE_NCCL
  ncclComm_t nccl = nullptr;  // the by-hand NCCL side's
  cudaStream_t cuda_stream = nullptr;
#endif
};

#if MESHRT_HAVE_NCCL
// With NCCL_COMM_BLOCKING=0 in the environment the by-hand communicator is non-blocking
// too: a call may return ncclInProgress, and `comm`'s state says when it has finished.
void nccl_check(ncclResult_t rc, const char* what, ncclComm_t comm = nullptr) {
  while (rc == ncclInProgress && comm != nullptr) {
    std::this_thread::yield();
    ncclResult_t state = ncclSuccess;
    const ncclResult_t got = ncclCommGetAsyncError(comm, &state);
    rc = got != ncclSuccess ? got : state;
  }
  if (rc != ncclSuccess) {
    throw std::runtime_error(std::string("device-collectives: ") + what + " by hand: expected ncclSuccess, found " +
                             ncclGetErrorString(rc));
  }
}
void cuda_check(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess) {
    throw std::runtime_error(std::string("device-collectives: ") + what + " by hand: expected cudaSuccess, found " +
                             cudaGetErrorString(rc));
  }
}
#endif

// Whether the by-hand side is NCCL (cuda in a build with NCCL) rather than MPI on host
// buffers (emulated, or cuda built without NCCL).
bool nccl_by_hand(const Setup& s) {
  return MESHRT_HAVE_NCCL && s.accelerator == Accelerator::Cuda;
}

// The buffers of one message size: device tensors from the pool (both sides on cuda use
// them) and host vectors (the MPI side on emulated). Replaced when another size starts:
// every size at once would take GiBs at 256 MiB.
struct Buffers {
  std::size_t in_b = 0, out_b = 0;
  Tensor in, out;
  std::vector<char> host_in, host_out;
};

Buffers& buffers(Setup& s, std::size_t in_b, std::size_t out_b) {
  static Buffers b;
  if (b.in_b != in_b || b.out_b != out_b || !b.in.defined()) {
    s.stream.synchronize();
    b = Buffers{};
    b.in_b = in_b;
    b.out_b = out_b;
    device::Backend& backend = device::backend(s.accelerator);
    const Device where = Device::of(device::device_kind(s.accelerator), s.device);
    const auto elements = [](std::size_t bytes) { return static_cast<std::int64_t>(bytes / 4); };
    b.in = backend.empty(TensorMeta({elements(in_b)}, DType::Float32, where), s.stream);
    b.out = backend.empty(TensorMeta({elements(out_b)}, DType::Float32, where), s.stream);
    backend.memset_async(b.in.raw_data(), 0, in_b, s.stream);
    backend.memset_async(b.out.raw_data(), 0, out_b, s.stream);
    s.stream.synchronize();
    if (!nccl_by_hand(s)) {
      b.host_in.assign(in_b, 0);
      b.host_out.assign(out_b, 0);
    }
  }
  return b;
}

Setup& setup(const Context& ctx) {
  // Never destroyed: its communicators would be freed after MPI_Finalize.
  static Setup* s = [&] {
    auto* out = new Setup;
    const Accelerator configured = device::configured_accelerator();
    out->accelerator = configured == Accelerator::None ? Accelerator::Emulated : configured;
    out->device = device::select_device(out->accelerator, ctx.comm);
    device::set_placement({out->accelerator, out->device});
    device::Backend& backend = device::backend(out->accelerator);
    backend.make_current(out->device);
    out->stream = backend.create_stream(out->device);
    out->comm = device::create_communicator(out->accelerator, ctx.comm, out->device, std::chrono::seconds(120));
    MPI_Comm_dup(ctx.comm, &out->mpi);
#if MESHRT_HAVE_NCCL
    if (out->accelerator == Accelerator::Cuda) {
      cuda_check(cudaSetDevice(out->device), "cudaSetDevice");
      ncclUniqueId id;
      if (ctx.rank == 0) nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
      MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, ctx.comm);
      const ncclResult_t rc = ncclCommInitRank(&out->nccl, ctx.size, id, ctx.rank);
      nccl_check(rc, "ncclCommInitRank", out->nccl);
      cuda_check(cudaStreamCreateWithFlags(&out->cuda_stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    }
#endif
    if (ctx.rank == 0) {
      std::printf("device-collectives on %s (device %d of rank 0), by hand: %s\n",
                  std::string(device::name(out->accelerator)).c_str(), out->device,
                  nccl_by_hand(*out) ? "NCCL" : "MPI on host buffers");
    }
    return out;
  }();
  return *s;
}

enum class Op { all_reduce, all_gather, reduce_scatter, all_to_all, send };

// One operation through the device layer's communicator, and its stream synchronized.
void through_meshrt(Setup& s, Op op, std::size_t whole, std::size_t per_rank, int rank, int n, std::size_t in_b,
                    std::size_t out_b) {
  Buffers& b = buffers(s, in_b, out_b);
  void* in = b.in.raw_data();
  void* out = b.out.raw_data();
  const int h = n / 2;
  switch (op) {
    case Op::all_reduce:
      s.comm->all_reduce(in, out, whole, DType::Float32, Reduction::Sum, s.stream);
      break;
    case Op::all_gather:
      s.comm->all_gather(in, out, per_rank, DType::Float32, s.stream);
      break;
    case Op::reduce_scatter:
      s.comm->reduce_scatter(in, out, per_rank, DType::Float32, Reduction::Sum, s.stream);
      break;
    case Op::all_to_all:
      s.comm->all_to_all(in, out, per_rank, DType::Float32, s.stream);
      break;
    case Op::send:
      if (rank < 2 * h) {
        const device::Communicator::PeerOp peer{rank < h, rank < h ? rank + h : rank - h, rank < h ? in : out, whole};
        s.comm->send_recv(std::span(&peer, 1), DType::Float32, s.stream);
      }
      break;
  }
  s.stream.synchronize();
}

// The same operation made by hand with the backend's library.
void by_hand(Setup& s, Op op, std::size_t whole, std::size_t per_rank, int rank, int n, std::size_t in_b,
             std::size_t out_b) {
  Buffers& b = buffers(s, in_b, out_b);
  const int h = n / 2;
#if MESHRT_HAVE_NCCL
  if (nccl_by_hand(s)) {
    const void* in = b.in.raw_data();
    void* out = b.out.raw_data();
    ncclResult_t rc = ncclSuccess;
    switch (op) {
      case Op::all_reduce:
        rc = ncclAllReduce(in, out, whole, ncclFloat, ncclSum, s.nccl, s.cuda_stream);
        break;
      case Op::all_gather:
        rc = ncclAllGather(in, out, per_rank, ncclFloat, s.nccl, s.cuda_stream);
        break;
      case Op::reduce_scatter:
        rc = ncclReduceScatter(in, out, per_rank, ncclFloat, ncclSum, s.nccl, s.cuda_stream);
        break;
      case Op::all_to_all:
        // As nccl-tests' alltoall: grouped sends and receives of one block per peer.
        nccl_check(ncclGroupStart(), "ncclGroupStart");
        for (int peer = 0; peer < n; ++peer) {
          const std::size_t offset = static_cast<std::size_t>(peer) * per_rank;
          nccl_check(ncclSend(static_cast<const float*>(in) + offset, per_rank, ncclFloat, peer, s.nccl, s.cuda_stream),
                     "ncclSend");
          nccl_check(ncclRecv(static_cast<float*>(out) + offset, per_rank, ncclFloat, peer, s.nccl, s.cuda_stream),
                     "ncclRecv");
        }
        rc = ncclGroupEnd();
        break;
      case Op::send:
        if (rank < h) rc = ncclSend(in, whole, ncclFloat, rank + h, s.nccl, s.cuda_stream);
        if (rank >= h && rank < 2 * h) rc = ncclRecv(out, whole, ncclFloat, rank - h, s.nccl, s.cuda_stream);
        break;
    }
    nccl_check(rc, "the NCCL call", s.nccl);
    cuda_check(cudaStreamSynchronize(s.cuda_stream), "cudaStreamSynchronize");
    return;
  }
#endif
  void* in = b.host_in.data();
  void* out = b.host_out.data();
  const int cw = static_cast<int>(whole), cp = static_cast<int>(per_rank);
  switch (op) {
    case Op::all_reduce:
      MPI_Allreduce(in, out, cw, MPI_FLOAT, MPI_SUM, s.mpi);
      break;
    case Op::all_gather:
      MPI_Allgather(in, cp, MPI_FLOAT, out, cp, MPI_FLOAT, s.mpi);
      break;
    case Op::reduce_scatter:
      MPI_Reduce_scatter_block(in, out, cp, MPI_FLOAT, MPI_SUM, s.mpi);
      break;
    case Op::all_to_all:
      MPI_Alltoall(in, cp, MPI_FLOAT, out, cp, MPI_FLOAT, s.mpi);
      break;
    case Op::send:
      if (rank < h) MPI_Send(in, cw, MPI_FLOAT, rank + h, 0, s.mpi);
      if (rank >= h && rank < 2 * h) MPI_Recv(out, cw, MPI_FLOAT, rank - h, 0, s.mpi, MPI_STATUS_IGNORE);
      break;
  }
}

void register_device_collectives(Context& ctx) {
  Setup* setup_or_null = nullptr;
  try {
    setup_or_null = &setup(ctx);
  } catch (const std::exception& e) {
    // No device, or a communicator that did not form: say so and end the job, so no rank
    // waits in a collective for this one.
    std::fprintf(stderr, "meshrt-bench device-collectives: rank %d: %s\n", ctx.rank, e.what());
    MPI_Abort(ctx.comm, 1);
  }
  Setup& s = *setup_or_null;
  const int n = ctx.size;
  const int rank = ctx.rank;
  std::vector<std::size_t> sizes = sizes_up_to(std::size_t{256} << 20, ctx.quick);
  if (!ctx.quick) sizes.push_back(std::size_t{256} << 20);
  struct Named {
    const char* name;
    Op op;
    BusFactor bus;
  };
  const Named ops[] = {{"all_reduce", Op::all_reduce, BusFactor::all_reduce},
                       {"all_gather", Op::all_gather, BusFactor::gather_like},
                       {"reduce_scatter", Op::reduce_scatter, BusFactor::gather_like},
                       {"all_to_all", Op::all_to_all, BusFactor::gather_like},
                       {"send", Op::send, BusFactor::one}};
  for (const Named& named : ops) {
    if (named.op == Op::send && n < 2) continue;
    for (std::size_t bytes : sizes) {
      // float32 elements; sizes below one element per rank keep one element per rank.
      const std::size_t per_rank = std::max<std::size_t>(bytes / 4 / static_cast<std::size_t>(n), 1);
      const std::size_t whole = per_rank * static_cast<std::size_t>(n);
      const std::size_t wb = whole * 4, pb = per_rank * 4;
      const std::size_t in_b = named.op == Op::all_gather ? pb : wb;
      const std::size_t out_b = named.op == Op::reduce_scatter ? pb : wb;
      const int inner = bytes >= (std::size_t{16} << 20)   ? 1
                        : bytes >= (std::size_t{1} << 20)  ? 3
                        : bytes >= (std::size_t{64} << 10) ? 10
                                                           : 100;
      const int iterations = bytes >= (std::size_t{16} << 20) ? 3 : bytes >= (std::size_t{1} << 20) ? 10 : 30;
      const Op op = named.op;
      Setup* sp = &s;
      add_pair(ctx, {.suite = "device-collectives",
                     .op = named.name,
                     .bytes = bytes,
                     .bus = named.bus,
                     .inner = inner,
                     .iterations = iterations,
                     .meshrt = [=] { through_meshrt(*sp, op, whole, per_rank, rank, n, in_b, out_b); },
                     .mpi = [=] { by_hand(*sp, op, whole, per_rank, rank, n, in_b, out_b); }});
    }
  }
}

}  // namespace
MESHRT_BENCH_SUITE("device-collectives",
                   "the device layer's communicator on the job's accelerator against the same MPI (emulated) or "
                   "NCCL (cuda) call by hand",
                   register_device_collectives);
}  // namespace meshrt::bench
