// The device layer (docs/ARCHITECTURE.md section 7): memory, streams, events and the device
// communicator behind one interface, with two backends: `cuda` (CUDA + NCCL, only when
// meshrt is built with CUDA) and `emulated`, an accelerator run on the host that enforces
// a GPU's rules (device memory the host cannot read, asynchronous streams, delays that
// turn a missing ordering into a wrong value every time).
//
// Handles (Stream, Event) are small values sharing their backend object, as cudaStream_t
// and cudaEvent_t are. No CUDA or NCCL header is included here; mpi.h is, because a device
// communicator is made over an MPI communicator of its members (as comm.hpp does).
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "meshrt/reduction.hpp"
#include "meshrt/tensor.hpp"

namespace meshrt::device {

// The job's accelerator. MESHRT_ACCELERATOR=cuda|emulated|none|auto picks it; auto (the
// default) is cuda when meshrt was built with CUDA and a device is visible, else none.
enum class Accelerator : std::uint8_t { None, Cuda, Emulated };
std::string_view name(Accelerator accelerator) noexcept;
// "none", "cuda", "emulated" or "auto" (resolved as above); throws UsageError otherwise.
Accelerator parse_accelerator(std::string_view text);
// MESHRT_ACCELERATOR, resolved once per process.
Accelerator configured_accelerator();
// The Device::Kind of an accelerator (None -> Cpu).
Device::Kind device_kind(Accelerator accelerator) noexcept;

class Backend;

// A device stream: work enqueued on it runs in order, asynchronously to the host
// (cuda: a non-blocking CUDA stream; emulated: a FIFO run by its own thread).
class Stream {
 public:
  struct Impl;
  Stream() = default;
  explicit Stream(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

  bool defined() const noexcept { return impl_ != nullptr; }
  // The device index it belongs to.
  int device() const;
  // The cudaStream_t on cuda; nullptr on emulated.
  void* native() const;
  // Runs `task` on the host in stream order. On emulated it runs on the stream's thread,
  // the one place emulated device memory is readable (DeviceMemoryAccess); on cuda it is a
  // host function (cudaLaunchHostFunc): it must not call CUDA. A task that throws puts the
  // stream in error, as a faulting kernel does a GPU.
  void enqueue(std::function<void()> task) const;
  // True once everything enqueued so far has run. Never blocks.
  bool query() const;
  // Blocks until everything enqueued so far has run (tests, shutdown; the worker polls).
  void synchronize() const;
  // The first error of work on this stream, sticky as CUDA's; nullopt while none.
  std::optional<std::string> error() const;
  // "emulated:0 stream 3"
  std::string to_string() const;

  Impl* impl() const noexcept { return impl_.get(); }
  friend bool operator==(const Stream& a, const Stream& b) noexcept { return a.impl_ == b.impl_; }

 private:
  std::shared_ptr<Impl> impl_;
};

// A point in a stream's work: record() marks it, wait() makes another stream wait for
// it on the device (the host does not block), query() polls it.
class Event {
 public:
  struct Impl;
  Event() = default;
  explicit Event(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

  bool defined() const noexcept { return impl_ != nullptr; }
  // Captures everything enqueued on `stream` so far; re-recording moves the point.
  void record(const Stream& stream);
  // Work enqueued on `stream` after this call starts only once the recorded point is
  // reached. An event never recorded is complete.
  void wait(const Stream& stream) const;
  // True once the recorded point is reached. Never blocks.
  bool query() const;
  void synchronize() const;

  Impl* impl() const noexcept { return impl_.get(); }

 private:
  std::shared_ptr<Impl> impl_;
};

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
  // Devices visible to this process (emulated: MESHRT_EMULATED_DEVICES per node).
  virtual int device_count() const = 0;
  // Makes `index` the calling thread's current device (cudaSetDevice; the current
  // device is per thread). Throws UsageError for an index out of range.
  virtual void make_current(int index) = 0;

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
  // Frees every cached (unused) block of the pool.
  virtual void empty_cache() = 0;
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

// ---------------------------------------------------------------------------- placement

// This rank's device (docs/ARCHITECTURE.md section 7: one device per rank, chosen once at start from
// the local rank, MESHRT_DEVICE overriding; src/device/comm.hpp select_device). The
// runtime sets it; until then it is device 0 of no accelerator.
struct Placement {
  Accelerator accelerator = Accelerator::None;
  int device = 0;
};
void set_placement(Placement placement) noexcept;
Placement placement() noexcept;
// This rank's device of `kind`: the cpu, or index placement().device of an accelerator
// kind (the emulated kind is always available; cuda only in a CUDA build).
Device rank_device(Device::Kind kind);
// Marks the calling thread as one that works for this rank's worker (every such thread
// calls it: the current CUDA device is per thread). It makes no device call: this rank's
// device becomes current on the thread only when the thread first needs a device (a
// stream, memory, a copy, a communicator), since cudaSetDevice creates a CUDA context and
// a CPU-only program must create none.
void enter_worker_thread() noexcept;

// The device stream of meshrt stream `stream_id` on `device`, created on first use and
// shared by everything that works on that meshrt stream in this process (the worker's
// streams, kernels, the data plane). release_stream drops them once the stream is gone.
Stream stream_for(std::uint64_t stream_id, const Device& device);
// That stream if it exists already, else an undefined one: creates nothing (no context).
Stream existing_stream(std::uint64_t stream_id, const Device& device);
void release_stream(std::uint64_t stream_id);

// For kernels (docs/ARCHITECTURE.md section 7, "Kernels on the accelerator"), with the call's
// ctx.stream_id() and ctx.device():
// - empty_on: a new tensor of `meta`; on an accelerator from the pool of the call's stream.
// - host_task: host code in the order of the call's stream: at once on the cpu; on the
//   emulated accelerator a task on the stream, the one place its memory is readable
//   (capture tensors by value: the task runs after the kernel returned). cuda memory is
//   not readable from the host: there it throws UsageError (use a CUDA kernel).
Tensor empty_on(std::uint64_t stream_id, const TensorMeta& meta);
void host_task(std::uint64_t stream_id, const Device& device, std::function<void()> work);

// Stream-ordered helpers over Backend, for any accelerator tensor.

// A device tensor of `meta` (on meta.device()), zeroed on `stream`.
Tensor zeros(const TensorMeta& meta, const Stream& stream);
// A copy of host (CPU) tensor `host` on `device`, through pinned staging, on `stream`.
Tensor to_device(const Tensor& host, const Device& device, const Stream& stream);
// Copies src into dst on `stream`; same shape and dtype, both on accelerator devices.
void copy(const Tensor& dst, const Tensor& src, const Stream& stream);
// A copy of accelerator tensor `t` on its device, made on `stream` (Tensor::clone's form
// on one stream, which does not block the host).
Tensor clone(const Tensor& t, const Stream& stream);
// A fetch (docs/ARCHITECTURE.md section 7): the device-to-host copy of `tensor` on `stream` into
// pinned memory, and the event recorded after it. `host` is readable once done.query().
struct Fetch {
  Tensor host;
  Event done;
};
Fetch fetch(const Tensor& tensor, const Stream& stream);
// The test-only switch that removes a fetch's ordering: the copy then runs at once
// instead of after the stream's queued work, as if a fetch used another stream without
// waiting. The emulated accelerator shows the wrong value this gives.
void set_unordered_fetch_for_testing(bool on) noexcept;

// The device communicator (NCCL's ncclComm_t, or the emulated one): made collectively
// over its members (src/device/comm.hpp); every operation is enqueued on a stream and
// completes in that stream's order. Counts are in elements of `dtype`.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const noexcept = 0;
  virtual int size() const noexcept = 0;
  virtual int device() const noexcept = 0;

  // Sum, Avg (sum, then a division: integer ones truncate toward zero), Product, Min, Max.
  // Bitwise reductions and Stack are refused with UsageError, as NCCL has no such ops.
  virtual void all_reduce(const void* send, void* recv, std::size_t count, DType dtype, Reduction reduction,
                          const Stream& stream) = 0;
  // recv holds size() * count elements, rank r's in block r.
  virtual void all_gather(const void* send, void* recv, std::size_t count, DType dtype, const Stream& stream) = 0;
  // send holds size() * count elements; recv gets the reduction of every rank's block rank().
  virtual void reduce_scatter(const void* send, void* recv, std::size_t count, DType dtype, Reduction reduction,
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
  // (ncclCommDestroy on a failed communicator may hang). Idempotent.
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

// This rank's index among the ranks of its node (MPI_Comm_split_type SHARED), and how
// many ranks the node runs; each collective over `world`.
int local_rank(MPI_Comm world);
int node_size(MPI_Comm world);
// This rank's device of `accelerator`: MESHRT_DEVICE if set, else the local rank modulo
// the node's device count. Collective over `world`.
int select_device(Accelerator accelerator, MPI_Comm world);

}  // namespace meshrt::device
