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
// The parameter sets and why (the measurements: docs/benchmarks.md, "Older figures"):
// - kDataPlaneWait (wait() on a Pending): a small collective finishes within a few us,
//   so spin 20 us (cheaper than a trip through the scheduler), yield until 200 us (an
//   oversubscribed peer can run), then sleep waited/32 (10 us .. 1 ms): oversleeping adds
//   at most ~3% to a long operation.
// - kInFlight (the worker loop while a non-blocking collective is in flight): spin 20 us,
//   then yield, not sleep, until 2 ms: Open MPI's non-blocking collectives progress only
//   inside MPI calls, so a sleeping worker stalls them; then sleep waited/32 for a late peer.
// - kControl (the control channel, the worker loop, the controller's waits for replies):
//   yield for 2 ms (never spin: the controller or a peer may need this very core; a
//   running program sends its next batch within that), then sleep waited/32 (10 us ..
//   1 ms): an idle worker wakes ~1000 times a second, and a wait of T returns at most
//   T/32 late.
// - kDoorbell (worker 0's loop, which shares rank 0's core with the controller): yield
//   for 100 us (a program that keeps issuing commands finds worker 0 awake, with no futex
//   wake to pay), then idle on the transport's doorbell, which the controller rings with
//   every command for rank 0, for waited/32 (10 us .. 1 ms), so commands from elsewhere
//   (a fan-out parent) are still seen within 1/32 of the wait. Yielding longer takes the
//   core from the controller between a program's bursts.
// - kOwnCore (the worker loop of a rank other than 0 with a core of its own,
//   WorkerOptions::block_in_mpi): kControl with a 20 ms yield (kControl's is 2 ms). Between a
//   program's bursts such a worker has nothing to give its core to, and one that slept
//   wakes late for the next collective; past 20 ms it sleeps as kControl does, so an idle
//   job still leaves its cores alone.
// - kReplyBell (the controller's wait while worker 0, on the same core, still owes the
//   awaited ident): yield for 20 us (a fetch completes within it and pays no wake-up),
//   then idle on the doorbell worker 0 rings with every reply, 1 ms at a time (the wait
//   cannot end before that reply; the millisecond bounds how late a timeout or the
//   laggards' status requests are seen). Yielding longer keeps the controller polling MPI
//   beside worker 0's collective on the shared core.
// - kGroup (StatelessGroup's waits): 64 hot polls without reading the clock (which costs
//   as much as a poll); spin 20 us (a small message about to arrive is taken without a
//   trip through the scheduler); yield until the operation's spin time (2 ms, or twice the
//   time its bytes take at 1 GB/s: shared-memory transfers advance only while both ranks
//   call into MPI, and a sleeping sender stalls its receiver, as a sleeping receiver stalls
//   a sender whose queue to it is full); then sleep waited/32 (10 us .. 1 ms).
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
                                      .spin = std::chrono::microseconds(20),
                                      .yield = std::chrono::milliseconds(2),
                                      .sleep_divisor = 32,
                                      .min_sleep = std::chrono::microseconds(10),
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
