// wait(): completes a Pending without burning a core while it idles.
#include <algorithm>
#include <chrono>
#include <thread>

#include "meshrt/comm.hpp"

namespace meshrt {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::microseconds;

// Small collectives finish within a few microseconds: spinning that long costs less than
// one trip through the scheduler. Past that, yielding still reacts within microseconds
// but lets an oversubscribed peer run. Past that, the operation is long or a peer is
// late: sleep, with intervals that grow with the time already waited (so oversleeping
// adds at most ~1/32 to a long operation) up to 1 ms (so an idle wait wakes ~1000 times
// a second, not millions). An operation on the comm thread wakes the waiter at once.
constexpr microseconds kSpin{20};
constexpr microseconds kYield{200};
constexpr microseconds kMinSleep{10};
constexpr microseconds kMaxSleep{1000};

}  // namespace

Outcome wait(Pending& pending) {
  if (pending.test()) return pending.take();
  const auto start = Clock::now();
  for (;;) {
    const auto waited = std::chrono::duration_cast<microseconds>(Clock::now() - start);
    if (waited >= kYield) {
      pending.idle(std::clamp(waited / 32, kMinSleep, kMaxSleep));
    } else if (waited >= kSpin) {
      std::this_thread::yield();
    }
    if (pending.test()) return pending.take();
  }
}

}  // namespace meshrt
