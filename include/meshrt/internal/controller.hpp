// What the controller's blocking waits do besides waiting: a check the embedding program
// installs (the Python package lets Ctrl-C through it). Not installed: programs in C++
// stop a wait with a timeout instead.
#pragma once

#include <chrono>

namespace meshrt::detail {

// Runs on the waiting thread about every kWaitCheckInterval while a controller wait
// blocks (Future::get and exception, synchronize, release_cached_memory; not
// restart_workers, nor the session's shutdown). It may throw: the exception leaves the
// wait as it is and the session stays usable (a Future waited on stays pending and can be
// waited on again). One per process; nullptr removes it; set it while no wait runs.
using WaitCheck = void (*)();
void set_wait_check(WaitCheck check) noexcept;
inline constexpr std::chrono::milliseconds kWaitCheckInterval{50};

}  // namespace meshrt::detail
