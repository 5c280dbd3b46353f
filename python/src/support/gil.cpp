#include "support/gil.hpp"

#include <utility>

namespace meshrt::python {
namespace {

struct Grave {
  void* handle;
  void (*destroy)(void*);
};
std::mutex& graveyard_mutex() {
  static auto* m = new std::mutex();
  return *m;
}
std::vector<Grave>& graveyard() {
  static auto* g = new std::vector<Grave>();
  return *g;
}

}  // namespace

std::recursive_mutex& controller_mutex() {
  static auto* m = new std::recursive_mutex();  // never destroyed: handles die after exit's statics
  return *m;
}

void gil_internal::bury(void* handle, void (*destroy)(void*)) {
  std::lock_guard g(graveyard_mutex());
  graveyard().push_back(Grave{handle, destroy});
}

void empty_graveyard() {
  std::vector<Grave> graves;
  {
    std::lock_guard lock(graveyard_mutex());
    if (graveyard().empty()) return;
    graves.swap(graveyard());
  }
  for (const Grave& g : graves) g.destroy(g.handle);
}

std::atomic<int>& python_kernels_running() {
  static std::atomic<int> n{0};
  return n;
}

bool& in_python_kernel() {
  thread_local bool in = false;
  return in;
}

void refuse_in_kernel() {
  constexpr const char* kWhat = "meshrt's Python API";
  detail::refuse_on_worker_thread(kWhat);
  if (in_python_kernel()) {
    throw UsageError(
        "meshrt's Python API called from inside a Python kernel running on an accelerator stream of rank 0: a kernel "
        "cannot drive the controller (the controller runs the program on rank 0's main thread and waits for this "
        "very kernel); return values from the kernel instead, and call the controller from the program");
  }
}

void check_signals() {
  // A kernel holding the GIL would hold the wait here past its deadline; its signals are
  // seen at the next check after it ends (the deadline is checked without the GIL).
  if (python_kernels_running().load() > 0) return;
  py::gil_scoped_acquire acquire;
  if (PyErr_CheckSignals() != 0) throw py::error_already_set();
}

}  // namespace meshrt::python
