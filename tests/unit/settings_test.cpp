#include "meshrt/internal/settings.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <functional>
#include <set>
#include <string>
#include <utility>

#include "../support/expect_error.hpp"
#include "../support/scoped_env.hpp"
#include "meshrt/error.hpp"

namespace meshrt {
namespace {

using test::ScopedEnv;
using test::usage_error;

// A bad value is refused naming the setting, the text found and what the setting takes,
// both where it is read and at the runtime's start (validate_all).
void expect_refused(const settings::Info& s, const char* bad, const std::function<void()>& read) {
  ScopedEnv env(std::string(s.name), bad);
  const std::string expected =
      "setting " + std::string(s.name) + ": expected " + settings::takes(s) + ", found \"" + bad + "\"";
  EXPECT_NE(usage_error(read).find(expected), std::string::npos) << usage_error(read);
  EXPECT_NE(usage_error(settings::validate_all).find(expected), std::string::npos)
      << usage_error(settings::validate_all);
}

TEST(Settings, TableHasUniqueMeshrtNamesAndEveryDefaultReads) {
  std::set<std::string_view> names;
  for (const auto& s : settings::all()) {
    EXPECT_EQ(s.name.substr(0, 7), "MESHRT_");
    EXPECT_FALSE(s.description.empty()) << s.name;
    EXPECT_FALSE(settings::takes(s).empty()) << s.name;
    EXPECT_TRUE(names.insert(s.name).second) << "duplicate " << s.name;
    EXPECT_EQ(&settings::find(s.name), &s);
  }
  EXPECT_NO_THROW(settings::validate_all());  // the test runs without MESHRT_* set
}

TEST(Settings, DefaultAndEnvironment) {
  unsetenv("MESHRT_GROUP_TIMEOUT");
  EXPECT_EQ(settings::kGroupTimeout.get(), settings::Seconds(300));
  EXPECT_EQ(settings::kGroupTimeout.from_environment(), std::nullopt);
  {
    ScopedEnv env("MESHRT_GROUP_TIMEOUT", "2.5");
    EXPECT_DOUBLE_EQ(settings::kGroupTimeout.get().count(), 2.5);
    EXPECT_EQ(settings::kGroupTimeout.from_environment(), settings::Seconds(2.5));
  }
  {
    ScopedEnv env("MESHRT_GROUP_TIMEOUT", "");  // empty reads as unset
    EXPECT_EQ(settings::kGroupTimeout.get(), settings::Seconds(300));
  }
  EXPECT_EQ(settings::kDevice.from_environment(), std::nullopt);  // no default
  ScopedEnv device("MESHRT_DEVICE", "3");
  EXPECT_EQ(settings::kDevice.from_environment(), 3);
}

TEST(Settings, AnIntegerSettingRefusesTextAndValuesOutOfItsRange) {
  expect_refused(settings::kFanout.info, "eight", [] { (void)settings::kFanout.get(); });
  expect_refused(settings::kFanout.info, "-1", [] { (void)settings::kFanout.get(); });
  expect_refused(settings::kFanout.info, "8x", [] { (void)settings::kFanout.get(); });
  expect_refused(settings::kGroupChunkBytes.info, "4294967296", [] { (void)settings::kGroupChunkBytes.get(); });
  expect_refused(settings::kDevice.info, "-2", [] { (void)settings::kDevice.from_environment(); });
  EXPECT_EQ(settings::takes(settings::kFanoutThreshold.info), "an integer >= 0");
  EXPECT_EQ(settings::takes(settings::kGroupChunkBytes.info), "an integer in 1..2147483647");
  ScopedEnv env("MESHRT_FANOUT", "0");
  EXPECT_EQ(settings::kFanout.get(), 0);
}

TEST(Settings, ASecondsSettingRefusesTextAndNegativeDurations) {
  expect_refused(settings::kGroupTimeout.info, "soon", [] { (void)settings::kGroupTimeout.get(); });
  expect_refused(settings::kGroupTimeout.info, "-1", [] { (void)settings::kGroupTimeout.get(); });
  expect_refused(settings::kTestWatchdog.info, "nan", [] { (void)settings::kTestWatchdog.from_environment(); });
  // "inf" means no limit only where 0 does.
  expect_refused(settings::kStateQueryTimeout.info, "inf", [] { (void)settings::kStateQueryTimeout.get(); });
}

TEST(Settings, ZeroMeansNoLimitOnlyWhereTheSettingSaysSo) {
  for (const char* none : {"0", "inf", "None"}) {
    ScopedEnv env("MESHRT_GROUP_TIMEOUT", none);
    EXPECT_EQ(settings::kGroupTimeout.get(), settings::Seconds::max()) << none;
  }
  EXPECT_NE(settings::kGroupTimeout.info.description.find("0 = none"), std::string_view::npos);
  // MESHRT_STATE_QUERY_TIMEOUT has one meaning of 0 wherever it is read: no wait.
  ScopedEnv env("MESHRT_STATE_QUERY_TIMEOUT", "0");
  EXPECT_EQ(settings::kStateQueryTimeout.get(), settings::Seconds(0));
  EXPECT_NE(settings::kStateQueryTimeout.info.description.find("0 = no wait"), std::string_view::npos);
}

TEST(Settings, BooleansTakeTheUsualSpellingsInAnyCaseAndRefuseTheRest) {
  for (const char* yes : {"1", "true", "YES", "On"}) EXPECT_EQ(settings::parse_bool(yes), true) << yes;
  for (const char* no : {"0", "False", "no", "OFF", ""}) EXPECT_EQ(settings::parse_bool(no), false) << no;
  EXPECT_EQ(settings::parse_bool("maybe"), std::nullopt);
  EXPECT_EQ(settings::parse_bool("auto"), std::nullopt);
  expect_refused(settings::kSignalHandler.info, "maybe", [] { (void)settings::kSignalHandler.get(); });
  ScopedEnv env("MESHRT_SIGNAL_HANDLER", "no");
  EXPECT_FALSE(settings::kSignalHandler.get());
}

TEST(Settings, AChoiceTakesItsOptionsInAnyCaseAndRefusesTheRest) {
  expect_refused(settings::kAccelerator.info, "tpu", [] { (void)settings::kAccelerator.get(); });
  expect_refused(settings::kTimeoutAction.info, "abort!", [] { (void)settings::kTimeoutAction.get(); });
  expect_refused(settings::kWorkerBlocking.info, "maybe", [] { (void)settings::kWorkerBlocking.get(); });
  EXPECT_EQ(settings::takes(settings::kTimeoutAction.info), "one of raise, abort");
  ScopedEnv env("MESHRT_ACCELERATOR", "Emulated");
  EXPECT_EQ(settings::kAccelerator.get(), "emulated");
}

// Each range is what works: the values below were accepted once and ended or starved the
// job they were given to (a ring of 256 GiB per thread, 8 GB of emulated devices, a
// flight recorder too big to allocate, a heartbeat timeout under the ring's own tick, a
// fan-out the envelope's 32 bits truncate to 0, a stream sleeping for ages before each
// operation, a state query that waits longer than any timeout it serves).
TEST(Settings, EachRangeIsWhatWorks) {
  expect_refused(settings::kTraceEvents.info, "4294967296", [] { (void)settings::kTraceEvents.get(); });
  expect_refused(settings::kEmulatedDevices.info, "2147483647", [] { (void)settings::kEmulatedDevices.get(); });
  expect_refused(settings::kFlightRecorder.info, "9223372036854775807", [] { (void)settings::kFlightRecorder.get(); });
  expect_refused(settings::kFanout.info, "4294967296", [] { (void)settings::kFanout.get(); });
  expect_refused(settings::kEmulatedDelayUs.info, "9223372036854775807",
                 [] { (void)settings::kEmulatedDelayUs.get(); });
  expect_refused(settings::kStateQueryTimeout.info, "1e9", [] { (void)settings::kStateQueryTimeout.get(); });
  for (const char* tiny : {"1e-300", "0.01", "0.1", "1.9"}) {
    expect_refused(settings::kPeerTimeout.info, tiny, [] { (void)settings::kPeerTimeout.get(); });
  }
  EXPECT_EQ(settings::takes(settings::kPeerTimeout.info), "seconds >= 2 (fractions allowed; 0, inf or none: no limit)");
  EXPECT_EQ(settings::takes(settings::kStateQueryTimeout.info), "seconds in 0..60 (fractions allowed)");
  // The largest of each range still reads, and 0 still turns the heartbeat ring off.
  {
    ScopedEnv env("MESHRT_PEER_TIMEOUT", "2");
    EXPECT_EQ(settings::kPeerTimeout.get(), settings::Seconds(2));
  }
  {
    ScopedEnv env("MESHRT_PEER_TIMEOUT", "0");
    EXPECT_EQ(settings::kPeerTimeout.get(), settings::Seconds::max());
  }
  ScopedEnv events("MESHRT_TRACE_EVENTS", "16777216");
  EXPECT_EQ(settings::kTraceEvents.get(), 16777216);
  ScopedEnv recorder("MESHRT_FLIGHT_RECORDER", "1000000");
  EXPECT_EQ(settings::kFlightRecorder.get(), 1000000);
}

TEST(Settings, TheStallWarningTakesWholeSecondsOrZeroForNever) {
  EXPECT_EQ(settings::kStallWarning.get(), settings::Seconds(300));
  expect_refused(settings::kStallWarning.info, "0.5", [] { (void)settings::kStallWarning.get(); });
  ScopedEnv env("MESHRT_STALL_WARNING", "0");
  EXPECT_EQ(settings::kStallWarning.get(), settings::Seconds::max());
}

// A MESHRT_* variable that is no setting is most often a typo, which would otherwise be
// ignored without a word; the scripts' and tests' own variables are not settings.
TEST(Settings, UnknownVariablesAreNamedWithTheClosestSetting) {
  const char* const environment[] = {"PATH=/bin",
                                     "MESHRT_TRCE=t.json",
                                     "MESHRT_GROUP_TIMEOUTT=3",
                                     "MESHRT_TRACE=t.json",
                                     "MESHRT_JOBS=2",
                                     "MESHRT_TEST_LARGE=1",
                                     "MESHRT_CI_MPICH=0",
                                     "MESHRT_NOTHING_LIKE_IT=1",
                                     "MESHRT_TEST_WATCHDOG=30"};
  const auto unknown = settings::unknown_variables(environment);
  ASSERT_EQ(unknown.size(), 3u);
  EXPECT_EQ(unknown[0].name, "MESHRT_GROUP_TIMEOUTT");
  EXPECT_EQ(unknown[0].closest, "MESHRT_GROUP_TIMEOUT");
  EXPECT_EQ(unknown[1].name, "MESHRT_NOTHING_LIKE_IT");
  EXPECT_EQ(unknown[1].closest, "");
  EXPECT_EQ(unknown[2].name, "MESHRT_TRCE");
  EXPECT_EQ(unknown[2].closest, "MESHRT_TRACE");
  EXPECT_EQ(settings::unknown_variables_warning(unknown),
            "meshrt: MESHRT_GROUP_TIMEOUTT is not a meshrt setting and is ignored (did you mean "
            "MESHRT_GROUP_TIMEOUT?); docs/settings.md lists the settings\n"
            "meshrt: MESHRT_NOTHING_LIKE_IT is not a meshrt setting and is ignored; docs/settings.md lists the "
            "settings\n"
            "meshrt: MESHRT_TRCE is not a meshrt setting and is ignored (did you mean MESHRT_TRACE?); docs/settings.md "
            "lists the settings\n");
  EXPECT_EQ(settings::unknown_variables_warning({}), "");
}

TEST(Settings, UnknownNameIsAnError) {
  EXPECT_THROW((void)settings::find("MESHRT_NO_SUCH_THING"), UsageError);
}

}  // namespace
}  // namespace meshrt
