// The reductions over a mesh dimension (DESIGN.md section 3, "Reductions").
#pragma once

#include <cstdint>
#include <string_view>

namespace meshrt {

enum class Reduction : std::uint8_t { Stack, Sum, Avg, Product, Min, Max, Band, Bor, Bxor };
inline constexpr int kNumReductions = 9;

// "stack", "sum", "avg", "product", "min", "max", "band", "bor", "bxor".
std::string_view name(Reduction reduction) noexcept;
// Parses the names above; throws UsageError listing them.
Reduction parse_reduction(std::string_view text);
inline bool is_bitwise(Reduction r) noexcept {
  return r == Reduction::Band || r == Reduction::Bor || r == Reduction::Bxor;
}

}  // namespace meshrt
