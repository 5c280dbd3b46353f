#include "control/mpi_transport.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>

#include "common/backoff.hpp"
#include "common/checks.hpp"

namespace meshrt::control {

namespace {
// The process's doorbells: one rung after every command, one after every reply, that
// this very rank sends to itself.
struct Doorbell {
  std::atomic<std::uint64_t> rings{0};
  std::mutex mutex;
  std::condition_variable rung;
};
// nullptr for a tag without a doorbell.
Doorbell* doorbell(Tag tag) {
  static Doorbell command, reply;
  if (tag == Tag::Command) return &command;
  if (tag == Tag::Reply) return &reply;
  return nullptr;
}
}  // namespace

MpiTransport::MpiTransport(MPI_Comm comm) : comm_(comm) {
  MESHRT_MPI_CHECK(MPI_Comm_rank(comm_, &self_));
}

std::uint64_t MpiTransport::rings(Tag tag) const {
  const Doorbell* bell = doorbell(tag);
  return bell ? bell->rings.load(std::memory_order_acquire) : 0;
}

void MpiTransport::wait_ring(Tag tag, std::uint64_t seen, std::chrono::microseconds d) {
  Doorbell* bell = doorbell(tag);
  if (!bell) {
    Transport::wait_ring(tag, seen, d);
    return;
  }
  std::unique_lock lock(bell->mutex);
  bell->rung.wait_for(lock, d, [&] { return bell->rings.load(std::memory_order_acquire) > seen; });
}

std::shared_ptr<Transport> mpi_transport(MPI_Comm comm) {
  return std::make_shared<MpiTransport>(comm);
}

MpiTransport::~MpiTransport() {
  // Sends still in flight at destruction belong to a peer that stopped listening (a
  // failed job); cancel rather than hang. Return codes ignored on purpose: a destructor
  // cannot raise, and a send that cannot be cancelled is already lost with its peer.
  for (auto& s : sends_) {
    MESHRT_MPI_IGNORE(MPI_Cancel(&s.request));
    MESHRT_MPI_IGNORE(MPI_Request_free(&s.request));
  }
}

bool MpiTransport::do_try_receive(int source, Tag tag, Bytes& out, int* from) {
  std::lock_guard lock(mutex_);
  int flag = 0;
  MPI_Message message;
  MPI_Status status;
  MESHRT_MPI_CHECK(MPI_Improbe(source == kAnySource ? MPI_ANY_SOURCE : source, static_cast<int>(tag), comm_, &flag,
                               &message, &status));
  if (!flag) return false;
  int count = 0;
  MESHRT_MPI_CHECK(MPI_Get_count(&status, MPI_BYTE, &count));
  out.resize(static_cast<std::size_t>(count));
  MESHRT_MPI_CHECK(MPI_Mrecv(out.data(), count, MPI_BYTE, &message, MPI_STATUS_IGNORE));
  if (from != nullptr) *from = status.MPI_SOURCE;
  return true;
}

void MpiTransport::do_send(const std::vector<int>& dests, Tag tag, std::shared_ptr<const Bytes> bytes) {
  if (bytes->size() > static_cast<std::size_t>(INT32_MAX)) {
    throw UsageError("control message of " + std::to_string(bytes->size()) +
                     " bytes: expected at most 2 GiB; fetch large tensors in pieces");
  }
  std::lock_guard lock(mutex_);
  for (int dest : dests) {
    Send s{MPI_REQUEST_NULL, bytes};
    MESHRT_MPI_CHECK(MPI_Isend(bytes->data(), static_cast<int>(bytes->size()), MPI_BYTE, dest, static_cast<int>(tag),
                               comm_, &s.request));
    sends_.push_back(std::move(s));
  }
  // The last reference to the bytes is then always dropped in reap_locked, once MPI_Test
  // reports the send done, never here when the parameter dies (the TSan suppression for a
  // send to this process's own worker names reap_locked: tests/sanitizers/tsan.supp).
  bytes.reset();
  reap_locked();
  Doorbell* bell = doorbell(tag);
  if (bell && std::find(dests.begin(), dests.end(), self_) != dests.end()) {
    // After the Isend: a woken thread's matched probe finds the message. The increment
    // under the mutex so that a waiter between its check and its sleep cannot miss it.
    {
      std::lock_guard ring(bell->mutex);
      bell->rings.fetch_add(1, std::memory_order_release);
    }
    bell->rung.notify_all();
  }
}

void MpiTransport::reap() {
  std::lock_guard lock(mutex_);
  reap_locked();
}

void MpiTransport::reap_locked() {
  while (!sends_.empty()) {
    int done = 0;
    MESHRT_MPI_CHECK(MPI_Test(&sends_.front().request, &done, MPI_STATUS_IGNORE));
    if (!done) break;
    sends_.pop_front();
  }
}

bool MpiTransport::drain(std::chrono::duration<double> timeout) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::nanoseconds>(timeout);
  detail::Backoff backoff(detail::kControl);
  for (;;) {
    {
      std::lock_guard lock(mutex_);
      reap_locked();
      if (sends_.empty()) return true;
    }
    if (std::chrono::steady_clock::now() > deadline) return false;
    backoff.pause();
  }
}

}  // namespace meshrt::control
