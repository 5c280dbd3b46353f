#include "meshrt/reduction.hpp"

#include <fmt/format.h>

#include <array>

#include "meshrt/error.hpp"

namespace meshrt {
namespace {
constexpr std::array<std::string_view, kNumReductions> kNames{"stack", "sum",  "avg", "product", "min",
                                                              "max",   "band", "bor", "bxor"};
}

std::string_view name(Reduction reduction) noexcept {
  const auto i = static_cast<std::size_t>(reduction);
  return i < kNames.size() ? kNames[i] : std::string_view("?");
}

Reduction parse_reduction(std::string_view text) {
  for (std::size_t i = 0; i < kNames.size(); ++i) {
    if (kNames[i] == text) return static_cast<Reduction>(i);
  }
  throw UsageError(fmt::format(
      "unknown reduction \"{}\": expected one of stack, sum, avg, product, min, max, band, bor, bxor", text));
}

}  // namespace meshrt
