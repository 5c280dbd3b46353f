// wait(): completes a Pending without burning a core while it idles.
#include "common/backoff.hpp"
#include "meshrt/internal/comm.hpp"

namespace meshrt {

// The data plane's parameters (kDataPlaneWait, common/backoff.hpp says why); the idle
// step is the Pending's own: an operation on the comm thread wakes the waiter at once.
Outcome wait(Pending& pending) {
  detail::Backoff backoff(detail::kDataPlaneWait);
  while (!pending.test()) backoff.pause([&pending](std::chrono::microseconds d) { pending.idle(d); });
  return pending.take();
}

}  // namespace meshrt
