// InternalError (a meshrt bug) apart from UsageError (the caller's mistake): what
// MESHRT_ASSERT and MESHRT_INTERNAL raise, and that it names the file and line.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "common/assert.hpp"
#include "meshrt/group.hpp"

namespace meshrt::test {
namespace {

constexpr int kAssertLine = __LINE__ + 2;  // the MESHRT_ASSERT below
int checked_half(int even) {
  MESHRT_ASSERT(even % 2 == 0, "checked_half takes an even number, found " + std::to_string(even));
  return even / 2;
}

TEST(InternalError, AssertPassesOrRaisesWithFileAndLine) {
  EXPECT_EQ(checked_half(8), 4);
  const int line = kAssertLine;
  try {
    checked_half(7);
    FAIL() << "expected an InternalError";
  } catch (const UsageError&) {
    FAIL() << "an internal error must not be a UsageError";
  } catch (const InternalError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("meshrt internal error (a bug in meshrt, not in the calling program"), std::string::npos)
        << what;
    EXPECT_NE(what.find("expected even % 2 == 0: checked_half takes an even number, found 7"), std::string::npos)
        << what;
    EXPECT_NE(what.find("error_test.cpp:" + std::to_string(line)), std::string::npos) << what;
    EXPECT_EQ(e.line(), line);
    EXPECT_TRUE(e.file().ends_with("error_test.cpp")) << e.file();
  }
}

TEST(InternalError, UnreachablePathIsAnErrorButNotAUsageError) {
  auto f = [] { MESHRT_INTERNAL("unreachable: a kind added without its case"); };
  EXPECT_THROW(f(), InternalError);
  EXPECT_THROW(f(), Error);
  bool usage = false;
  try {
    f();
  } catch (const UsageError&) {
    usage = true;
  } catch (const Error&) {
  }
  EXPECT_FALSE(usage);
}

// Type names in group messages read as code writes them.
TEST(TypeNames, ReadAsCodeWritesThem) {
  EXPECT_EQ(detail::type_tag<std::string>().name, "std::string");
  EXPECT_EQ(detail::type_tag<std::vector<std::string>>().name, "std::vector<std::string>");
  using Map = std::map<std::string, std::vector<int>>;
  EXPECT_EQ(detail::type_tag<Map>().name, "std::map<std::string, std::vector<int>>");
  EXPECT_EQ(detail::readable_type_name("std::unique_ptr<int, std::default_delete<int> >"), "std::unique_ptr<int>");
}

}  // namespace
}  // namespace meshrt::test
