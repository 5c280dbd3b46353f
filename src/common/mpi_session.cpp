#include "meshrt/internal/mpi_session.hpp"

#include <fmt/format.h>
#include <mpi.h>

#include <atomic>
#include <cctype>

#include "common/checks.hpp"
#include "common/network_check.hpp"
#include "meshrt/error.hpp"
#include "meshrt/version.hpp"

namespace meshrt::mpi_session {
namespace {

std::atomic<bool> g_started{false};

std::mutex g_turn;
thread_local bool t_holds_turn = false;

bool turns_needed() {
  // The level is fixed once MPI runs; the first caller (after MPI_Init) reads it.
  static const bool needed = [] {
    int level = MPI_THREAD_MULTIPLE;
    MESHRT_MPI_IGNORE(MPI_Query_thread(&level));
    return level < MPI_THREAD_MULTIPLE;
  }();
  return needed;
}

}  // namespace

bool running() {
  int initialized = 0, finalized = 0;
  MESHRT_MPI_CHECK(MPI_Initialized(&initialized));
  MESHRT_MPI_CHECK(MPI_Finalized(&finalized));
  return initialized != 0 && finalized == 0;
}

int ensure_started(const char* who, int* argc, char*** argv) {
  int initialized = 0, finalized = 0;
  MESHRT_MPI_CHECK(MPI_Initialized(&initialized));
  MESHRT_MPI_CHECK(MPI_Finalized(&finalized));
  if (finalized) {
    throw UsageError(fmt::format(
        "{}: expected MPI to be running or not yet started, found it finalised in this process (MPI starts once "
        "per process; finalise it at exit only)",
        who));
  }
  int provided = MPI_THREAD_SINGLE;
  if (initialized) {
    MESHRT_MPI_CHECK(MPI_Query_thread(&provided));
    return provided;
  }
  // Before MPI_Init, which would fail on it with a message that names no setting.
  detail::check_tcp_interfaces();
  MESHRT_MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided));
  g_started.store(true);
  return provided;
}

void require_running(const char* who) {
  int initialized = 0, finalized = 0;
  MESHRT_MPI_CHECK(MPI_Initialized(&initialized));
  MESHRT_MPI_CHECK(MPI_Finalized(&finalized));
  if (finalized) {
    throw UsageError(
        fmt::format("{}: expected MPI to be running, found it finalised (MPI_Finalize was called); use it before "
                    "MPI_Finalize",
                    who));
  }
  if (!initialized) {
    throw UsageError(
        fmt::format("{}: expected MPI to be initialised, found MPI_Init not called yet; call "
                    "MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided) first (and MPI_Finalize "
                    "at the end), or use it inside meshrt::run, which starts MPI",
                    who));
  }
}

bool started_by_meshrt() {
  return g_started.load();
}

void finish() noexcept {
  if (!g_started.load()) return;
  int finalized = 0;
  MESHRT_MPI_IGNORE(MPI_Finalized(&finalized));  // teardown: nothing is left to report to
  if (!finalized) MESHRT_MPI_IGNORE(MPI_Finalize());
}

std::string thread_level_constant(int level) {
  std::string name = thread_level_name(level);
  for (char& c : name) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return "MPI_THREAD_" + name;
}

HeldTurn::HeldTurn() {
  if (!turns_needed()) return;
  g_turn.lock();
  t_holds_turn = held_ = true;
}

HeldTurn::~HeldTurn() {
  if (!held_) return;
  t_holds_turn = false;
  g_turn.unlock();
}

LentTurn::LentTurn() {
  if (!t_holds_turn) return;
  g_turn.unlock();
  lent_ = true;
}

LentTurn::~LentTurn() {
  if (lent_) g_turn.lock();
}

TakenTurn::TakenTurn() {
  if (!turns_needed()) return;
  lock_ = std::unique_lock<std::mutex>(g_turn, std::try_to_lock);
  ok_ = lock_.owns_lock();
}

}  // namespace meshrt::mpi_session
