#include "worker/streams.hpp"

#include "common/checks.hpp"
#include "meshrt/tensor.hpp"

namespace meshrt::detail {

#if MESHRT_HAVE_CUDA

namespace {
std::shared_ptr<void> record(const StreamHandle& s) {
  cudaEvent_t e = nullptr;
  MESHRT_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  MESHRT_CUDA_CHECK(cudaEventRecord(e, static_cast<cudaStream_t>(s.native())));
  return std::shared_ptr<void>(e, [](void* p) { cudaEventDestroy(static_cast<cudaEvent_t>(p)); });
}
}  // namespace

StreamHandle make_stream(bool is_default) {
  if (is_default || !cuda_available()) return {};
  cudaStream_t s = nullptr;
  MESHRT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return {std::shared_ptr<void>(s, [](void* p) { cudaStreamDestroy(static_cast<cudaStream_t>(p)); })};
}

BorrowEvents borrow_create(const StreamHandle& from) {
  if (!cuda_available()) return {};
  return {record(from), false};
}

void borrow_first_use(BorrowEvents& b, const StreamHandle& to) {
  b.used = true;
  if (b.created)
    MESHRT_CUDA_CHECK(
        cudaStreamWaitEvent(static_cast<cudaStream_t>(to.native()), static_cast<cudaEvent_t>(b.created.get()), 0));
}

void borrow_drop(BorrowEvents& b, const StreamHandle& from, const StreamHandle& to) {
  if (!b.used || !b.created) return;
  // The origin may reuse the memory only after the borrower's work on it.
  auto done = record(to);
  MESHRT_CUDA_CHECK(
      cudaStreamWaitEvent(static_cast<cudaStream_t>(from.native()), static_cast<cudaEvent_t>(done.get()), 0));
}

#else

StreamHandle make_stream(bool) {
  return {};
}
BorrowEvents borrow_create(const StreamHandle&) {
  return {};
}
void borrow_first_use(BorrowEvents& b, const StreamHandle&) {
  b.used = true;
}
void borrow_drop(BorrowEvents&, const StreamHandle&, const StreamHandle&) {}

#endif

}  // namespace meshrt::detail
