#include "meshrt/internal/control.hpp"

#include <algorithm>

namespace meshrt::control {

class MemoryEndpoint final : public Transport {
 public:
  MemoryEndpoint(std::shared_ptr<MemoryNetwork> network, int rank) : network_(std::move(network)), rank_(rank) {}
  // A send is complete as soon as it is posted: nothing is ever in flight.
  void reap() override {}
  bool drain(std::chrono::duration<double>) override { return true; }

 protected:
  void do_send(const std::vector<int>& dests, Tag tag, std::shared_ptr<const Bytes> bytes) override {
    network_->post(rank_, dests, tag, bytes);
  }
  bool do_try_receive(int source, Tag tag, Bytes& out, int* from) override {
    return network_->take(rank_, source, tag, out, from);
  }

 private:
  std::shared_ptr<MemoryNetwork> network_;
  int rank_;
};

std::shared_ptr<Transport> MemoryNetwork::endpoint(int rank) {
  return std::make_shared<MemoryEndpoint>(shared_from_this(), rank);
}

void MemoryNetwork::post(int from, const std::vector<int>& dests, Tag tag, const std::shared_ptr<const Bytes>& bytes) {
  {
    std::lock_guard lock(mutex_);
    for (int dest : dests) boxes_[{dest, tag}].push_back(Message{from, bytes});
  }
  posted_.notify_all();
}

bool MemoryNetwork::take(int rank, int source, Tag tag, Bytes& out, int* from) {
  std::lock_guard lock(mutex_);
  auto box = boxes_.find({rank, tag});
  if (box == boxes_.end()) return false;
  auto& q = box->second;
  // Oldest first, and from one sender in the order sent, as MPI's non-overtaking rule.
  auto it =
      std::find_if(q.begin(), q.end(), [source](const Message& m) { return source == kAnySource || m.from == source; });
  if (it == q.end()) return false;
  out.assign(it->bytes->begin(), it->bytes->end());
  if (from != nullptr) *from = it->from;
  q.erase(it);
  return true;
}

std::optional<Bytes> MemoryNetwork::wait_for(int rank, Tag tag, std::chrono::duration<double> timeout, int* from) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::nanoseconds>(timeout);
  Bytes out;
  for (;;) {
    if (take(rank, kAnySource, tag, out, from)) return out;
    std::unique_lock lock(mutex_);
    auto box = boxes_.find({rank, tag});
    if (box != boxes_.end() && !box->second.empty()) continue;
    if (posted_.wait_until(lock, deadline) == std::cv_status::timeout) {
      lock.unlock();
      if (take(rank, kAnySource, tag, out, from)) return out;
      return std::nullopt;
    }
  }
}

std::size_t MemoryNetwork::waiting(int rank, Tag tag) const {
  std::lock_guard lock(mutex_);
  auto box = boxes_.find({rank, tag});
  return box == boxes_.end() ? 0 : box->second.size();
}

}  // namespace meshrt::control
