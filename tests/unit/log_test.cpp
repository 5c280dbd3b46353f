#include "meshrt/log.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "meshrt/error.hpp"

namespace meshrt {
namespace {

TEST(Log, ParseLevel) {
  EXPECT_EQ(log::parse_level("INFO"), log::Level::info);
  EXPECT_EQ(log::parse_level("warn"), log::Level::warning);
  EXPECT_THROW(log::parse_level("loud"), UsageError);
}

TEST(Log, LevelFiltersAndFileSinkTagsRankAndRole) {
  const auto dir = std::filesystem::temp_directory_path() / ("meshrt_log_test_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  setenv("MESHRT_LOG_DIR", dir.c_str(), 1);
  setenv("MESHRT_LOG_LEVEL", "info", 1);
  log::init(3);
  log::set_thread_role("worker 3");
  MESHRT_LOG(debug) << "hidden record";
  MESHRT_LOG(info) << "visible record " << 42;
  MESHRT_LOG(error) << "an error record";
  EXPECT_TRUE(log::file_name(3).starts_with("meshrt.rank3.")) << log::file_name(3);
  EXPECT_TRUE(log::file_name(3).ends_with(".log")) << log::file_name(3);
  std::ifstream in(dir / log::file_name(3));
  std::stringstream text;
  text << in.rdbuf();
  const std::string s = text.str();
  EXPECT_NE(s.find("[meshrt info rank 3 worker 3] visible record 42"), std::string::npos) << s;
  EXPECT_NE(s.find("[meshrt error rank 3 worker 3] an error record (log_test.cpp:"), std::string::npos) << s;
  EXPECT_EQ(s.find("hidden record"), std::string::npos) << s;
  unsetenv("MESHRT_LOG_DIR");
  unsetenv("MESHRT_LOG_LEVEL");
  log::init(3);
  std::filesystem::remove_all(dir);
}

TEST(Log, BadLevelInEnvironmentIsAClearError) {
  setenv("MESHRT_LOG_LEVEL", "chatty", 1);
  try {
    log::init(0);
    FAIL();
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("found \"chatty\""), std::string::npos) << e.what();
  }
  unsetenv("MESHRT_LOG_LEVEL");
}

}  // namespace
}  // namespace meshrt
