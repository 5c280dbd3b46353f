#include "meshrt/log.hpp"

#include <fmt/format.h>

#include <boost/core/null_deleter.hpp>
#include <boost/log/attributes/constant.hpp>
#include <boost/log/core.hpp>
#include <boost/log/expressions.hpp>
#include <boost/log/sinks/sync_frontend.hpp>
#include <boost/log/sinks/text_ostream_backend.hpp>
#include <boost/log/sources/record_ostream.hpp>
#include <boost/log/sources/severity_logger.hpp>
#include <boost/log/utility/setup/common_attributes.hpp>
#include <boost/make_shared.hpp>

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <mutex>

#include "meshrt/error.hpp"
#include "meshrt/internal/settings.hpp"

namespace meshrt::log {

namespace detail {
std::atomic<int> g_level{static_cast<int>(Level::warning)};
}

namespace {

namespace bl = boost::log;
using Sink = bl::sinks::synchronous_sink<bl::sinks::text_ostream_backend>;

std::mutex g_init_mutex;
boost::shared_ptr<Sink> g_console;
boost::shared_ptr<Sink> g_file;
std::atomic<int> g_rank{-1};
thread_local std::string t_role;

BOOST_LOG_ATTRIBUTE_KEYWORD(a_severity, "Severity", Level)
BOOST_LOG_ATTRIBUTE_KEYWORD(a_rank, "Rank", int)
BOOST_LOG_ATTRIBUTE_KEYWORD(a_role, "Role", std::string)
BOOST_LOG_ATTRIBUTE_KEYWORD(a_where, "Where", std::string)

void format(bl::record_view const& rec, bl::formatting_ostream& out) {
  const auto rank = rec[a_rank];
  const auto role = rec[a_role];
  const auto sev = rec[a_severity];
  out << "[meshrt " << (sev ? to_string(*sev) : "?") << " rank " << (rank && *rank >= 0 ? std::to_string(*rank) : "?");
  if (role && !role->empty()) out << " " << *role;
  out << "] " << rec[bl::expressions::smessage];
  if (auto where = rec[a_where]; where && !where->empty()) out << " (" << *where << ")";
}

boost::shared_ptr<Sink> make_sink(boost::shared_ptr<std::ostream> stream) {
  auto backend = boost::make_shared<bl::sinks::text_ostream_backend>();
  backend->add_stream(std::move(stream));
  backend->auto_flush(true);
  auto sink = boost::make_shared<Sink>(backend);
  sink->set_formatter(&format);
  return sink;
}

}  // namespace

Level parse_level(std::string_view text) {
  std::string t(text);
  std::transform(t.begin(), t.end(), t.begin(), [](unsigned char c) { return std::tolower(c); });
  for (int l = 0; l <= static_cast<int>(Level::off); ++l) {
    if (to_string(static_cast<Level>(l)) == t) return static_cast<Level>(l);
  }
  if (t == "warn") return Level::warning;
  throw UsageError(
      fmt::format("log level: expected one of trace, debug, info, warning, error, fatal, off; found \"{}\"", text));
}

std::string_view to_string(Level level) {
  switch (level) {
    case Level::trace:
      return "trace";
    case Level::debug:
      return "debug";
    case Level::info:
      return "info";
    case Level::warning:
      return "warning";
    case Level::error:
      return "error";
    case Level::fatal:
      return "fatal";
    case Level::off:
      return "off";
  }
  return "?";
}

void set_level(Level level) {
  detail::g_level.store(static_cast<int>(level), std::memory_order_relaxed);
}
Level level() noexcept {
  return static_cast<Level>(detail::g_level.load(std::memory_order_relaxed));
}

void set_thread_role(std::string role) {
  t_role = std::move(role);
}

namespace {

// This node's short host name for file names: up to the first '.', letters, digits, '-'
// and '_' only ("node" when it has none).
std::string node_name() {
  char host[256] = {};
  if (gethostname(host, sizeof host - 1) != 0) return "node";
  std::string out;
  for (const char* c = host; *c != '\0' && *c != '.'; ++c) {
    const bool plain = std::isalnum(static_cast<unsigned char>(*c)) || *c == '-' || *c == '_';
    out += plain ? *c : '_';
  }
  return out.empty() ? "node" : out;
}

}  // namespace

std::string file_name(int rank) {
  return fmt::format("meshrt.rank{}.{}.log", rank, node_name());
}

void init(int rank) {
  std::lock_guard lock(g_init_mutex);
  set_level(parse_level(settings::kLogLevel.get()));
  auto core = bl::core::get();
  g_rank.store(rank);
  if (!g_console) {
    g_console = make_sink(boost::shared_ptr<std::ostream>(&std::clog, boost::null_deleter()));
    core->add_sink(g_console);
  }
  if (g_file) {
    core->remove_sink(g_file);
    g_file.reset();
  }
  if (auto dir = settings::kLogDir.from_environment(); dir && rank >= 0) {
    std::error_code ec;
    std::filesystem::create_directories(*dir, ec);
    auto path = std::filesystem::path(*dir) / file_name(rank);
    auto file = boost::make_shared<std::ofstream>(path, std::ios::app);
    if (!*file) {
      // The same text on every rank that fails alike, so that the start prints it once.
      const std::string why = ec ? fmt::format("cannot create it: {}", ec.message())
                                 : fmt::format("cannot open {} in it for writing", path.filename().string());
      throw UsageError(fmt::format(
          "setting MESHRT_LOG_DIR: expected a directory where every rank can write its log, found {} ({})", *dir, why));
    }
    g_file = make_sink(file);
    core->add_sink(g_file);
  }
}

namespace detail {

void write(Level level, const char* file, int line, const std::string& message) {
  static std::once_flag once;
  std::call_once(once, [] {
    if (!g_console) init(g_rank.load());
  });
  static thread_local bl::sources::severity_logger_mt<Level> logger;
  bl::record rec = logger.open_record(bl::keywords::severity = level);
  if (!rec) return;
  auto& attrs = rec.attribute_values();
  attrs.insert("Rank", bl::attributes::make_attribute_value(g_rank.load()));
  attrs.insert("Role", bl::attributes::make_attribute_value(t_role));
  if (level >= Level::warning || meshrt::log::level() <= Level::debug) {
    std::string_view f(file);
    if (auto pos = f.rfind('/'); pos != std::string_view::npos) f = f.substr(pos + 1);
    attrs.insert("Where", bl::attributes::make_attribute_value(fmt::format("{}:{}", f, line)));
  }
  {
    bl::record_ostream out(rec);
    out << message;
    out.flush();
  }
  logger.push_record(boost::move(rec));
}

}  // namespace detail
}  // namespace meshrt::log
