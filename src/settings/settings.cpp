#include "meshrt/internal/settings.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <limits>

#include "common/assert.hpp"
#include "common/edit_distance.hpp"
#include "meshrt/error.hpp"

namespace meshrt::settings {
namespace {

// The table: every handle of settings.hpp, in the order meshrt-info prints them. A handle
// that is read but missing here is an internal error at its first read (checked_info).
// clang-format off
constexpr std::array kTable{
    kLogLevel.info,
    kLogDir.info,
    kTrace.info,
    kTraceEvents.info,
    kGroupTimeout.info,
    kGroupChunkBytes.info,
    kFanout.info,
    kFanoutThreshold.info,
    kFlightRecorder.info,
    kTimeoutAction.info,
    kStallWarning.info,
    kSignalHandler.info,
    kPeerTimeout.info,
    kStartTimeout.info,
    kStateQueryTimeout.info,
    kWorkerBlocking.info,
    kCommPoolBytes.info,
    kAccelerator.info,
    kDevice.info,
    kEmulatedDevices.info,
    kEmulatedVisibleDevices.info,
    kEmulatedDelayUs.info,
    kDeviceTimeout.info,
    kDevicePoolBytes.info,
    kRequireGpu.info,
    kTestWatchdog.info,
    kTestAllRanksOutput.info,
    kSoakCommands.info,
    kSoakTrace.info,
};
// clang-format on

std::string lower(std::string_view text) {
  std::string out(text);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
  return out;
}

[[noreturn]] void bad_value(const Info& s, std::string_view found) {
  throw UsageError(fmt::format("setting {}: expected {}, found \"{}\" (default \"{}\")", s.name, takes(s), found,
                               s.default_value.empty() ? "unset" : s.default_value));
}

std::int64_t read_integer(const Info& s, const std::string& text) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || errno != 0 || *end != '\0' || v < s.min || v > s.max) bad_value(s, text);
  return v;
}

Seconds read_seconds(const Info& s, const std::string& text) {
  const std::string t = lower(text);
  if (s.zero_is_no_limit && (t == "inf" || t == "none")) return Seconds::max();
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  // Finite only: an infinite or NaN duration would overflow the deadlines built from it.
  if (text.empty() || errno != 0 || *end != '\0' || !(v >= 0) || v > s.max_seconds) bad_value(s, text);
  if (v == 0 && s.zero_is_no_limit) return Seconds::max();
  if (v < s.min_seconds) bad_value(s, text);
  return Seconds(v);
}

bool read_boolean(const Info& s, const std::string& text) {
  if (const std::optional<bool> b = parse_bool(text)) return *b;
  bad_value(s, text);
}

std::string read_choice(const Info& s, const std::string& text) {
  const std::string t = lower(text);
  for (std::string_view rest = s.choices; !rest.empty();) {
    const auto bar = rest.find('|');
    const std::string_view option = rest.substr(0, bar);
    if (option == t) return std::string(option);
    rest = bar == std::string_view::npos ? std::string_view() : rest.substr(bar + 1);
  }
  bad_value(s, text);
}

// Reads `text` as the value of `s`, by its kind.
template <class T>
T read(const Info& s, const std::string& text);

template <>
std::string read<std::string>(const Info& s, const std::string& text) {
  return s.kind == Kind::Choice ? read_choice(s, text) : text;
}
template <>
std::int64_t read<std::int64_t>(const Info& s, const std::string& text) {
  return read_integer(s, text);
}
template <>
Seconds read<Seconds>(const Info& s, const std::string& text) {
  return read_seconds(s, text);
}
template <>
bool read<bool>(const Info& s, const std::string& text) {
  return read_boolean(s, text);
}

// The handle's row of the table; a handle not in the table is meshrt's own mistake.
const Info& checked_info(const Info& info) {
  for (const Info& row : kTable) {
    if (row.name == info.name) return row;
  }
  MESHRT_INTERNAL(
      fmt::format("setting {} is declared in settings.hpp but not in the table of settings.cpp", info.name));
}

}  // namespace

std::span<const Info> all() {
  return kTable;
}

const Info& find(std::string_view name) {
  auto it = std::find_if(kTable.begin(), kTable.end(), [&](const Info& s) { return s.name == name; });
  if (it == kTable.end()) {
    throw UsageError(fmt::format("unknown setting {}: it is not in meshrt's settings table", name));
  }
  return *it;
}

std::string takes(const Info& s) {
  switch (s.kind) {
    case Kind::Text:
      return "any text";
    case Kind::Integer:
      if (s.max != std::numeric_limits<std::int64_t>::max()) return fmt::format("an integer in {}..{}", s.min, s.max);
      if (s.min != std::numeric_limits<std::int64_t>::min()) return fmt::format("an integer >= {}", s.min);
      return "an integer";
    case Kind::Duration: {
      const std::string range = s.max_seconds < 1e9 ? fmt::format("seconds in {:g}..{:g}", s.min_seconds, s.max_seconds)
                                                    : fmt::format("seconds >= {:g}", s.min_seconds);
      return range + (s.zero_is_no_limit ? " (fractions allowed; 0, inf or none: no limit)" : " (fractions allowed)");
    }
    case Kind::Boolean:
      return "a boolean: 1/0, true/false, yes/no, on/off";
    case Kind::Choice: {
      std::string out = "one of ";
      for (char c : s.choices) out += c == '|' ? std::string(", ") : std::string(1, c);
      return out;
    }
  }
  MESHRT_INTERNAL(fmt::format("setting {}: a kind without its case", s.name));
}

std::optional<std::string> text_from_environment(const Info& s) {
  if (const char* v = std::getenv(std::string(s.name).c_str()); v != nullptr && *v != '\0') return std::string(v);
  return std::nullopt;
}

template <class T>
std::optional<T> Setting<T>::from_environment() const {
  const Info& s = checked_info(info);
  if (auto text = text_from_environment(s)) return read<T>(s, *text);
  return std::nullopt;
}

template <class T>
T Setting<T>::get() const {
  const Info& s = checked_info(info);
  if (auto text = text_from_environment(s)) return read<T>(s, *text);
  if (s.default_value.empty() && s.kind != Kind::Text) {
    MESHRT_INTERNAL(fmt::format("setting {} has no default: read it with from_environment()", s.name));
  }
  return read<T>(s, std::string(s.default_value));
}

template std::string Setting<std::string>::get() const;
template std::int64_t Setting<std::int64_t>::get() const;
template Seconds Setting<Seconds>::get() const;
template bool Setting<bool>::get() const;
template std::optional<std::string> Setting<std::string>::from_environment() const;
template std::optional<std::int64_t> Setting<std::int64_t>::from_environment() const;
template std::optional<Seconds> Setting<Seconds>::from_environment() const;
template std::optional<bool> Setting<bool>::from_environment() const;

void validate_all() {
  for (const Info& s : kTable) {
    const std::string text = text_from_environment(s).value_or(std::string(s.default_value));
    if (text.empty()) continue;  // unset, with no default
    switch (s.kind) {
      case Kind::Text:
        break;
      case Kind::Integer:
        (void)read_integer(s, text);
        break;
      case Kind::Duration:
        (void)read_seconds(s, text);
        break;
      case Kind::Boolean:
        (void)read_boolean(s, text);
        break;
      case Kind::Choice:
        (void)read_choice(s, text);
        break;
    }
  }
}

std::vector<UnknownVariable> unknown_variables(std::span<const char* const> environment) {
  std::vector<const char*> own;
  if (environment.empty()) {
    for (char** e = environ; e != nullptr && *e != nullptr; ++e) own.push_back(*e);
    environment = own;
  }
  std::vector<UnknownVariable> out;
  for (const char* entry : environment) {
    const std::string_view text(entry);
    const std::string_view name = text.substr(0, text.find('='));
    if (!name.starts_with("MESHRT_")) continue;
    if (std::any_of(kTable.begin(), kTable.end(), [&](const Info& s) { return s.name == name; })) continue;
    if (std::any_of(std::begin(kNotSettings), std::end(kNotSettings), [&](std::string_view known) {
          return known.ends_with('_') ? name.starts_with(known) : name == known;
        })) {
      continue;
    }
    // The closest setting, if it is close: a few letters off, as a typo is.
    std::size_t best = std::max<std::size_t>(2, (name.size() - 7) / 3) + 1;
    std::string closest;
    for (const Info& s : kTable) {
      const std::size_t d = detail::edit_distance(name, s.name);
      if (d < best) {
        best = d;
        closest = s.name;
      }
    }
    out.push_back({std::string(name), closest});
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  return out;
}

std::string unknown_variables_warning(const std::vector<UnknownVariable>& unknown) {
  std::string out;
  for (const UnknownVariable& u : unknown) {
    out += fmt::format("meshrt: {} is not a meshrt setting and is ignored{}; docs/settings.md lists the settings\n",
                       u.name, u.closest.empty() ? std::string() : fmt::format(" (did you mean {}?)", u.closest));
  }
  return out;
}

std::optional<bool> parse_bool(std::string_view value) {
  const std::string text = lower(value);
  if (text == "1" || text == "true" || text == "yes" || text == "on") return true;
  if (text == "0" || text == "false" || text == "no" || text == "off" || text.empty()) return false;
  return std::nullopt;
}

}  // namespace meshrt::settings
