// meshrt's tunables. Every MESHRT_* environment setting is declared once, with its
// default and meaning, in the table in src/settings/settings.cpp; meshrt-info prints it.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace meshrt::settings {

struct Setting {
  std::string_view name;           // the environment variable, e.g. "MESHRT_LOG_LEVEL"
  std::string_view default_value;  // as text; "" means unset
  std::string_view description;
};

// The whole table, in declaration order.
std::span<const Setting> all();

// The declared setting `name`; throws UsageError for a name that is not in the table.
const Setting& find(std::string_view name);

// The environment's value of a declared setting, or nullopt when unset.
std::optional<std::string> from_environment(std::string_view name);

// The value in force: the environment's, else the default.
std::string get(std::string_view name);

// Typed reads; a value that does not parse raises UsageError naming the setting,
// the text found and what was expected.
std::int64_t get_int(std::string_view name);
double get_double(std::string_view name);
bool get_bool(std::string_view name);
// A boolean setting's text, any case: 1/true/yes/on, 0/false/no/off or empty; nullopt for
// anything else (get_bool's rule, for settings that take more than a boolean).
std::optional<bool> parse_bool(std::string_view text);
// Seconds as a duration (fractions allowed); "0" or "inf" mean no limit (returns max()).
std::chrono::duration<double> get_seconds(std::string_view name);

}  // namespace meshrt::settings
