#include "meshrt/ndslice.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <set>

namespace meshrt {
namespace {

using Int = NDSlice::Int;
using Kind = SliceError::Kind;

Kind kind_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const SliceError& e) {
    return e.kind();
  }
  ADD_FAILURE() << "expected a SliceError";
  return Kind::InvalidValue;
}

TEST(NDSlice, ColumnMajor) {
  NDSlice s(0, {3, 4}, {1, 4});
  EXPECT_EQ(s.len(), 12);
  // Row-major order of coordinates: (0,0),(0,1),... -> 0,4,8,1,5,9,...
  EXPECT_EQ(s.to_vector(), (std::vector<Int>{0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14}));
  EXPECT_EQ(s.coordinates(9), (std::vector<Int>{1, 2}));
  EXPECT_EQ(s.index(9), 6);
  EXPECT_EQ(s.location(std::vector<Int>{2, 3}), 14);
  EXPECT_FALSE(s.contains(3));
  EXPECT_FALSE(s.contains(15));
  EXPECT_EQ(s.at(1, 2).to_vector(), (std::vector<Int>{8, 9, 10}));
  EXPECT_EQ(s.at(0, 1).to_vector(), (std::vector<Int>{1, 5, 9, 13}));
}

TEST(NDSlice, Strided3D) {
  NDSlice s(24, {4, 3, 8}, {96, 16, 2});
  EXPECT_EQ(s.len(), 96);
  EXPECT_EQ(s[0], 24);
  EXPECT_EQ(s[1], 26);
  EXPECT_EQ(s[8], 40);
  EXPECT_EQ(s[24], 120);
  EXPECT_EQ(s[95], 24 + 3 * 96 + 2 * 16 + 7 * 2);
  EXPECT_EQ(s.coordinates(24 + 2 * 96 + 16 + 6), (std::vector<Int>{2, 1, 3}));
  EXPECT_FALSE(s.contains(25));       // odd
  EXPECT_FALSE(s.contains(24 + 48));  // past dim 1's extent, short of dim 0's stride
  EXPECT_FALSE(s.contains(23));
  const NDSlice sel = s.select(2, 1, 8, 3);  // coordinates 1, 4, 7
  EXPECT_EQ(sel.sizes(), (std::vector<Int>{4, 3, 3}));
  EXPECT_EQ(sel.strides(), (std::vector<Int>{96, 16, 6}));
  EXPECT_EQ(sel.offset(), 26);
}

TEST(NDSlice, ZeroDimensional) {
  NDSlice s(37, {}, {});
  EXPECT_EQ(s.len(), 1);
  EXPECT_EQ(s.ndim(), 0u);
  EXPECT_EQ(s[0], 37);
  EXPECT_EQ(s.index(37), 0);
  EXPECT_TRUE(s.coordinates(37).empty());
  EXPECT_EQ(s.location(std::vector<Int>{}), 37);
  EXPECT_EQ(s.to_vector(), (std::vector<Int>{37}));
  EXPECT_EQ(kind_of([&] { (void)s.index(36); }), Kind::NotInSlice);
  EXPECT_EQ(kind_of([&] { (void)s[1]; }), Kind::IndexOutOfRange);
}

TEST(NDSlice, InvalidSlicesRaiseTypedErrors) {
  EXPECT_EQ(kind_of([] { NDSlice(0, {2, 3}, {3}); }), Kind::NonRectangular);
  EXPECT_EQ(kind_of([] { NDSlice(0, {2, 0}, {1, 1}); }), Kind::EmptyDimension);
  EXPECT_EQ(kind_of([] { NDSlice(0, {2, -1}, {1, 1}); }), Kind::EmptyDimension);
  EXPECT_EQ(kind_of([] { NDSlice(0, {2, 2}, {2, 2}); }), Kind::NonUniqueStrides);
  EXPECT_EQ(kind_of([] { NDSlice(0, {4, 2}, {1, 3}); }), Kind::Overlapping);
  EXPECT_EQ(kind_of([] { NDSlice(-1, {2}, {1}); }), Kind::InvalidValue);
  EXPECT_EQ(kind_of([] { NDSlice(0, {2}, {0}); }), Kind::InvalidValue);
  EXPECT_EQ(kind_of([] { NDSlice(0, {Int{1} << 40, Int{1} << 40}, {1, Int{1} << 40}); }), Kind::InvalidValue);
  NDSlice s = NDSlice::row_major({2, 3});
  EXPECT_EQ(kind_of([&] { (void)s[6]; }), Kind::IndexOutOfRange);
  EXPECT_EQ(kind_of([&] { (void)s[-1]; }), Kind::IndexOutOfRange);
  EXPECT_EQ(kind_of([&] { (void)s.index(6); }), Kind::NotInSlice);
  EXPECT_EQ(kind_of([&] { (void)s.location(std::vector<Int>{2, 0}); }), Kind::IndexOutOfRange);
  EXPECT_EQ(kind_of([&] { (void)s.location(std::vector<Int>{0}); }), Kind::IndexOutOfRange);
  EXPECT_EQ(kind_of([&] { (void)s.at(2, 0); }), Kind::IndexOutOfRange);
  EXPECT_EQ(kind_of([&] { (void)s.at(0, 2); }), Kind::IndexOutOfRange);
  EXPECT_EQ(kind_of([&] { (void)s.select(1, 2, 2); }), Kind::IndexOutOfRange);
  EXPECT_EQ(kind_of([&] { (void)s.select(1, 0, 4); }), Kind::IndexOutOfRange);
}

TEST(NDSlice, ErrorsSayWhatWasExpectedAndFound) {
  try {
    NDSlice(0, {2, 2}, {2, 2});
    FAIL();
  } catch (const SliceError& e) {
    EXPECT_NE(std::string(e.what()).find("expected distinct strides, found stride 2 in dimensions 0 and 1"),
              std::string::npos)
        << e.what();
  }
  try {
    (void)NDSlice::row_major({2, 3}).index(17);
    FAIL();
  } catch (const SliceError& e) {
    EXPECT_NE(std::string(e.what()).find("value 17 is not in the slice"), std::string::npos) << e.what();
  }
}

TEST(NDSlice, SelectThatLeavesASizeOneDimensionWithARepeatedStrideIsValid) {
  NDSlice s = NDSlice::row_major({2, 4});  // strides 4, 1
  NDSlice sel = s.select(1, 0, 4, 4);      // one column, stride 4 (same as dim 0)
  EXPECT_EQ(sel.to_vector(), (std::vector<Int>{0, 4}));
}

// A random valid slice: nested strides with random gaps, dimensions in a random order.
NDSlice random_slice(std::mt19937_64& rng) {
  std::uniform_int_distribution<int> ndim_d(0, 4), size_d(1, 4), gap_d(1, 3), offset_d(0, 50);
  const int ndim = ndim_d(rng);
  std::vector<Int> sizes(static_cast<std::size_t>(ndim)), strides(static_cast<std::size_t>(ndim));
  std::vector<std::size_t> order(sizes.size());
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  Int stride = gap_d(rng);
  for (std::size_t d : order) {
    sizes[d] = size_d(rng);
    strides[d] = stride;
    stride = stride * sizes[d] * gap_d(rng);
  }
  return NDSlice(offset_d(rng), sizes, strides);
}

// Every coordinate vector, in row-major order, with its value computed directly.
std::vector<std::pair<std::vector<Int>, Int>> brute_force(const NDSlice& s) {
  std::vector<std::pair<std::vector<Int>, Int>> out;
  std::vector<Int> c(s.ndim(), 0);
  for (Int i = 0; i < s.len(); ++i) {
    Int v = s.offset();
    for (std::size_t d = 0; d < s.ndim(); ++d) v += c[d] * s.strides()[d];
    out.emplace_back(c, v);
    for (std::size_t d = s.ndim(); d-- > 0;) {
      if (++c[d] < s.sizes()[d]) break;
      c[d] = 0;
    }
  }
  return out;
}

TEST(NDSlice, RandomizedProperties) {
  std::mt19937_64 rng(20261129);
  for (int trial = 0; trial < 1500; ++trial) {
    const NDSlice s = random_slice(rng);
    SCOPED_TRACE(s.to_string());
    const auto expected = brute_force(s);
    ASSERT_EQ(static_cast<Int>(expected.size()), s.len());
    std::set<Int> members;
    Int i = 0;
    for (Int v : s) {
      const auto& [coords, value] = expected[static_cast<std::size_t>(i)];
      ASSERT_EQ(v, value);
      ASSERT_EQ(s[i], v);
      ASSERT_EQ(s.index(v), i);
      ASSERT_EQ(s.coordinates(v), coords);
      ASSERT_EQ(s.location(coords), v);
      ASSERT_TRUE(s.contains(v));
      members.insert(v);
      ++i;
    }
    ASSERT_EQ(i, s.len());
    ASSERT_EQ(members.size(), expected.size()) << "values must be distinct";

    // Non-members and out-of-range indices raise.
    const Int hi = *members.rbegin() + 3;
    for (Int v = 0; v <= hi; ++v) {
      if (members.count(v)) continue;
      ASSERT_FALSE(s.contains(v));
      ASSERT_EQ(kind_of([&] { (void)s.index(v); }), Kind::NotInSlice);
    }
    ASSERT_EQ(kind_of([&] { (void)s[s.len()]; }), Kind::IndexOutOfRange);

    // at and select agree with brute force.
    for (std::size_t d = 0; d < s.ndim(); ++d) {
      const Int size = s.sizes()[d];
      std::uniform_int_distribution<Int> pick(0, size - 1);
      const Int k = pick(rng);
      std::vector<Int> want;
      for (const auto& [coords, value] : expected) {
        if (coords[d] == k) want.push_back(value);
      }
      ASSERT_EQ(s.at(d, k).to_vector(), want);

      const Int begin = pick(rng);
      std::uniform_int_distribution<Int> end_d(begin + 1, size), step_d(1, 3);
      const Int end = end_d(rng), step = step_d(rng);
      want.clear();
      for (const auto& [coords, value] : expected) {
        if (coords[d] >= begin && coords[d] < end && (coords[d] - begin) % step == 0) want.push_back(value);
      }
      ASSERT_EQ(s.select(d, begin, end, step).to_vector(), want);
    }
  }
}

// Arbitrary strides: the constructor accepts exactly the slices whose coordinates map to
// distinct values (sizes > 1 with distinct strides), and then every property holds.
TEST(NDSlice, ArbitraryStridesAreAcceptedExactlyWhenValuesAreDistinct) {
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<int> ndim_d(1, 3), size_d(1, 4), stride_d(1, 7);
  int accepted = 0, rejected = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    const int ndim = ndim_d(rng);
    std::vector<Int> sizes, strides;
    for (int d = 0; d < ndim; ++d) {
      sizes.push_back(size_d(rng));
      strides.push_back(stride_d(rng));
    }
    std::vector<Int> values;
    std::vector<Int> c(sizes.size(), 0);
    bool done = false;
    while (!done) {
      Int v = 5;
      for (std::size_t d = 0; d < sizes.size(); ++d) v += c[d] * strides[d];
      values.push_back(v);
      done = true;
      for (std::size_t d = sizes.size(); d-- > 0;) {
        if (++c[d] < sizes[d]) {
          done = false;
          break;
        }
        c[d] = 0;
      }
    }
    std::vector<Int> sorted = values;
    std::sort(sorted.begin(), sorted.end());
    const bool distinct = std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end();
    if (!distinct) {
      ++rejected;
      const Kind k = kind_of([&] { NDSlice(5, sizes, strides); });
      ASSERT_TRUE(k == Kind::Overlapping || k == Kind::NonUniqueStrides);
      continue;
    }
    ++accepted;
    const NDSlice s(5, sizes, strides);
    ASSERT_EQ(s.to_vector(), values);
    for (Int i = 0; i < s.len(); ++i) ASSERT_EQ(s.index(values[static_cast<std::size_t>(i)]), i);
    for (Int v = 0; v < sorted.back() + 2; ++v) {
      ASSERT_EQ(s.contains(v), std::binary_search(sorted.begin(), sorted.end(), v)) << s.to_string() << " value " << v;
    }
  }
  EXPECT_GT(accepted, 100);
  EXPECT_GT(rejected, 100);
}

}  // namespace
}  // namespace meshrt
