// Starting and stopping meshrt in an MPI job.
//
//   int main(int argc, char** argv) {
//     return meshrt::run(argc, argv, [](meshrt::Controller& ctl) { ... });
//   }
//
// Every rank calls run(); rank 0 runs the function (the controller) on the calling
// thread and its own worker on a background thread; every other rank runs a worker until
// the controller finishes. Programs that want several controller sessions in one job use
// Runtime directly and call session() the same number of times on every rank.
#pragma once

#include <functional>
#include <memory>

#include "meshrt/controller.hpp"

namespace meshrt {

struct RuntimeOptions {
  // Rank 0 runs only the controller; the workers are ranks 1..N-1.
  bool dedicated_controller = false;
  // How long shutdown waits for the workers to acknowledge Exit before MPI_Abort.
  double shutdown_timeout_seconds = 60;
};

class Runtime {
 public:
  // Initialises MPI (MPI_THREAD_MULTIPLE) unless the program already did, sets up
  // logging, and runs the start-up handshake: every rank must run the same meshrt,
  // protocol and function table, or the start fails on every rank with an Error naming
  // the ranks that differ. Any failure of the start (a bad setting, a log directory, the
  // device choice, the handshake) fails it on every rank with the same Error, printed
  // once for the job by rank 0 with the ranks that hit it.
  Runtime(int& argc, char**& argv, RuntimeOptions options = {});
  ~Runtime();  // finalises MPI if it initialised it
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  int rank() const noexcept;
  int world_size() const noexcept;
  bool is_controller() const noexcept { return rank() == 0; }

  // One controller session. On rank 0 runs fn and then shuts the workers' loops down (also
  // when fn throws: the exception is rethrown after shutdown). On other ranks serves
  // commands until the session ends.
  void session(const std::function<void(Controller&)>& fn);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Runtime plus one session: returns 0, or 1 after printing the controller's exception
// (on rank 0) when it threw or the start failed.
int run(int argc, char** argv, const std::function<void(Controller&)>& fn, RuntimeOptions options = {});

}  // namespace meshrt
