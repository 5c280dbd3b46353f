#include "device/emulated_comm.hpp"

#include <fmt/format.h>

#include <array>
#include <atomic>
#include <climits>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/backoff.hpp"
#include "common/checks.hpp"
#include "common/mpi_wait.hpp"
#include "device/emulated.hpp"
#include "device/nan_rule.hpp"
#include "meshrt/internal/settings.hpp"

namespace meshrt::device {
namespace {

template <class T>
T combine(T a, T b, Reduction r) {
  if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
    constexpr bool half = std::is_same_v<T, Half>;
    const float x = half ? half_to_float(Half{a.bits}) : bfloat16_to_float(BFloat16{a.bits});
    const float y = half ? half_to_float(Half{b.bits}) : bfloat16_to_float(BFloat16{b.bits});
    const float z = combine<float>(x, y, r);
    if constexpr (half) {
      return float_to_half(z);
    } else {
      return float_to_bfloat16(z);
    }
  } else if constexpr (std::is_integral_v<T>) {
    // Signed overflow wraps through unsigned arithmetic, as on the GPU.
    using U = std::make_unsigned_t<T>;
    switch (r) {
      case Reduction::Sum:
      case Reduction::Avg:
        return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
      case Reduction::Product:
        return static_cast<T>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
      case Reduction::Min:
        return b < a ? b : a;
      default:
        return a < b ? b : a;
    }
  } else {
    switch (r) {
      case Reduction::Sum:
      case Reduction::Avg:
        return a + b;
      case Reduction::Product:
        return a * b;
      // As fmin and fmax, NaN-dropping as NCCL's may be: the NaN rule comes after the
      // reduction (reduce_blocks), as on cuda.
      case Reduction::Min:
        return std::fmin(a, b);
      default:
        return std::fmax(a, b);
    }
  }
}

template <class T>
T divide(T sum, int n) {
  if constexpr (std::is_same_v<T, Half>) {
    return float_to_half(half_to_float(sum) / static_cast<float>(n));
  } else if constexpr (std::is_same_v<T, BFloat16>) {
    return float_to_bfloat16(bfloat16_to_float(sum) / static_cast<float>(n));
  } else {
    return static_cast<T>(sum / static_cast<T>(n));  // integers truncate toward zero
  }
}

// out[i] = blocks[0][i] op blocks[1][i] op ... in rank order (the same on every member),
// then / n for avg: a sum, then a division, on every backend.
void reduce_blocks(const char* blocks, std::size_t block_bytes, int n, std::size_t count, DType dtype, Reduction r,
                   void* out) {
  // bool reduces as the byte it is, like NCCL's ncclUint8.
  const DType as = dtype == DType::Bool ? DType::UInt8 : dtype;
  dispatch_dtype(as, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, bool>) {
      auto* o = static_cast<T*>(out);
      std::vector<T> acc(count);
      std::memcpy(acc.data(), blocks, count * sizeof(T));
      for (int k = 1; k < n; ++k) {
        const auto* b = reinterpret_cast<const T*>(blocks + static_cast<std::size_t>(k) * block_bytes);
        for (std::size_t i = 0; i < count; ++i) acc[i] = combine<T>(acc[i], b[i], r);
      }
      if (r == Reduction::Avg) {
        for (std::size_t i = 0; i < count; ++i) acc[i] = divide<T>(acc[i], n);
      }
      std::memcpy(o, acc.data(), count * sizeof(T));
    }
  });
  // Max and min propagate NaN from any member, the way the cuda backend makes NCCL do it
  // (device/nan_rule.hpp): each block's any-NaN mask, reduced with max over uint8, then
  // NaN where the reduced mask is set.
  if (nan_rule::applies(static_cast<int>(dtype), static_cast<int>(r))) {
    nan_rule::for_floating(static_cast<int>(dtype), [&](auto tag) {
      constexpr int D = decltype(tag)::value;
      std::vector<std::uint8_t> mask(count, 0);
      std::vector<std::uint8_t> block(count);
      for (int k = 0; k < n; ++k) {
        nan_rule::mask_of<D>(blocks + static_cast<std::size_t>(k) * block_bytes, block.data(),
                             static_cast<std::int64_t>(count));
        for (std::size_t i = 0; i < count; ++i) mask[i] = combine<std::uint8_t>(mask[i], block[i], Reduction::Max);
      }
      nan_rule::apply_mask<D>(out, mask.data(), static_cast<std::int64_t>(count));
    });
  }
}

// A fault of this member's own buffers (not device memory, or one buffer where two are
// needed): the stream faults, the member still takes part with scratch data.
struct MemoryFault : SystemError {
  using SystemError::SystemError;
};

// The host memory of one member's part of a collective (scratch data in shadow mode, the
// gathered blocks of a reduction), owned jointly with its wait: a part cut short by an
// abort leaves its MPI request posted, and a peer that joins late still writes here.
class Buffers {
 public:
  char* make(std::size_t bytes) { return blocks_.emplace_back(bytes).data(); }
  // `buffer`, or scratch bytes of the same size in shadow mode.
  template <class P>
  P or_scratch(bool shadow, P buffer, std::size_t bytes) {
    return shadow ? static_cast<P>(make(bytes)) : buffer;
  }

 private:
  std::deque<std::vector<char>> blocks_;  // a deque: earlier blocks never move
};

// A member's part ended by an abort (ncclCommAbort ends the kernels in flight).
struct Aborted {};

// NCCL's group, kept per host thread as NCCL keeps it (its group.h): between
// ncclGroupStart and ncclGroupEnd the calls of the thread are queued, and the outermost
// group end launches them. A call that fails inside records the group's error, and that
// group end then launches none of its calls and returns the error. A group that is never
// ended stays open: every later call of the thread, on any communicator, is queued into it
// and never launched, and the events recorded after it complete at once.
struct Group {
  int depth = 0;
  std::optional<std::string> error;
  std::vector<std::function<void()>> launches;
};
thread_local Group t_group;

void group_start() {
  ++t_group.depth;
}

// ncclGroupEnd: at the outermost end, the group's error, else its calls launched in order.
void group_end() {
  if (t_group.depth == 0) throw UsageError("group end: expected an open group of device calls, found none");
  if (--t_group.depth > 0) return;
  std::vector<std::function<void()>> launches = std::exchange(t_group.launches, {});
  if (auto error = std::exchange(t_group.error, std::nullopt)) throw SystemError(*error);
  for (auto& launch : launches) launch();
}

// A call that failed: inside a group it is the group's error too.
[[noreturn]] void call_failed(const std::string& message) {
  if (t_group.depth > 0 && !t_group.error) t_group.error = message;
  throw SystemError(message);
}

// A call's launch: now outside a group, else at the group's end.
void launch_in_group(std::function<void()> launch) {
  if (t_group.depth > 0) {
    t_group.launches.push_back(std::move(launch));
  } else {
    launch();
  }
}

// The group of one operation that makes several calls, ended on every way out (its error
// then ignored: the call's own is the one thrown), as the cuda backend ends NCCL's.
class GroupGuard {
 public:
  GroupGuard() { group_start(); }
  ~GroupGuard() {
    if (open_) {
      try {
        group_end();
      } catch (const std::exception&) {
      }
    }
  }
  GroupGuard(const GroupGuard&) = delete;
  GroupGuard& operator=(const GroupGuard&) = delete;
  void end() {
    open_ = false;
    group_end();
  }

 private:
  bool open_ = true;
};

// The launch of a CUDA kernel that the cuda backend's operation makes (the NaN mask, the
// division of avg): it reports the thread's last error (cudaGetLastError after a launch).
void launch_check(const char* what, const std::string& where) {
  if (auto error = take_last_error()) {
    throw SystemError(
        fmt::format("{} on {}: a kernel launch failed: {} (the calling thread's last error)", what, where, *error));
  }
}

struct CommState {
  MPI_Comm comm = MPI_COMM_NULL;
  std::mutex mutex;
  std::condition_variable cv;
  std::optional<std::string> error;
  bool aborted = false;
  // `aborted`, readable without the mutex by a member's wait, which polls it between
  // MPI_Testall calls (a lock there cost about a microsecond per small collective).
  std::atomic<bool> abort_seen{false};
  bool destroyed = false;
  int pending = 0;
};

// The states of the emulated communicators made so far (set_async_error_for_testing).
std::mutex g_states_mutex;
std::vector<std::weak_ptr<CommState>> g_states;

class EmulatedCommunicator final : public Communicator {
 public:
  EmulatedCommunicator(MPI_Comm comm, int rank, int size, int device, std::string id)
      : state_(std::make_shared<CommState>()),
        rank_(rank),
        size_(size),
        device_(device),
        id_(std::move(id)),
        timeout_(settings::kDeviceTimeout.get()) {
    state_->comm = comm;
    std::lock_guard lock(g_states_mutex);
    std::erase_if(g_states, [](const std::weak_ptr<CommState>& w) { return w.expired(); });
    g_states.push_back(state_);
  }
  ~EmulatedCommunicator() override { destroy(); }

  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return size_; }
  int device() const noexcept override { return device_; }

  void all_reduce(const void* send, void* recv, std::size_t count, DType dtype, Reduction reduction,
                  const Stream& stream) override {
    check_reduction(reduction, dtype, "all_reduce");
    const std::size_t bytes = checked_bytes(count, dtype, 1, "all_reduce");
    const int n = size_;
    // As on cuda: the NaN mask's kernel, then the reduction (and the mask's) in one group,
    // then the division of avg.
    if (nan_rule::applies(static_cast<int>(dtype), static_cast<int>(reduction)) && count > 0)
      launch_check("all_reduce", describe());
    GroupGuard group;
    submit(stream, "all_reduce", [=](MPI_Comm c, bool shadow, const Wait& wait) {
      if (!shadow) {
        check_memory(send, bytes, "all_reduce send buffer");
        check_memory(recv, bytes, "all_reduce receive buffer");
      }
      auto keep = std::make_shared<Buffers>();
      char* all = keep->make(bytes * static_cast<std::size_t>(n));
      MPI_Request r = MPI_REQUEST_NULL;
      MESHRT_MPI_CHECK(MPI_Iallgather(keep->or_scratch(shadow, send, bytes), static_cast<int>(bytes), MPI_BYTE, all,
                                      static_cast<int>(bytes), MPI_BYTE, c, &r));
      wait(&r, 1, keep);
      if (!shadow) reduce_blocks(all, bytes, n, count, dtype, reduction, recv);
    });
    group.end();
    if (reduction == Reduction::Avg && count > 0 && n > 1) launch_check("all_reduce", describe());
  }

  void reduce(const void* send, void* recv, std::size_t count, DType dtype, Reduction reduction, int root,
              const Stream& stream) override {
    check_reduction(reduction, dtype, "reduce");
    check_root(root, "reduce");
    const std::size_t bytes = checked_bytes(count, dtype, size_, "reduce");
    const int n = size_;
    const bool at_root = root == rank_;
    // As all_reduce, the reduction done at the root only: every member's block comes to it.
    if (nan_rule::applies(static_cast<int>(dtype), static_cast<int>(reduction)) && count > 0)
      launch_check("reduce", describe());
    GroupGuard group;
    submit(stream, "reduce", [=](MPI_Comm c, bool shadow, const Wait& wait) {
      if (!shadow) {
        check_memory(send, bytes, "reduce send buffer");
        if (at_root) check_memory(recv, bytes, "reduce receive buffer");
      }
      auto keep = std::make_shared<Buffers>();
      char* all = at_root ? keep->make(bytes * static_cast<std::size_t>(n)) : nullptr;
      MPI_Request r = MPI_REQUEST_NULL;
      MESHRT_MPI_CHECK(MPI_Igather(keep->or_scratch(shadow, send, bytes), static_cast<int>(bytes), MPI_BYTE, all,
                                   static_cast<int>(bytes), MPI_BYTE, root, c, &r));
      wait(&r, 1, keep);
      if (!shadow && at_root) reduce_blocks(all, bytes, n, count, dtype, reduction, recv);
    });
    group.end();
    if (at_root && reduction == Reduction::Avg && count > 0 && n > 1) launch_check("reduce", describe());
  }

  void broadcast(const void* send, void* recv, std::size_t count, DType dtype, int root,
                 const Stream& stream) override {
    check_root(root, "broadcast");
    const std::size_t bytes = checked_bytes(count, dtype, 1, "broadcast");
    const bool at_root = root == rank_;
    submit(stream, "broadcast", [=](MPI_Comm c, bool shadow, const Wait& wait) {
      if (!shadow) {
        if (at_root) check_memory(send, bytes, "broadcast send buffer");
        check_memory(recv, bytes, "broadcast receive buffer");
        if (at_root && send != recv && bytes > 0) std::memcpy(recv, send, bytes);
      }
      auto keep = std::make_shared<Buffers>();
      MPI_Request r = MPI_REQUEST_NULL;
      MESHRT_MPI_CHECK(
          MPI_Ibcast(keep->or_scratch(shadow, recv, bytes), static_cast<int>(bytes), MPI_BYTE, root, c, &r));
      wait(&r, 1, keep);
    });
  }

  void all_gather(const void* send, void* recv, std::size_t count, DType dtype, const Stream& stream) override {
    const std::size_t bytes = checked_bytes(count, dtype, size_, "all_gather");
    const auto n = static_cast<std::size_t>(size_);
    submit(stream, "all_gather", [=](MPI_Comm c, bool shadow, const Wait& wait) {
      if (!shadow) {
        check_memory(send, bytes, "all_gather send buffer");
        check_memory(recv, bytes * n, "all_gather receive buffer");
      }
      auto keep = std::make_shared<Buffers>();
      MPI_Request r = MPI_REQUEST_NULL;
      MESHRT_MPI_CHECK(MPI_Iallgather(keep->or_scratch(shadow, send, bytes), static_cast<int>(bytes), MPI_BYTE,
                                      keep->or_scratch(shadow, recv, bytes * n), static_cast<int>(bytes), MPI_BYTE, c,
                                      &r));
      wait(&r, 1, keep);
    });
  }

  void reduce_scatter(const void* send, void* recv, std::size_t count, DType dtype, Reduction reduction,
                      const Stream& stream) override {
    check_reduction(reduction, dtype, "reduce_scatter");
    const std::size_t bytes = checked_bytes(count, dtype, size_, "reduce_scatter");
    const int n = size_;
    if (nan_rule::applies(static_cast<int>(dtype), static_cast<int>(reduction)) && count > 0)
      launch_check("reduce_scatter", describe());
    GroupGuard group;
    submit(stream, "reduce_scatter", [=](MPI_Comm c, bool shadow, const Wait& wait) {
      const std::size_t total = bytes * static_cast<std::size_t>(n);
      if (!shadow) {
        check_memory(send, total, "reduce_scatter send buffer");
        check_memory(recv, bytes, "reduce_scatter receive buffer");
      }
      // Block r of every member comes to member r, which reduces them in member order.
      auto keep = std::make_shared<Buffers>();
      char* mine = keep->make(total);
      MPI_Request r = MPI_REQUEST_NULL;
      MESHRT_MPI_CHECK(MPI_Ialltoall(keep->or_scratch(shadow, send, total), static_cast<int>(bytes), MPI_BYTE, mine,
                                     static_cast<int>(bytes), MPI_BYTE, c, &r));
      wait(&r, 1, keep);
      if (!shadow) reduce_blocks(mine, bytes, n, count, dtype, reduction, recv);
    });
    group.end();
    if (reduction == Reduction::Avg && count > 0 && n > 1) launch_check("reduce_scatter", describe());
  }

  void all_to_all(const void* send, void* recv, std::size_t count, DType dtype, const Stream& stream) override {
    const std::size_t bytes = checked_bytes(count, dtype, size_, "all_to_all");
    const std::size_t total = bytes * static_cast<std::size_t>(size_);
    GroupGuard group;  // a send and a receive per peer, as on cuda
    submit(stream, "all_to_all", [=](MPI_Comm c, bool shadow, const Wait& wait) {
      if (!shadow) {
        check_memory(send, total, "all_to_all send buffer");
        check_memory(recv, total, "all_to_all receive buffer");
        if (send == recv)
          throw MemoryFault(
              "all_to_all: expected distinct send and receive buffers (NCCL has no "
              "in-place all-to-all), found one buffer");
      }
      auto keep = std::make_shared<Buffers>();
      MPI_Request r = MPI_REQUEST_NULL;
      MESHRT_MPI_CHECK(MPI_Ialltoall(keep->or_scratch(shadow, send, total), static_cast<int>(bytes), MPI_BYTE,
                                     keep->or_scratch(shadow, recv, total), static_cast<int>(bytes), MPI_BYTE, c, &r));
      wait(&r, 1, keep);
    });
    group.end();
  }

  void send_recv(std::span<const PeerOp> ops, DType dtype, const Stream& stream) override {
    std::vector<PeerOp> copy(ops.begin(), ops.end());
    for (const PeerOp& op : copy) {
      if (op.peer < 0 || op.peer >= size_) {
        throw UsageError(
            fmt::format("send_recv on {}: expected a peer in 0..{}, found {}", describe(), size_ - 1, op.peer));
      }
      (void)checked_bytes(op.count, dtype, 1, "send_recv");
    }
    const std::size_t elsize = element_size(dtype);
    GroupGuard group;
    submit(stream, "send_recv", [=](MPI_Comm c, bool shadow, const Wait& wait) {
      if (!shadow) {
        for (const PeerOp& op : copy)
          check_memory(op.buffer, op.count * elsize, op.send ? "send buffer" : "receive buffer");
      }
      auto keep = std::make_shared<Buffers>();
      std::vector<MPI_Request> requests;
      requests.reserve(copy.size());
      for (const PeerOp& op : copy) {
        const auto bytes = static_cast<int>(op.count * elsize);
        void* buffer = keep->or_scratch(shadow, op.buffer, op.count * elsize);
        MPI_Request r = MPI_REQUEST_NULL;
        if (op.send) {
          MESHRT_MPI_CHECK(MPI_Isend(buffer, bytes, MPI_BYTE, op.peer, 0, c, &r));
        } else {
          MESHRT_MPI_CHECK(MPI_Irecv(buffer, bytes, MPI_BYTE, op.peer, 0, c, &r));
        }
        requests.push_back(r);
      }
      wait(requests.data(), static_cast<int>(requests.size()), keep);
    });
    group.end();
  }

  std::optional<std::string> async_error() override {
    std::lock_guard lock(state_->mutex);
    if (state_->error) return state_->error;
    if (state_->aborted) return fmt::format("{} was aborted", describe());
    return std::nullopt;
  }

  void abort() noexcept override {
    std::lock_guard lock(state_->mutex);
    state_->aborted = true;
    state_->abort_seen.store(true);
  }

  void destroy() noexcept override {
    std::unique_lock lock(state_->mutex);
    if (state_->destroyed) return;
    state_->destroyed = true;
    if (state_->error || state_->aborted) {
      // A task may still be blocked inside MPI on this communicator (a peer that never
      // came): freeing it under that task is undefined, so a failed one is left to MPI.
      state_->aborted = true;
      return;
    }
    // Work that never finishes (a peer that never joined) is given up on at the
    // deadline, as an abort would end it, and the communicator is left to MPI.
    if (!state_->cv.wait_until(lock, detail::deadline_after(timeout_), [&] { return state_->pending == 0; })) {
      state_->aborted = true;
      state_->abort_seen.store(true);
      return;
    }
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&state_->comm);
  }

  std::string describe() const override {
    return fmt::format("emulated communicator {} (rank {} of {} on emulated:{})", id_, rank_, size_, device_);
  }

 private:
  void check_reduction(Reduction r, DType dtype, const char* what) const {
    if (is_bitwise(r) || r == Reduction::Stack) {
      throw UsageError(
          fmt::format("{} on {}: expected sum, avg, product, min or max (NCCL has no {} operator), "
                      "found {} on {}",
                      what, describe(), name(r), name(r), meshrt::name(dtype)));
    }
  }

  void check_root(int root, const char* what) const {
    if (root < 0 || root >= size_) {
      throw UsageError(fmt::format("{} on {}: expected a root in 0..{}, found {}", what, describe(), size_ - 1, root));
    }
  }

  std::size_t checked_bytes(std::size_t count, DType dtype, int blocks, const char* what) const {
    const std::size_t bytes = count * element_size(dtype);
    if (bytes * static_cast<std::size_t>(blocks) > static_cast<std::size_t>(INT_MAX)) {
      throw UsageError(fmt::format("{} on {}: expected at most {} bytes per call on the emulated accelerator, found {}",
                                   what, describe(), INT_MAX, bytes * static_cast<std::size_t>(blocks)));
    }
    return bytes;
  }

  // A collective given anything but device memory faults on the stream, as NCCL's kernels
  // do on a host pointer: an asynchronous error, not an exception at the call.
  static void check_memory(const void* p, std::size_t bytes, const char* what) {
    if (bytes == 0) return;
    if (!emulated_backend().is_device_memory(p, bytes)) {
      throw MemoryFault(
          fmt::format("illegal memory access: the {} ({} bytes at {}) is not emulated device memory", what, bytes, p));
    }
  }

  // Waits for a member's requests as NCCL's kernels wait for their peers: until they
  // complete, or until the communicator is aborted (from the thread that issues its work,
  // ncclCommAbort's rule), which throws Aborted. The requests then stay posted (a
  // collective cannot be cancelled) and `keep` is never freed, so a peer that joins late
  // completes against valid memory; the caller keeps the stream's own buffers alive the
  // same way (the data plane's abandoned buffers).
  using Wait = std::function<void(MPI_Request*, int, const std::shared_ptr<Buffers>&)>;

  // `op(comm, shadow, wait)` is this member's part of a collective. With `shadow` it
  // moves scratch data of the same sizes and touches none of the stream's buffers: a
  // member whose stream faulted, or whose buffers are not device memory, still takes
  // part, so its peers complete (their results depend on a failed rank, which that rank
  // reports) and no one waits forever. The fault belongs to the stream, as a sticky CUDA
  // error does, not to the communicator, which stays usable. A part that an abort ends
  // while it waits leaves the stream healthy, as ncclCommAbort ends a kernel (the command
  // it served has failed already); work enqueued on an aborted one faults the stream.
  void submit(const Stream& stream, const char* what, std::function<void(MPI_Comm, bool, const Wait&)> op) {
    auto& s = static_cast<EmulatedStream&>(stream_impl(stream, Accelerator::Emulated, what));
    if (s.device() != device_) {
      throw UsageError(fmt::format("{} on {}: expected a stream of emulated:{}, found {}", what, describe(), device_,
                                   s.to_string()));
    }
    if (auto fault = take_enqueue_fault()) call_failed(fmt::format("{} on {}: {}", what, describe(), *fault));
    {
      std::lock_guard lock(state_->mutex);
      // As NCCL's: an aborted or destroyed communicator is gone, and refuses new work.
      if (state_->destroyed || state_->aborted) {
        throw UsageError(fmt::format("{} on {}: expected a live communicator, found it {}", what, describe(),
                                     state_->aborted ? "aborted" : "destroyed"));
      }
    }
    // Launched now, or by the end of this thread's open group.
    launch_in_group([state = state_, stream = std::static_pointer_cast<EmulatedStream>(s.shared_from_this()), what,
                     text = describe(),
                     op = std::move(op)]() mutable { launch(state, *stream, what, text, std::move(op)); });
  }

  static void launch(const std::shared_ptr<CommState>& shared, EmulatedStream& s, const char* what,
                     const std::string& text, std::function<void(MPI_Comm, bool, const Wait&)> op) {
    {
      std::lock_guard lock(shared->mutex);
      ++shared->pending;
    }
    s.enqueue_communication([state = shared, what, text, op = std::move(op)] {
      struct Done {
        CommState& state;
        ~Done() {
          std::lock_guard lock(state.mutex);
          --state.pending;
          state.cv.notify_all();
        }
      } done{*state};
      {
        std::lock_guard lock(state->mutex);
        if (state->aborted) throw SystemError(fmt::format("{} on {}: the communicator was aborted", what, text));
        if (state->error) throw SystemError(fmt::format("{} on {}: the communicator failed before", what, text));
      }
      const Wait wait = [&state = *state](MPI_Request* requests, int n, const std::shared_ptr<Buffers>& keep) {
        // MPI progresses a non-blocking collective only inside its calls: poll as the
        // worker polls its collectives (kInFlight), until done or aborted.
        detail::Backoff(detail::kInFlight).poll_until([&] {
          int complete = 0;
          MESHRT_MPI_CHECK(MPI_Testall(n, requests, &complete, MPI_STATUSES_IGNORE));
          if (complete) return true;
          if (state.abort_seen.load(std::memory_order_relaxed)) {
            abandon(keep);
            throw Aborted{};
          }
          return false;
        });
      };
      try {
        if (EmulatedStream::faulted_now()) {
          op(state->comm, true, wait);  // the stream's own error stands
          return;
        }
        try {
          op(state->comm, false, wait);
        } catch (const MemoryFault& e) {
          op(state->comm, true, wait);
          throw MemoryFault(fmt::format("{} on {}: {}", what, text, e.what()));  // faults the stream
        } catch (const Aborted&) {
          throw;
        } catch (const std::exception& e) {
          std::lock_guard lock(state->mutex);
          if (!state->error) state->error = fmt::format("{} on {}: {}", what, text, e.what());
          throw;
        }
      } catch (const Aborted&) {
        // Ended by abort(): the worker failed the command; the stream goes on.
      }
    });
  }

  // Buffers of a part ended by an abort: kept until the process ends.
  static void abandon(const std::shared_ptr<Buffers>& keep) {
    static std::mutex mutex;
    static auto& kept = *new std::vector<std::shared_ptr<Buffers>>();
    std::lock_guard lock(mutex);
    kept.push_back(keep);
  }

  std::shared_ptr<CommState> state_;
  int rank_;
  int size_;
  int device_;
  std::string id_;
  std::chrono::duration<double> timeout_;  // MESHRT_DEVICE_TIMEOUT: destroy's wait for pending work
};

}  // namespace

void set_async_error_for_testing(const std::string& message) {
  std::lock_guard lock(g_states_mutex);
  for (const auto& weak : g_states) {
    if (auto state = weak.lock()) {
      std::lock_guard state_lock(state->mutex);
      if (!state->error && !state->destroyed) state->error = message;
    }
  }
}

std::unique_ptr<Communicator> create_emulated_communicator(MPI_Comm members, int device,
                                                           std::chrono::duration<double> timeout) {
  int provided = 0;
  MESHRT_MPI_CHECK(MPI_Query_thread(&provided));
  if (provided < MPI_THREAD_MULTIPLE) {
    throw UsageError(
        "emulated communicator: expected MPI_THREAD_MULTIPLE (its collectives run on stream threads), found a lower "
        "thread level");
  }
  emulated_backend().check_device(device, "emulated communicator");
  emulated_backend().touch(device);  // ncclCommInitRank creates the device's context
  const auto deadline = detail::deadline_after(timeout);
  int rank = 0;
  int size = 0;
  MESHRT_MPI_CHECK(MPI_Comm_rank(members, &rank));
  MESHRT_MPI_CHECK(MPI_Comm_size(members, &size));
  // As ncclGetUniqueId + MPI_Bcast: member 0 names the communicator, every member joins.
  // What the posted requests write into is owned by them past a timeout (a member that
  // joins late still completes them).
  auto id = std::make_unique<std::array<std::uint64_t, 2>>();
  if (rank == 0) {
    std::random_device random;
    *id = {(std::uint64_t{random()} << 32) | random(), (std::uint64_t{random()} << 32) | random()};
  }
  MPI_Request request = MPI_REQUEST_NULL;
  MESHRT_MPI_CHECK(MPI_Ibcast(id->data(), static_cast<int>(sizeof(*id)), MPI_BYTE, 0, members, &request));
  detail::wait_request_owning(request, id, deadline, "emulated communicator init", "the unique id's broadcast");
  check_distinct_devices(members, Accelerator::Emulated, device, deadline);
  auto own = std::make_unique<MPI_Comm>(MPI_COMM_NULL);
  MESHRT_MPI_CHECK(MPI_Comm_idup(members, own.get(), &request));
  detail::wait_request_owning(request, own, deadline, "emulated communicator init", "the communicator's duplication");
  MESHRT_MPI_CHECK(MPI_Comm_set_errhandler(*own, MPI_ERRORS_RETURN));
  return std::make_unique<EmulatedCommunicator>(*own, rank, size, device, fmt::format("{:016x}", (*id)[0]));
}

}  // namespace meshrt::device
