// Python stacks in the reports that say where a job is stuck (meshrt/internal/stacks.hpp):
// a rank's Python kernel, and the Python controller. The frames are read as faulthandler
// reads them, without the GIL: a stuck kernel holds it, and the controller's thread
// waits without it.
#include <pybind11/pybind11.h>

#include <cstdio>
#include <string>

#include "bindings.hpp"
#include "meshrt/internal/stacks.hpp"

// CPython's own dumper (faulthandler's): async-signal-safe, no GIL, at most 100 frames,
// each "File ..., line N in f". Exported by the interpreter, declared in its internal
// headers only.
extern "C" void _Py_DumpTraceback(int fd, PyThreadState* tstate);

namespace meshrt::python {
namespace {

// The thread state of the thread `thread` (pthread_self()'s number), or null. Walks the
// interpreter's list without its lock, as faulthandler does: the threads meshrt asks
// about (the worker's, the controller's) keep their states for the process's life.
PyThreadState* state_of(std::uint64_t thread) {
  PyInterpreterState* interp = PyInterpreterState_Main();
  if (interp == nullptr) return nullptr;
  for (PyThreadState* t = PyInterpreterState_ThreadHead(interp); t != nullptr; t = PyThreadState_Next(t)) {
    if (static_cast<std::uint64_t>(t->thread_id) == thread) return t;
  }
  return nullptr;
}

std::string dump(PyThreadState* t) {
  if (t == nullptr) return "";
  std::FILE* f = std::tmpfile();
  if (f == nullptr) return "";
  _Py_DumpTraceback(fileno(f), t);
  std::string out;
  std::rewind(f);
  char buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) out.append(buf, n);
  std::fclose(f);
  // "Stack (most recent call first):" then the frames; a thread with none has only the
  // header (or "<no Python frame>").
  if (out.find("File \"") == std::string::npos) return "";
  while (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

std::string python_stack(const detail::StackOf& of) {
  if (Py_IsInitialized() == 0) return "";
  return dump(state_of(of.thread));
}

}  // namespace

void register_python_stacks() {
  detail::set_stack_provider("Python", &python_stack);
}

}  // namespace meshrt::python
