// How the controller names a line of the user's program in its messages.
#pragma once

#include <fmt/format.h>

#include <filesystem>
#include <source_location>
#include <string>

namespace meshrt::detail {

// "train.cpp:42 (void step(meshrt::Controller&))"
inline std::string describe(const std::source_location& where) {
  return fmt::format("{}:{} ({})", std::filesystem::path(where.file_name()).filename().string(), where.line(),
                     where.function_name());
}

}  // namespace meshrt::detail
