#include "meshrt/runtime.hpp"

#include <fmt/format.h>
#include <mpi.h>

#include <cstdio>
#include <optional>
#include <thread>

#include "common/checks.hpp"
#include "controller/state.hpp"
#include "meshrt/comm.hpp"
#include "meshrt/device.hpp"
#include "meshrt/functions.hpp"
#include "meshrt/log.hpp"
#include "meshrt/protocol.hpp"
#include "meshrt/settings.hpp"
#include "meshrt/version.hpp"
#include "meshrt/worker.hpp"
#include "worker/monitor.hpp"
#include "worker/watch.hpp"

namespace meshrt {

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
  // This rank's flight recorder and the thread that answers the controller's queries.
  std::unique_ptr<detail::Monitor> monitor;
  std::unique_ptr<detail::Watch> watch;

  bool runs_worker() const { return !(options.dedicated_controller && rank == 0); }

  void free_comms() {
    free_device_communicators();
    for (MPI_Comm* c : {&world, &control, &p2p}) {
      if (*c != MPI_COMM_NULL) MPI_Comm_free(c);
    }
  }

  WorkerOptions worker_options() const { return WorkerOptions{rank, world, control, p2p, 1.0, monitor.get()}; }

  // Every rank sends rank 0 its handshake (or why it cannot run); rank 0 compares them
  // and broadcasts the verdict, so all ranks fail the start together, naming the culprits.
  void handshake() {
    std::string local_error;
    protocol::Handshake mine;
    mine.meshrt_version = MESHRT_VERSION_STRING;
    mine.thread_level = provided;
    mine.rank = rank;
    char host[MPI_MAX_PROCESSOR_NAME] = {};
    int len = 0;
    MPI_Get_processor_name(host, &len);
    mine.host = host;
    try {
      mine.function_table_hash = functions::table_hash();
    } catch (const std::exception& e) {
      local_error = e.what();
    }
    if (provided < MPI_THREAD_MULTIPLE && !(options.dedicated_controller && rank != 0)) {
      local_error += fmt::format(
          "{}MPI provides thread level {}; meshrt needs multiple (rank 0 runs the controller "
          "and worker 0 on two threads)",
          local_error.empty() ? "" : "; ", thread_level_name(provided));
    }
    const auto bytes = protocol::encode(mine);
    auto gather = [&](const void* data, int n) {
      std::vector<int> lens(static_cast<std::size_t>(size));
      MESHRT_MPI_CHECK(MPI_Gather(&n, 1, MPI_INT, lens.data(), 1, MPI_INT, 0, control));
      std::vector<int> displs(static_cast<std::size_t>(size), 0);
      int total = 0;
      for (int r = 0; r < size; ++r) {
        displs[static_cast<std::size_t>(r)] = total;
        total += lens[static_cast<std::size_t>(r)];
      }
      std::vector<std::byte> all(static_cast<std::size_t>(std::max(total, 1)));
      MESHRT_MPI_CHECK(MPI_Gatherv(data, n, MPI_BYTE, all.data(), lens.data(), displs.data(), MPI_BYTE, 0, control));
      std::vector<std::vector<std::byte>> parts;
      if (rank == 0) {
        for (int r = 0; r < size; ++r) {
          auto b = all.begin() + displs[static_cast<std::size_t>(r)];
          parts.emplace_back(b, b + lens[static_cast<std::size_t>(r)]);
        }
      }
      return parts;
    };
    const auto handshakes = gather(bytes.data(), static_cast<int>(bytes.size()));
    const auto errors = gather(local_error.data(), static_cast<int>(local_error.size()));
    std::string verdict;
    if (rank == 0) {
      for (int r = 0; r < size; ++r) {
        const auto& err = errors[static_cast<std::size_t>(r)];
        if (!err.empty()) {
          verdict +=
              fmt::format("\n  rank {}: {}", r, std::string(reinterpret_cast<const char*>(err.data()), err.size()));
        }
        if (r == 0) continue;
        try {
          const protocol::Handshake h = protocol::decode_handshake(handshakes[static_cast<std::size_t>(r)]);
          std::vector<std::string> diffs;
          if (h.meshrt_version != mine.meshrt_version) {
            diffs.push_back(fmt::format("meshrt {} (rank 0: {})", h.meshrt_version, mine.meshrt_version));
          }
          if (h.protocol_version != mine.protocol_version) {
            diffs.push_back(fmt::format("protocol {} (rank 0: {})", h.protocol_version, mine.protocol_version));
          }
          if (h.function_table_hash != mine.function_table_hash) {
            diffs.push_back(fmt::format("function table {:016x} (rank 0: {:016x}): a different program or library set",
                                        h.function_table_hash, mine.function_table_hash));
          }
          if (!diffs.empty()) {
            verdict +=
                fmt::format("\n  rank {} (host {}) runs a different binary: {}", r, h.host, fmt::join(diffs, "; "));
          }
        } catch (const std::exception& e) {
          verdict += fmt::format("\n  rank {}: its handshake does not decode ({}): a different meshrt", r, e.what());
        }
      }
    }
    int n = static_cast<int>(verdict.size());
    MESHRT_MPI_CHECK(MPI_Bcast(&n, 1, MPI_INT, 0, control));
    verdict.resize(static_cast<std::size_t>(n));
    MESHRT_MPI_CHECK(MPI_Bcast(verdict.data(), n, MPI_CHAR, 0, control));
    if (!verdict.empty()) throw Error("meshrt start-up failed: the ranks disagree:" + verdict);
  }

  void shutdown(detail::ControllerState& state) {
    state.flush_deferred();
    const protocol::Ident ident = state.new_ident("shutdown");
    state.append(state.all_dests, protocol::RequestStatus{ident}, ident);
    state.append(state.all_dests, protocol::Exit{false});
    state.flush();
    // No RequestStatus may follow Exit (the next session would receive it), so wait here
    // without asking again.
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::duration<double>(options.shutdown_timeout_seconds);
    detail::Backoff backoff;
    while (state.frontier() < ident) {
      state.poll_replies();
      if (std::chrono::steady_clock::now() > deadline) {
        const std::string report = state.lagging_report(ident);
        MESHRT_LOG(fatal) << "shutdown: workers did not finish within " << options.shutdown_timeout_seconds
                          << " s; aborting the job:" << report;
        std::fprintf(stderr, "meshrt: shutdown timed out; aborting the job:%s\n", report.c_str());
        MPI_Abort(MPI_COMM_WORLD, 1);
      }
      backoff.pause();
    }
    state.channel.drain(std::chrono::duration<double>(options.shutdown_timeout_seconds));
  }
};

Runtime::Runtime(int& argc, char**& argv, RuntimeOptions options) : impl_(std::make_unique<Impl>()) {
  Impl& i = *impl_;
  i.options = options;
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    MESHRT_MPI_CHECK(MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &i.provided));
    i.initialized_mpi = true;
  } else {
    MPI_Query_thread(&i.provided);
  }
  MPI_Comm_rank(MPI_COMM_WORLD, &i.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &i.size);
  try {
    log::init(i.rank);
    log::set_thread_role(i.rank == 0 ? "controller" : fmt::format("worker {}", i.rank));
    MESHRT_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &i.control));
    MESHRT_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &i.world));
    MESHRT_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &i.p2p));
    i.handshake();
    // One device per rank (DESIGN.md section 9), chosen before any worker thread starts.
    if (const auto acc = device::configured_accelerator(); acc != device::Accelerator::None) {
      device::set_placement({acc, device::select_device(acc, MPI_COMM_WORLD)});
    }
    if (options.dedicated_controller) {
      if (i.size < 2) throw UsageError("a dedicated controller needs at least 2 ranks: one controller, one worker");
      i.worker_ranks = NDSlice(1, {i.size - 1}, {1});
    } else {
      i.worker_ranks = NDSlice::row_major({i.size});
    }
    if (i.runs_worker()) {
      i.monitor = std::make_unique<detail::Monitor>(
          i.rank, static_cast<std::size_t>(std::max<std::int64_t>(1, settings::get_int("MESHRT_FLIGHT_RECORDER"))));
      i.watch = std::make_unique<detail::Watch>(i.control, *i.monitor);
      detail::install_signal_handlers(i.monitor.get());
    }
  } catch (...) {
    if (i.monitor) detail::uninstall_signal_handlers();
    i.watch.reset();
    i.free_comms();
    if (i.initialized_mpi) MPI_Finalize();
    throw;
  }
}

Runtime::~Runtime() {
  if (impl_->monitor) detail::uninstall_signal_handlers();
  impl_->watch.reset();
  impl_->free_comms();
  if (impl_->initialized_mpi) MPI_Finalize();
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
        MPI_Abort(MPI_COMM_WORLD, 1);
      }
    });
  }
  std::exception_ptr error;
  {
    auto state = std::make_shared<detail::ControllerState>(i.control, i.size, i.worker_ranks);
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
  }
  if (worker0.joinable()) worker0.join();
  if (error) std::rethrow_exception(error);
}

int run(int argc, char** argv, const std::function<void(Controller&)>& fn, RuntimeOptions options) {
  std::optional<Runtime> runtime;
  try {
    runtime.emplace(argc, argv, options);
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
