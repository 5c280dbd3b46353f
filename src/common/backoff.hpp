// Waiting without burning a core (docs/ARCHITECTURE.md section 6): the one back-off every polling loop
// in meshrt uses (the control channel, the worker loop, the data plane's wait(), the
// StatelessGroup). A loop calls pause() after each poll that found nothing and reset()
// after one that did. Between two polls pause():
//   1. returns at once for the first `hot_polls` polls (no clock read);
//   2. returns at once (busy poll) until `spin` has passed since the last reset;
//   3. yields the core until `yield` has passed;
//   4. then idles for waited / `sleep_divisor`, clamped to [min_sleep, max_sleep]: at most
//      1/divisor added to a long wait, and about 1/max_sleep wakeups a second when idle.
// The idle step is a plain sleep, or a caller's idle function (one that can wake early,
// e.g. on a condition variable, when the awaited thing is known to finish on another
// thread).
//
// The parameter sets and why, measured on the project's 2-core machine with Open MPI 4.1
// over shared memory (figures from the suites named):
// - kDataPlaneWait (wait() on a Pending): small collectives finish within a few us, so
//   spinning 20 us costs less than one trip through the scheduler; yielding until 200 us
//   still reacts within microseconds but lets an oversubscribed peer run; then sleep
//   waited/32 (10 us .. 1 ms), so oversleeping adds at most ~3% to a long operation.
// - kInFlight (the worker loop while a non-blocking collective is in flight): spin 20 us
//   as kDataPlaneWait, then yield, not sleep, until 2 ms: Open MPI's non-blocking
//   collectives progress only inside MPI calls, and sleeping from 200 us on made 256 KiB
//   collectives through the runtime ~3x slower (all_gather 64 -> 187 us); then sleep
//   waited/32 (10 us .. 1 ms) for a peer that is late. Without the 20 us spin, 8 B
//   all_reduce took 13.5 us instead of 6.1 (src/worker/worker.cpp has the figures).
// - kControl (the control channel, the worker loop, the controller's waits for replies):
//   a controller sends the next batch within a few ms while a program runs, so yield
//   (never spin: the controller or a peer may need this very core) for 2 ms, then sleep
//   waited/32 (10 us .. 1 ms): an idle worker wakes ~1000 times a second, and a
//   synchronize that waited T returns at most T/32 late (the old doubling sleeps, 10 us
//   to 1 ms after 2 ms, could make a 4 ms synchronize up to 25% late; runtime-collectives
//   measures synchronize loops).
// - kDoorbell (worker 0's loop, which shares rank 0 with the controller): yield for 100 us
//   as kControl does (a program that keeps issuing commands finds worker 0 awake: waking a
//   sleeping thread costs a futex wake, and in a VM an inter-processor interrupt), then
//   idle on the transport's doorbell, which the controller rings with every command it
//   sends to rank 0, for waited/32 (10 us .. 1 ms), so commands from anywhere else (a
//   fan-out parent) are still seen within 1/32 of the wait. Yielding for 2 ms there kept
//   taking a share of the cores from the controller and the other ranks between a
//   program's bursts (src/worker/worker.cpp has the figures).
// - kOwnCore (the worker loop of a rank other than 0 with a core of its own: no more
//   ranks than cores on the node, WorkerOptions::block_in_mpi): kControl yielding for
//   20 ms instead of 2. Between a program's bursts (the controller loading the next batch
//   of data, say) such a worker has nothing to give its core to, and a worker that slept
//   wakes late: after a 5 ms pause of the controller the next collective started up to
//   ~500 us late on rank 1. meshrt-bench runtime-collectives, 1 MiB all_gather, 2 ranks,
//   the controller sleeping 5 ms before each timed loop (a temporary change), medians of
//   the loop's first call over both ranks and 5 repetitions: 585-703 us with kControl
//   against 297-555 yielding 50 ms (three interleaved pairs) and 334-449 yielding 20 ms
//   (three runs); by hand the first call after such a pause takes 190-280 us on this
//   machine, and the rest of the loop ~70-85 either way. Past 20 ms it sleeps as kControl
//   does, waited/32 at most 1 ms: an idle job still leaves its cores alone.
// - kReplyBell (the controller's wait while worker 0, on the same core, still owes the
//   awaited ident): yield for 20 us (a fetch completes within it and pays no wake-up),
//   then idle on the doorbell worker 0 rings with every reply it sends, 1 ms at a time
//   (the wait cannot end before that reply; the millisecond bounds how late a timeout or
//   the laggards' status requests are seen). Yielding there kept the controller polling
//   MPI beside worker 0's collective: with one repetition's 20 blocking 1 MiB all_gathers
//   timed inside the worker, the call took ~108 us with the controller yielding and ~68
//   us with it asleep (MPI by hand: 65-75). meshrt-bench runtime-collectives, 2 ranks, two
//   interleaved runs before/after (yielding 100 us): 8 B all_reduce 8.1-9.2 -> 5.3-6.1 us,
//   all_gather 5.9-6.3 -> 4.4-6.5, to_mesh 7.5-7.8 -> 4.9-6.5; 1 MiB within the noise.
//   Then 100 us against 20 us, four interleaved pairs: 1 MiB all_gather 93-138 -> 81-133
//   us, all_to_all 85-138 -> 75-138, 8 B all_gather 4.4-7.4 -> 4.5-6.2 (each loop's first
//   calls ran slow while the controller yielded beside them); dispatch, eight pairs: fetch
//   median 9.5 -> 8.3 us, call + fetch 22.4 -> 17.9. Not yielding at all (six pairs against
//   20 us) made call + fetch 24-28 us against 17-27: it then pays a wake-up.
// - kGroup (StatelessGroup's waits): 64 hot polls (a few us) without reading the clock,
//   which costs as much as a poll; yield until the operation's spin time (200 us, or
//   twice the time its bytes take at 1 GB/s: shared-memory transfers only advance while
//   both ranks call into MPI, and a sleeping sender stalls its receiver); then sleep
//   waited/8 (20 us .. 1 ms) (meshrt-bench group: 1 MiB pingpong at 1.00x raw MPI).
#pragma once

#include <algorithm>
#include <chrono>
#include <thread>

namespace meshrt::detail {

struct BackoffPolicy {
  int hot_polls = 0;
  std::chrono::nanoseconds spin{0};
  std::chrono::nanoseconds yield{0};
  int sleep_divisor = 8;
  std::chrono::microseconds min_sleep{10};
  std::chrono::microseconds max_sleep{1000};

  // The same policy, yielding until `t` (kGroup's spin time grows with the bytes).
  constexpr BackoffPolicy yielding_until(std::chrono::nanoseconds t) const {
    BackoffPolicy p = *this;
    p.yield = t;
    return p;
  }
};

inline constexpr BackoffPolicy kDataPlaneWait{.hot_polls = 0,
                                              .spin = std::chrono::microseconds(20),
                                              .yield = std::chrono::microseconds(200),
                                              .sleep_divisor = 32,
                                              .min_sleep = std::chrono::microseconds(10),
                                              .max_sleep = std::chrono::microseconds(1000)};
inline constexpr BackoffPolicy kInFlight{.hot_polls = 0,
                                         .spin = std::chrono::microseconds(20),
                                         .yield = std::chrono::milliseconds(2),
                                         .sleep_divisor = 32,
                                         .min_sleep = std::chrono::microseconds(10),
                                         .max_sleep = std::chrono::microseconds(1000)};
inline constexpr BackoffPolicy kControl{.hot_polls = 0,
                                        .spin = std::chrono::nanoseconds(0),
                                        .yield = std::chrono::milliseconds(2),
                                        .sleep_divisor = 32,
                                        .min_sleep = std::chrono::microseconds(10),
                                        .max_sleep = std::chrono::microseconds(1000)};
inline constexpr BackoffPolicy kDoorbell{.hot_polls = 0,
                                         .spin = std::chrono::nanoseconds(0),
                                         .yield = std::chrono::microseconds(100),
                                         .sleep_divisor = 32,
                                         .min_sleep = std::chrono::microseconds(10),
                                         .max_sleep = std::chrono::microseconds(1000)};
inline constexpr BackoffPolicy kOwnCore = kControl.yielding_until(std::chrono::milliseconds(20));
inline constexpr BackoffPolicy kReplyBell{.hot_polls = 0,
                                          .spin = std::chrono::nanoseconds(0),
                                          .yield = std::chrono::microseconds(20),
                                          .sleep_divisor = 32,
                                          .min_sleep = std::chrono::microseconds(1000),
                                          .max_sleep = std::chrono::microseconds(1000)};
inline constexpr BackoffPolicy kGroup{.hot_polls = 64,
                                      .spin = std::chrono::nanoseconds(0),
                                      .yield = std::chrono::microseconds(200),
                                      .sleep_divisor = 8,
                                      .min_sleep = std::chrono::microseconds(20),
                                      .max_sleep = std::chrono::microseconds(1000)};

// Each set's phases in order, and a sleep range that is one.
constexpr bool well_formed(const BackoffPolicy& p) {
  return p.hot_polls >= 0 && p.spin <= p.yield && p.sleep_divisor > 0 && p.min_sleep <= p.max_sleep;
}
static_assert(well_formed(kDataPlaneWait) && well_formed(kInFlight) && well_formed(kControl) && well_formed(kOwnCore) &&
              well_formed(kDoorbell) && well_formed(kReplyBell) && well_formed(kGroup));

class Backoff {
 public:
  using Clock = std::chrono::steady_clock;

  // The default waits as the control plane does (kControl).
  explicit Backoff(const BackoffPolicy& policy = kControl) : policy_(policy) {}

  // Starts a new wait: the next pauses are short again.
  void reset() noexcept {
    polls_ = 0;
    started_ = false;
  }

  // True once the hot polls are over and `deadline` has passed (the clock is read only
  // then).
  bool expired(Clock::time_point deadline) const { return polls_ >= policy_.hot_polls && Clock::now() >= deadline; }

  void pause() {
    pause([](std::chrono::microseconds d) { std::this_thread::sleep_for(d); });
  }

  // Calls `done()` until it returns true, pausing between calls; false when `deadline`
  // passes first (the default: never).
  template <class Done>
  bool poll_until(Done&& done, Clock::time_point deadline = Clock::time_point::max()) {
    while (!done()) {
      if (deadline != Clock::time_point::max() && expired(deadline)) return false;
      pause();
    }
    return true;
  }

  // As pause(), with `idle(duration)` in place of the sleep; it may return early.
  template <class Idle>
  void pause(Idle&& idle) {
    if (polls_ < policy_.hot_polls) {
      ++polls_;
      return;
    }
    const auto now = Clock::now();
    if (!started_) {
      started_ = true;
      start_ = now;
    }
    const auto waited = now - start_;
    if (waited < policy_.spin) return;
    if (waited < policy_.yield) {
      std::this_thread::yield();
      return;
    }
    idle(std::clamp(std::chrono::duration_cast<std::chrono::microseconds>(waited / policy_.sleep_divisor),
                    policy_.min_sleep, policy_.max_sleep));
  }

 private:
  BackoffPolicy policy_;
  int polls_ = 0;
  bool started_ = false;
  Clock::time_point start_{};
};

}  // namespace meshrt::detail
