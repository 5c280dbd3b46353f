// The emulated accelerator (docs/ARCHITECTURE.md section 7): a GPU's rules, enforced on the host.
// Device memory is host memory from the caching pool that Tensor's accessors refuse
// outside a stream task; each stream is a FIFO run by its own thread, and every stream
// operation first sleeps MESHRT_EMULATED_DELAY_US, so work the host does not order after
// it reads the old value every time rather than once in a thousand runs.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "device/backend.hpp"
#include "device/pool.hpp"

namespace meshrt::device {

// CUDA's last error of the calling host thread, as the emulator keeps it (cudaGetLastError
// returns and clears it): a failed device allocation sets it, and a kernel launch
// (host_task on an emulated device) reports it, as meshrt's CUDA kernels check
// cudaGetLastError after each launch. A caller that handles a failed allocation clears it.
void set_last_error(std::string error);
std::optional<std::string> take_last_error() noexcept;

class EmulatedStream final : public Stream::Impl {
 public:
  // `pool`: the pool whose blocks of this stream are freed once its work is done (none
  // for the backend's own stream of frees).
  EmulatedStream(int device, std::uint64_t id, std::chrono::microseconds delay, CachingPool* pool);
  ~EmulatedStream() override;

  Accelerator accelerator() const noexcept override { return Accelerator::Emulated; }
  int device() const noexcept override { return shared_->device; }
  std::uint64_t id() const noexcept override { return shared_->id; }
  void* native() const noexcept override { return nullptr; }
  void enqueue(std::function<void()> task) override;
  // A communicator's part of a collective: it runs even after the stream has faulted
  // (kernels and copies are then skipped), so that a faulted rank still takes part and
  // its peers are never left waiting; faulted_now() tells such a task to move scratch
  // data instead of the stream's buffers.
  void enqueue_communication(std::function<void()> task);
  static bool faulted_now() noexcept;
  // The device's own step in stream order, as cudaFreeAsync is: it runs even after the
  // stream faulted, and is no span of the timeline. False when the stream has ended (its
  // work has all run): the caller does it at once.
  bool enqueue_internal(std::function<void()> task);
  // Waits until the work enqueued so far has run (or the stream ended), like an event
  // recorded now; the function holds the stream's state, not the stream.
  std::function<void()> waiter();
  bool query() override;
  void synchronize() override;
  std::optional<std::string> error() override;
  std::string to_string() const override;

  // Whether the calling thread is this stream's own (one of its tasks runs now).
  bool on_own_thread() const noexcept { return thread_.get_id() == std::this_thread::get_id(); }
  // Operations enqueued so far / run so far (an event records the first).
  std::uint64_t enqueued();
  void wait_until(std::uint64_t count);
  bool reached(std::uint64_t count);

 private:
  // What the stream's thread uses, owned jointly with it: the last handle may go inside
  // one of the stream's own tasks, and the thread then outlives the EmulatedStream.
  struct Shared {
    int device = 0;
    std::uint64_t id = 0;
    std::chrono::microseconds delay{0};
    CachingPool* pool = nullptr;
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<std::function<void()>> queue;
    std::uint64_t enqueued = 0;
    std::uint64_t completed = 0;
    bool stopping = false;
    bool finished = false;  // the thread has left its loop: nothing enqueued runs any more
    std::optional<std::string> error;
  };
  static void run(const std::shared_ptr<Shared>& shared);

  std::shared_ptr<Shared> shared_;
  std::thread thread_;
};

class EmulatedBackend final : public Backend {
 public:
  EmulatedBackend();
  Accelerator accelerator() const noexcept override { return Accelerator::Emulated; }
  int device_count() const override { return static_cast<int>(visible_.size()); }
  void make_current(int index) override;
  std::string physical_device(int index) const override;
  Stream create_stream(int device) override;
  Event create_event(int device) override;
  Tensor empty(const TensorMeta& meta, const Stream& stream) override;
  void copy_async(void* dst, const void* src, std::size_t bytes, const Stream& stream) override;
  void memset_async(void* dst, int value, std::size_t bytes, const Stream& stream) override;
  std::shared_ptr<void> pinned(std::size_t bytes) override;
  PoolStats pool_stats() const override { return pool_.stats(); }
  void empty_cache() override { pool_.empty_cache(); }
  int contexts() const override;

  // Whether [p, p + bytes) is live device memory of this backend (a collective given
  // anything else faults, as NCCL does on a host pointer).
  bool is_device_memory(const void* p, std::size_t bytes) const { return pool_.contains(p, bytes); }
  // Device memory outside any stream (Tensor::empty of an emulated meta).
  std::shared_ptr<void> allocate_unordered(int device, std::size_t bytes) {
    touch(device);
    return pool_.allocate(bytes, 0);
  }
  void check_device(int index, const char* what) const;
  // What one emulated device holds: an allocation larger than this fails as cudaMalloc
  // does on a device without the memory (out of memory, set as the thread's last error).
  static constexpr std::size_t kDeviceBytes = std::size_t{1} << 40;
  // Counts `device`'s context the first time it is used, as a GPU creates one.
  void touch(int device);
  // The calling thread's current device (make_current), 0 by default.
  static int current();
  // A pool block's free in stream order (CachingPool::RawFree): a task on the block's
  // stream while it runs, at once once its work is all done; a block of no stream (key 0)
  // after the work every stream has been given so far, on the backend's own stream.
  void free_ordered(void* p, std::uint64_t stream_key);

 private:
  int node_devices_;                         // MESHRT_EMULATED_DEVICES
  std::optional<std::string> visible_text_;  // MESHRT_EMULATED_VISIBLE_DEVICES
  std::vector<int> visible_;                 // device i is the node's visible_[i]
  mutable std::mutex contexts_mutex_;
  std::vector<bool> has_context_;
  std::chrono::microseconds delay_;
  // Before the pools, whose frees use them (members go in reverse order).
  std::mutex streams_mutex_;
  std::map<std::uint64_t, std::weak_ptr<EmulatedStream>> streams_;  // by id: every stream made, live or gone
  std::unique_ptr<EmulatedStream> frees_;                           // the frees of blocks of no stream
  CachingPool pool_;
  CachingPool pinned_;
  std::atomic<std::uint64_t> next_stream_{1};
};

EmulatedBackend& emulated_backend();

}  // namespace meshrt::device
