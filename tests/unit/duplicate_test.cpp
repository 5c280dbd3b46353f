// duplicate_a.cpp and duplicate_b.cpp both register "test.same_name" at start-up. The
// program must not die in a static initialiser; the first use of the table must fail,
// naming both registration places.
#include <gtest/gtest.h>

#include "meshrt/functions.hpp"

extern const int duplicate_a_line;
extern const int duplicate_b_line;

namespace meshrt {
namespace {

void expect_refused(const std::function<void()>& f) {
  try {
    f();
    ADD_FAILURE() << "expected a UsageError";
  } catch (const UsageError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("remote function 'test.same_name' registered twice"), std::string::npos) << what;
    EXPECT_NE(what.find("duplicate_a.cpp:" + std::to_string(duplicate_a_line)), std::string::npos) << what;
    EXPECT_NE(what.find("duplicate_b.cpp:" + std::to_string(duplicate_b_line)), std::string::npos) << what;
  }
}

TEST(DuplicateRegistration, FirstUseOfTheTableFails) {
  expect_refused([] { functions::check_table(); });
  expect_refused([] { (void)functions::lookup("meshrt.add"); });
  expect_refused([] { (void)functions::names(); });
  expect_refused([] { (void)functions::table_hash(); });
}

}  // namespace
}  // namespace meshrt
