// The GIL and the controller lock (docs/python.md, "The GIL and Ctrl-C"). The binding's
// three rules:
//   - Arguments are converted with the GIL held; the C++ call then runs with the GIL
//     released and the controller lock held (released()). The controller is not
//     thread-safe; the lock is what serialises Python threads now that the GIL does not.
//   - A handle whose Python object dies while another thread holds the lock is destroyed
//     by the next call that takes it (the graveyard), never waited for.
//   - A blocking wait checks for signals every detail::kWaitCheckInterval (check_signals,
//     through detail::set_wait_check), so Ctrl-C is a KeyboardInterrupt and not a hang.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <mutex>
#include <vector>

namespace meshrt::python {

namespace py = pybind11;

// Held around every C++ controller call. Recursive: a Python signal handler that the wait
// check runs may itself drop a handle or call the controller, on the thread that holds it.
std::recursive_mutex& controller_mutex();

// Destroys the handles queued while another thread held the controller lock. The caller
// holds the controller lock.
void empty_graveyard();

namespace gil_internal {
// Queues `handle` for the next holder of the controller lock to destroy.
void bury(void* handle, void (*destroy)(void*));
}  // namespace gil_internal

// The holder's deleter of every handle type (DTensor, Mesh, Stream, Future): at once when
// the controller lock is free, else by the next call that takes it (waiting for the lock
// could deadlock: the holder may wait for worker 0, whose Python kernel is the thread
// that dropped the handle; and destroying a handle only queues a delete anyway).
template <class T>
struct HandleDelete {
  void operator()(T* handle) const noexcept {
    std::unique_lock lock(controller_mutex(), std::try_to_lock);
    if (lock.owns_lock()) {
      delete handle;
      return;
    }
    gil_internal::bury(handle, [](void* p) { delete static_cast<T*>(p); });
  }
};
template <class T>
using Holder = std::unique_ptr<T, HandleDelete<T>>;

// Runs f (a C++ controller call) with the GIL released and the controller lock held.
template <class F>
auto released(F&& f) -> decltype(f()) {
  py::gil_scoped_release release;
  std::lock_guard lock(controller_mutex());
  empty_graveyard();
  return f();
}

// The GIL for this thread, which keeps its Python thread state between calls (made on its
// first call) rather than making and deleting one per call: the worker thread and an
// emulated stream's thread come back for every Python kernel.
class KeptGil {
 public:
  KeptGil() {
    thread_local bool kept = false;
    if (!kept) {
      acquire_.inc_ref();
      kept = true;
    }
  }

 private:
  py::gil_scoped_acquire acquire_;
};

// The wait check (meshrt/internal/controller.hpp): a pending signal's Python handler runs
// here, and its exception (KeyboardInterrupt) ends the wait.
void check_signals();

}  // namespace meshrt::python
