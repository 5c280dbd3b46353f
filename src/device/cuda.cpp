// The cuda backend's streams, events and memory. Nothing here uses the legacy default
// stream: every copy and memset is asynchronous on the stream it is given.
#include "device/cuda.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <map>
#include <mutex>
#include <vector>

#include "common/trace.hpp"
#include "device/backend.hpp"
#include "device/pool.hpp"
#include "meshrt/internal/settings.hpp"

namespace meshrt::device {
namespace {

// The first error of the host functions of one stream, shared with those in flight.
struct ErrorSlot {
  std::mutex mutex;
  std::optional<std::string> error;
  void set(std::string text) {
    std::lock_guard lock(mutex);
    if (!error) error = std::move(text);
  }
};

struct HostTask {
  std::function<void()> fn;
  std::shared_ptr<ErrorSlot> slot;
};

// A host function must not call CUDA; meshrt's tasks only touch host memory and the pool.
void CUDART_CB run_host_task(void* p) {
  std::unique_ptr<HostTask> task(static_cast<HostTask*>(p));
  try {
    task->fn();
  } catch (const std::exception& e) {
    task->slot->set(e.what());
  } catch (...) {
    task->slot->set("a host task threw a non-std::exception");
  }
}

// Device memory in stream order, from a memory pool of each device's own
// (cudaMallocFromPoolAsync, cudaFreeAsync): a block is allocated on the stream that uses
// it and freed on that stream after the work enqueued on it so far, so no free ever waits
// for the device. cudaFree may synchronize the whole device (cuda_runtime_api.h, "this API
// may perform implicit synchronization"), which a collective waiting for a peer holds up.
// A block whose stream is gone is freed on the device's stream for frees, which waited for
// the last work of every stream that went. The pool lets a stream reuse what another
// freed only once that free has run (no internal dependencies: an allocation on one
// stream never waits for another, which may wait for a peer), and keeps what was freed
// reserved until trim(), which the worker calls when idle with nothing in flight.
class OrderedMemory {
 public:
  explicit OrderedMemory(int devices) : devices_(static_cast<std::size_t>(devices)) {}

  void add_stream(std::uint64_t key, cudaStream_t stream) {
    std::lock_guard lock(mutex_);
    streams_[key] = stream;
  }
  // Before cudaStreamDestroy: later frees of its blocks go to the device's stream for
  // frees, which first waits for everything this stream was given.
  void remove_stream(std::uint64_t key, int device) noexcept {
    std::lock_guard lock(mutex_);
    const auto it = streams_.find(key);
    if (it == streams_.end()) return;
    try {
      CudaDeviceGuard guard(device);  // the tail event on the stream's device
      cudaEvent_t tail = nullptr;
      if (cudaEventCreateWithFlags(&tail, cudaEventDisableTiming) == cudaSuccess) {
        if (cudaEventRecord(tail, it->second) == cudaSuccess) {
          if (cudaStream_t frees = frees_stream(device)) (void)cudaStreamWaitEvent(frees, tail, 0);
        }
        (void)cudaEventDestroy(tail);  // released once the device is past it
      }
    } catch (const std::exception&) {
      // CUDA is gone (the process ends): nothing is freed any more.
    }
    (void)cudaGetLastError();
    streams_.erase(it);
  }

  void* allocate(int device, std::size_t bytes, std::uint64_t key) {
    CudaDeviceGuard guard(device);
    std::lock_guard lock(mutex_);
    const auto it = streams_.find(key);
    if (it == streams_.end()) {
      throw UsageError(
          fmt::format("cuda allocation on cuda:{}: expected a live stream, found stream {} gone", device, key));
    }
    void* p = nullptr;
    const cudaError_t rc = cudaMallocFromPoolAsync(&p, bytes, pool(device), it->second);
    if (rc != cudaSuccess) {
      // Handled here (the caller may retry or report it): a failed allocation must not
      // stay CUDA's last error, or the next kernel launch's check would report it.
      (void)cudaGetLastError();
      throw SystemError(fmt::format("cudaMallocFromPoolAsync of {} bytes on cuda:{} failed: {} ({})", bytes, device,
                                    cudaGetErrorString(rc), cudaGetErrorName(rc)));
    }
    return p;
  }

  void free(int device, void* p, std::uint64_t key) noexcept {
    std::lock_guard lock(mutex_);
    try {
      CudaDeviceGuard guard(device);
      const auto it = streams_.find(key);
      cudaStream_t on = it != streams_.end() ? it->second : frees_stream(device);
      if (on == nullptr || cudaFreeAsync(p, on) != cudaSuccess) (void)cudaGetLastError();
    } catch (const std::exception&) {
      (void)cudaGetLastError();  // CUDA is gone (the process ends): the block goes with it
    }
    freed_since_trim_ = true;
  }

  // Gives the device what the pools hold but no block uses; only when the worker waits
  // for nothing (a trim may wait for the frees it releases).
  void trim() noexcept {
    if (!freed_since_trim_.exchange(false)) return;
    std::lock_guard lock(mutex_);
    for (std::size_t d = 0; d < devices_.size(); ++d) {
      if (devices_[d].pool == nullptr) continue;
      if (cudaMemPoolTrimTo(devices_[d].pool, 0) != cudaSuccess) (void)cudaGetLastError();
    }
  }

 private:
  struct PerDevice {
    cudaMemPool_t pool = nullptr;
    cudaStream_t frees = nullptr;
  };
  // Under mutex_, with `device` current.
  cudaMemPool_t pool(int device) {
    PerDevice& d = devices_.at(static_cast<std::size_t>(device));
    if (d.pool == nullptr) {
      cudaMemPoolProps props{};
      props.allocType = cudaMemAllocationTypePinned;
      props.handleTypes = cudaMemHandleTypeNone;
      props.location.type = cudaMemLocationTypeDevice;
      props.location.id = device;
      cudaMemPool_t made = nullptr;
      std::uint64_t keep = UINT64_MAX;  // released by trim() only
      int no = 0;
      cudaError_t rc = cudaMemPoolCreate(&made, &props);
      if (rc == cudaSuccess) rc = cudaMemPoolSetAttribute(made, cudaMemPoolAttrReleaseThreshold, &keep);
      if (rc == cudaSuccess) rc = cudaMemPoolSetAttribute(made, cudaMemPoolReuseAllowInternalDependencies, &no);
      if (rc != cudaSuccess) {
        (void)cudaGetLastError();  // reported here, not by the next kernel launch
        if (made != nullptr) (void)cudaMemPoolDestroy(made);
        throw SystemError(fmt::format("cuda:{}: making its memory pool failed: {} ({})", device, cudaGetErrorString(rc),
                                      cudaGetErrorName(rc)));
      }
      d.pool = made;
    }
    return d.pool;
  }
  cudaStream_t frees_stream(int device) noexcept {
    PerDevice& d = devices_.at(static_cast<std::size_t>(device));
    if (d.frees == nullptr && cudaStreamCreateWithFlags(&d.frees, cudaStreamNonBlocking) != cudaSuccess) {
      (void)cudaGetLastError();
      d.frees = nullptr;
    }
    return d.frees;
  }

  std::mutex mutex_;
  std::map<std::uint64_t, cudaStream_t> streams_;  // the live streams, by pool key
  std::vector<PerDevice> devices_;
  std::atomic<bool> freed_since_trim_{false};
};

class CudaStream;

// The streams with traced spans not yet recorded (cuda_trace_flush), and how many spans.
std::mutex g_traced_mutex;
std::vector<std::weak_ptr<CudaStream>> g_traced;
std::atomic<std::size_t> g_traced_spans{0};

// Timing events tell how long after another event they completed, on the device's clock.
// A span's times on the host's clock come from an anchor: an event recorded on an idle
// stream of its own and waited for, whose completion the host saw a few microseconds
// after the device did. A new anchor every few seconds: the times are float milliseconds
// (about a microsecond of resolution 8 s after the anchor).
struct Anchor {
  cudaEvent_t event = nullptr;
  std::int64_t host_ns = 0;
  Anchor() = default;
  Anchor(const Anchor&) = delete;
  Anchor& operator=(const Anchor&) = delete;
  ~Anchor() {
    if (event) (void)cudaEventDestroy(event);
  }
};
constexpr std::int64_t kReanchorNs = 4'000'000'000;

// MESHRT_TRACE: one command's device work on a stream, between two timing events, and
// the command that enqueued it.
struct TracedSpan {
  cudaEvent_t begin = nullptr;
  cudaEvent_t end = nullptr;
  std::shared_ptr<const Anchor> anchor;  // recorded and complete before `begin`
  std::int64_t queued_ns = 0;
  std::uint64_t ident = 0;
};

class CudaStream final : public Stream::Impl {
 public:
  CudaStream(int device, std::uint64_t id, CachingPool& pool, OrderedMemory& memory)
      : device_(device), id_(id), pool_(pool), memory_(memory) {
    CudaDeviceGuard guard(device);
    MESHRT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    memory_.add_stream(id_, stream_);
  }
  ~CudaStream() override {
    // What has run is recorded; spans still running are not waited for.
    if (traced_) {
      flush(false);
      std::lock_guard lock(trace_mutex_);
      g_traced_spans -= done_.size();
      for (const TracedSpan& s : done_) spare_.insert(spare_.end(), {s.begin, s.end});
      if (open_) spare_.push_back(open_->begin);
      for (cudaEvent_t e : spare_) (void)cudaEventDestroy(e);
      anchor_.reset();
      if (anchor_stream_) (void)cudaStreamDestroy(anchor_stream_);
    }
    // Queued work still runs after cudaStreamDestroy; this stream's blocks are freed on
    // the device's stream for frees, after that work.
    memory_.remove_stream(id_, device_);
    (void)cudaStreamDestroy(stream_);
    pool_.forget_stream(id_);
  }

  // Called by the worker's thread only. An open span of an earlier command that never
  // closed it (its stream was made outside a command) is started again.
  void trace_open() override {
    CudaDeviceGuard guard(device_);
    std::lock_guard lock(trace_mutex_);
    if (!traced_) {
      traced_ = true;
      std::lock_guard registry(g_traced_mutex);
      g_traced.push_back(std::static_pointer_cast<CudaStream>(shared_from_this()));
    }
    const std::int64_t now = detail::trace::now_ns();
    if (!anchor_ || now - anchor_->host_ns > kReanchorNs) reanchor();
    if (!open_) open_ = TracedSpan{.begin = take_event(), .end = nullptr, .anchor = {}, .queued_ns = 0, .ident = 0};
    open_->anchor = anchor_;
    open_->queued_ns = detail::trace::now_ns();
    open_->ident = detail::trace::current_ident;
    MESHRT_CUDA_CHECK(cudaEventRecord(open_->begin, stream_));
  }
  void trace_close() override {
    CudaDeviceGuard guard(device_);
    std::lock_guard lock(trace_mutex_);
    if (!open_) return;
    open_->end = take_event();
    MESHRT_CUDA_CHECK(cudaEventRecord(open_->end, stream_));
    done_.push_back(*open_);
    open_.reset();
    ++g_traced_spans;
  }

  // Records the spans whose work has ended, oldest first (`wait`: every one, waiting).
  // From any thread (the watch's for write_trace): the stream's device is made current and
  // left so, as a guard would restore device 0 on a new thread and make a context there.
  void flush(bool wait) {
    std::lock_guard lock(trace_mutex_);
    if (done_.empty()) return;
    int current = -1;
    if (cudaGetDevice(&current) != cudaSuccess || current != device_) {
      if (cudaSetDevice(device_) != cudaSuccess) return;
    }
    while (!done_.empty()) {
      const TracedSpan s = done_.front();
      const cudaError_t rc = wait ? cudaEventSynchronize(s.end) : cudaEventQuery(s.end);
      if (rc == cudaErrorNotReady) return;
      detail::trace::Event e;
      e.track = detail::trace::Track::Worker;
      e.kind = detail::trace::Kind::Device;
      e.type = 1;  // cuda
      e.queued_ns = s.queued_ns;
      e.ident = s.ident;
      e.b = id_;
      e.c = static_cast<std::uint64_t>(device_);
      float begin_ms = 0, end_ms = 0;
      if (rc == cudaSuccess && cudaEventElapsedTime(&begin_ms, s.anchor->event, s.begin) == cudaSuccess &&
          cudaEventElapsedTime(&end_ms, s.anchor->event, s.end) == cudaSuccess) {
        // Never before it was enqueued: the anchor's error is the host's lag behind it.
        const std::int64_t at = s.anchor->host_ns;
        e.start_ns = std::max(s.queued_ns, at + static_cast<std::int64_t>(static_cast<double>(begin_ms) * 1e6));
        e.end_ns = std::max(e.start_ns, at + static_cast<std::int64_t>(static_cast<double>(end_ms) * 1e6));
      } else {
        e.start_ns = e.end_ns = s.queued_ns;  // the stream failed: a mark where it was enqueued
        e.failed = true;
      }
      detail::trace::record(e);
      spare_.insert(spare_.end(), {s.begin, s.end});
      done_.pop_front();  // and its hold on the anchor
      --g_traced_spans;
    }
  }

  Accelerator accelerator() const noexcept override { return Accelerator::Cuda; }
  int device() const noexcept override { return device_; }
  std::uint64_t id() const noexcept override { return id_; }
  void* native() const noexcept override { return stream_; }

  void enqueue(std::function<void()> task) override {
    auto* t = new HostTask{std::move(task), slot_};
    const cudaError_t rc = cudaLaunchHostFunc(stream_, run_host_task, t);
    if (rc != cudaSuccess) {
      delete t;
      MESHRT_CUDA_CHECK(rc);
    }
  }
  // An error of a stream's work is a kernel's asynchronous one (an illegal address, a
  // failed launch): sticky, the context is lost, and the rank with it (device_fault).
  bool query() override {
    const cudaError_t rc = cudaStreamQuery(stream_);
    if (rc == cudaErrorNotReady) return false;
    if (rc != cudaSuccess) faulted(rc);
    return true;
  }
  void synchronize() override {
    const cudaError_t rc = cudaStreamSynchronize(stream_);
    if (rc != cudaSuccess) faulted(rc);
  }
  std::optional<std::string> error() override {
    std::lock_guard lock(slot_->mutex);
    return slot_->error;
  }
  std::string to_string() const override { return fmt::format("cuda:{} stream {}", device_, id_); }

 private:
  void faulted(cudaError_t rc) {
    const std::string what = fmt::format("{}: {} ({})", to_string(), cudaGetErrorString(rc), cudaGetErrorName(rc));
    slot_->set(what);
    record_device_fault(what);
  }
  // Under trace_mutex_, on a thread where device_ is current.
  cudaEvent_t take_event() {
    if (!spare_.empty()) {
      cudaEvent_t e = spare_.back();
      spare_.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    MESHRT_CUDA_CHECK(cudaEventCreate(&e));  // with timing
    return e;
  }
  // Never waits for this stream's work (which may wait for a peer): the anchor's stream is idle.
  void reanchor() {
    if (!anchor_stream_) MESHRT_CUDA_CHECK(cudaStreamCreateWithFlags(&anchor_stream_, cudaStreamNonBlocking));
    auto anchor = std::make_shared<Anchor>();
    MESHRT_CUDA_CHECK(cudaEventCreate(&anchor->event));
    MESHRT_CUDA_CHECK(cudaEventRecord(anchor->event, anchor_stream_));
    MESHRT_CUDA_CHECK(cudaEventSynchronize(anchor->event));
    anchor->host_ns = detail::trace::now_ns();
    anchor_ = std::move(anchor);
  }

  int device_;
  std::uint64_t id_;
  CachingPool& pool_;
  OrderedMemory& memory_;
  cudaStream_t stream_ = nullptr;
  std::shared_ptr<ErrorSlot> slot_ = std::make_shared<ErrorSlot>();
  // MESHRT_TRACE
  std::mutex trace_mutex_;
  bool traced_ = false;
  std::optional<TracedSpan> open_;
  std::deque<TracedSpan> done_;
  std::vector<cudaEvent_t> spare_;
  cudaStream_t anchor_stream_ = nullptr;
  std::shared_ptr<const Anchor> anchor_;
};

class CudaEvent final : public Event::Impl {
 public:
  explicit CudaEvent(int device) {
    CudaDeviceGuard guard(device);
    MESHRT_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
  }
  ~CudaEvent() override { (void)cudaEventDestroy(event_); }
  void record(Stream::Impl& stream) override {
    MESHRT_CUDA_CHECK(cudaEventRecord(event_, static_cast<cudaStream_t>(stream.native())));
  }
  void wait(Stream::Impl& stream) override {
    MESHRT_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream.native()), event_, 0));
  }
  bool query() override {
    const cudaError_t rc = cudaEventQuery(event_);
    if (rc == cudaErrorNotReady) return false;
    if (rc != cudaSuccess) {
      record_device_fault(fmt::format("cuda event: {} ({})", cudaGetErrorString(rc), cudaGetErrorName(rc)));
    }
    MESHRT_CUDA_CHECK(rc);
    return true;
  }
  void synchronize() override { MESHRT_CUDA_CHECK(cudaEventSynchronize(event_)); }

 private:
  cudaEvent_t event_ = nullptr;
};

class CudaBackend final : public Backend {
 public:
  CudaBackend()
      : pool_limit_(static_cast<std::size_t>(settings::kDevicePoolBytes.get())),
        pinned_(
            [](std::size_t n, std::uint64_t) {
              void* p = nullptr;
              const cudaError_t rc = cudaMallocHost(&p, n);
              if (rc != cudaSuccess) {
                (void)cudaGetLastError();  // handled: not the next launch's error
                throw SystemError(fmt::format("cudaMallocHost of {} bytes failed: {} ({})", n, cudaGetErrorString(rc),
                                              cudaGetErrorName(rc)));
              }
              return p;
            },
            // cudaFreeHost may synchronize the device: what the staging cache gives up is
            // freed when the worker is idle with nothing in flight (trim).
            [this](void* p, std::uint64_t) {
              std::lock_guard lock(host_frees_mutex_);
              host_frees_.push_back(p);
            },
            SIZE_MAX) {
    const cudaError_t rc = cudaGetDeviceCount(&count_);
    if (rc != cudaSuccess || count_ < 1) {
      (void)cudaGetLastError();
      throw UsageError(fmt::format("cuda backend: expected a usable CUDA device, found {}",
                                   rc != cudaSuccess ? cudaGetErrorString(rc) : "none visible"));
    }
    has_context_.assign(static_cast<std::size_t>(count_), false);
    memory_ = std::make_unique<OrderedMemory>(count_);
    for (int d = 0; d < count_; ++d) {
      pools_.push_back(std::make_unique<CachingPool>(
          [this, d](std::size_t n, std::uint64_t key) { return memory_->allocate(d, n, key); },
          [this, d](void* p, std::uint64_t key) { memory_->free(d, p, key); }, pool_limit_));
    }
  }

  Accelerator accelerator() const noexcept override { return Accelerator::Cuda; }
  int device_count() const override { return count_; }
  void make_current(int index) override {
    check(index, "make_current");
    touch(index);  // cudaSetDevice creates the primary context (CUDA 12 and up)
    MESHRT_CUDA_CHECK(cudaSetDevice(index));
  }
  std::string physical_device(int index) const override {
    check(index, "physical_device");
    char bus[32] = {};
    MESHRT_CUDA_CHECK(cudaDeviceGetPCIBusId(bus, static_cast<int>(sizeof bus), index));
    return fmt::format("the GPU at PCI bus id {}", bus);
  }
  Stream create_stream(int device) override {
    check(device, "create_stream");
    touch(device);
    auto stream =
        std::make_shared<CudaStream>(device, next_stream_++, *pools_[static_cast<std::size_t>(device)], *memory_);
    // Made by a command's first device work: the span of that command starts here.
    if (detail::trace::enabled()) stream->trace_open();
    return Stream(std::move(stream));
  }
  Event create_event(int device) override {
    check(device, "create_event");
    touch(device);
    return Event(std::make_shared<CudaEvent>(device));
  }
  Tensor empty(const TensorMeta& meta, const Stream& stream) override {
    Stream::Impl& s = stream_impl(stream, Accelerator::Cuda, "cuda empty");
    if (!meta.device().is_cuda() || meta.device().index() != s.device()) {
      throw UsageError(fmt::format("cuda empty: expected a tensor on {}'s device cuda:{}, found {}", s.to_string(),
                                   s.device(), meta.to_string()));
    }
    touch(s.device());
    return Tensor::adopt_device(meta, pools_[static_cast<std::size_t>(s.device())]->allocate(meta.nbytes(), s.id()));
  }
  void copy_async(void* dst, const void* src, std::size_t bytes, const Stream& stream) override {
    Stream::Impl& s = stream_impl(stream, Accelerator::Cuda, "cuda copy_async");
    if (bytes == 0) return;
    MESHRT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(s.native())));
  }
  void memset_async(void* dst, int value, std::size_t bytes, const Stream& stream) override {
    Stream::Impl& s = stream_impl(stream, Accelerator::Cuda, "cuda memset_async");
    if (bytes == 0) return;
    MESHRT_CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, static_cast<cudaStream_t>(s.native())));
  }
  std::shared_ptr<void> pinned(std::size_t bytes) override {
    // cudaMallocHost creates a context on the current device (ensure_current made it the
    // rank's own on a worker thread).
    int current = 0;
    MESHRT_CUDA_CHECK(cudaGetDevice(&current));
    touch(current);
    return pinned_.allocate(bytes, 1);
  }
  PoolStats pool_stats() const override {
    PoolStats total;
    for (const auto& p : pools_) {
      const PoolStats s = p->stats();
      total.hits += s.hits;
      total.misses += s.misses;
      total.cached_bytes += s.cached_bytes;
      total.live_bytes += s.live_bytes;
    }
    return total;
  }
  void empty_cache() override {
    for (auto& p : pools_) p->empty_cache();
    pinned_.empty_cache();
  }
  void trim() override {
    std::lock_guard trimming(trim_mutex_);
    memory_->trim();
    std::vector<void*> frees;
    {
      std::lock_guard lock(host_frees_mutex_);
      frees.swap(host_frees_);
    }
    for (void* p : frees) (void)cudaFreeHost(p);
    (void)cudaGetLastError();
  }
  int contexts() const override {
    std::lock_guard lock(contexts_mutex_);
    return static_cast<int>(std::count(has_context_.begin(), has_context_.end(), true));
  }

 private:
  void check(int index, const char* what) const {
    if (index < 0 || index >= count_) {
      throw UsageError(fmt::format("cuda {}: expected a device in 0..{}, found {}", what, count_ - 1, index));
    }
  }
  void touch(int device) {
    std::lock_guard lock(contexts_mutex_);
    if (device >= 0 && device < count_) has_context_[static_cast<std::size_t>(device)] = true;
  }
  int count_ = 0;
  mutable std::mutex contexts_mutex_;
  std::vector<bool> has_context_;
  std::size_t pool_limit_;
  std::mutex trim_mutex_;
  std::mutex host_frees_mutex_;
  std::vector<void*> host_frees_;  // pinned blocks given up, freed by trim()
  std::unique_ptr<OrderedMemory> memory_;
  std::vector<std::unique_ptr<CachingPool>> pools_;
  CachingPool pinned_;
  std::atomic<std::uint64_t> next_stream_{1};
};

}  // namespace

void cuda_trace_flush(bool wait) {
  if (g_traced_spans.load() == 0) return;
  std::vector<std::shared_ptr<CudaStream>> live;
  {
    std::lock_guard lock(g_traced_mutex);
    std::erase_if(g_traced, [](const std::weak_ptr<CudaStream>& s) { return s.expired(); });
    for (const auto& s : g_traced) {
      if (auto p = s.lock()) live.push_back(std::move(p));
    }
  }
  for (const auto& s : live) s->flush(wait);
}

std::atomic<CudaBackend*> g_cuda_backend{nullptr};

Backend& cuda_backend() {
  // Never destroyed, as the emulated one: tensors freed at exit return to its pools.
  static auto* backend = [] {
    auto* b = new CudaBackend();
    g_cuda_backend.store(b);
    return b;
  }();
  return *backend;
}

void cuda_trim() noexcept {
  if (CudaBackend* b = g_cuda_backend.load()) b->trim();
}

int cuda_visible_devices(std::string* why) noexcept {
  int count = 0;
  if (const cudaError_t rc = cudaGetDeviceCount(&count); rc != cudaSuccess) {
    (void)cudaGetLastError();
    if (why != nullptr) {
      try {
        *why = fmt::format("cudaGetDeviceCount: {} ({})", cudaGetErrorString(rc), cudaGetErrorName(rc));
      } catch (...) {
      }
    }
    return 0;
  }
  return count;
}

void cuda_make_native_wait(void* native, Stream::Impl& stream) {
  CudaDeviceGuard guard(stream.device());
  cudaEvent_t event = nullptr;
  MESHRT_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  cudaError_t rc = cudaEventRecord(event, static_cast<cudaStream_t>(stream.native()));
  if (rc == cudaSuccess) rc = cudaStreamWaitEvent(static_cast<cudaStream_t>(native), event, 0);
  // Destroyed at once: CUDA keeps a recorded event until the work it marks is done.
  (void)cudaEventDestroy(event);
  MESHRT_CUDA_CHECK(rc);
}

}  // namespace meshrt::device
