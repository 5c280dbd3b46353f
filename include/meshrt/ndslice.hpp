// NDSlice: a strided, rectangular set of ranks, the layout of a device mesh.
//
// NDSlice(offset, sizes, strides) holds the values offset + sum_i c_i * strides[i] for
// every coordinate vector c with 0 <= c_i < sizes[i]. Elements are numbered in row-major
// order of their coordinates: s[i] is the i-th, index(s[i]) == i. A 0-d slice holds one
// value, its offset.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <span>
#include <string>
#include <vector>

#include <boost/container/small_vector.hpp>

#include "meshrt/error.hpp"

namespace meshrt {

class SliceError : public UsageError {
 public:
  enum class Kind {
    NonRectangular,    // sizes and strides have different lengths
    InvalidValue,      // negative offset, stride < 1
    EmptyDimension,    // a size < 1
    NonUniqueStrides,  // two dimensions (of size > 1) with the same stride
    Overlapping,       // two coordinates share a value
    IndexOutOfRange,   // an index, coordinate or dimension past the end
    NotInSlice,        // a value the slice does not contain
  };
  SliceError(Kind kind, const std::string& what) : UsageError(what), kind_(kind) {}
  Kind kind() const noexcept { return kind_; }

 private:
  Kind kind_;
};

class NDSlice {
 public:
  using Int = std::int64_t;

  // Validates; throws SliceError.
  NDSlice(Int offset, std::vector<Int> sizes, std::vector<Int> strides);
  // The contiguous row-major slice of `sizes` starting at `offset`.
  static NDSlice row_major(std::vector<Int> sizes, Int offset = 0);

  Int offset() const noexcept { return offset_; }
  const std::vector<Int>& sizes() const noexcept { return sizes_; }
  const std::vector<Int>& strides() const noexcept { return strides_; }
  std::size_t ndim() const noexcept { return sizes_.size(); }
  // Number of elements (1 for a 0-d slice).
  Int len() const noexcept { return len_; }

  // The i-th element in row-major order of coordinates; throws IndexOutOfRange.
  Int operator[](Int i) const;
  // The position of `value` in that order; throws NotInSlice.
  Int index(Int value) const;
  // The coordinates of `value`; throws NotInSlice.
  std::vector<Int> coordinates(Int value) const;
  // The value at `coords`; throws IndexOutOfRange.
  Int location(std::span<const Int> coords) const;
  bool contains(Int value) const noexcept;

  // Keeps dimension `dim`, restricted to begin, begin+step, ... < end.
  NDSlice select(std::size_t dim, Int begin, Int end, Int step = 1) const;
  // Fixes dimension `dim` at `index` and drops it.
  NDSlice at(std::size_t dim, Int index) const;

  std::vector<Int> to_vector() const;
  std::string to_string() const;
  bool operator==(const NDSlice& other) const noexcept;

  class iterator {
   public:
    using iterator_category = std::forward_iterator_tag;
    using value_type = Int;
    using difference_type = std::ptrdiff_t;
    using pointer = void;
    using reference = Int;
    iterator() = default;
    iterator(const NDSlice* s, Int i) : s_(s), i_(i) {}
    Int operator*() const { return (*s_)[i_]; }
    iterator& operator++() {
      ++i_;
      return *this;
    }
    iterator operator++(int) {
      iterator t = *this;
      ++i_;
      return t;
    }
    bool operator==(const iterator& o) const noexcept { return i_ == o.i_; }

   private:
    const NDSlice* s_ = nullptr;
    Int i_ = 0;
  };
  iterator begin() const { return {this, 0}; }
  iterator end() const { return {this, len_}; }

 private:
  bool try_coordinates(Int value, std::vector<Int>& out) const noexcept;
  bool solve(std::size_t k, Int rest, std::vector<Int>& out) const noexcept;

  Int offset_;
  std::vector<Int> sizes_;
  std::vector<Int> strides_;
  Int len_ = 1;
  // Derived from sizes and strides, inline up to 4 dimensions: a slice is copied with
  // every command that names one (a send's ranks), and these would double its allocations.
  boost::container::small_vector<std::size_t, 4> by_stride_desc_;  // dimensions of size > 1, largest stride first
  boost::container::small_vector<Int, 5> suffix_extent_;           // sum of (size-1)*stride over by_stride_desc_[k:]
  bool nested_ = true;                                             // each stride clears the extent of the next smaller
};

}  // namespace meshrt
