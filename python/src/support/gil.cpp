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

void check_signals() {
  py::gil_scoped_acquire acquire;
  if (PyErr_CheckSignals() != 0) throw py::error_already_set();
}

}  // namespace meshrt::python
