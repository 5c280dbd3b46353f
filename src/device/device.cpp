// The device layer's handles, the accelerator setting, the backend registry and the
// stream-ordered helpers shared by every backend.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <vector>

#include "common/trace.hpp"
#include "device/backend.hpp"
#include "device/emulated.hpp"
#include "device/pool.hpp"
#include "meshrt/config.hpp"
#include "meshrt/internal/settings.hpp"

#if MESHRT_HAVE_CUDA
#include "device/cuda.hpp"
#endif

namespace meshrt::device {
namespace {

std::atomic<bool> g_unordered_fetch{false};

std::mutex g_placement_mutex;
Placement g_placement;

// Whether this thread works for the worker, and whether it made the rank's device current.
thread_local bool t_worker_thread = false;
thread_local bool t_device_current = false;

std::mutex g_streams_mutex;
std::map<std::tuple<std::uint64_t, int, int>, Stream> g_streams;  // (meshrt stream, kind, index)

Stream::Impl& require(const Stream& stream, const char* what) {
  if (!stream.defined()) throw UsageError(fmt::format("{}: expected a stream, found an undefined one", what));
  return *stream.impl();
}

Event::Impl& require(const Event& event, const char* what) {
  if (!event.defined()) throw UsageError(fmt::format("{}: expected an event, found an undefined one", what));
  return *event.impl();
}

// Tensor::empty of an emulated meta: device memory from the pool, outside any stream.
std::shared_ptr<void> emulated_tensor_memory(const Device& device, std::size_t bytes) {
  EmulatedBackend& b = emulated_backend();
  b.check_device(device.index(), "emulated tensor allocation");
  return b.allocate_unordered(device.index(), bytes);
}

// The meshrt stream id of the device layer's own stream for Tensor's copies (no meshrt
// stream has it: the controller counts refs up from 1).
constexpr std::uint64_t kTensorCopies = UINT64_MAX;

// Runs `op` on the device layer's own stream of `on`, after everything enqueued so far on
// every other stream of `on` (and of `also`, for a copy between two devices) in this
// process, and waits for it: Tensor's stream-less copies are so ordered with the kernels
// that produced the value, whichever stream ran them, and never use the legacy stream.
void ordered_on(const Device& on, const std::optional<Device>& also, const char* what,
                const std::function<void(Backend&, const Stream&)>& op) {
  Backend& b = backend(on.kind());
  const Stream copies = stream_for(kTensorCopies, on);
  std::vector<Stream> before;
  {
    std::lock_guard lock(g_streams_mutex);
    for (const auto& [key, s] : g_streams) {
      const auto& [id, kind, index] = key;
      const bool same =
          kind == static_cast<int>(on.kind()) && (index == on.index() || (also && index == also->index()));
      if (same && id != kTensorCopies) before.push_back(s);
    }
  }
  for (const Stream& s : before) {
    Event e = b.create_event(s.device());
    e.record(s);
    e.wait(copies);
  }
  op(b, copies);
  copies.synchronize();
  if (auto error = copies.error()) {
    release_stream(kTensorCopies);  // its error is sticky: the next copy gets a fresh stream
    throw SystemError(fmt::format("{} on {}: device error: {}", what, on.to_string(), *error));
  }
}

void tensor_copy(void* dst, const Device& dst_device, const void* src, const Device& src_device, std::size_t n) {
  if (dst_device.is_accelerator() && src_device.is_accelerator() && dst_device.kind() != src_device.kind()) {
    throw UsageError(fmt::format("tensor copy: expected devices of one accelerator, found {} and {}",
                                 src_device.to_string(), dst_device.to_string()));
  }
  const Device& on = dst_device.is_accelerator() ? dst_device : src_device;
  const Device& other = &on == &dst_device ? src_device : dst_device;
  const std::optional<Device> also =
      other.is_accelerator() && other != on ? std::optional<Device>(other) : std::nullopt;
  ordered_on(on, also, "tensor copy", [&](Backend& b, const Stream& s) { b.copy_async(dst, src, n, s); });
}

void tensor_zero(void* dst, const Device& device, std::size_t n) {
  ordered_on(device, std::nullopt, "Tensor::zeros", [&](Backend& b, const Stream& s) { b.memset_async(dst, 0, n, s); });
}

// Installed at load: libmeshrt is one shared library, so this runs before main.
[[maybe_unused]] const bool g_allocator_installed = [] {
  meshrt::detail::set_device_allocator(emulated_tensor_memory);
  meshrt::detail::set_device_transfers(tensor_copy, tensor_zero);
  return true;
}();

// What the device still uses after a call returned (a copy's source, a staging block),
// held until an event recorded after that use completes, and released by the thread that
// next calls into the device layer (the worker, each turn): never inside a CUDA host
// function, which may make no CUDA call (a release can free into the pool), and whose
// callbacks a stream waits for.
struct Held {
  Event done;
  std::shared_ptr<const void> what;
};
std::mutex g_held_mutex;
std::vector<Held> g_held;
std::atomic<std::size_t> g_held_count{0};

void hold_until(Event done, std::shared_ptr<const void> what) {
  release_completed();
  std::lock_guard lock(g_held_mutex);
  g_held.push_back({std::move(done), std::move(what)});
  g_held_count.store(g_held.size());
}

void hold_until_done(Backend& b, const Stream& stream, std::shared_ptr<const void> what) {
  Event done = b.create_event(stream.device());
  done.record(stream);
  hold_until(std::move(done), std::move(what));
}

std::shared_ptr<const void> holding(const Tensor& t) {
  return std::make_shared<const Tensor>(t);
}

void require_accelerator_tensor(const Tensor& t, const char* what) {
  if (!t.defined() || !t.device().is_accelerator()) {
    throw UsageError(fmt::format("{}: expected an accelerator tensor, found {}", what, t.to_string()));
  }
}

}  // namespace

std::string_view name(Accelerator accelerator) noexcept {
  switch (accelerator) {
    case Accelerator::None:
      return "none";
    case Accelerator::Cuda:
      return "cuda";
    case Accelerator::Emulated:
      return "emulated";
  }
  return "invalid";
}

Accelerator parse_accelerator(std::string_view text) {
  if (text == "none") return Accelerator::None;
  if (text == "cuda") return Accelerator::Cuda;
  if (text == "emulated") return Accelerator::Emulated;
  if (text == "auto") return cuda_available() ? Accelerator::Cuda : Accelerator::None;
  throw UsageError(
      fmt::format("setting MESHRT_ACCELERATOR: expected one of auto, cuda, emulated, none, found \"{}\"", text));
}

Accelerator configured_accelerator() {
  static const Accelerator accelerator = parse_accelerator(settings::kAccelerator.get());
  return accelerator;
}

Device::Kind device_kind(Accelerator accelerator) noexcept {
  switch (accelerator) {
    case Accelerator::Cuda:
      return Device::Kind::Cuda;
    case Accelerator::Emulated:
      return Device::Kind::Emulated;
    case Accelerator::None:
      break;
  }
  return Device::Kind::Cpu;
}

Backend& backend(Accelerator accelerator) {
  switch (accelerator) {
    case Accelerator::Emulated:
      return emulated_backend();
    case Accelerator::Cuda:
#if MESHRT_HAVE_CUDA
      return cuda_backend();
#else
      throw UsageError(
          "device backend: expected an accelerator this build has, found cuda (meshrt was built "
          "without CUDA); use MESHRT_ACCELERATOR=emulated or none");
#endif
    case Accelerator::None:
      break;
  }
  throw UsageError("device backend: expected an accelerator (cuda or emulated), found none");
}

Backend& backend(Device::Kind kind) {
  switch (kind) {
    case Device::Kind::Cuda:
      return backend(Accelerator::Cuda);
    case Device::Kind::Emulated:
      return backend(Accelerator::Emulated);
    case Device::Kind::Cpu:
      break;
  }
  throw UsageError("device backend: expected an accelerator device kind (cuda or emulated), found cpu");
}

Stream::Impl& stream_impl(const Stream& stream, Accelerator expected, const char* what) {
  Stream::Impl& s = require(stream, what);
  if (s.accelerator() != expected) {
    throw UsageError(
        fmt::format("{}: expected a stream of the {} accelerator, found {}", what, name(expected), s.to_string()));
  }
  return s;
}

// ---------------------------------------------------------------------------- placement

void set_placement(Placement p) noexcept {
  std::lock_guard lock(g_placement_mutex);
  g_placement = p;
}

Placement placement() noexcept {
  std::lock_guard lock(g_placement_mutex);
  return g_placement;
}

Device rank_device(Device::Kind kind) {
  if (kind == Device::Kind::Cpu) return Device::cpu();
  const Placement p = placement();
  // The emulated accelerator exists everywhere; a rank placed on cuda that asks for it
  // (or one without a placement) uses its local choice, device p.device modulo the count.
  Backend& b = backend(kind);
  return Device::of(kind, p.device % b.device_count());
}

void enter_worker_thread() noexcept {
  t_worker_thread = true;
  t_device_current = false;
}

void ensure_current(Device::Kind kind) {
  if (!t_worker_thread || t_device_current || kind == Device::Kind::Cpu) return;
  const Placement p = placement();
  if (device_kind(p.accelerator) != kind) return;
  backend(p.accelerator).make_current(rank_device(kind).index());
  t_device_current = true;
}

Stream stream_for(std::uint64_t stream_id, const Device& device) {
  if (!device.is_accelerator()) {
    throw UsageError(fmt::format("stream_for: expected an accelerator device, found {}", device.to_string()));
  }
  ensure_current(device.kind());
  const auto key = std::make_tuple(stream_id, static_cast<int>(device.kind()), device.index());
  {
    std::lock_guard lock(g_streams_mutex);
    if (auto it = g_streams.find(key); it != g_streams.end()) return it->second;
  }
  Stream s = backend(device.kind()).create_stream(device.index());
  std::lock_guard lock(g_streams_mutex);
  return g_streams.try_emplace(key, std::move(s)).first->second;
}

void make_native_wait(void* native, const Stream& stream) {
  Stream::Impl& s = require(stream, "make_native_wait");
  if (s.accelerator() != Accelerator::Cuda) {
    throw UsageError(
        fmt::format("make_native_wait: expected a cuda stream (another library's streams are CUDA streams), found {}",
                    s.to_string()));
  }
  if (native == s.native()) return;
#if MESHRT_HAVE_CUDA
  cuda_make_native_wait(native, s);
#endif
}

Stream existing_stream(std::uint64_t stream_id, const Device& device) {
  std::lock_guard lock(g_streams_mutex);
  const auto it = g_streams.find(std::make_tuple(stream_id, static_cast<int>(device.kind()), device.index()));
  return it == g_streams.end() ? Stream() : it->second;
}

void release_stream(std::uint64_t stream_id) {
  std::vector<Stream> gone;  // destroyed outside the lock: an emulated stream drains first
  {
    std::lock_guard lock(g_streams_mutex);
    for (auto it = g_streams.begin(); it != g_streams.end();) {
      if (std::get<0>(it->first) == stream_id) {
        gone.push_back(std::move(it->second));
        it = g_streams.erase(it);
      } else {
        ++it;
      }
    }
  }
}

// ---------------------------------------------------------------------------- handles

int Stream::device() const {
  return require(*this, "Stream::device").device();
}
void* Stream::native() const {
  return require(*this, "Stream::native").native();
}
void Stream::enqueue(std::function<void()> task) const {
  require(*this, "Stream::enqueue").enqueue(std::move(task));
}
bool Stream::query() const {
  return require(*this, "Stream::query").query();
}
void Stream::synchronize() const {
  require(*this, "Stream::synchronize").synchronize();
}
std::optional<std::string> Stream::error() const {
  return require(*this, "Stream::error").error();
}
std::string Stream::to_string() const {
  return impl_ ? impl_->to_string() : std::string("undefined stream");
}

void Event::record(const Stream& stream) {
  require(*this, "Event::record").record(require(stream, "Event::record"));
}
void Event::wait(const Stream& stream) const {
  require(*this, "Event::wait").wait(require(stream, "Event::wait"));
}
bool Event::query() const {
  return require(*this, "Event::query").query();
}
void Event::synchronize() const {
  require(*this, "Event::synchronize").synchronize();
}

// ---------------------------------------------------------------------------- helpers

namespace {
// The stream of `stream_id` on this rank's CUDA device, if there is one.
Stream traced_stream(std::uint64_t stream_id) {
  if (placement().accelerator != Accelerator::Cuda) return Stream();
  return existing_stream(stream_id, rank_device(Device::Kind::Cuda));
}

// `step` on the stream of `stream_id` on this rank's CUDA device, if there is one. A stream
// that cannot record an event fails the command's own work too: its span is left out.
void on_traced_stream(std::uint64_t stream_id, void (Stream::Impl::*step)()) noexcept {
  try {
    if (const Stream s = traced_stream(stream_id); s.defined()) (s.impl()->*step)();
  } catch (const std::exception&) {
  }
}
}  // namespace

void trace_command_begin(std::uint64_t stream_id) noexcept {
  if (detail::trace::enabled()) on_traced_stream(stream_id, &Stream::Impl::trace_open);
}

void trace_command_end(std::uint64_t stream_id) noexcept {
  on_traced_stream(stream_id, &Stream::Impl::trace_close);
}

void trace_flush([[maybe_unused]] bool wait) {
#if MESHRT_HAVE_CUDA
  cuda_trace_flush(wait);
#endif
}

void trim_idle() noexcept {
#if MESHRT_HAVE_CUDA
  cuda_trim();
#endif
}

void release_completed() {
  trace_flush(false);
  CachingPool::collect_all();  // blocks freed in stream order: never waits
  if (g_held_count.load() == 0) return;
  std::vector<Held> done;
  {
    std::lock_guard lock(g_held_mutex);
    // Pending ones first, completed ones after `first_done`.
    const auto first_done = std::partition(g_held.begin(), g_held.end(), [](const Held& h) {
      try {
        return !h.done.query();
      } catch (const std::exception&) {
        return false;  // a failed device: its work will not run
      }
    });
    std::move(first_done, g_held.end(), std::back_inserter(done));
    g_held.erase(first_done, g_held.end());
    g_held_count.store(g_held.size());
  }
  // `done` goes here, outside the lock: its blocks return to their pools.
}

Tensor zeros(const TensorMeta& meta, const Stream& stream) {
  ensure_current(meta.device().kind());
  Backend& b = backend(meta.device().kind());
  Tensor t = b.empty(meta, stream);
  b.memset_async(t.raw_data(), 0, t.nbytes(), stream);
  return t;
}

Tensor to_device(const Tensor& host, const Device& device, const Stream& stream) {
  if (!host.defined() || !host.device().is_cpu()) {
    throw UsageError(fmt::format("to_device: expected a CPU tensor, found {}", host.to_string()));
  }
  ensure_current(device.kind());
  Backend& b = backend(device.kind());
  Tensor out = b.empty(host.meta().with_device(device), stream);
  std::shared_ptr<void> staging = b.pinned(host.nbytes());
  if (host.nbytes() > 0) std::memcpy(staging.get(), host.raw_data(), host.nbytes());
  b.copy_async(out.raw_data(), staging.get(), host.nbytes(), stream);
  hold_until_done(b, stream, std::move(staging));  // until the copy ran
  return out;
}

void copy(const Tensor& dst, const Tensor& src, const Stream& stream) {
  require_accelerator_tensor(dst, "device copy");
  require_accelerator_tensor(src, "device copy");
  if (dst.shape() != src.shape() || dst.dtype() != src.dtype()) {
    throw UsageError(fmt::format("device copy: expected a source like {}, found {}", dst.meta().to_string(),
                                 src.meta().to_string()));
  }
  Backend& b = backend(dst.device().kind());
  b.copy_async(const_cast<void*>(dst.raw_data()), src.raw_data(), src.nbytes(), stream);
  // The source may come from another stream's pool list: held until the copy ran, so
  // that stream cannot reuse it first.
  hold_until_done(b, stream, holding(src));
}

Tensor clone(const Tensor& t, const Stream& stream) {
  require_accelerator_tensor(t, "device clone");
  ensure_current(t.device().kind());
  Tensor out = backend(t.device().kind()).empty(t.meta(), stream);
  copy(out, t, stream);
  return out;
}

Fetch fetch(const Tensor& tensor, const Stream& stream) {
  require_accelerator_tensor(tensor, "fetch");
  ensure_current(tensor.device().kind());
  Backend& b = backend(tensor.device().kind());
  const TensorMeta host_meta = tensor.meta().with_device(Device::cpu());
  Fetch out;
  out.host = Tensor::adopt_host(host_meta, b.pinned(tensor.nbytes()));
  out.done = b.create_event(stream.device());
  if (g_unordered_fetch.load() && tensor.device().is_emulated()) {
    // The bug this switch stands for: a copy not ordered after the stream's work.
    DeviceMemoryAccess access;
    if (tensor.nbytes() > 0) std::memcpy(out.host.raw_data(), tensor.raw_data(), tensor.nbytes());
    return out;
  }
  b.copy_async(out.host.raw_data(), tensor.raw_data(), tensor.nbytes(), stream);
  out.done.record(stream);
  hold_until(out.done, holding(tensor));
  return out;
}

Tensor empty_on(std::uint64_t stream_id, const TensorMeta& meta) {
  if (!meta.device().is_accelerator()) return Tensor::empty(meta);
  release_completed();
  ensure_current(meta.device().kind());
  return backend(meta.device().kind()).empty(meta, stream_for(stream_id, meta.device()));
}

namespace {
thread_local std::shared_ptr<TaskFailures> t_task_failures;
std::mutex g_fault_mutex;
std::optional<std::string> g_fault;  // under g_fault_mutex
std::atomic<bool> g_faulted{false};  // g_fault is set (read without the lock)
}  // namespace

void TaskFailures::record(std::string message) {
  std::lock_guard lock(mutex);
  if (!first) first = std::move(message);
}

std::optional<std::string> TaskFailures::error() {
  std::lock_guard lock(mutex);
  return first;
}

TaskScope::TaskScope(std::shared_ptr<TaskFailures> failures) noexcept
    : previous_(std::exchange(t_task_failures, std::move(failures))) {}

TaskScope::~TaskScope() {
  t_task_failures = std::move(previous_);
}

std::optional<std::string> device_fault() {
  if (!g_faulted.load(std::memory_order_acquire)) return std::nullopt;
  std::lock_guard lock(g_fault_mutex);
  return g_fault;
}

void record_device_fault(std::string message) noexcept {
  try {
    std::lock_guard lock(g_fault_mutex);
    if (!g_fault) g_fault = std::move(message);
  } catch (...) {
    // An allocation failed: the flag below still ends the rank.
  }
  g_faulted.store(true, std::memory_order_release);
}

void host_task(std::uint64_t stream_id, const Device& device, std::function<void()> work) {
  if (device.is_cpu()) {
    work();
    return;
  }
  if (device.is_cuda()) {
    throw UsageError(
        fmt::format("host_task on {}: expected host-readable memory, found CUDA device memory; run a "
                    "CUDA kernel on ctx.native_stream() instead",
                    device.to_string()));
  }
  // In a kernel of the worker's (a TaskScope is open), the task's exception fails its call
  // (the worker reads it once the stream has run the task); elsewhere it faults the stream.
  if (std::shared_ptr<TaskFailures> failures = t_task_failures) {
    failures->tasks.fetch_add(1, std::memory_order_relaxed);
    work = [work = std::move(work), failures = std::move(failures)] {
      try {
        work();
      } catch (const std::exception& e) {
        failures->record(e.what());
      } catch (...) {
        failures->record("a host task threw an exception not derived from std::exception");
      }
    };
  }
  stream_for(stream_id, device).enqueue(std::move(work));
  // A kernel launch on the emulated device: the thread's last error is reported after it,
  // as meshrt's CUDA kernels check cudaGetLastError after each launch.
  if (auto error = take_last_error()) {
    throw SystemError(
        fmt::format("kernel launch on {}: {} (the calling thread's last error)", device.to_string(), *error));
  }
}

void set_unordered_fetch_for_testing(bool on) noexcept {
  g_unordered_fetch.store(on);
}

}  // namespace meshrt::device
