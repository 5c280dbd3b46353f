// A line of the user's program that issued a controller call: what errors, the desync
// report, the flight recorder and the timeline name ("train.cpp:42 (step)"). Every
// controller call takes one, made implicitly from std::source_location::current() at the
// caller; a binding for another language (meshrt's Python package) gives its own line
// with the three-argument constructor.
#pragma once

#include <cstdint>
#include <source_location>
#include <string>

namespace meshrt {

class CallSite {
 public:
  // No known line: file and function empty, line 0.
  constexpr CallSite() noexcept = default;
  // The compiler's record of a line, which is how C++ callers make one (implicitly, as the
  // default argument of every controller call).
  constexpr CallSite(const std::source_location& where) noexcept  // NOLINT(google-explicit-constructor)
      : file_(where.file_name()), function_(where.function_name()), line_(where.line()) {}
  // A line given by a binding: `file` and `function` must outlive every use of the site
  // (the controller keeps sites as long as it reports on the work they issued), so a
  // binding interns them.
  constexpr CallSite(const char* file, const char* function, std::uint32_t line) noexcept
      : file_(file != nullptr ? file : ""), function_(function != nullptr ? function : ""), line_(line) {}

  static constexpr CallSite current(std::source_location where = std::source_location::current()) noexcept {
    return where;
  }

  constexpr const char* file_name() const noexcept { return file_; }
  // As the compiler writes it for C++ ("void train(meshrt::Controller&)"), or a binding's
  // plain name ("step").
  constexpr const char* function_name() const noexcept { return function_; }
  constexpr std::uint32_t line() const noexcept { return line_; }
  // Line 0 names no line (a default-made site, or "not a replay").
  constexpr bool known() const noexcept { return line_ != 0; }

 private:
  const char* file_ = "";
  const char* function_ = "";
  std::uint32_t line_ = 0;
};

// "train.cpp:42 (step)": the file's name, the line and the bare function name, as
// meshrt's messages name a site.
std::string to_string(const CallSite& where);

}  // namespace meshrt
