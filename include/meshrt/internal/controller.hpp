// What the controller's blocking waits do besides waiting: a check the embedding program
// installs (the Python package lets Ctrl-C through it). Not installed: programs in C++
// stop a wait with a timeout instead. The refusal of controller calls from a worker's
// thread, and a test's switch for the control plane's size limit.
#pragma once

#include <chrono>
#include <cstddef>
#include <string_view>

namespace meshrt::detail {

// Runs on the waiting thread about every kWaitCheckInterval while a controller wait
// blocks (Future::get and exception, synchronize, release_cached_memory; not
// restart_workers, nor the session's shutdown). It may throw: the exception leaves the
// wait as it is and the session stays usable (a Future waited on stays pending and can be
// waited on again). One per process; nullptr removes it; set it while no wait runs.
using WaitCheck = void (*)();
void set_wait_check(WaitCheck check) noexcept;
inline constexpr std::chrono::milliseconds kWaitCheckInterval{50};

// UsageError when the calling thread runs a worker's loop (a kernel, most likely, that
// captured a handle): on rank 0 the controller would wait for that very worker, and its
// state belongs to the controller's thread. `what` names the call. Every controller entry
// point calls it first; an embedding that takes a lock of its own around controller calls
// (the Python package) calls it before that lock.
void refuse_on_worker_thread(std::string_view what);

// For tests: the bytes of host data (arguments) one command or batch may carry, in place
// of the control plane's limit of about 2 GiB, so the refusals and the batch splitting are
// tested with small tensors; 0 restores the limit. Set it while no session runs.
void set_payload_limit(std::size_t bytes) noexcept;

}  // namespace meshrt::detail
