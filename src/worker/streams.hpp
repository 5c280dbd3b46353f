// A worker's streams over the device layer (meshrt/device.hpp). On the CPU every stream
// runs in order on the event loop, so borrows need no events (the controller still
// enforces their rules). On an accelerator a meshrt stream is one device stream per rank
// (device::stream_for), created when device work first needs it, and a borrow is a pair
// of device events: recorded on the origin at creation, waited on by the borrower at
// first use, and at drop the origin waits for the borrower. A borrow orders only device
// streams that device work already made: a stream without one has no device work to
// wait for, and a CPU-only program's borrows so create no stream and no context.
#pragma once

#include <cstdint>
#include <memory>

#include "meshrt/internal/device.hpp"

namespace meshrt::detail {

class StreamHandle {
 public:
  StreamHandle() = default;
  StreamHandle(std::uint64_t id, bool is_default);

  std::uint64_t id() const noexcept;
  bool is_default() const noexcept;
  // The device stream of this meshrt stream on this rank's device of `kind` (an
  // accelerator kind), created on first use.
  device::Stream device(Device::Kind kind) const;
  // That device stream if device work made it already, else an undefined one.
  device::Stream existing(Device::Kind kind) const;

 private:
  struct State;
  std::shared_ptr<State> state_;  // the device streams are released with the last copy
};

// A new stream, `id` its ref in the worker's environment.
StreamHandle make_stream(bool is_default, std::uint64_t id = 0);

struct BorrowEvents {
  device::Event created;  // recorded on the origin at BorrowCreate
  Device::Kind kind = Device::Kind::Cpu;
  bool used = false;
};

BorrowEvents borrow_create(const StreamHandle& from);
void borrow_first_use(BorrowEvents& b, const StreamHandle& to);
void borrow_drop(BorrowEvents& b, const StreamHandle& from, const StreamHandle& to);

}  // namespace meshrt::detail
