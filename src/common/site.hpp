// How meshrt names a line of the user's program (a CallSite) in its messages.
#pragma once

#include <fmt/format.h>

#include <filesystem>
#include <string>
#include <string_view>

#include "meshrt/call_site.hpp"

namespace meshrt::detail {

// The bare name of the function a source_location is in, as a reader names it:
// "void {anonymous}::train(meshrt::Controller&)::<lambda()>" -> "train",
// "int main(int, char**)" -> "main", "T ns::Trainer<T>::step() [with T = float]" -> "step".
// Lambdas are named by the function they are written in; namespaces, classes, return
// types and parameters are dropped.
inline std::string short_function_name(std::string_view full) {
  // A lambda (or a local class) is written inside the function named before it.
  if (const auto lambda = full.find("::<lambda"); lambda != std::string_view::npos) full = full.substr(0, lambda);
  if (const auto with = full.find(" [with "); with != std::string_view::npos) full = full.substr(0, with);
  // The name ends at the parameter list: the first '(' outside template brackets (an
  // operator's own parentheses, as in "operator()", belong to the name).
  std::size_t end = full.size();
  int angle = 0;
  for (std::size_t i = 0; i < full.size(); ++i) {
    const char c = full[i];
    if (c == '<') ++angle;
    if (c == '>' && angle > 0) --angle;
    if (c == '(' && angle == 0) {
      if (full.substr(0, i).ends_with("operator") && full.substr(i).starts_with("()")) {
        ++i;
        continue;
      }
      end = i;
      break;
    }
  }
  std::string_view name = full.substr(0, end);
  // The return type ends at the last space outside template brackets.
  angle = 0;
  std::size_t begin = 0;
  for (std::size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    if (c == '<') ++angle;
    if (c == '>' && angle > 0) --angle;
    if (c == ' ' && angle == 0 && !name.substr(0, i).ends_with("operator")) begin = i + 1;
  }
  name = name.substr(begin);
  // The last component of the qualified name, outside template brackets.
  angle = 0;
  std::size_t last = 0;
  for (std::size_t i = 0; i + 1 < name.size(); ++i) {
    const char c = name[i];
    if (c == '<') ++angle;
    if (c == '>' && angle > 0) --angle;
    if (c == ':' && name[i + 1] == ':' && angle == 0) last = i + 2;
  }
  name = name.substr(last);
  // Template arguments of the function itself are noise too: "run<float>" -> "run".
  if (const auto lt = name.find('<'); lt != std::string_view::npos && lt > 0 && !name.starts_with("operator")) {
    name = name.substr(0, lt);
  }
  return name.empty() ? std::string(full) : std::string(name);
}

// "train.cpp:42 (step)"
inline std::string describe(const CallSite& where) {
  return fmt::format("{}:{} ({})", std::filesystem::path(where.file_name()).filename().string(), where.line(),
                     short_function_name(where.function_name()));
}

// "step.cpp:12 (operator()), replayed at train.cpp:42 (train)": a command of a recorded
// function, run by a replay (`replayed_at` with line 0: not a replay).
inline std::string describe(const CallSite& where, const CallSite& replayed_at) {
  if (replayed_at.line() == 0) return describe(where);
  return fmt::format("{}, replayed at {}", describe(where), describe(replayed_at));
}

}  // namespace meshrt::detail
