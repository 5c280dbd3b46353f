// meshrt.run, meshrt.rank, meshrt.world_size and the process's one Runtime. MPI starts
// through the core's MPI session (meshrt/internal/mpi_session.hpp) whoever asks first
// (meshrt.run, meshrt.rank, a StatelessGroup), and is finalised after the interpreter has
// finished, if meshrt started it: groups and the runtime are gone by then.
#include <fmt/format.h>
#include <mpi.h>
#include <pybind11/stl.h>

#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "api/classes.hpp"
#include "bindings.hpp"
#include "meshrt/controller.hpp"
#include "meshrt/internal/controller.hpp"
#include "meshrt/internal/mpi_session.hpp"
#include "meshrt/internal/worker.hpp"
#include "meshrt/runtime.hpp"
#include "support/gil.hpp"

namespace meshrt::python {
namespace {

void mpi_check(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw SystemError(fmt::format("{} failed: {}", call, std::string(text, static_cast<std::size_t>(len))));
}

void finish_mpi() {
  mpi_session::finish();
}

}  // namespace

void start_mpi(const char* who) {
  static bool registered = false;
  {
    py::gil_scoped_release release;
    (void)mpi_session::ensure_started(who);
  }
  // After the interpreter: every group and the runtime are gone by then.
  if (!registered && mpi_session::started_by_meshrt()) {
    registered = true;
    Py_AtExit(finish_mpi);
  }
}

namespace {

// ------------------------------------------------------------------ the runtime

// The process's Runtime: made by the first run(), kept for later sessions (MPI can be
// initialised once per process), ended at interpreter exit (_shutdown).
struct Process {
  std::unique_ptr<Runtime> runtime;
  RuntimeOptions options;
  std::string start_error;  // the first start's failure: MPI cannot start twice
  bool in_session = false;
};
Process& process() {
  static auto* p = new Process();
  return *p;
}

// MPI initialised before meshrt (by mpi4py) is accepted at MPI_THREAD_MULTIPLE only. Every
// rank takes part and refuses together (the lowest level any rank needs and lacks).
void check_thread_level(bool dedicated_controller) {
  int initialized = 0, finalized = 0;
  mpi_check(MPI_Initialized(&initialized), "MPI_Initialized");
  mpi_check(MPI_Finalized(&finalized), "MPI_Finalized");
  if (finalized) {
    throw UsageError(
        "meshrt.run: MPI was already finalised (MPI.Finalize() from mpi4py?); meshrt needs it running: "
        "finalise it at exit only (mpi4py does so by itself)");
  }
  if (!initialized || mpi_session::started_by_meshrt()) return;
  int provided = MPI_THREAD_SINGLE, rank = 0;
  mpi_check(MPI_Query_thread(&provided), "MPI_Query_thread");
  mpi_check(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "MPI_Comm_rank");
  // With a dedicated controller the workers of ranks 1.. run on one thread each
  // (control::handshake's rule).
  const bool needs_multiple = !(dedicated_controller && rank != 0);
  int mine = needs_multiple ? provided : MPI_THREAD_MULTIPLE;
  int lowest = mine;
  mpi_check(MPI_Allreduce(&mine, &lowest, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD), "MPI_Allreduce");
  if (lowest >= MPI_THREAD_MULTIPLE) return;
  throw UsageError(fmt::format(
      "meshrt.run: MPI was initialised before meshrt (by mpi4py?) with thread level {} (this rank: {}); meshrt "
      "needs MPI_THREAD_MULTIPLE (rank 0 runs the controller and worker 0 on two threads). Fix: leave "
      "mpi4py.rc.thread_level at \"multiple\" (its default) or set it so before `from mpi4py import MPI`, or "
      "import mpi4py's MPI only after meshrt.run has started MPI",
      mpi_session::thread_level_constant(lowest), mpi_session::thread_level_constant(provided)));
}

// SIGTERM raises meshrt.Terminated in the program's main thread (docs/python.md, "Threads,
// the GIL and Ctrl-C"), unless the program has a handler of its own. The runtime's C
// handler (which reports the rank and ends it a second later) replaces Python's when the
// Runtime starts, so it passes the signal on to Python through the hook.
void install_sigterm() {
  py::module_ signal = py::module_::import("signal");
  const py::object sigterm = signal.attr("SIGTERM");
  if (!signal.attr("getsignal")(sigterm).is(signal.attr("SIG_DFL"))) return;
  signal.attr("signal")(sigterm, py::cpp_function([](py::args) {
                          py::object terminated = py::module_::import("meshrt._core").attr("Terminated");
                          PyErr_SetObject(terminated.ptr(),
                                          terminated("SIGTERM: the job is being ended (scancel, a time limit, or "
                                                     "Ctrl-C under mpiexec)")
                                              .ptr());
                          throw py::error_already_set();
                        }));
  WorkerWatch::set_sigterm_hook([] { PyErr_SetInterruptEx(SIGTERM); });
}

Runtime& start_runtime(const RuntimeOptions& options) {
  Process& p = process();
  if (p.runtime) {
    if (p.options.dedicated_controller != options.dedicated_controller) {
      throw UsageError(fmt::format(
          "meshrt.run: expected dedicated_controller={} as in this process's first meshrt.run (one runtime per "
          "process: MPI starts once), found dedicated_controller={}",
          p.options.dedicated_controller ? "True" : "False", options.dedicated_controller ? "True" : "False"));
    }
    return *p.runtime;
  }
  if (!p.start_error.empty()) {
    throw Error("meshrt.run: meshrt failed to start earlier in this process, and MPI cannot start twice: " +
                p.start_error);
  }
  check_thread_level(options.dedicated_controller);
  install_sigterm();
  // Started here rather than by the Runtime, so that it ends with the process (after the
  // interpreter), not with the Runtime: groups may outlive meshrt.run.
  start_mpi("meshrt.run");
  int argc = 1;
  static char program[] = "python";
  static char* args[] = {program, nullptr};
  char** argv = args;
  try {
    py::gil_scoped_release release;
    p.runtime = std::make_unique<Runtime>(argc, argv, options);
  } catch (const std::exception& e) {
    p.start_error = e.what();
    throw;
  }
  p.options = options;
  return *p.runtime;
}

// Rank 0: the session runs main(ctl) on this thread; its result or exception comes back
// after the workers have shut down. The exception is main's own Python exception object.
py::object run_controller(Runtime& rt, const py::function& main) {
  auto handle = std::make_shared<ControllerHandle>();
  py::object ctl_object = py::cast(handle);
  py::object result;
  std::unique_lock shutdown_lock(controller_mutex(), std::defer_lock);
  {
    py::gil_scoped_release release;
    rt.session([&](Controller& ctl) {
      // The session's shutdown follows main on this thread, under the controller lock
      // (taken after the GIL is given back, also when main raises).
      struct LockForShutdown {
        std::unique_lock<std::recursive_mutex>& lock;
        ~LockForShutdown() {
          lock.lock();
          empty_graveyard();
        }
      } lock_for_shutdown{shutdown_lock};
      py::gil_scoped_acquire acquire;
      struct Invalidate {
        ControllerHandle& h;
        ~Invalidate() { h.ctl = nullptr; }
      } invalidate{*handle};
      handle->ctl = &ctl;
      result = main(ctl_object);
    });
  }
  return result ? result : py::none();
}

// Other ranks: the worker serves on a thread of its own while this one waits for the
// session to end and lets signals through. The first Ctrl-C is held until the controller
// ends the session (rank 0 has most likely been interrupted too), then raised; a second
// one ends the job.
void run_worker(Runtime& rt) {
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
  std::optional<py::error_already_set> interrupt;
  // Looked up now: not while a signal handler's exception is pending, when an import can
  // fail, and nothing may leave the loop below before the serving thread is joined.
  const py::object terminated = py::module_::import("meshrt._core").attr("Terminated");
  std::exception_ptr waiting_error;  // raised with the GIL held again
  {
    py::gil_scoped_release release;
    std::thread serve([&] {
      try {
        rt.session([](Controller&) {});
      } catch (...) {
        error = std::current_exception();
      }
      std::lock_guard lock(m);
      done = true;
      cv.notify_all();
    });
    for (;;) try {
        {
          std::unique_lock lock(m);
          if (cv.wait_for(lock, detail::kWaitCheckInterval, [&] { return done; })) break;
        }
        py::gil_scoped_acquire acquire;
        if (PyErr_CheckSignals() == 0) continue;
        // SIGTERM: the runtime reports this rank and ends it; the worker serves until then.
        if (PyErr_ExceptionMatches(terminated.ptr()) != 0) {
          PyErr_Clear();
          continue;
        }
        if (!interrupt) {
          interrupt.emplace();
          std::fprintf(stderr,
                       "meshrt: rank %d interrupted; its worker serves until the controller (rank 0) ends the "
                       "session; interrupt again to end the job\n",
                       rt.rank());
          std::fflush(stderr);
          continue;
        }
        PyErr_Clear();
        std::fprintf(stderr, "meshrt: rank %d interrupted twice while serving; aborting the job\n", rt.rank());
        std::fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, 130);
      } catch (...) {
        // Raised here, after the session: the serving thread runs on, and a joinable thread
        // must not be destroyed.
        waiting_error = std::current_exception();
        std::unique_lock lock(m);
        cv.wait(lock, [&] { return done; });
        break;
      }
    serve.join();
  }
  if (waiting_error) std::rethrow_exception(waiting_error);
  // A signal that came after the last check belongs to this session, not the next one.
  if (PyErr_CheckSignals() != 0) {
    if (PyErr_ExceptionMatches(terminated.ptr()) != 0 || interrupt) {
      PyErr_Clear();
    } else {
      interrupt.emplace();
    }
  }
  if (error) std::rethrow_exception(error);
  if (interrupt) throw *interrupt;
}

py::object run(const py::function& main, bool dedicated_controller, double shutdown_timeout) {
  Process& p = process();
  if (p.in_session) {
    throw UsageError("meshrt.run: called inside a session's main; a process runs one session at a time");
  }
  RuntimeOptions options;
  options.dedicated_controller = dedicated_controller;
  options.shutdown_timeout_seconds = shutdown_timeout;
  Runtime& rt = start_runtime(options);
  p.in_session = true;
  struct Leave {
    ~Leave() { process().in_session = false; }
  } leave;
  if (rt.is_controller()) return run_controller(rt, main);
  run_worker(rt);
  return py::none();
}

void shutdown() {
  Process& p = process();
  detail::set_wait_check(nullptr);
  py::gil_scoped_release release;
  {
    std::lock_guard lock(controller_mutex());
    empty_graveyard();
  }
  p.runtime.reset();
}
}  // namespace

bool runtime_started() {
  return process().runtime != nullptr;
}

void bind_runtime(py::module_& m) {
  m.def("run", &run, py::arg("main"), py::kw_only(), py::arg("dedicated_controller") = false,
        py::arg("shutdown_timeout") = 60.0,
        "Every rank calls it: rank 0 runs main(ctl) and returns its result (main's exception is raised after the "
        "workers shut down), every rank runs a worker and returns None. The first call starts MPI and meshrt; "
        "later calls reuse them.");
  m.def(
      "rank",
      [] {
        if (process().runtime) return process().runtime->rank();
        start_mpi("meshrt.rank");
        int r = 0;
        mpi_check(MPI_Comm_rank(MPI_COMM_WORLD, &r), "MPI_Comm_rank");
        return r;
      },
      "This process's rank in the job (starts MPI if nothing has).");
  m.def(
      "world_size",
      [] {
        if (process().runtime) return process().runtime->world_size();
        start_mpi("meshrt.world_size");
        int n = 0;
        mpi_check(MPI_Comm_size(MPI_COMM_WORLD, &n), "MPI_Comm_size");
        return n;
      },
      "The number of ranks in the job (starts MPI if nothing has).");
  m.def(
      "_in_session", [] { return process().in_session; },
      "Whether this process is inside meshrt.run (its worker's SIGUSR1 handler then writes the flight recorder "
      "to the log; for meshrt.testing).");
  m.def(
      "_abort_job",
      [](int code) {
        std::fflush(nullptr);
        int started = 0;
        int finished = 0;
        MPI_Initialized(&started);
        MPI_Finalized(&finished);
        py::gil_scoped_release release;
        if (started != 0 && finished == 0) MPI_Abort(MPI_COMM_WORLD, code);
        std::_Exit(code);
      },
      py::arg("code"), "Ends the whole job now (MPI_Abort, or this process without MPI; for meshrt.testing).");
  m.def("_shutdown", &shutdown,
        "Ends meshrt's runtime; registered with atexit (MPI, if meshrt started it, ends after the interpreter).");
}

}  // namespace meshrt::python
