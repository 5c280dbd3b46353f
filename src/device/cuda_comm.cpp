// The cuda backend's communicator: NCCL, non-blocking (config.blocking = 0) so that init
// and every call can be polled against a deadline and aborted from the issuing thread.
#include <fmt/format.h>

#include <chrono>
#include <memory>
#include <vector>

#include "common/backoff.hpp"
#include "common/mpi_wait.hpp"
#include "device/backend.hpp"
#include "device/cuda.hpp"
#include "device/cuda_kernels.hpp"
#include "device/nan_rule.hpp"
#include "meshrt/internal/settings.hpp"

namespace meshrt::device {
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
  throw UsageError(fmt::format("NCCL: expected a valid dtype, found code {}", static_cast<int>(dtype)));
}

// Avg is ncclSum and a division kernel: ncclAvg pre-multiplies by 1/n (rounded to the
// dtype), which differs from the CPU's sum-then-divide when n is not a power of two.
ncclRedOp_t nccl_op(Reduction r, const std::string& where) {
  switch (r) {
    case Reduction::Sum:
    case Reduction::Avg:
      return ncclSum;
    case Reduction::Product:
      return ncclProd;
    case Reduction::Min:
      return ncclMin;
    case Reduction::Max:
      return ncclMax;
    default:
      break;
  }
  throw UsageError(fmt::format("{}: expected sum, avg, product, min or max (NCCL has no {} operator), found {}", where,
                               name(r), name(r)));
}

std::string nccl_message(ncclComm_t comm, ncclResult_t rc) {
  const char* last = comm != nullptr ? ncclGetLastError(comm) : nullptr;
  return fmt::format("{}{}{}", ncclGetErrorString(rc), last != nullptr && *last != '\0' ? ": " : "",
                     last != nullptr ? last : "");
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, int rank, int size, int device)
      : comm_(comm), rank_(rank), size_(size), device_(device), timeout_(settings::kDeviceTimeout.get()) {}
  ~NcclCommunicator() override { destroy(); }

  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return size_; }
  int device() const noexcept override { return device_; }

  void all_reduce(const void* send, void* recv, std::size_t count, DType dtype, Reduction reduction,
                  const Stream& stream) override {
    const ncclRedOp_t op = nccl_op(reduction, where("all_reduce"));
    cudaStream_t s = native(stream, "all_reduce");
    CudaDeviceGuard guard(device_);
    const NanMasks masks = nan_masks(send, count, count, dtype, reduction, stream);
    Group group(*this, "all_reduce");
    check(ncclAllReduce(send, recv, count, nccl_datatype(dtype), op, comm_, s), "ncclAllReduce");
    if (masks) {
      check(ncclAllReduce(masks.send, masks.recv, count, ncclUint8, ncclMax, comm_, s), "ncclAllReduce (NaN mask)");
    }
    group.end();
    if (masks)
      cuda_kernels::apply_nan_mask(static_cast<int>(dtype), recv, masks.recv, static_cast<std::int64_t>(count), s);
    if (reduction == Reduction::Avg) divide(recv, count, dtype, s);
  }
  void reduce(const void* send, void* recv, std::size_t count, DType dtype, Reduction reduction, int root,
              const Stream& stream) override {
    const ncclRedOp_t op = nccl_op(reduction, where("reduce"));
    check_root(root, "reduce");
    cudaStream_t s = native(stream, "reduce");
    CudaDeviceGuard guard(device_);
    const bool at_root = root == rank_;
    // Every member makes its mask and reduces it in place (the root's is the result there);
    // the root alone applies it.
    const NanMasks masks = nan_masks(send, count, count, dtype, reduction, stream);
    Group group(*this, "reduce");
    check(ncclReduce(send, recv, count, nccl_datatype(dtype), op, root, comm_, s), "ncclReduce");
    if (masks) {
      check(ncclReduce(masks.send, masks.send, count, ncclUint8, ncclMax, root, comm_, s), "ncclReduce (NaN mask)");
    }
    group.end();
    if (!at_root) return;
    if (masks)
      cuda_kernels::apply_nan_mask(static_cast<int>(dtype), recv, masks.send, static_cast<std::int64_t>(count), s);
    if (reduction == Reduction::Avg) divide(recv, count, dtype, s);
  }
  void broadcast(const void* send, void* recv, std::size_t count, DType dtype, int root,
                 const Stream& stream) override {
    check_root(root, "broadcast");
    cudaStream_t s = native(stream, "broadcast");
    CudaDeviceGuard guard(device_);
    if (auto fault = take_enqueue_fault()) throw SystemError(fmt::format("{}: {}", where("broadcast"), *fault));
    check(ncclBroadcast(send, recv, count, nccl_datatype(dtype), root, comm_, s), "ncclBroadcast");
  }
  void all_gather(const void* send, void* recv, std::size_t count, DType dtype, const Stream& stream) override {
    cudaStream_t s = native(stream, "all_gather");
    CudaDeviceGuard guard(device_);
    if (auto fault = take_enqueue_fault()) throw SystemError(fmt::format("{}: {}", where("all_gather"), *fault));
    check(ncclAllGather(send, recv, count, nccl_datatype(dtype), comm_, s), "ncclAllGather");
  }
  void reduce_scatter(const void* send, void* recv, std::size_t count, DType dtype, Reduction reduction,
                      const Stream& stream) override {
    const ncclRedOp_t op = nccl_op(reduction, where("reduce_scatter"));
    cudaStream_t s = native(stream, "reduce_scatter");
    CudaDeviceGuard guard(device_);
    const NanMasks masks = nan_masks(send, count * static_cast<std::size_t>(size_), count, dtype, reduction, stream);
    Group group(*this, "reduce_scatter");
    check(ncclReduceScatter(send, recv, count, nccl_datatype(dtype), op, comm_, s), "ncclReduceScatter");
    if (masks) {
      check(ncclReduceScatter(masks.send, masks.recv, count, ncclUint8, ncclMax, comm_, s),
            "ncclReduceScatter (NaN mask)");
    }
    group.end();
    if (masks)
      cuda_kernels::apply_nan_mask(static_cast<int>(dtype), recv, masks.recv, static_cast<std::int64_t>(count), s);
    if (reduction == Reduction::Avg) divide(recv, count, dtype, s);
  }
  void all_to_all(const void* send, void* recv, std::size_t count, DType dtype, const Stream& stream) override {
    if (send == recv) {
      throw UsageError(
          fmt::format("{}: expected distinct send and receive buffers (NCCL has no in-place all-to-all), "
                      "found one buffer",
                      where("all_to_all")));
    }
    cudaStream_t s = native(stream, "all_to_all");
    CudaDeviceGuard guard(device_);
    const ncclDataType_t type = nccl_datatype(dtype);
    const std::size_t block = count * element_size(dtype);
    Group group(*this, "all_to_all");
    for (int r = 0; r < size_; ++r) {
      const auto offset = static_cast<std::size_t>(r) * block;
      check(ncclSend(static_cast<const char*>(send) + offset, count, type, r, comm_, s), "ncclSend");
      check(ncclRecv(static_cast<char*>(recv) + offset, count, type, r, comm_, s), "ncclRecv");
    }
    group.end();
  }
  void send_recv(std::span<const PeerOp> ops, DType dtype, const Stream& stream) override {
    cudaStream_t s = native(stream, "send_recv");
    CudaDeviceGuard guard(device_);
    const ncclDataType_t type = nccl_datatype(dtype);
    Group group(*this, "send_recv");
    for (const PeerOp& op : ops) {
      if (op.send) {
        check(ncclSend(op.buffer, op.count, type, op.peer, comm_, s), "ncclSend");
      } else {
        check(ncclRecv(op.buffer, op.count, type, op.peer, comm_, s), "ncclRecv");
      }
    }
    group.end();
  }

  std::optional<std::string> async_error() override {
    if (comm_ == nullptr) return fmt::format("{} {}", describe(), aborted_ ? "was aborted" : "is destroyed");
    ncclResult_t state = ncclSuccess;
    const ncclResult_t rc = ncclCommGetAsyncError(comm_, &state);
    if (rc != ncclSuccess) return fmt::format("{}: ncclCommGetAsyncError: {}", describe(), nccl_message(comm_, rc));
    if (state != ncclSuccess && state != ncclInProgress) {
      return fmt::format("{}: {}", describe(), nccl_message(comm_, state));
    }
    return std::nullopt;
  }

  void abort() noexcept override {
    if (comm_ == nullptr) return;
    (void)ncclCommAbort(comm_);
    comm_ = nullptr;
    aborted_ = true;
  }

  void destroy() noexcept override {
    if (comm_ == nullptr) return;
    // ncclCommDestroy on a failed communicator may hang: such a one is aborted instead.
    if (async_error()) {
      abort();
      return;
    }
    {
      // Finalize waits for the communicator's work, which a peer that never joins holds
      // up forever: past the deadline it is aborted instead.
      (void)ncclCommFinalize(comm_);
      ncclResult_t state = ncclInProgress;
      const bool settled =
          detail::Backoff(detail::kControl)  // yielding to NCCL's thread, as check() does
              .poll_until(
                  [&] { return ncclCommGetAsyncError(comm_, &state) != ncclSuccess || state != ncclInProgress; },
                  detail::deadline_after(timeout_));
      if (!settled || state != ncclSuccess) {
        abort();
        return;
      }
    }
    (void)ncclCommDestroy(comm_);
    comm_ = nullptr;
  }

  std::string describe() const override {
    return fmt::format("NCCL communicator (rank {} of {} on cuda:{})", rank_, size_, device_);
  }

 private:
  std::string where(const char* what) const { return fmt::format("{} on {}", what, describe()); }
  void check_root(int root, const char* what) const {
    if (root < 0 || root >= size_) {
      throw UsageError(fmt::format("{}: expected a root in 0..{}, found {}", where(what), size_ - 1, root));
    }
  }

  // ncclGroupStart, and ncclGroupEnd on every way out: NCCL keeps the group per thread
  // (its group.h), and a group left open by a call that failed inside it queues every
  // later NCCL call of this thread, on any communicator, and launches none; their events
  // then complete at once with outputs never written. On an error the group's end is
  // called for that alone and its result ignored (the call's error is the one thrown).
  // The test fault (set_enqueue_fault_for_testing) fails the operation right inside it.
  class Group {
   public:
    Group(NcclCommunicator& comm, const char* what) : comm_(comm) {
      comm_.check(ncclGroupStart(), "ncclGroupStart");
      open_ = true;
      if (auto fault = take_enqueue_fault()) {
        close();
        throw SystemError(fmt::format("{}: {}", comm_.where(what), *fault));
      }
    }
    ~Group() { close(); }
    Group(const Group&) = delete;
    Group& operator=(const Group&) = delete;
    void end() {
      open_ = false;
      comm_.check(ncclGroupEnd(), "ncclGroupEnd");
    }

   private:
    void close() noexcept {
      if (!open_) return;
      open_ = false;
      (void)ncclGroupEnd();
    }
    NcclCommunicator& comm_;
    bool open_ = false;
  };

  cudaStream_t native(const Stream& stream, const char* what) const {
    Stream::Impl& s = stream_impl(stream, Accelerator::Cuda, what);
    if (comm_ == nullptr) {
      throw UsageError(fmt::format("{}: expected a live communicator, found it {}", where(what),
                                   aborted_ ? "aborted" : "destroyed"));
    }
    if (s.device() != device_) {
      throw UsageError(fmt::format("{}: expected a stream of cuda:{}, found {}", where(what), device_, s.to_string()));
    }
    return static_cast<cudaStream_t>(s.native());
  }

  // A non-blocking communicator may answer ncclInProgress: the call is then complete only
  // once ncclCommGetAsyncError says so, and nothing else may be issued before. The first
  // call on a communicator may connect to its peers there, so a peer that never posts
  // its part holds it up: polled against MESHRT_DEVICE_TIMEOUT, then aborted (the data
  // plane drops it). Polled yielding from the first poll, never spinning: what is in
  // progress runs on a thread NCCL starts (each group end of a non-blocking communicator),
  // which inherits this thread's CPU binding; a rank bound to one core that spins starves
  // it for the whole spin.
  void check(ncclResult_t rc, const char* call) {
    if (rc == ncclInProgress) {
      ncclResult_t state = ncclInProgress;
      const bool settled = detail::Backoff(detail::kControl)
                               .poll_until(
                                   [&] {
                                     rc = ncclCommGetAsyncError(comm_, &state);
                                     if (rc != ncclSuccess) return true;
                                     rc = state;
                                     return state != ncclInProgress;
                                   },
                                   detail::deadline_after(timeout_));
      if (!settled) {
        abort();
        throw TimeoutError(fmt::format(
            "{}: {} still in progress after {:g} s (MESHRT_DEVICE_TIMEOUT): expected every peer to post its part in "
            "time, found one that never did (or is stuck before it); aborted the communicator",
            describe(), call, timeout_.count()));
      }
    }
    if (rc != ncclSuccess) {
      throw SystemError(fmt::format("{}: {} failed: {}", describe(), call, nccl_message(comm_, rc)));
    }
  }

  // The NaN rule of max and min (device/nan_rule.hpp): NCCL's may drop a NaN, so beside
  // the data goes an any-NaN mask, reduced with max, and NaN is written where it is set.
  // The masks come from the pool on the call's stream and go back to it when this
  // returns: only later work on that stream can reuse them.
  struct NanMasks {
    Tensor send_mask;
    Tensor recv_mask;
    void* send = nullptr;
    void* recv = nullptr;
    explicit operator bool() const noexcept { return send != nullptr; }
  };
  NanMasks nan_masks(const void* send, std::size_t send_count, std::size_t recv_count, DType dtype, Reduction reduction,
                     const Stream& stream) const {
    NanMasks m;
    if (!nan_rule::applies(static_cast<int>(dtype), static_cast<int>(reduction)) || send_count == 0) return m;
    Backend& b = backend(Accelerator::Cuda);
    const Device here = Device::cuda(device_);
    m.send_mask = b.empty(TensorMeta({static_cast<std::int64_t>(send_count)}, DType::UInt8, here), stream);
    m.send = m.send_mask.raw_data();
    if (recv_count == send_count) {
      m.recv = m.send;  // all_reduce: in place
    } else {
      m.recv_mask = b.empty(TensorMeta({static_cast<std::int64_t>(recv_count)}, DType::UInt8, here), stream);
      m.recv = m.recv_mask.raw_data();
    }
    cuda_kernels::nan_mask(static_cast<int>(dtype), send, m.send, static_cast<std::int64_t>(send_count),
                           stream.native());
    return m;
  }

  void divide(void* buffer, std::size_t count, DType dtype, cudaStream_t s) const {
    cuda_kernels::divide(static_cast<int>(dtype), buffer, size_, static_cast<std::int64_t>(count), s);
  }

  ncclComm_t comm_;
  int rank_;
  int size_;
  int device_;
  bool aborted_ = false;                   // comm_ is gone: aborted (true) or destroyed
  std::chrono::duration<double> timeout_;  // MESHRT_DEVICE_TIMEOUT: in-progress calls and finalize
};

}  // namespace

namespace {

// The NCCL loaded at run time (the machine's libnccl.so.2, maybe not the build's): 2.14
// or later, which has what the deadlines rest on (non-blocking communicators,
// ncclCommFinalize, the asynchronous error of a call in progress).
void require_nccl_version() {
  static const int version = [] {
    int v = 0;
    return ncclGetVersion(&v) == ncclSuccess ? v : 0;
  }();
  if (version < 21400) {
    throw UsageError(fmt::format(
        "NCCL communicator: expected NCCL 2.14 or later (non-blocking communicators, ncclCommFinalize), found the "
        "libnccl.so.2 loaded at version code {}; put a newer NCCL first on the library path",
        version));
  }
}

}  // namespace

std::unique_ptr<Communicator> create_nccl_communicator(MPI_Comm members, int device,
                                                       std::chrono::duration<double> timeout) {
  require_nccl_version();
  const auto deadline = detail::deadline_after(timeout);
  int rank = 0;
  int size = 0;
  MESHRT_MPI_CHECK(MPI_Comm_rank(members, &rank));
  MESHRT_MPI_CHECK(MPI_Comm_size(members, &size));
  // Before NCCL sees it: NCCL's own "Duplicate GPU detected" names no MPI rank.
  check_distinct_devices(members, Accelerator::Cuda, device, deadline);
  auto owned = std::make_unique<ncclUniqueId>();  // the broadcast's, past a timeout
  if (rank == 0) MESHRT_NCCL_CHECK(ncclGetUniqueId(owned.get()));
  MPI_Request request = MPI_REQUEST_NULL;
  MESHRT_MPI_CHECK(MPI_Ibcast(owned.get(), static_cast<int>(sizeof(ncclUniqueId)), MPI_BYTE, 0, members, &request));
  detail::wait_request_owning(request, owned, deadline, "NCCL communicator init", "the unique id's broadcast");
  const ncclUniqueId id = *owned;
  CudaDeviceGuard guard(device);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  ncclResult_t rc = ncclCommInitRankConfig(&comm, size, id, rank, &config);
  ncclResult_t state = rc;
  const bool initialized = detail::Backoff(detail::kControl)
                               .poll_until(
                                   [&] {
                                     if (rc == ncclInProgress || (rc == ncclSuccess && state == ncclInProgress)) {
                                       rc = ncclCommGetAsyncError(comm, &state);
                                       return false;
                                     }
                                     return true;
                                   },
                                   deadline);
  if (!initialized) {
    (void)ncclCommAbort(comm);
    throw TimeoutError(
        fmt::format("NCCL communicator init on cuda:{} (rank {} of {}): expected every member to "
                    "join in time, found the init still in progress at the deadline",
                    device, rank, size));
  }
  if (rc != ncclSuccess || state != ncclSuccess) {
    const std::string message = nccl_message(comm, rc != ncclSuccess ? rc : state);
    if (comm != nullptr) (void)ncclCommAbort(comm);
    throw SystemError(
        fmt::format("NCCL communicator init on cuda:{} (rank {} of {}): ncclCommInitRankConfig failed: {}", device,
                    rank, size, message));
  }
  return std::make_unique<NcclCommunicator>(comm, rank, size, device);
}

}  // namespace meshrt::device
