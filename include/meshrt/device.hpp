// The device layer for kernel authors (docs/ARCHITECTURE.md section 7): streams, events
// and stream-ordered memory on the rank's accelerator, with two backends: `cuda` (CUDA +
// NCCL, only when meshrt is built with CUDA) and `emulated`, an accelerator run on the host
// that enforces a GPU's rules (device memory the host cannot read, asynchronous streams,
// delays that turn a missing ordering into a wrong value every time).
//
// Handles (Stream, Event) are small values sharing their backend object, as cudaStream_t
// and cudaEvent_t are. No CUDA, NCCL or MPI header is included here.
#pragma once

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

// This rank's device of `kind`: the cpu, or index placement().device of an accelerator
// kind (the emulated kind is always available; cuda only in a CUDA build).
Device rank_device(Device::Kind kind);
// The device stream of meshrt stream `stream_id` on `device`, created on first use and
// shared by everything that works on that meshrt stream in this process (the worker's
// streams, kernels, the data plane). release_stream drops them once the stream is gone.
Stream stream_for(std::uint64_t stream_id, const Device& device);

// For kernels (docs/ARCHITECTURE.md section 7, "Kernels on the accelerator"), with the call's
// ctx.stream_id() and ctx.device():
// - empty_on: a new tensor of `meta`; on an accelerator from the pool of the call's stream.
// - host_task: host code in the order of the call's stream: at once on the cpu; on the
//   emulated accelerator a task on the stream, the one place its memory is readable
//   (capture tensors by value: the task runs after the kernel returned). cuda memory is
//   not readable from the host: there it throws UsageError (use a CUDA kernel).
Tensor empty_on(std::uint64_t stream_id, const TensorMeta& meta);
void host_task(std::uint64_t stream_id, const Device& device, std::function<void()> work);

// Stream-ordered helpers for any accelerator tensor.

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

}  // namespace meshrt::device
