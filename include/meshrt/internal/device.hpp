// The device layer's runtime side (docs/ARCHITECTURE.md section 7): the backends, this
// rank's placement, the device communicators and the test switches. The runtime, the
// worker, the data plane and the Python binding use it; kernels use meshrt/device.hpp.
// Not installed.
#pragma once

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>

#include "meshrt/device.hpp"

namespace meshrt::device {

struct PoolStats {
  std::uint64_t hits = 0;    // allocations served by a cached block
  std::uint64_t misses = 0;  // allocations that needed fresh device memory
  std::size_t cached_bytes = 0;
  std::size_t live_bytes = 0;
};

// One accelerator of this process. The backend objects live until the process ends
// (contexts are created on first use, never for a CPU-only program).
class Backend {
 public:
  virtual ~Backend() = default;
  virtual Accelerator accelerator() const noexcept = 0;
  Device::Kind kind() const noexcept { return device_kind(accelerator()); }
  // Devices visible to this process (emulated: MESHRT_EMULATED_DEVICES per node, or those
  // MESHRT_EMULATED_VISIBLE_DEVICES lists).
  virtual int device_count() const = 0;
  // Makes `index` the calling thread's current device (cudaSetDevice; the current
  // device is per thread). Throws UsageError for an index out of range.
  virtual void make_current(int index) = 0;
  // The physical device behind `index`, named as every process of the node names it,
  // whichever devices each one sees (cuda: its PCI bus id, as NCCL tells GPUs apart;
  // emulated: its place among the node's MESHRT_EMULATED_DEVICES, through
  // MESHRT_EMULATED_VISIBLE_DEVICES). Throws UsageError for an index out of range.
  virtual std::string physical_device(int index) const = 0;

  virtual Stream create_stream(int device) = 0;
  virtual Event create_event(int device) = 0;

  // Device memory from the stream-ordered caching pool: usable by work enqueued on
  // `stream` from now on; when the last handle goes, the block returns to the pool in
  // `stream`'s order (so a block freed while work on it is queued is never reused by
  // another stream before that work ran).
  virtual Tensor empty(const TensorMeta& meta, const Stream& stream) = 0;
  // Asynchronous copies and memsets on `stream` between device memory and pinned (or
  // device) memory of this backend.
  virtual void copy_async(void* dst, const void* src, std::size_t bytes, const Stream& stream) = 0;
  virtual void memset_async(void* dst, int value, std::size_t bytes, const Stream& stream) = 0;
  // Page-locked host memory for staging (cudaMallocHost); at least 64-byte aligned.
  virtual std::shared_ptr<void> pinned(std::size_t bytes) = 0;
  virtual PoolStats pool_stats() const = 0;
  // Frees every cached (unused) block of the pool, in each block's stream order.
  virtual void empty_cache() = 0;
  // Gives back what freed blocks leave reserved (cuda: the driver's pools, and the pinned
  // staging blocks the cache gave up, whose cudaFreeHost may synchronize the device). It may
  // wait for the device, so the worker calls it only when it waits for nothing (trim_idle).
  virtual void trim() {}
  // How many devices have a context in this process through this backend: a device
  // counts from the first time meshrt makes it current or gives it a stream, an event or
  // memory (cuda: the calls that create its primary context; emulated: the same calls,
  // counted as a GPU would make them). A CPU-only program makes none.
  virtual int contexts() const = 0;
};

// The backend of `accelerator`, created on first use; throws UsageError for None, and
// for cuda in a build without CUDA or on a machine without a usable device.
Backend& backend(Accelerator accelerator);
// The backend of an accelerator Device kind (cuda, emulated).
Backend& backend(Device::Kind kind);

// This rank's device (docs/ARCHITECTURE.md section 7: one device per rank, chosen once at start from
// the local rank, MESHRT_DEVICE overriding; select_device below). The
// runtime sets it; until then it is device 0 of no accelerator.
struct Placement {
  Accelerator accelerator = Accelerator::None;
  int device = 0;
};
void set_placement(Placement placement) noexcept;
Placement placement() noexcept;
// Marks the calling thread as one that works for this rank's worker (every such thread
// calls it: the current CUDA device is per thread). It makes no device call: this rank's
// device becomes current on the thread only when the thread first needs a device (a
// stream, memory, a copy, a communicator), since cudaSetDevice creates a CUDA context and
// a CPU-only program must create none.
void enter_worker_thread() noexcept;

// Releases what the device layer holds for device work that has completed: a copy's
// source, a fetch's device tensor, a staging block. They are held until an event recorded
// after their use completes, never by a host function on the stream (it may make no CUDA
// call, and its release may free into the pool); the worker calls this every turn, and
// the device layer's own calls do too. Never blocks.
void release_completed();
// Called by the worker when it is idle with no collective or send in flight: the
// accelerator in use gives back the memory its frees left reserved (Backend::trim). Never
// creates a backend.
void trim_idle() noexcept;

// MESHRT_TRACE on CUDA: the device work one worker command enqueues on meshrt stream
// `stream_id` becomes one span of that device stream's track, from when the stream reached
// it to when the GPU ended it (two CUDA events), recorded once it has run (trace_flush; the worker's
// every turn through release_completed). Only on a stream that exists (or that the command
// creates): they make no stream and no context; begin does nothing while the timeline is
// off. The emulated stream records each task itself; a rank without CUDA records nothing here.
void trace_command_begin(std::uint64_t stream_id) noexcept;
void trace_command_end(std::uint64_t stream_id) noexcept;
// Records the spans whose device work has ended; `wait`: all of them, waiting for the work.
void trace_flush(bool wait);

// That stream if it exists already, else an undefined one: creates nothing (no context).
Stream existing_stream(std::uint64_t stream_id, const Device& device);
void release_stream(std::uint64_t stream_id);

// The host tasks of one call (docs/ARCHITECTURE.md section 7, "Kernels on the
// accelerator"): an exception in one fails that call, not its stream. The worker opens a
// TaskScope around a kernel on an accelerator mesh; every host_task the kernel enqueues
// counts itself and, if it throws, records the first error here. The worker then holds the
// call's completion until its stream has run those tasks (an event after them).
struct TaskFailures {
  std::atomic<int> tasks{0};
  std::mutex mutex;
  std::optional<std::string> first;  // under mutex
  void record(std::string message);
  std::optional<std::string> error();
};
class TaskScope {
 public:
  explicit TaskScope(std::shared_ptr<TaskFailures> failures) noexcept;
  ~TaskScope();
  TaskScope(const TaskScope&) = delete;
  TaskScope& operator=(const TaskScope&) = delete;

 private:
  std::shared_ptr<TaskFailures> previous_;
};

// A device fault of this process: an error in device work that is not a host task's (an
// illegal address in a CUDA kernel, which poisons the context; on the emulated
// accelerator, a stream task other than a host task that throws). The rank cannot go on:
// the worker ends the job naming it. nullopt while there is none.
std::optional<std::string> device_fault();
void record_device_fault(std::string message) noexcept;

// The test-only switch that removes a fetch's ordering: the copy then runs at once
// instead of after the stream's queued work, as if a fetch used another stream without
// waiting. The emulated accelerator shows the wrong value this gives.
void set_unordered_fetch_for_testing(bool on) noexcept;
// The test-only fault of an enqueue: the next operation this process gives a device
// communicator throws SystemError("<op> on <communicator>: <message>") at its call, before
// anything is posted, as an NCCL call can return an error (fatal to its communicator). An
// operation of several calls (all_reduce with its NaN mask, all_to_all, send_recv) fails
// inside its group (ncclGroupStart ... ncclGroupEnd), which it must still end.
void set_enqueue_fault_for_testing(std::string message);
// The test-only failure of a peer: every emulated communicator of this process alive now
// reports `message` as its asynchronous error from now on, as a communicator whose peer
// or network failed does (ncclCommGetAsyncError).
void set_async_error_for_testing(const std::string& message);

// The device communicator (NCCL's ncclComm_t, or the emulated one): made collectively
// over its members (create_communicator below); every operation is enqueued on a stream and
// completes in that stream's order. Counts are in elements of `dtype`.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const noexcept = 0;
  virtual int size() const noexcept = 0;
  virtual int device() const noexcept = 0;

  // Sum, Avg (sum, then a division; on integers it would truncate toward zero, and
  // reduction_rule refuses it before it gets here), Product, Min, Max.
  // Bitwise reductions and Stack are refused with UsageError, as NCCL has no such ops.
  virtual void all_reduce(const void* send, void* recv, std::size_t count, DType dtype, Reduction reduction,
                          const Stream& stream) = 0;
  // recv holds size() * count elements, rank r's in block r.
  virtual void all_gather(const void* send, void* recv, std::size_t count, DType dtype, const Stream& stream) = 0;
  // send holds size() * count elements; recv gets the reduction of every rank's block rank().
  virtual void reduce_scatter(const void* send, void* recv, std::size_t count, DType dtype, Reduction reduction,
                              const Stream& stream) = 0;
  // The reduction of every rank's send into recv on rank `root` only (ncclReduce; recv is
  // not used elsewhere and may be null there): the reductions and NaN rule of all_reduce.
  virtual void reduce(const void* send, void* recv, std::size_t count, DType dtype, Reduction reduction, int root,
                      const Stream& stream) = 0;
  // Rank `root`'s send into every rank's recv, root's included (ncclBroadcast; send is
  // read on the root only, and may be null elsewhere).
  virtual void broadcast(const void* send, void* recv, std::size_t count, DType dtype, int root,
                         const Stream& stream) = 0;
  // Block r of send goes to rank r, and arrives in block (sender) of recv; count per block.
  virtual void all_to_all(const void* send, void* recv, std::size_t count, DType dtype, const Stream& stream) = 0;
  // Grouped point-to-point (ncclGroupStart ... ncclGroupEnd): every op posted at once, so
  // pairs that send to each other do not deadlock.
  struct PeerOp {
    bool send = true;
    int peer = 0;
    void* buffer = nullptr;  // const for a send
    std::size_t count = 0;
  };
  virtual void send_recv(std::span<const PeerOp> ops, DType dtype, const Stream& stream) = 0;

  // The asynchronous error of this communicator (ncclCommGetAsyncError): nullopt while
  // healthy, else the device's message. Never blocks.
  virtual std::optional<std::string> async_error() = 0;
  // Gives up on every operation in flight (ncclCommAbort); call from the thread that
  // issues this communicator's work. Further operations fail as asynchronous errors.
  virtual void abort() noexcept = 0;
  // Frees it: a clean destroy when healthy, an abort when its error state says it failed
  // (ncclCommDestroy on a failed communicator may hang), or when its pending work has not
  // finished within MESHRT_DEVICE_TIMEOUT (a peer that never joined). Idempotent.
  virtual void destroy() noexcept = 0;
  // "emulated communicator 3f2a.. rank 1 of 4 on emulated:1"
  virtual std::string describe() const = 0;
};

// Collective over exactly the ranks of `members` (every one must call it, as for
// ncclCommInitRank): member 0 makes the unique id and broadcasts it, then every member
// joins on `device` of `accelerator`. Throws UsageError on every member when two of them
// are on one device of one node (naming both ranks), and TimeoutError when the init does
// not finish within `timeout`.
std::unique_ptr<Communicator> create_communicator(Accelerator accelerator, MPI_Comm members, int device,
                                                  std::chrono::duration<double> timeout);

// What create_communicator checks first: members' (host, physical device) pairs must
// differ (Backend::physical_device: ranks that each see one GPU all call theirs device 0;
// hosts told apart as NCCL does, by NCCL_HOSTID when set, else by node). Throws
// UsageError naming both ranks and the device otherwise, on every member alike.
// Collective over `members`, non-blocking: TimeoutError when a member has not joined by
// `deadline`.
void check_distinct_devices(MPI_Comm members, Accelerator accelerator, int device,
                            std::chrono::steady_clock::time_point deadline);

// How many ranks the host with the most of them holds, telling hosts apart as NCCL does
// and check_distinct_devices checks (NCCL_HOSTID when set, else the node): a communicator
// over every rank needs that many devices per host. Collective over `world`.
int most_ranks_on_a_host(MPI_Comm world);

// This rank's index among the ranks of its node (MPI_Comm_split_type SHARED), and how
// many ranks the node runs; each collective over `world`.
int local_rank(MPI_Comm world);
int node_size(MPI_Comm world);
// This rank's device of `accelerator`: MESHRT_DEVICE if set, else the local rank modulo
// the node's device count. Collective over `world`.
int select_device(Accelerator accelerator, MPI_Comm world);

// Makes `native`, another library's CUDA stream (a cudaStream_t of torch's, CuPy's; nullptr
// or cudaStreamLegacy for the legacy default stream, cudaStreamPerThread for the thread's),
// wait on the device for everything enqueued on `stream` so far, without blocking the
// host: DLPack's stream hand-off, after which work on `native` reads what `stream`'s work
// wrote. Nothing when `native` is `stream`'s own. cuda streams only (UsageError otherwise).
void make_native_wait(void* native, const Stream& stream);

}  // namespace meshrt::device
