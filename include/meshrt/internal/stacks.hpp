// A thread's stack in its own language, for the reports that say where a job is stuck:
// the desync report (a timeout's, or MESHRT_STALL_WARNING's) shows, under a rank whose
// worker runs a kernel, that kernel's stack (a Python kernel's Python frames), and under
// the table the controller thread's. meshrt itself knows only its C++ side; the binding
// of a language (the Python package) registers a provider that reads the frames. Without
// one the reports show the command alone. Not installed: for meshrt's own bindings.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace meshrt::detail {

// Whose stack a report asks for.
enum class StackOwner : std::uint8_t {
  Kernel,      // a worker thread inside a CallFunction command: the kernel it runs
  Controller,  // rank 0's controller thread, while it builds a desync report
};

struct StackOf {
  StackOwner owner = StackOwner::Kernel;
  // The thread: its pthread_self() as an integer (what CPython's PyThreadState.thread_id
  // and threading.get_ident() hold on Linux).
  std::uint64_t thread = 0;
  // Kernel: the function the worker runs ("my.fn"); Controller: empty.
  std::string_view function;
};

// Returns the thread's stack as lines of text (no trailing newline needed), or "" when
// that thread has nothing in the provider's language now (a C++ kernel, or no frames).
//
// Where it is called:
// - Kernel: on the rank's watch thread, while it answers the controller's state query;
//   the kernel's thread is running (possibly stuck in the kernel, a lock or a C
//   extension) and takes no part. So the provider must not wait for that thread nor for
//   anything it may hold (Python: no GIL; read the frames as faulthandler does), and must
//   return within milliseconds: the controller waits MESHRT_STATE_QUERY_TIMEOUT for every
//   rank's answer.
// - Controller: on the controller thread itself, inside a wait (it does not hold the GIL
//   there in the Python package).
// It may throw: the report then says the provider failed, with the exception's text.
using StackProvider = std::string (*)(const StackOf& of);

// Registers the provider (nullptr removes it); `language` ("Python") names it in the
// reports: "Python stack of the kernel:", "Python stack of the controller:". One per
// process; thread-safe. `language` must outlive every later call (a string literal).
void set_stack_provider(const char* language, StackProvider provider) noexcept;

// For the reports: "<language> stack of the kernel:" or "... of the controller:" and then
// the provider's lines, each indented by `indent` spaces plus two; "" when no provider is
// registered or it has nothing to show. Never throws.
std::string language_stack(const StackOf& of, std::size_t indent);

// This thread's id as StackOf::thread takes it.
std::uint64_t this_thread_id() noexcept;

}  // namespace meshrt::detail
