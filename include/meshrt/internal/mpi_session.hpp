// This process's MPI, started and finished by one policy for every entry point of meshrt:
// meshrt::Runtime, the C++ StatelessGroup (which never starts MPI itself) and the Python
// package (which starts it for meshrt.rank(), meshrt.run and its groups). MPI starts at
// most once per process, and meshrt finalises it only if meshrt started it.
#pragma once

#include <mutex>
#include <string>

namespace meshrt::mpi_session {

// Starts MPI at MPI_THREAD_MULTIPLE unless it runs already (started by the program, or
// mpi4py); returns the thread level MPI provides. Refuses (UsageError naming `who`) once
// MPI has been finalised: it cannot start twice. argc/argv may be null.
int ensure_started(const char* who, int* argc = nullptr, char*** argv = nullptr);
// Refuses (UsageError naming `who` and what to do) unless MPI runs: before MPI_Init, or
// after MPI_Finalize.
void require_running(const char* who);
// Whether MPI runs now (initialised and not finalised).
bool running();
// Whether ensure_started started MPI in this process.
bool started_by_meshrt();
// MPI_Finalize, if meshrt started MPI and it still runs; later calls do nothing. Errors
// are ignored: it runs at the end, where nothing is left to report to.
void finish() noexcept;
// "MPI_THREAD_MULTIPLE" for MPI_THREAD_MULTIPLE (meshrt::thread_level_name gives
// "multiple").
std::string thread_level_constant(int level);

// Below MPI_THREAD_MULTIPLE (a worker that starts MPI itself at MPI_THREAD_SERIALIZED
// beside a dedicated controller) one thread at a time may be inside MPI, and such a rank
// has two that call it: its main thread and its watch (the thread that answers the
// controller's queries). They take turns: the main thread holds the turn for its whole
// run (HeldTurn) and lends it only while it waits with nothing to do (LentTurn); the
// watch takes it, when it is free, for one poll or one answer (TakenTurn). At
// MPI_THREAD_MULTIPLE none of the three does anything. Use them only while MPI runs.
class HeldTurn {
 public:
  HeldTurn();
  ~HeldTurn();
  HeldTurn(const HeldTurn&) = delete;
  HeldTurn& operator=(const HeldTurn&) = delete;

 private:
  bool held_ = false;
};

// Gives up this thread's turn (if it holds one) until the end of the scope.
class LentTurn {
 public:
  LentTurn();
  ~LentTurn();
  LentTurn(const LentTurn&) = delete;
  LentTurn& operator=(const LentTurn&) = delete;

 private:
  bool lent_ = false;
};

// The turn if it is free now (or not needed): true when this thread may call MPI.
class TakenTurn {
 public:
  TakenTurn();
  explicit operator bool() const { return ok_; }

 private:
  std::unique_lock<std::mutex> lock_;
  bool ok_ = true;
};

}  // namespace meshrt::mpi_session
