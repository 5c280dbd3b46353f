// meshrt's tunables. Every MESHRT_* environment setting is declared once, below, as a
// typed handle with its default, the kind of value it takes and its meaning; each is read
// only through its handle (kGroupTimeout.get()), so it has one meaning everywhere.
// meshrt-info prints the table, and docs/settings.md is generated from it.
#pragma once

#include <chrono>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace meshrt::settings {

using Seconds = std::chrono::duration<double>;

// The kind of value a setting takes; it decides how the text is read and refused.
enum class Kind { Text, Integer, Duration, Boolean, Choice };

// What every setting has, whatever its type: one row of the table.
struct Info {
  std::string_view name;           // the environment variable, e.g. "MESHRT_LOG_LEVEL"
  std::string_view default_value;  // as text; "" means unset
  std::string_view description;
  Kind kind = Kind::Text;
  std::int64_t min = std::numeric_limits<std::int64_t>::min();  // Integer: the least value taken
  std::int64_t max = std::numeric_limits<std::int64_t>::max();  // Integer: the greatest
  bool zero_is_no_limit = false;                                // Duration: "0" (as "inf" and "none") means no limit
  double min_seconds = 0;    // Duration: the least value taken (but 0 where it means no limit)
  double max_seconds = 1e9;  // Duration: the greatest
  std::string_view choices;  // Choice: the values taken, '|'-separated, matched in any case
};

// A setting whose value in force is a T: std::string (Text, Choice), std::int64_t
// (Integer), Seconds (Duration) or bool (Boolean). Text that does not read as the setting's kind
// raises UsageError naming the setting, the text found and what it takes.
template <class T>
struct Setting {
  // Refuses, when meshrt compiles, a handle whose T does not read its kind.
  consteval Setting(Info i) : info(i) {
    const bool fits = std::is_same_v<T, std::string>    ? i.kind == Kind::Text || i.kind == Kind::Choice
                      : std::is_same_v<T, std::int64_t> ? i.kind == Kind::Integer
                      : std::is_same_v<T, Seconds>      ? i.kind == Kind::Duration
                      : std::is_same_v<T, bool>         ? i.kind == Kind::Boolean
                                                        : false;
    if (!fits) throw "a setting's type does not read its kind";
  }

  Info info;
  // The environment's value, else the default. A setting whose default is unset ("") is
  // read with from_environment() (Text ones with either).
  T get() const;
  // The environment's value, or nullopt when unset (or set to "").
  std::optional<T> from_environment() const;
};

// clang-format off
inline constexpr Setting<std::string> kLogLevel{{
    .name = "MESHRT_LOG_LEVEL", .default_value = "warning",
    .description = "Least severe log level written",
    .kind = Kind::Choice, .choices = "trace|debug|info|warning|warn|error|fatal|off"}};
inline constexpr Setting<std::string> kLogDir{{
    .name = "MESHRT_LOG_DIR", .default_value = "",
    .description = "If set, each rank also logs to <dir>/meshrt.rank<N>.<host>.log"}};
inline constexpr Setting<std::string> kTrace{{
    .name = "MESHRT_TRACE", .default_value = "",
    .description = "If set, every rank records what it does (controller calls and waits, each worker's commands) "
                   "and rank 0 writes one Chrome-trace JSON file here at the end of the run, clocks aligned "
                   "(docs/running.md, \"A timeline of the run\"); a file rank 0 cannot create is refused at start"}};
inline constexpr Setting<std::int64_t> kTraceEvents{{
    .name = "MESHRT_TRACE_EVENTS", .default_value = "262144",
    .description = "With MESHRT_TRACE: the events each thread keeps, the newest (64 bytes each, mapped when the "
                   "thread records its first; the file says how many older ones were dropped). At most a 1 GiB "
                   "ring, and refused at start when the rings of this node's ranks would not fit in half its memory",
    .kind = Kind::Integer, .min = 4096, .max = std::int64_t{1} << 24}};
inline constexpr Setting<Seconds> kGroupTimeout{{
    .name = "MESHRT_GROUP_TIMEOUT", .default_value = "300",
    .description = "Default timeout of StatelessGroup operations, and the limit on creating a mesh's, a line's or a "
                   "send's communicators (MPI and device) and make_nccl_comm's, seconds (0 = none)",
    .kind = Kind::Duration, .zero_is_no_limit = true}};
inline constexpr Setting<std::int64_t> kGroupChunkBytes{{
    .name = "MESHRT_GROUP_CHUNK_BYTES", .default_value = "1073741824",
    .description = "Largest single MPI message of a StatelessGroup transfer; bigger objects are chunked",
    .kind = Kind::Integer, .min = 1, .max = std::numeric_limits<std::int32_t>::max()}};
inline constexpr Setting<std::int64_t> kFanout{{
    .name = "MESHRT_FANOUT", .default_value = "8",
    .description = "Children per node of the tree that forwards a batch to a mesh's ranks (0 = the controller sends "
                   "every batch to every rank itself, with no envelope)",
    .kind = Kind::Integer, .min = 0, .max = 65536}};
inline constexpr Setting<std::int64_t> kFanoutThreshold{{
    .name = "MESHRT_FANOUT_THRESHOLD", .default_value = "16",
    .description = "A batch for more ranks than this goes down the fan-out tree, and a job with more workers than "
                   "this sends Status up the status tree; below it the controller talks to each rank itself",
    .kind = Kind::Integer, .min = 0}};
inline constexpr Setting<std::int64_t> kFlightRecorder{{
    .name = "MESHRT_FLIGHT_RECORDER", .default_value = "1000",
    .description = "Commands each worker keeps in its flight recorder (about 200 bytes each)",
    .kind = Kind::Integer, .min = 1, .max = 1'000'000}};
inline constexpr Setting<std::string> kTimeoutAction{{
    .name = "MESHRT_TIMEOUT_ACTION", .default_value = "raise",
    .description = "What a Future/synchronize timeout does after its desync report: raise (TimeoutError) or abort "
                   "(the job)",
    .kind = Kind::Choice, .choices = "raise|abort"}};
inline constexpr Setting<Seconds> kStallWarning{{
    .name = "MESHRT_STALL_WARNING", .default_value = "300",
    .description = "Seconds a controller wait (Future::get, synchronize, ...) may last before its desync report is "
                   "printed to stderr, once per wait, while the wait goes on: a hang explains itself without a "
                   "timeout. Waits with a shorter timeout of their own report at it instead (0 = never)",
    .kind = Kind::Duration, .zero_is_no_limit = true, .min_seconds = 1}};
inline constexpr Setting<bool> kSignalHandler{{
    .name = "MESHRT_SIGNAL_HANDLER", .default_value = "1",
    .description = "On a fatal signal, print the rank, the command and a backtrace, then MPI_Abort the job; on "
                   "SIGTERM (scancel, a time limit), print the rank's last commands, then end as SIGTERM does "
                   "(0 = off)",
    .kind = Kind::Boolean}};
inline constexpr Setting<Seconds> kPeerTimeout{{
    .name = "MESHRT_PEER_TIMEOUT", .default_value = "60",
    .description = "Seconds a rank may go unheard before the next rank names it and its host and ends the job: each "
                   "rank sends the next a heartbeat every second from a thread of its own, so this catches a lost "
                   "node or a stopped process, which MPI never reports (0 = off). Values under 2 s are refused: "
                   "a rank's heartbeat thread that is not scheduled for a moment on a busy node must not end a "
                   "healthy job",
    .kind = Kind::Duration, .zero_is_no_limit = true, .min_seconds = 2}};
inline constexpr Setting<Seconds> kStartTimeout{{
    .name = "MESHRT_START_TIMEOUT", .default_value = "120",
    .description = "Seconds each rank waits at start for every other rank to call meshrt::run (or Runtime); then "
                   "rank 0 names the ranks that never did and ends the job, instead of every rank waiting for "
                   "ever (0 = no limit)",
    .kind = Kind::Duration, .zero_is_no_limit = true}};
inline constexpr Setting<Seconds> kStateQueryTimeout{{
    .name = "MESHRT_STATE_QUERY_TIMEOUT", .default_value = "2",
    .description = "Seconds the controller waits for workers' answers when it builds a desync report or dumps the "
                   "flight recorders (0 = no wait: only answers already there are used)",
    .kind = Kind::Duration, .max_seconds = 60}};
inline constexpr Setting<std::string> kWorkerBlocking{{
    .name = "MESHRT_WORKER_BLOCKING", .default_value = "auto",
    .description = "How a worker runs CPU collectives and sends below the status tree: auto (the blocking MPI call "
                   "when this node has a core per rank, else non-blocking with back-off so a waiting rank leaves "
                   "the core to its peers), 1 (always blocking), 0 (never)",
    .kind = Kind::Choice, .choices = "auto|1|0|true|false|yes|no|on|off"}};
inline constexpr Setting<std::int64_t> kCommPoolBytes{{
    .name = "MESHRT_COMM_POOL_BYTES", .default_value = "",
    .description = "Bytes of freed CPU collective outputs (256 KiB and up) each rank keeps warm for reuse (0 = none; "
                   "unset: min(1 GiB, an eighth of physical memory per core)); Controller::release_cached_memory() "
                   "frees them",
    .kind = Kind::Integer, .min = 0}};
inline constexpr Setting<std::string> kAccelerator{{
    .name = "MESHRT_ACCELERATOR", .default_value = "auto",
    .description = "The job's accelerator: auto (cuda if built with CUDA and a device is visible, else none), cuda, "
                   "emulated or none",
    .kind = Kind::Choice, .choices = "auto|cuda|emulated|none"}};
inline constexpr Setting<std::int64_t> kDevice{{
    .name = "MESHRT_DEVICE", .default_value = "",
    .description = "This rank's device index (default: the local rank modulo the node's device count)",
    .kind = Kind::Integer, .min = 0}};
inline constexpr Setting<std::int64_t> kEmulatedDevices{{
    .name = "MESHRT_EMULATED_DEVICES", .default_value = "8",
    .description = "Devices per node of the emulated accelerator",
    .kind = Kind::Integer, .min = 1, .max = 1024}};
inline constexpr Setting<std::string> kEmulatedVisibleDevices{{
    .name = "MESHRT_EMULATED_VISIBLE_DEVICES", .default_value = "",
    .description = "The emulated devices of this node this process sees, as CUDA_VISIBLE_DEVICES for cuda: "
                   "comma-separated, distinct, in 0..MESHRT_EMULATED_DEVICES-1; device i is the i-th listed "
                   "(unset: all)"}};
inline constexpr Setting<std::int64_t> kEmulatedDelayUs{{
    .name = "MESHRT_EMULATED_DELAY_US", .default_value = "0",
    .description = "Microseconds the emulated accelerator sleeps before each stream operation (makes missing "
                   "orderings show)",
    .kind = Kind::Integer, .min = 0, .max = 1'000'000}};
inline constexpr Setting<Seconds> kDeviceTimeout{{
    .name = "MESHRT_DEVICE_TIMEOUT", .default_value = "300",
    .description = "Seconds a device collective or send may wait for its peers once its stream reached it; then its "
                   "communicator is aborted and the command fails (0 = none)",
    .kind = Kind::Duration, .zero_is_no_limit = true}};
inline constexpr Setting<std::int64_t> kDevicePoolBytes{{
    .name = "MESHRT_DEVICE_POOL_BYTES", .default_value = "1073741824",
    .description = "Bytes of freed device memory each rank's stream-ordered pool keeps cached for reuse",
    .kind = Kind::Integer, .min = 0}};
inline constexpr Setting<bool> kRequireGpu{{
    .name = "MESHRT_REQUIRE_GPU", .default_value = "0",
    .description = "1 turns every test skip for a missing GPU into a failure naming why (for GPU nodes; "
                   "scripts/gpu-check.sh)",
    .kind = Kind::Boolean}};
inline constexpr Setting<Seconds> kTestWatchdog{{
    .name = "MESHRT_TEST_WATCHDOG", .default_value = "",
    .description = "Seconds after which an MPI test binary names the running test and aborts the job (unset or 0 = "
                   "no watchdog)",
    .kind = Kind::Duration, .zero_is_no_limit = true}};
inline constexpr Setting<bool> kTestAllRanksOutput{{
    .name = "MESHRT_TEST_ALL_RANKS_OUTPUT", .default_value = "0",
    .description = "1: every rank of an MPI test binary prints GoogleTest's report, not rank 0 alone",
    .kind = Kind::Boolean}};
inline constexpr Setting<std::int64_t> kSoakCommands{{
    .name = "MESHRT_SOAK_COMMANDS", .default_value = "",
    .description = "Commands meshrt-bench soak runs (default: 1000000, 100000 with --quick)",
    .kind = Kind::Integer, .min = 1}};
inline constexpr Setting<bool> kSoakTrace{{
    .name = "MESHRT_SOAK_TRACE", .default_value = "0",
    .description = "1: meshrt-bench soak prints every rank's resident memory at every synchronize",
    .kind = Kind::Boolean}};
// clang-format on

// The whole table, in declaration order (every handle above, once).
std::span<const Info> all();

// MESHRT_* environment variables that meshrt's own scripts, tests and tools read, not the
// runtime (scripts/, tests/, docs/building.md): the start's check for misspelled settings
// passes them by. A name ending in '_' stands for every name that begins with it.
inline constexpr std::string_view kNotSettings[] = {
    "MESHRT_BUILD_DIR",    "MESHRT_CMAKE_ARGS",     "MESHRT_JOBS",         "MESHRT_MPICH_BUILD_DIR",
    "MESHRT_FUZZ_SECONDS", "MESHRT_FUZZ_BUILD_DIR", "MESHRT_CLANG_FORMAT", "MESHRT_PYTHON_TEST_FUNCTIONS",
    "MESHRT_FIXTURE",      "MESHRT_INFO",           "MESHRT_INFO_ARGS",    "MESHRT_NCCL_LIB_DIR",
    "MESHRT_GPU_BUNDLE",   "MESHRT_BUNDLE",         "MESHRT_ROOT",         "MESHRT_TEST_",
    "MESHRT_CI_",          "MESHRT_GPU_CHECK_",     "MESHRT_BUNDLE_",      "MESHRT_PIP_",
};

// A MESHRT_* variable of the environment that is neither a setting nor in kNotSettings,
// with the setting whose name is closest to it ("" when none is close): most often a typo.
struct UnknownVariable {
  std::string name;
  std::string closest;
};
// `environment`: "NAME=value" entries (the process's environ when empty).
std::vector<UnknownVariable> unknown_variables(std::span<const char* const> environment = {});
// One line per unknown variable, saying it is ignored and what was likely meant ("" when none).
std::string unknown_variables_warning(const std::vector<UnknownVariable>& unknown);

// The declared setting `name`; throws UsageError for a name that is not in the table.
const Info& find(std::string_view name);

// What a setting takes, in words: "an integer >= 0", "one of raise, abort", ...
std::string takes(const Info& setting);

// The environment's text of a setting, or nullopt when unset (or set to ""), unread.
std::optional<std::string> text_from_environment(const Info& setting);

// Reads every setting the environment sets (and every default) as its kind; the first
// that does not read raises UsageError. Runtime's start calls it, so that a bad value is
// reported at start, whichever part of meshrt would read it later.
void validate_all();

// A boolean's text, any case: 1/true/yes/on, 0/false/no/off or empty; nullopt for anything
// else (the rule of Kind::Boolean, for settings that take more than a boolean).
std::optional<bool> parse_bool(std::string_view text);

}  // namespace meshrt::settings
