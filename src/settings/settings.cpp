#include "meshrt/internal/settings.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>
#include <limits>

#include "meshrt/error.hpp"

namespace meshrt::settings {
namespace {

// The one table of meshrt's settings. Add a row here, nowhere else.
constexpr std::array kSettings{
    Setting{"MESHRT_LOG_LEVEL", "warning", "Least severe log level written: trace, debug, info, warning, error, fatal"},
    Setting{"MESHRT_LOG_DIR", "", "If set, each rank also logs to <dir>/meshrt.rank<N>.log"},
    Setting{"MESHRT_GROUP_TIMEOUT", "300", "Default timeout of StatelessGroup operations, seconds (0 = none)"},
    Setting{"MESHRT_GROUP_CHUNK_BYTES", "1073741824",
            "Largest single MPI message of a StatelessGroup transfer; bigger objects are chunked"},
    Setting{"MESHRT_FANOUT", "8",
            "Children per node of the tree that forwards a batch to a mesh's ranks (0 = the controller sends every "
            "batch to every rank itself, with no envelope)"},
    Setting{"MESHRT_FANOUT_THRESHOLD", "16",
            "A batch for more ranks than this goes down the fan-out tree, and a job with more workers than this "
            "sends Status up the status tree; below it the controller talks to each rank itself"},
    Setting{"MESHRT_FLIGHT_RECORDER", "1000", "Commands each worker keeps in its flight recorder"},
    Setting{"MESHRT_TIMEOUT_ACTION", "raise",
            "What a Future/synchronize timeout does after its desync report: raise (TimeoutError) or abort (the job)"},
    Setting{"MESHRT_SIGNAL_HANDLER", "1",
            "On a fatal signal, print the rank, the command and a backtrace, then MPI_Abort the job (0 = off)"},
    Setting{"MESHRT_STATE_QUERY_TIMEOUT", "2",
            "Seconds the controller waits for workers' answers when it builds a desync report"},
    Setting{"MESHRT_WORKER_BLOCKING", "auto",
            "How a worker runs CPU collectives and sends below the status tree: auto (the blocking MPI call when this "
            "node has a core per rank, else non-blocking with back-off so a waiting rank leaves the core to its "
            "peers), 1 (always blocking), 0 (never)"},
    Setting{"MESHRT_COMM_POOL_BYTES", "",
            "Bytes of freed CPU collective outputs (256 KiB and up) each rank keeps warm for reuse (0 = none; unset: "
            "min(1 GiB, an eighth of physical memory per core)); Controller::release_cached_memory() frees them"},
    Setting{"MESHRT_ACCELERATOR", "auto",
            "The job's accelerator: auto (cuda if built with CUDA and a device is visible, else none), cuda, emulated "
            "or none"},
    Setting{"MESHRT_DEVICE", "", "This rank's device index (default: the local rank modulo the node's device count)"},
    Setting{"MESHRT_EMULATED_DEVICES", "8", "Devices per node of the emulated accelerator"},
    Setting{"MESHRT_EMULATED_DELAY_US", "0",
            "Microseconds the emulated accelerator sleeps before each stream operation (makes missing orderings show)"},
    Setting{"MESHRT_DEVICE_TIMEOUT", "300",
            "Seconds a device collective or send may wait for its peers once its stream reached it; then its "
            "communicator is aborted and the command fails (0 = none)"},
    Setting{"MESHRT_DEVICE_POOL_BYTES", "1073741824",
            "Bytes of freed device memory each rank's stream-ordered pool keeps cached for reuse"},
    Setting{
        "MESHRT_REQUIRE_GPU", "0",
        "1 turns every test skip for a missing GPU into a failure naming why (for GPU nodes; scripts/gpu-check.sh)"},
    Setting{"MESHRT_TEST_WATCHDOG", "",
            "Seconds after which an MPI test binary names the running test and aborts the job"},
};

[[noreturn]] void bad_value(const Setting& s, const std::string& found, std::string_view expected) {
  throw UsageError(
      fmt::format("setting {}: expected {}, found \"{}\" (default \"{}\")", s.name, expected, found, s.default_value));
}

}  // namespace

std::span<const Setting> all() {
  return kSettings;
}

const Setting& find(std::string_view name) {
  auto it = std::find_if(kSettings.begin(), kSettings.end(), [&](const Setting& s) { return s.name == name; });
  if (it == kSettings.end()) {
    throw UsageError(fmt::format("unknown setting {}: it is not in meshrt's settings table", name));
  }
  return *it;
}

std::optional<std::string> from_environment(std::string_view name) {
  const Setting& s = find(name);
  if (const char* v = std::getenv(std::string(s.name).c_str()); v != nullptr && *v != '\0') {
    return std::string(v);
  }
  return std::nullopt;
}

std::string get(std::string_view name) {
  if (auto v = from_environment(name)) return *v;
  return std::string(find(name).default_value);
}

std::int64_t get_int(std::string_view name) {
  const std::string text = get(name);
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || errno != 0 || *end != '\0') bad_value(find(name), text, "an integer");
  return v;
}

double get_double(std::string_view name) {
  const std::string text = get(name);
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || errno != 0 || *end != '\0') bad_value(find(name), text, "a number");
  return v;
}

std::optional<bool> parse_bool(std::string_view value) {
  std::string text(value);
  std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return std::tolower(c); });
  if (text == "1" || text == "true" || text == "yes" || text == "on") return true;
  if (text == "0" || text == "false" || text == "no" || text == "off" || text.empty()) return false;
  return std::nullopt;
}

bool get_bool(std::string_view name) {
  const std::string text = get(name);
  if (const std::optional<bool> b = parse_bool(text)) return *b;
  bad_value(find(name), text, "a boolean (1/0, true/false, yes/no, on/off)");
}

std::chrono::duration<double> get_seconds(std::string_view name) {
  const std::string text = get(name);
  if (text == "inf" || text == "none") return std::chrono::duration<double>::max();
  const double v = get_double(name);
  if (v < 0) bad_value(find(name), text, "a duration in seconds >= 0");
  if (v == 0) return std::chrono::duration<double>::max();
  return std::chrono::duration<double>(v);
}

}  // namespace meshrt::settings
