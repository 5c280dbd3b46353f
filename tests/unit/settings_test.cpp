#include "meshrt/internal/settings.hpp"

#include <gtest/gtest.h>

#include <cstdlib>

#include "meshrt/error.hpp"

namespace meshrt {
namespace {

TEST(Settings, TableHasUniqueMeshrtNames) {
  std::set<std::string_view> names;
  for (const auto& s : settings::all()) {
    EXPECT_EQ(s.name.substr(0, 7), "MESHRT_");
    EXPECT_FALSE(s.description.empty()) << s.name;
    EXPECT_TRUE(names.insert(s.name).second) << "duplicate " << s.name;
  }
}

TEST(Settings, DefaultAndEnvironment) {
  unsetenv("MESHRT_GROUP_TIMEOUT");
  EXPECT_EQ(settings::get("MESHRT_GROUP_TIMEOUT"), settings::find("MESHRT_GROUP_TIMEOUT").default_value);
  setenv("MESHRT_GROUP_TIMEOUT", "2.5", 1);
  EXPECT_DOUBLE_EQ(settings::get_seconds("MESHRT_GROUP_TIMEOUT").count(), 2.5);
  setenv("MESHRT_GROUP_TIMEOUT", "0", 1);
  EXPECT_EQ(settings::get_seconds("MESHRT_GROUP_TIMEOUT"), std::chrono::duration<double>::max());
  setenv("MESHRT_GROUP_TIMEOUT", "soon", 1);
  try {
    (void)settings::get_seconds("MESHRT_GROUP_TIMEOUT");
    FAIL();
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("MESHRT_GROUP_TIMEOUT: expected a number, found \"soon\""), std::string::npos)
        << e.what();
  }
  unsetenv("MESHRT_GROUP_TIMEOUT");
}

TEST(Settings, BooleansTakeTheUsualSpellingsInAnyCaseAndRefuseTheRest) {
  for (const char* yes : {"1", "true", "YES", "On"}) EXPECT_EQ(settings::parse_bool(yes), true) << yes;
  for (const char* no : {"0", "False", "no", "OFF", ""}) EXPECT_EQ(settings::parse_bool(no), false) << no;
  EXPECT_EQ(settings::parse_bool("maybe"), std::nullopt);
  EXPECT_EQ(settings::parse_bool("auto"), std::nullopt);
  setenv("MESHRT_SIGNAL_HANDLER", "maybe", 1);
  try {
    (void)settings::get_bool("MESHRT_SIGNAL_HANDLER");
    FAIL();
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("MESHRT_SIGNAL_HANDLER: expected a boolean"), std::string::npos) << e.what();
  }
  setenv("MESHRT_SIGNAL_HANDLER", "no", 1);
  EXPECT_FALSE(settings::get_bool("MESHRT_SIGNAL_HANDLER"));
  unsetenv("MESHRT_SIGNAL_HANDLER");
}

TEST(Settings, UnknownNameIsAnError) {
  EXPECT_THROW((void)settings::get("MESHRT_NO_SUCH_THING"), UsageError);
}

}  // namespace
}  // namespace meshrt
