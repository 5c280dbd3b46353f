// The control transport over MPI: framed messages over a communicator of their own,
// received with matched probes (safe with several threads per process: the controller,
// its flusher and worker 0 share rank 0) and sent without blocking (the transport owns
// each buffer until MPI is done with it).
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstddef>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

#include "meshrt/internal/control.hpp"

namespace meshrt::control {

class MpiTransport final : public Transport {
 public:
  explicit MpiTransport(MPI_Comm comm);
  MpiTransport(const MpiTransport&) = delete;
  MpiTransport& operator=(const MpiTransport&) = delete;
  ~MpiTransport() override;

  MPI_Comm comm() const noexcept { return comm_; }

  void reap() override;
  bool drain(std::chrono::duration<double> timeout) override;
  // The doorbells are the process's: the controller and worker 0 have transports of
  // their own.
  bool has_doorbells() const override { return true; }
  std::uint64_t rings(Tag tag) const override;
  void wait_ring(Tag tag, std::uint64_t seen, std::chrono::microseconds d) override;
  std::size_t in_flight() const noexcept { return sends_.size(); }

 protected:
  void do_send(const std::vector<int>& dests, Tag tag, std::shared_ptr<const Bytes> bytes) override;
  bool do_try_receive(int source, Tag tag, Bytes& out, int* from) override;

 private:
  void reap_locked();
  struct Send {
    MPI_Request request;
    std::shared_ptr<const Bytes> bytes;
  };
  MPI_Comm comm_;
  int self_ = -1;     // this process's rank in comm_
  std::mutex mutex_;  // the controller's batch flusher sends from its own thread
  std::deque<Send> sends_;
};

}  // namespace meshrt::control
