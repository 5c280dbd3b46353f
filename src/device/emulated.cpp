#include "device/emulated.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <new>
#include <string_view>
#include <utility>

#include "common/trace.hpp"
#include "meshrt/internal/settings.hpp"

namespace meshrt::device {
namespace {

constexpr std::size_t kAlignment = 64;

void* host_allocate(std::size_t bytes) {
  return ::operator new(bytes, std::align_val_t(kAlignment));
}
void host_free(void* p) {
  ::operator delete(p, std::align_val_t(kAlignment));
}

thread_local int t_current_device = 0;
thread_local std::optional<std::string> t_last_error;

// As cudaMalloc: nullptr, with the calling thread's last error set, when the device has not
// the memory.
void* device_malloc(std::size_t bytes) {
  if (bytes > EmulatedBackend::kDeviceBytes) {
    set_last_error("out of memory");
    return nullptr;
  }
  return host_allocate(bytes);
}

class EmulatedEvent final : public Event::Impl {
 public:
  void record(Stream::Impl& stream) override {
    auto s = std::static_pointer_cast<EmulatedStream>(stream.shared_from_this());
    std::lock_guard lock(mutex_);
    count_ = s->enqueued();
    stream_ = std::move(s);
  }
  void wait(Stream::Impl& stream) override {
    auto [s, count] = point();
    if (!s) return;
    // The waiting stream's thread blocks until the recorded point: device-side, the host
    // caller goes on at once.
    stream.enqueue([s = std::move(s), count = count] { s->wait_until(count); });
  }
  bool query() override {
    auto [s, count] = point();
    return !s || s->reached(count);
  }
  void synchronize() override {
    auto [s, count] = point();
    if (s) s->wait_until(count);
  }

 private:
  std::pair<std::shared_ptr<EmulatedStream>, std::uint64_t> point() {
    std::lock_guard lock(mutex_);
    return {stream_, count_};
  }
  std::mutex mutex_;
  std::shared_ptr<EmulatedStream> stream_;
  std::uint64_t count_ = 0;
};

}  // namespace

void set_last_error(std::string error) {
  t_last_error = std::move(error);
}

std::optional<std::string> take_last_error() noexcept {
  return std::exchange(t_last_error, std::nullopt);
}

// ---------------------------------------------------------------------------- stream

namespace {
// Whether the stream whose thread this is had faulted before the task it runs now.
thread_local bool t_faulted = false;
}  // namespace

EmulatedStream::EmulatedStream(int device, std::uint64_t id, std::chrono::microseconds delay, CachingPool* pool)
    : shared_(std::make_shared<Shared>()) {
  shared_->device = device;
  shared_->id = id;
  shared_->delay = delay;
  shared_->pool = pool;
  thread_ = std::thread([shared = shared_] { run(shared); });
}

EmulatedStream::~EmulatedStream() {
  {
    std::lock_guard lock(shared_->mutex);
    shared_->stopping = true;
  }
  shared_->cv.notify_all();
  // The last handle may go inside one of this stream's own tasks: the thread then drains
  // the queue and ends on its own.
  if (thread_.get_id() == std::this_thread::get_id()) {
    thread_.detach();
  } else {
    thread_.join();
  }
}

bool EmulatedStream::faulted_now() noexcept {
  return t_faulted;
}

void EmulatedStream::enqueue(std::function<void()> task) {
  enqueue_communication([task = std::move(task), device = shared_->device, id = shared_->id] {
    if (t_faulted) return;
    try {
      task();
    } catch (const std::exception& e) {
      // A kernel's error (a host task's is its call's, caught before it gets here): the
      // emulator's model of an illegal address, which loses a GPU's context.
      record_device_fault(fmt::format("emulated:{} stream {}: {}", device, id, e.what()));
      throw;
    }
  });
}

void EmulatedStream::enqueue_communication(std::function<void()> task) {
  if (detail::trace::enabled()) {
    // MESHRT_TRACE: the task as a span of this stream's track, with the command that
    // enqueued it, from its queueing through its run on the stream's thread.
    task = [task = std::move(task), queued = detail::trace::now_ns(), ident = detail::trace::current_ident,
            id = shared_->id, device = shared_->device] {
      detail::trace::Event e;
      e.track = detail::trace::Track::Worker;
      e.kind = detail::trace::Kind::Device;
      e.queued_ns = queued;
      e.ident = ident;
      e.b = id;
      e.c = static_cast<std::uint64_t>(device);
      e.start_ns = detail::trace::now_ns();
      struct Record {
        detail::trace::Event& e;
        ~Record() {
          e.end_ns = detail::trace::now_ns();
          e.failed = std::uncaught_exceptions() > 0 || EmulatedStream::faulted_now();
          detail::trace::record(e);
        }
      } record{e};
      task();
    };
  }
  {
    std::lock_guard lock(shared_->mutex);
    shared_->queue.push_back(std::move(task));
    ++shared_->enqueued;
  }
  shared_->cv.notify_all();
}

bool EmulatedStream::enqueue_internal(std::function<void()> task) {
  {
    std::lock_guard lock(shared_->mutex);
    if (shared_->finished) return false;
    // Not wrapped as enqueue() wraps a kernel: it runs even on a faulted stream.
    shared_->queue.push_back(std::move(task));
    ++shared_->enqueued;
  }
  shared_->cv.notify_all();
  return true;
}

std::function<void()> EmulatedStream::waiter() {
  std::lock_guard lock(shared_->mutex);
  return [shared = shared_, count = shared_->enqueued] {
    std::unique_lock wait_lock(shared->mutex);
    shared->cv.wait(wait_lock, [&] { return shared->completed >= count || shared->finished; });
  };
}

void EmulatedStream::run(const std::shared_ptr<Shared>& shared) {
  Shared& s = *shared;
  std::unique_lock lock(s.mutex);
  for (;;) {
    s.cv.wait(lock, [&] { return s.stopping || !s.queue.empty(); });
    // Stopping drains the queue first: queued work still runs, as on a GPU.
    if (s.queue.empty()) break;
    std::function<void()> task = std::move(s.queue.front());
    s.queue.pop_front();
    const bool failed = s.error.has_value();
    lock.unlock();
    if (s.delay.count() > 0) std::this_thread::sleep_for(s.delay);
    std::optional<std::string> error;
    // After an error the stream is broken, as a CUDA context after a fault: later work
    // is skipped (events still complete, so nobody waits forever), except a
    // communicator's part of a collective, which still runs with scratch buffers.
    {
      t_faulted = failed;
      DeviceMemoryAccess access;
      try {
        task();
      } catch (const std::exception& e) {
        error = e.what();
      } catch (...) {
        error = "a task threw a non-std::exception";
      }
    }
    task = nullptr;  // its captures (tensors, pinned blocks) go before the count moves
    lock.lock();
    if (error && !s.error) s.error = fmt::format("emulated:{} stream {}: {}", s.device, s.id, *error);
    ++s.completed;
    s.cv.notify_all();
  }
  s.finished = true;
  s.cv.notify_all();
  lock.unlock();
  // Its work is done: the blocks it cached may go.
  if (s.pool != nullptr) s.pool->forget_stream(s.id);
}

bool EmulatedStream::query() {
  std::lock_guard lock(shared_->mutex);
  return shared_->completed == shared_->enqueued;
}

void EmulatedStream::synchronize() {
  wait_until(enqueued());
}

std::uint64_t EmulatedStream::enqueued() {
  std::lock_guard lock(shared_->mutex);
  return shared_->enqueued;
}

void EmulatedStream::wait_until(std::uint64_t count) {
  std::unique_lock lock(shared_->mutex);
  shared_->cv.wait(lock, [&] { return shared_->completed >= count; });
}

bool EmulatedStream::reached(std::uint64_t count) {
  std::lock_guard lock(shared_->mutex);
  return shared_->completed >= count;
}

std::optional<std::string> EmulatedStream::error() {
  std::lock_guard lock(shared_->mutex);
  return shared_->error;
}

std::string EmulatedStream::to_string() const {
  return fmt::format("emulated:{} stream {}", shared_->device, shared_->id);
}

// ---------------------------------------------------------------------------- backend

namespace {

// MESHRT_EMULATED_VISIBLE_DEVICES: the node's devices this process sees, in order (all of
// them when unset), as CUDA_VISIBLE_DEVICES lists GPUs.
std::vector<int> visible_devices(int node_devices, const std::optional<std::string>& text) {
  std::vector<int> out;
  if (!text) {
    for (int d = 0; d < node_devices; ++d) out.push_back(d);
    return out;
  }
  const auto refuse = [&] {
    throw UsageError(
        fmt::format("setting MESHRT_EMULATED_VISIBLE_DEVICES: expected a comma-separated list of distinct emulated "
                    "devices in 0..{} (MESHRT_EMULATED_DEVICES={}), found \"{}\"",
                    node_devices - 1, node_devices, *text));
  };
  std::string_view rest = *text;
  while (true) {
    const auto comma = rest.find(',');
    const std::string_view item = rest.substr(0, comma);
    int d = 0;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), d);
    if (item.empty() || ec != std::errc() || end != item.data() + item.size() || d < 0 || d >= node_devices ||
        std::find(out.begin(), out.end(), d) != out.end()) {
      refuse();
    }
    out.push_back(d);
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  return out;
}

}  // namespace

EmulatedBackend::EmulatedBackend()
    : node_devices_(static_cast<int>(settings::kEmulatedDevices.get())),
      visible_text_(settings::kEmulatedVisibleDevices.from_environment()),
      visible_(visible_devices(node_devices_, visible_text_)),
      delay_(settings::kEmulatedDelayUs.get()),
      frees_(std::make_unique<EmulatedStream>(0, 0, std::chrono::microseconds(0), nullptr)),
      pool_(
          [](std::size_t n, std::uint64_t) {
            void* p = device_malloc(n);
            if (p == nullptr) {
              // Handled here (the pool retries, or the caller reports it): not the next
              // kernel launch's error.
              const std::string error = take_last_error().value_or("out of memory");
              throw SystemError(fmt::format("emulated allocation of {} bytes: {} (an emulated device holds {} bytes)",
                                            n, error, kDeviceBytes));
            }
            return p;
          },
          [this](void* p, std::uint64_t stream_key) { free_ordered(p, stream_key); },
          static_cast<std::size_t>(settings::kDevicePoolBytes.get())),
      pinned_([](std::size_t n, std::uint64_t) { return host_allocate(n); },
              [](void* p, std::uint64_t) { host_free(p); }, SIZE_MAX) {
  has_context_.assign(visible_.size(), false);  // the settings take >= 1 devices, >= 0 us
}

void EmulatedBackend::check_device(int index, const char* what) const {
  if (index < 0 || index >= device_count()) {
    throw UsageError(fmt::format(
        "{}: expected an emulated device in 0..{} (MESHRT_EMULATED_DEVICES={}{}), found {}", what, device_count() - 1,
        node_devices_, visible_text_ ? ", MESHRT_EMULATED_VISIBLE_DEVICES=" + *visible_text_ : std::string(), index));
  }
}

std::string EmulatedBackend::physical_device(int index) const {
  check_device(index, "physical_device");
  return fmt::format("emulated device {} of the node", visible_[static_cast<std::size_t>(index)]);
}

void EmulatedBackend::touch(int device) {
  std::lock_guard lock(contexts_mutex_);
  has_context_.at(static_cast<std::size_t>(device)) = true;
}

int EmulatedBackend::contexts() const {
  std::lock_guard lock(contexts_mutex_);
  return static_cast<int>(std::count(has_context_.begin(), has_context_.end(), true));
}

void EmulatedBackend::make_current(int index) {
  check_device(index, "make_current");
  touch(index);  // cudaSetDevice creates the device's primary context (CUDA 12 and up)
  t_current_device = index;
}

int EmulatedBackend::current() {
  return t_current_device;
}

Stream EmulatedBackend::create_stream(int device) {
  check_device(device, "create_stream");
  touch(device);
  auto stream = std::make_shared<EmulatedStream>(device, next_stream_++, delay_, &pool_);
  std::lock_guard lock(streams_mutex_);
  std::erase_if(streams_, [](const auto& entry) { return entry.second.expired(); });
  streams_.emplace(stream->id(), stream);
  return Stream(std::move(stream));
}

void EmulatedBackend::free_ordered(void* p, std::uint64_t stream_key) {
  if (stream_key != 0) {
    std::shared_ptr<EmulatedStream> s;
    {
      std::lock_guard lock(streams_mutex_);
      if (auto it = streams_.find(stream_key); it != streams_.end()) s = it->second.lock();
    }
    // Freed by the stream after the work it was given so far, as cudaFreeAsync does; a
    // stream that has ended ran all of its work.
    if (!s || !s->enqueue_internal([p] { host_free(p); })) host_free(p);
    return;
  }
  // No stream: any of them may have used it. The backend's own stream waits for what
  // each live stream was given so far, then frees it; the caller never waits.
  std::vector<std::function<void()>> waits;
  {
    std::lock_guard lock(streams_mutex_);
    for (const auto& [id, weak] : streams_) {
      if (auto s = weak.lock()) waits.push_back(s->waiter());
    }
  }
  frees_->enqueue_internal([p, waits = std::move(waits)] {
    for (const auto& wait : waits) wait();
    host_free(p);
  });
}

Event EmulatedBackend::create_event(int device) {
  check_device(device, "create_event");
  touch(device);
  return Event(std::make_shared<EmulatedEvent>());
}

Tensor EmulatedBackend::empty(const TensorMeta& meta, const Stream& stream) {
  Stream::Impl& s = stream_impl(stream, Accelerator::Emulated, "emulated empty");
  if (!meta.device().is_emulated() || meta.device().index() != s.device()) {
    throw UsageError(fmt::format("emulated empty: expected a tensor on {}'s device emulated:{}, found {}",
                                 s.to_string(), s.device(), meta.to_string()));
  }
  return Tensor::adopt_device(meta, pool_.allocate(meta.nbytes(), s.id()));
}

void EmulatedBackend::copy_async(void* dst, const void* src, std::size_t bytes, const Stream& stream) {
  Stream::Impl& s = stream_impl(stream, Accelerator::Emulated, "emulated copy_async");
  if (bytes == 0) return;
  s.enqueue([=] { std::memcpy(dst, src, bytes); });
}

void EmulatedBackend::memset_async(void* dst, int value, std::size_t bytes, const Stream& stream) {
  Stream::Impl& s = stream_impl(stream, Accelerator::Emulated, "emulated memset_async");
  if (bytes == 0) return;
  s.enqueue([=] { std::memset(dst, value, bytes); });
}

std::shared_ptr<void> EmulatedBackend::pinned(std::size_t bytes) {
  touch(t_current_device);  // cudaMallocHost creates a context on the current device
  return pinned_.allocate(bytes, 1);
}

EmulatedBackend& emulated_backend() {
  // Never destroyed: tensors freed during exit still return their blocks to its pool.
  static auto* backend = new EmulatedBackend();
  return *backend;
}

}  // namespace meshrt::device
