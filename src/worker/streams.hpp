// A worker's streams. On the CPU every stream runs in order on the event loop, so
// borrows need no events (the controller still enforces their rules). With CUDA and a
// GPU, a non-default stream is a CUDA stream and a borrow is a pair of CUDA events:
// created on the origin stream, waited on by the borrower at first use, and at drop the
// origin waits for the borrower.
#pragma once

#include <memory>

namespace meshrt::detail {

struct StreamHandle {
  std::shared_ptr<void> cuda;  // cudaStream_t (nullptr: the CPU stream or CUDA's default)
  void* native() const noexcept { return cuda.get(); }
};

// A new stream: a CUDA stream when meshrt was built with CUDA, a GPU is visible and the
// stream is not the default one; otherwise the CPU stream.
StreamHandle make_stream(bool is_default);

struct BorrowEvents {
  std::shared_ptr<void> created;  // recorded on the origin at BorrowCreate
  bool used = false;
};

BorrowEvents borrow_create(const StreamHandle& from);
void borrow_first_use(BorrowEvents& b, const StreamHandle& to);
void borrow_drop(BorrowEvents& b, const StreamHandle& from, const StreamHandle& to);

}  // namespace meshrt::detail
