#include "meshrt/runtime.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <mpi.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/checks.hpp"
#include "common/network_check.hpp"
#include "common/timeline.hpp"
#include "common/trace.hpp"
#include "controller/state.hpp"
#include "meshrt/internal/comm.hpp"
#include "meshrt/internal/control.hpp"
#include "meshrt/internal/device.hpp"
#include "meshrt/internal/mpi_session.hpp"
#include "meshrt/internal/protocol.hpp"
#include "meshrt/internal/settings.hpp"
#include "meshrt/internal/worker.hpp"
#include "meshrt/log.hpp"
#include "runtime/peer_watch.hpp"
#include "runtime/trace_file.hpp"

namespace meshrt {

namespace {

// WorkerOptions::block_in_mpi (MESHRT_WORKER_BLOCKING, worker_blocks_in_mpi), for a rank
// of `local` on its node.
bool decide_worker_blocking(int rank, int local) {
  const long cores = std::max(1L, sysconf(_SC_NPROCESSORS_ONLN));
  const std::string mode = settings::kWorkerBlocking.get();
  const bool block = worker_blocks_in_mpi(mode, local, cores);
  if (rank == 0) {
    MESHRT_LOG(info) << "workers run CPU collectives " << (block ? "blocking" : "non-blocking") << " (" << local
                     << " ranks on this node, " << cores << " online cores, MESHRT_WORKER_BLOCKING=" << mode << ")";
  }
  return block;
}

// One step of the start, agreed by the whole job (control::agree_on_start): it fails on
// every rank or on none, and its message is printed once.
void start_step(MPI_Comm comm, const std::function<void()>& step) {
  std::string error;
  try {
    step();
  } catch (const std::exception& e) {
    error = e.what();
  }
  control::agree_on_start(comm, error);
}

// Every rank places itself on the same accelerator, or none does: collective (the device
// choice that follows is), and the same error on every rank when they differ.
void check_one_accelerator(MPI_Comm comm, device::Accelerator mine) {
  int size = 1;
  MESHRT_MPI_CHECK(MPI_Comm_size(comm, &size));
  auto code = static_cast<int>(mine);
  std::vector<int> all(static_cast<std::size_t>(size));
  MESHRT_MPI_CHECK(MPI_Allgather(&code, 1, MPI_INT, all.data(), 1, MPI_INT, comm));
  if (std::all_of(all.begin(), all.end(), [&](int c) { return c == all[0]; })) return;
  std::map<int, std::vector<int>> ranks_on;  // accelerator -> its ranks
  for (int r = 0; r < size; ++r) ranks_on[all[static_cast<std::size_t>(r)]].push_back(r);
  std::vector<std::string> found;
  for (const auto& [accelerator, ranks] : ranks_on) {
    found.push_back(fmt::format("{} on rank{} {}", device::name(static_cast<device::Accelerator>(accelerator)),
                                ranks.size() == 1 ? "" : "s", fmt::join(ranks, ", ")));
  }
  throw UsageError(fmt::format("setting MESHRT_ACCELERATOR: expected the same accelerator on every rank, found {}",
                               fmt::join(found, "; ")));
}

// Settings that size what every rank maps up front, refused at start when this node's
// `node_ranks` would need more than half its memory: found later, as a std::bad_alloc in a
// thread, they end the job without a word about why.
void check_memory_settings(int node_ranks) {
  const double physical = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGESIZE));
  const std::int64_t events = settings::kTraceEvents.get();
  // A ring per thread that records: the controller's and the worker's, and one per device
  // stream; about this many per rank (the emulated accelerator's tests map 2 to 5).
  constexpr double kRingsPerRank = 4;
  const double ring = static_cast<double>(sizeof(detail::trace::Event)) * kRingsPerRank * node_ranks;
  if (physical > 0 && static_cast<double>(events) * ring > physical / 2) {
    throw UsageError(fmt::format(
        "setting MESHRT_TRACE_EVENTS: expected at most {} here, found {}: each of this node's {} ranks maps about {:g} "
        "rings of that many {}-byte events, which must fit in half of its {:.1f} GiB of memory",
        static_cast<std::int64_t>(physical / 2 / ring), events, node_ranks, kRingsPerRank, sizeof(detail::trace::Event),
        physical / static_cast<double>(1ull << 30)));
  }
}

// The tag of the start's hello and go messages on MPI_COMM_WORLD (the only communicator
// there is before the start's first collective).
constexpr int kStartTag = 32001;

// Before the start's first collective (which would wait for ever for a rank that never
// calls meshrt::run): every rank tells rank 0 it is here, and rank 0 answers each once all
// are. Past MESHRT_START_TIMEOUT rank 0 names the ranks that never came and ends the job;
// a rank that hears nothing from rank 0 ends it too, a little later (rank 0 says more).
void meet_at_start(int rank, int size) {
  if (size < 2) return;
  settings::Seconds timeout{120};
  try {
    timeout = settings::kStartTimeout.get();
  } catch (const std::exception&) {
    // A bad value: the settings' check after the meeting refuses it on every rank.
  }
  const bool unlimited = timeout >= settings::Seconds(1e9);
  using Clock = std::chrono::steady_clock;
  const auto started = Clock::now();
  auto past = [&](settings::Seconds after) {
    return !unlimited && Clock::now() - started > std::chrono::duration_cast<Clock::duration>(after);
  };
  static char hello = 'h', go = 'g';
  static char inbox = 0;
  if (rank == 0) {
    std::vector<MPI_Request> hellos(static_cast<std::size_t>(size - 1), MPI_REQUEST_NULL);
    std::vector<char> got(hellos.size(), 0);
    for (int r = 1; r < size; ++r) {
      MESHRT_MPI_CHECK(MPI_Irecv(&got[static_cast<std::size_t>(r - 1)], 1, MPI_CHAR, r, kStartTag, MPI_COMM_WORLD,
                                 &hellos[static_cast<std::size_t>(r - 1)]));
    }
    std::vector<int> done(hellos.size());
    for (;;) {
      // Testsome frees each request that completed (Testall leaves all of them until every one has).
      int count = 0;
      MESHRT_MPI_CHECK(
          MPI_Testsome(static_cast<int>(hellos.size()), hellos.data(), &count, done.data(), MPI_STATUSES_IGNORE));
      if (count == MPI_UNDEFINED) break;  // none left
      if (past(timeout)) {
        std::vector<int> missing;
        for (std::size_t i = 0; i < hellos.size(); ++i) {
          if (hellos[i] != MPI_REQUEST_NULL) missing.push_back(static_cast<int>(i) + 1);
        }
        std::fprintf(stderr,
                     "meshrt: start-up: rank%s %s of the job's %d never called meshrt::run (or meshrt::Runtime) "
                     "within %.3g s of rank 0 (MESHRT_START_TIMEOUT): every rank must call it (is it called under "
                     "an 'if' on the rank, or did those ranks fail or hang before it?); ending the job (MPI_Abort) "
                     "so that no rank waits for ever\n",
                     missing.size() == 1 ? "" : "s", fmt::format("{}", fmt::join(missing, ", ")).c_str(), size,
                     timeout.count());
        std::fflush(stderr);
        detail::end_job_after_report(1);  // a moment for the launcher to pass the report on
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    std::vector<MPI_Request> gos(static_cast<std::size_t>(size - 1), MPI_REQUEST_NULL);
    for (int r = 1; r < size; ++r) {
      MESHRT_MPI_CHECK(
          MPI_Isend(&go, 1, MPI_CHAR, r, kStartTag, MPI_COMM_WORLD, &gos[static_cast<std::size_t>(r - 1)]));
    }
    MESHRT_MPI_CHECK(MPI_Waitall(static_cast<int>(gos.size()), gos.data(), MPI_STATUSES_IGNORE));
    return;
  }
  MPI_Request requests[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  MESHRT_MPI_CHECK(MPI_Isend(&hello, 1, MPI_CHAR, 0, kStartTag, MPI_COMM_WORLD, &requests[0]));
  MESHRT_MPI_CHECK(MPI_Irecv(&inbox, 1, MPI_CHAR, 0, kStartTag, MPI_COMM_WORLD, &requests[1]));
  // Rank 0 knows who is missing: it gets the time to say so (and its MPI_Abort the time
  // to reach this rank) before this rank gives up.
  const settings::Seconds grace = std::clamp(timeout, settings::Seconds(5), settings::Seconds(10));
  for (;;) {
    int all = 0;
    MESHRT_MPI_CHECK(MPI_Testall(2, requests, &all, MPI_STATUSES_IGNORE));
    if (all) return;
    if (past(timeout + grace)) {
      std::fprintf(stderr,
                   "meshrt: start-up: rank %d has waited %.3g s (MESHRT_START_TIMEOUT and %.3g s more) for rank 0 "
                   "to confirm that every rank of the job's %d called meshrt::run (or meshrt::Runtime): rank 0 "
                   "never did, or could not say so; ending the job (MPI_Abort) so that no rank waits for ever\n",
                   rank, (timeout + grace).count(), grace.count(), size);
      std::fflush(stderr);
      detail::end_job_after_report(1);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

}  // namespace

struct Runtime::Impl {
  RuntimeOptions options;
  bool initialized_mpi = false;
  int rank = 0;
  int size = 1;
  int provided = MPI_THREAD_SINGLE;
  MPI_Comm world = MPI_COMM_NULL;
  MPI_Comm control = MPI_COMM_NULL;
  MPI_Comm p2p = MPI_COMM_NULL;
  NDSlice worker_ranks = NDSlice::row_major({1});
  bool block_in_mpi = false;  // WorkerOptions::block_in_mpi, decided once at start
  // Below MPI_THREAD_MULTIPLE this thread and the watch take turns at MPI (mpi_session.hpp);
  // declared before the watch, so that the watch has stopped when the turn is let go.
  std::optional<mpi_session::HeldTurn> turn;
  // This rank's flight recorder, the thread that answers the controller's queries and
  // the signal handlers (ranks that run a worker).
  std::unique_ptr<WorkerWatch> watch;
  std::unique_ptr<detail::PeerWatch> peers;  // the heartbeat ring (MESHRT_PEER_TIMEOUT)
  // MESHRT_TRACE (rank 0's path; on when any rank has it set) and the clocks measured at start.
  std::string trace_path;
  bool tracing = false;
  detail::ClockOffsets clocks;

  bool runs_worker() const { return !(options.dedicated_controller && rank == 0); }

  void free_comms() {
    free_device_communicators();
    // Return codes ignored on purpose: this runs in the destructor and on a failed start,
    // where raising would hide the first error (or terminate), and the job is ending.
    for (MPI_Comm* c : {&world, &control, &p2p}) {
      if (*c != MPI_COMM_NULL) MESHRT_MPI_IGNORE(MPI_Comm_free(c));
    }
  }

  WorkerOptions worker_options() const {
    WorkerOptions o{.rank = rank,
                    .world = world,
                    .control = control,
                    .p2p = p2p,
                    .status_interval_seconds = 1.0,
                    .monitor = watch ? watch->monitor() : nullptr,
                    .block_in_mpi = block_in_mpi};
    // The controller builds the same tree from the same settings (ControllerState).
    std::vector<int> workers;
    for (auto r : worker_ranks) workers.push_back(static_cast<int>(r));
    const auto tree = control::StatusTree::for_job(workers, static_cast<std::size_t>(settings::kFanout.get()),
                                                   static_cast<std::size_t>(settings::kFanoutThreshold.get()));
    if (tree && tree->contains(rank)) {
      o.status_parent = tree->is_top(rank) ? kStatusToController : tree->parent(rank);
      o.status_children = tree->children(rank);
    }
    return o;
  }

  void handshake() { control::handshake(control, provided, options.dedicated_controller); }

  void shutdown(detail::ControllerState& state) {
    state.shutdown(std::chrono::duration<double>(options.shutdown_timeout_seconds));
  }
};

Runtime::Runtime(int& argc, char**& argv, RuntimeOptions options) : impl_(std::make_unique<Impl>()) {
  Impl& i = *impl_;
  i.options = options;
  i.initialized_mpi = !mpi_session::running();
  i.provided = mpi_session::ensure_started("meshrt::Runtime", &argc, &argv);
  i.turn.emplace();
  MESHRT_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &i.rank));
  MESHRT_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &i.size));
  try {
    meet_at_start(i.rank, i.size);
    // MPI_ERRORS_RETURN on each, so that MESHRT_MPI_CHECK raises (common/checks.hpp).
    for (MPI_Comm* c : {&i.control, &i.world, &i.p2p}) {
      MESHRT_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, c));
      detail::set_error_policy(*c);
    }
    // A bad setting is reported here, not when it is first read.
    start_step(i.control, [&] {
      settings::validate_all();
      log::init(i.rank);
      log::set_thread_role(i.rank == 0 ? "controller" : fmt::format("worker {}", i.rank));
    });
    // A misspelled setting is otherwise ignored without a word: named once, by rank 0.
    if (i.rank == 0) {
      if (const std::string unknown = settings::unknown_variables_warning(settings::unknown_variables());
          !unknown.empty()) {
        std::fputs(unknown.c_str(), stderr);
        std::fflush(stderr);
      }
    }
    i.handshake();
    // One device per rank (docs/ARCHITECTURE.md section 7), chosen before any worker thread starts.
    auto accelerator = device::Accelerator::None;
    start_step(i.control, [&] { accelerator = device::configured_accelerator(); });
    start_step(i.control, [&] {
      check_one_accelerator(i.control, accelerator);
      if (accelerator != device::Accelerator::None) {
        device::set_placement({accelerator, device::select_device(accelerator, MPI_COMM_WORLD)});
      }
    });
    start_step(i.control, [&] {
      // Collective, before any setting is read, so that a bad value raises on every rank
      // after the same calls.
      const int local = device::node_size(MPI_COMM_WORLD);
      check_memory_settings(local);
      i.block_in_mpi = decide_worker_blocking(i.rank, local);
      if (options.dedicated_controller) {
        if (i.size < 2) throw UsageError("a dedicated controller needs at least 2 ranks: one controller, one worker");
        i.worker_ranks = NDSlice(1, {i.size - 1}, {1});
      } else {
        i.worker_ranks = NDSlice::row_major({i.size});
      }
      if (i.runs_worker()) {
        i.watch = std::make_unique<WorkerWatch>(i.rank, control::mpi_transport(i.control),
                                                static_cast<std::size_t>(settings::kFlightRecorder.get()));
      }
    });
    i.peers = std::make_unique<detail::PeerWatch>(MPI_COMM_WORLD, settings::kPeerTimeout.get(), i.provided);
    // The timeline: on for every rank when rank 0 asks for it (its path is the file's, and
    // the stem of each rank's own file when the job is ended). The clocks are measured in
    // any case: Controller::start_trace() may turn it on later.
    {
      std::string path = i.rank == 0 ? settings::kTrace.get() : std::string();
      start_step(i.control, [&] {
        if (!path.empty()) detail::check_trace_path(path);
      });
      int length = static_cast<int>(path.size());
      MESHRT_MPI_CHECK(MPI_Bcast(&length, 1, MPI_INT, 0, i.world));
      path.resize(static_cast<std::size_t>(length));
      MESHRT_MPI_CHECK(MPI_Bcast(path.data(), length, MPI_CHAR, 0, i.world));
      i.trace_path = path;
      i.tracing = !path.empty();
    }
    // 16 round trips per rank with MESHRT_TRACE, 4 otherwise (for a start_trace() later):
    // rank 0 makes them one rank after another, which a job of thousands of ranks feels.
    i.clocks = detail::measure_clock_offsets(i.world, i.tracing ? 16 : 4);
    {
      char host[256] = {};
      gethostname(host, sizeof host - 1);
      detail::trace::set_session(
          {.rank = i.rank,
           .size = i.size,
           .host = host,
           .path = i.trace_path,
           .offset_ns = i.clocks.own_offset_ns,
           .residual_ns = i.clocks.own_residual_ns,
           .offsets_ns = i.clocks.offset_ns,
           .residuals_ns = i.clocks.residual_ns,
           .capacity = static_cast<std::size_t>(settings::kTraceEvents.get()),
           .site = [](const CallSite& where,
                      const CallSite& replayed_at) { return detail::describe(where, replayed_at); },
           .command = [](std::uint8_t tag) { return protocol::command_name(tag); }});
    }
    if (i.tracing) detail::trace::enable(detail::trace::session().capacity);
  } catch (...) {
    i.peers.reset();
    {
      const mpi_session::LentTurn lent;  // the watch sends its last answers
      i.watch.reset();
    }
    i.free_comms();
    if (i.initialized_mpi) mpi_session::finish();  // the start's own error follows
    throw;
  }
}

Runtime::~Runtime() {
  if (impl_->tracing) {
    // Every rank reaches here once its sessions are over: the gather is collective.
    try {
      const std::uint64_t n = detail::write_trace_file(impl_->world, impl_->trace_path, impl_->clocks);
      if (impl_->rank == 0) {
        std::fprintf(stderr, "meshrt: wrote the timeline of %d ranks (%llu events) to %s\n", impl_->size,
                     static_cast<unsigned long long>(n), impl_->trace_path.c_str());
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "meshrt: rank %d: the timeline was not written: %s\n", impl_->rank, e.what());
    }
  }
  impl_->peers.reset();
  {
    const mpi_session::LentTurn lent;  // the watch sends its last answers
    impl_->watch.reset();
  }
  impl_->free_comms();
  if (impl_->initialized_mpi) mpi_session::finish();
}

int Runtime::rank() const noexcept {
  return impl_->rank;
}
int Runtime::world_size() const noexcept {
  return impl_->size;
}

void Runtime::session(const std::function<void(Controller&)>& fn) {
  Impl& i = *impl_;
  const WorkerOptions wo = i.worker_options();
  if (i.rank != 0) {
    device::enter_worker_thread();
    Worker::serve(wo);
    return;
  }
  std::thread worker0;
  if (!i.options.dedicated_controller) {
    worker0 = std::thread([wo] {
      log::set_thread_role("worker 0");
      try {
        device::enter_worker_thread();  // the current device is per thread
        Worker::serve(wo);
      } catch (const std::exception& e) {
        // A worker that cannot go on must not leave its peers waiting.
        MESHRT_LOG(fatal) << "worker 0 failed: " << e.what() << "; aborting the job";
        std::fprintf(stderr, "meshrt: worker 0 failed: %s; aborting the job\n", e.what());
        MESHRT_MPI_IGNORE(MPI_Abort(MPI_COMM_WORLD, 1));  // ignored on purpose: it does not return when it works
      } catch (...) {
        std::fprintf(stderr,
                     "meshrt: worker 0 failed with an exception not derived from std::exception; aborting "
                     "the job\n");
        MESHRT_MPI_IGNORE(MPI_Abort(MPI_COMM_WORLD, 1));  // ignored on purpose: it does not return when it works
      }
    });
  }
  std::exception_ptr error;
  {
    auto state = std::make_shared<detail::ControllerState>(control::mpi_transport(i.control), i.size, i.worker_ranks);
    Controller ctl(state);
    try {
      fn(ctl);
    } catch (...) {
      error = std::current_exception();
    }
    try {
      i.shutdown(*state);
    } catch (...) {
      if (!error) error = std::current_exception();
    }
    // Nobody handled the timeout: its flight recorders go to stderr, once, at the end.
    if (const std::string dumps = state->unhandled_dumps(error); !dumps.empty()) {
      std::fprintf(stderr, "meshrt: the workers' flight recorders at the timeout:\n%s", dumps.c_str());
    }
  }
  if (worker0.joinable()) worker0.join();
  if (error) std::rethrow_exception(error);
}

int run(int argc, char** argv, const std::function<void(Controller&)>& fn, RuntimeOptions options) {
  std::optional<Runtime> runtime;
  try {
    runtime.emplace(argc, argv, options);
  } catch (const control::StartupError&) {
    return 1;  // every rank has the same verdict, and rank 0 has printed it once for the job
  } catch (const std::exception& e) {
    std::fprintf(stderr, "meshrt: %s\n", e.what());
    return 1;
  }
  try {
    runtime->session(fn);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "meshrt: the controller failed: %s\n", e.what());
    return 1;
  }
  return 0;
}

}  // namespace meshrt
