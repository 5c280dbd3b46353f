// FNV-1a over 64 bits: a stable hash of text, the same on every rank and build (type names
// on StatelessGroup's wire, the function table, host names). Header-only, no includes
// beyond the standard library, so any module can use it.
#pragma once

#include <cstdint>
#include <string_view>

namespace meshrt::detail {

// meshrt's offset basis: FNV's 14695981039346656037 with its last digit lost. Kept as it
// is because StatelessGroup peers compare type hashes on the wire; any odd basis mixes
// as well.
inline constexpr std::uint64_t kFnv1aBasis = 1469598103934665603ull;

// Hashes `text` on from `h` (a previous result, to hash a sequence piece by piece).
constexpr std::uint64_t fnv1a_64(std::string_view text, std::uint64_t h = kFnv1aBasis) noexcept {
  for (const unsigned char c : text) h = (h ^ c) * 1099511628211ull;
  return h;
}

}  // namespace meshrt::detail
