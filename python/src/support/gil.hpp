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

#include <atomic>
#include <cstdio>
#include <memory>
#include <mutex>
#include <vector>

#include "meshrt/error.hpp"
#include "meshrt/internal/controller.hpp"

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

// How many Python kernels this process runs now (rank 0's worker, an emulated stream's
// thread): while one runs it most likely holds the GIL, so the controller's waits do not
// take it for their signal check (their deadline would wait for the kernel).
std::atomic<int>& python_kernels_running();
// Whether this thread runs a Python kernel now (rank 0's worker, or an emulated stream's
// thread, which is no worker's).
bool& in_python_kernel();
class PythonKernelRunning {
 public:
  PythonKernelRunning() {
    python_kernels_running().fetch_add(1);
    in_python_kernel() = true;
  }
  ~PythonKernelRunning() {
    in_python_kernel() = false;
    python_kernels_running().fetch_sub(1);
  }
  PythonKernelRunning(const PythonKernelRunning&) = delete;
  PythonKernelRunning& operator=(const PythonKernelRunning&) = delete;
};

// A kernel that calls the controller (a captured ctl): refused before the controller lock,
// which the program's thread holds while it waits for that very kernel.
void refuse_in_kernel();

// Runs f (a C++ controller call) with the GIL released and the controller lock held.
template <class F>
auto released(F&& f) -> decltype(f()) {
  refuse_in_kernel();
  py::gil_scoped_release release;
  std::lock_guard lock(controller_mutex());
  empty_graveyard();
  try {
    return f();
  } catch (const TimeoutError&) {
    // Raising it in Python needs the GIL, which a Python kernel on rank 0 may hold.
    if (python_kernels_running().load() > 0) {
      std::fputs(
          "meshrt: the controller's TimeoutError is raised once rank 0's Python kernel lets the GIL go (the "
          "error's desync report shows where the kernel is)\n",
          stderr);
    }
    throw;
  }
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
