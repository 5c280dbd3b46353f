// Helpers for tests that check an error's text.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "meshrt/error.hpp"

namespace meshrt::test {

// The text of the E `f` throws; a test failure (and "") if it throws none.
template <class E>
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an exception";
  return {};
}

// The text of the UsageError `f` throws; a test failure (and "") if it throws none.
inline std::string usage_error(const std::function<void()>& f) {
  return error_of<UsageError>(f);
}

// The text of any std::exception `f` throws, or "(no exception)" (for tests that compare
// the texts of several outcomes).
template <class F>
std::string error_text(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no exception)";
}

inline void expect_contains(const std::string& text, const std::string& part) {
  EXPECT_NE(text.find(part), std::string::npos) << "'" << part << "' not in: " << text;
}

}  // namespace meshrt::test
