#include "worker/streams.hpp"

namespace meshrt::detail {
namespace {

// The accelerator kind this rank's streams carry events on, or Cpu (none).
Device::Kind event_kind() {
  const device::Placement p = device::placement();
  return device::device_kind(p.accelerator);
}

}  // namespace

struct StreamHandle::State {
  std::uint64_t id = 0;
  bool is_default = true;
  ~State() {
    if (id != 0) device::release_stream(id);
  }
};

StreamHandle::StreamHandle(std::uint64_t id, bool is_default) : state_(std::make_shared<State>()) {
  state_->id = id;
  state_->is_default = is_default;
}

std::uint64_t StreamHandle::id() const noexcept {
  return state_ ? state_->id : 0;
}
bool StreamHandle::is_default() const noexcept {
  return !state_ || state_->is_default;
}

device::Stream StreamHandle::device(Device::Kind kind) const {
  return device::stream_for(id(), device::rank_device(kind));
}

device::Stream StreamHandle::existing(Device::Kind kind) const {
  return device::existing_stream(id(), device::rank_device(kind));
}

StreamHandle make_stream(bool is_default, std::uint64_t id) {
  return StreamHandle(id, is_default);
}

BorrowEvents borrow_create(const StreamHandle& from) {
  const Device::Kind kind = event_kind();
  if (kind == Device::Kind::Cpu) return {};
  // No device stream yet: no device work on the origin for the borrower to wait for.
  const device::Stream s = from.existing(kind);
  if (!s.defined()) return {{}, kind, false};
  device::Event e = device::backend(kind).create_event(s.device());
  e.record(s);
  return {std::move(e), kind, false};
}

void borrow_first_use(BorrowEvents& b, const StreamHandle& to) {
  b.used = true;
  if (b.created.defined()) b.created.wait(to.device(b.kind));
}

void borrow_drop(BorrowEvents& b, const StreamHandle& from, const StreamHandle& to) {
  if (!b.used || b.kind == Device::Kind::Cpu) return;
  // The origin may reuse the memory only after the borrower's device work on it (none
  // when the borrower's device stream does not exist).
  const device::Stream borrower = to.existing(b.kind);
  if (!borrower.defined()) return;
  device::Event done = device::backend(b.kind).create_event(borrower.device());
  done.record(borrower);
  done.wait(from.device(b.kind));
}

}  // namespace meshrt::detail
