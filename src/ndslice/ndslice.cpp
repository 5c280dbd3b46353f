#include "meshrt/ndslice.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <numeric>

namespace meshrt {
namespace {

using Int = NDSlice::Int;
using Kind = SliceError::Kind;

std::string describe(Int offset, const std::vector<Int>& sizes, const std::vector<Int>& strides) {
  return fmt::format("NDSlice(offset={}, sizes=[{}], strides=[{}])", offset, fmt::join(sizes, ", "),
                     fmt::join(strides, ", "));
}

}  // namespace

NDSlice::NDSlice(Int offset, std::vector<Int> sizes, std::vector<Int> strides)
    : offset_(offset), sizes_(std::move(sizes)), strides_(std::move(strides)) {
  const auto where = [&] { return describe(offset_, sizes_, strides_); };
  if (sizes_.size() != strides_.size()) {
    throw SliceError(Kind::NonRectangular,
                     fmt::format("{}: expected one stride per dimension, found {} sizes and {} strides", where(),
                                 sizes_.size(), strides_.size()));
  }
  if (offset_ < 0) {
    throw SliceError(Kind::InvalidValue, fmt::format("{}: expected offset >= 0, found {}", where(), offset_));
  }
  Int last = offset_;  // the largest value, checked for overflow
  for (std::size_t d = 0; d < sizes_.size(); ++d) {
    if (sizes_[d] < 1) {
      throw SliceError(Kind::EmptyDimension, fmt::format("{}: expected every size >= 1, found size {} in dimension {}",
                                                         where(), sizes_[d], d));
    }
    if (strides_[d] < 1) {
      throw SliceError(
          Kind::InvalidValue,
          fmt::format("{}: expected every stride >= 1, found stride {} in dimension {}", where(), strides_[d], d));
    }
    Int extent = 0;
    if (__builtin_mul_overflow(sizes_[d] - 1, strides_[d], &extent) || __builtin_add_overflow(last, extent, &last) ||
        __builtin_mul_overflow(len_, sizes_[d], &len_)) {
      throw SliceError(Kind::InvalidValue, fmt::format("{}: its values overflow a 64-bit integer", where()));
    }
    if (sizes_[d] > 1) by_stride_desc_.push_back(d);
  }
  std::sort(by_stride_desc_.begin(), by_stride_desc_.end(),
            [&](std::size_t a, std::size_t b) { return strides_[a] > strides_[b]; });
  for (std::size_t k = 1; k < by_stride_desc_.size(); ++k) {
    const std::size_t big = by_stride_desc_[k - 1], small = by_stride_desc_[k];
    if (strides_[small] == strides_[big]) {
      throw SliceError(Kind::NonUniqueStrides,
                       fmt::format("{}: expected distinct strides, found stride {} in dimensions {} and {}", where(),
                                   strides_[big], std::min(small, big), std::max(small, big)));
    }
    // Nested: each stride clears the whole extent of the next smaller one. Then every
    // value has one set of coordinates and a greedy division finds them.
    if (strides_[big] < strides_[small] * sizes_[small]) nested_ = false;
  }
  suffix_extent_.assign(by_stride_desc_.size() + 1, 0);
  for (std::size_t k = by_stride_desc_.size(); k-- > 0;) {
    const std::size_t d = by_stride_desc_[k];
    suffix_extent_[k] = suffix_extent_[k + 1] + (sizes_[d] - 1) * strides_[d];
  }
  // Interleaved strides (what select with a step makes) can still be valid; check that
  // no two coordinates share a value, by enumeration, for slices of a sane size.
  if (!nested_) {
    constexpr Int kMaxChecked = Int{1} << 22;
    if (len_ > kMaxChecked) {
      throw SliceError(Kind::Overlapping,
                       fmt::format("{}: strides interleave and the slice has {} elements, more than the {} "
                                   "meshrt verifies; expected nested strides",
                                   where(), len_, kMaxChecked));
    }
    std::vector<Int> values = to_vector();
    std::sort(values.begin(), values.end());
    if (auto dup = std::adjacent_find(values.begin(), values.end()); dup != values.end()) {
      throw SliceError(Kind::Overlapping,
                       fmt::format("{}: two coordinates share the value {}; expected every element to have "
                                   "one location",
                                   where(), *dup));
    }
  }
}

NDSlice NDSlice::row_major(std::vector<Int> sizes, Int offset) {
  std::vector<Int> strides(sizes.size());
  Int stride = 1;
  for (std::size_t d = sizes.size(); d-- > 0;) {
    strides[d] = stride;
    stride *= std::max<Int>(sizes[d], 1);
  }
  return NDSlice(offset, std::move(sizes), std::move(strides));
}

Int NDSlice::operator[](Int i) const {
  if (i < 0 || i >= len_) {
    throw SliceError(Kind::IndexOutOfRange,
                     fmt::format("{}: index {} out of range, expected 0 <= index < {}", to_string(), i, len_));
  }
  Int value = offset_;
  for (std::size_t d = sizes_.size(); d-- > 0;) {
    value += (i % sizes_[d]) * strides_[d];
    i /= sizes_[d];
  }
  return value;
}

bool NDSlice::solve(std::size_t k, Int rest, std::vector<Int>& out) const noexcept {
  if (k == by_stride_desc_.size()) return rest == 0;
  const std::size_t d = by_stride_desc_[k];
  for (Int c = std::min(sizes_[d] - 1, rest / strides_[d]); c >= 0; --c) {
    const Int left = rest - c * strides_[d];
    if (left > suffix_extent_[k + 1]) break;  // smaller c only leaves more
    out[d] = c;
    if (solve(k + 1, left, out)) return true;
    if (nested_) break;  // greedy is exact for nested strides
  }
  out[d] = 0;
  return false;
}

bool NDSlice::try_coordinates(Int value, std::vector<Int>& out) const noexcept {
  out.assign(sizes_.size(), 0);
  const Int rest = value - offset_;
  if (rest < 0 || rest > suffix_extent_[0]) return false;
  return solve(0, rest, out);
}

std::vector<Int> NDSlice::coordinates(Int value) const {
  std::vector<Int> coords;
  if (!try_coordinates(value, coords)) {
    throw SliceError(Kind::NotInSlice, fmt::format("{}: value {} is not in the slice", to_string(), value));
  }
  return coords;
}

Int NDSlice::index(Int value) const {
  const std::vector<Int> coords = coordinates(value);
  Int i = 0;
  for (std::size_t d = 0; d < sizes_.size(); ++d) i = i * sizes_[d] + coords[d];
  return i;
}

Int NDSlice::location(std::span<const Int> coords) const {
  if (coords.size() != sizes_.size()) {
    throw SliceError(Kind::IndexOutOfRange,
                     fmt::format("{}: expected {} coordinates, found {}", to_string(), sizes_.size(), coords.size()));
  }
  Int value = offset_;
  for (std::size_t d = 0; d < sizes_.size(); ++d) {
    if (coords[d] < 0 || coords[d] >= sizes_[d]) {
      throw SliceError(Kind::IndexOutOfRange,
                       fmt::format("{}: coordinate {} of dimension {} out of range, expected 0 <= c < {}", to_string(),
                                   coords[d], d, sizes_[d]));
    }
    value += coords[d] * strides_[d];
  }
  return value;
}

bool NDSlice::contains(Int value) const noexcept {
  if (nested_) {
    // solve()'s greedy division, which is exact for nested strides, without the
    // coordinates: a membership test per command allocates nothing.
    Int rest = value - offset_;
    if (rest < 0 || rest > suffix_extent_[0]) return false;
    for (std::size_t k = 0; k < by_stride_desc_.size(); ++k) {
      const std::size_t d = by_stride_desc_[k];
      rest -= std::min(sizes_[d] - 1, rest / strides_[d]) * strides_[d];
      if (rest > suffix_extent_[k + 1]) return false;
    }
    return rest == 0;
  }
  std::vector<Int> coords;
  return try_coordinates(value, coords);
}

NDSlice NDSlice::select(std::size_t dim, Int begin, Int end, Int step) const {
  if (dim >= sizes_.size()) {
    throw SliceError(Kind::IndexOutOfRange, fmt::format("{}: select on dimension {}, expected a dimension < {}",
                                                        to_string(), dim, sizes_.size()));
  }
  if (step < 1 || begin < 0 || end > sizes_[dim] || begin >= end) {
    throw SliceError(Kind::IndexOutOfRange,
                     fmt::format("{}: select({}, {}, {}, {}): expected 0 <= begin < end <= {} and step >= 1",
                                 to_string(), dim, begin, end, step, sizes_[dim]));
  }
  std::vector<Int> sizes = sizes_, strides = strides_;
  sizes[dim] = (end - begin + step - 1) / step;
  strides[dim] = strides_[dim] * step;
  return NDSlice(offset_ + begin * strides_[dim], std::move(sizes), std::move(strides));
}

NDSlice NDSlice::at(std::size_t dim, Int index) const {
  if (dim >= sizes_.size()) {
    throw SliceError(Kind::IndexOutOfRange,
                     fmt::format("{}: at on dimension {}, expected a dimension < {}", to_string(), dim, sizes_.size()));
  }
  if (index < 0 || index >= sizes_[dim]) {
    throw SliceError(Kind::IndexOutOfRange,
                     fmt::format("{}: at({}, {}): expected 0 <= index < {}", to_string(), dim, index, sizes_[dim]));
  }
  std::vector<Int> sizes = sizes_, strides = strides_;
  sizes.erase(sizes.begin() + static_cast<std::ptrdiff_t>(dim));
  strides.erase(strides.begin() + static_cast<std::ptrdiff_t>(dim));
  return NDSlice(offset_ + index * strides_[dim], std::move(sizes), std::move(strides));
}

std::vector<Int> NDSlice::to_vector() const {
  return {begin(), end()};
}

std::string NDSlice::to_string() const {
  return describe(offset_, sizes_, strides_);
}

bool NDSlice::operator==(const NDSlice& o) const noexcept {
  return offset_ == o.offset_ && sizes_ == o.sizes_ && strides_ == o.strides_;
}

}  // namespace meshrt
