// What a backend implements behind the device layer's handles (meshrt/device.hpp).
// Internal header: only src/device includes it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "meshrt/internal/device.hpp"

namespace meshrt::device {

struct Stream::Impl : std::enable_shared_from_this<Stream::Impl> {
  virtual ~Impl() = default;
  virtual Accelerator accelerator() const noexcept = 0;
  virtual int device() const noexcept = 0;
  // A process-unique number, the key of this stream's blocks in the caching pool.
  virtual std::uint64_t id() const noexcept = 0;
  virtual void* native() const noexcept = 0;
  virtual void enqueue(std::function<void()> task) = 0;
  virtual bool query() = 0;
  virtual void synchronize() = 0;
  virtual std::optional<std::string> error() = 0;
  virtual std::string to_string() const = 0;
  // MESHRT_TRACE: opens, then closes the span of one command's device work on this stream
  // (trace_command_begin in device.hpp). The emulated stream records each task itself.
  virtual void trace_open() {}
  virtual void trace_close() {}
};

struct Event::Impl {
  virtual ~Impl() = default;
  virtual void record(Stream::Impl& stream) = 0;
  virtual void wait(Stream::Impl& stream) = 0;
  virtual bool query() = 0;
  virtual void synchronize() = 0;
};

// On a worker thread (enter_worker_thread), makes this rank's device current the first
// time the thread needs a device of `kind`; elsewhere, or for another kind, does nothing.
// Every entry point that uses a device calls it before its first device call.
void ensure_current(Device::Kind kind);

// The fault set_enqueue_fault_for_testing set, taken (the next call on a device
// communicator fails with it, once); nullopt when none is set.
std::optional<std::string> take_enqueue_fault();

// The stream behind a handle; throws UsageError naming `what` for an undefined one or one
// of another accelerator.
Stream::Impl& stream_impl(const Stream& stream, Accelerator expected, const char* what);

}  // namespace meshrt::device
