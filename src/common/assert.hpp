// Checks of meshrt's own invariants: a failure is a bug in meshrt, raised as an
// InternalError naming the file and line, never as the caller's UsageError. Internal
// header with no MPI, CUDA or NCCL include, so that every module can use it.
//
// Use them where nothing outside meshrt can make the condition false. A condition that a
// caller's argument or a frame from the wire can make false is a UsageError or a
// ProtocolError instead, even when meshrt's own caller "never does that".
#pragma once

#include <string>
#include <string_view>

#include "meshrt/error.hpp"

namespace meshrt::detail {

// Throws InternalError("rank R: meshrt internal error (...): <message> at <file>:<line>").
[[noreturn]] void throw_internal(std::string_view message, const char* file, int line);

}  // namespace meshrt::detail

// An invariant: MESHRT_ASSERT(done_, "take() after completion") -> InternalError.
// Always on (not only in debug builds): the checks are cheap and a release run is where
// a bug must be reported, not turned into a wrong result.
#define MESHRT_ASSERT(cond, message)                                                                         \
  do {                                                                                                       \
    if (!(cond))                                                                                             \
      ::meshrt::detail::throw_internal(std::string("expected " #cond ": ") + (message), __FILE__, __LINE__); \
  } while (0)

// A path that cannot be reached unless meshrt has a bug.
#define MESHRT_INTERNAL(message) ::meshrt::detail::throw_internal((message), __FILE__, __LINE__)
