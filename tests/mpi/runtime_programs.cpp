// Whole programs around meshrt::run, chosen by argv[1]:
//   dedicated   a dedicated controller on rank 0 drives workers on ranks 1..N-1
//   throws      the controller function throws: run() returns non-zero, nothing hangs
//   crash       a kernel segfaults on rank 2: the handler names the rank and the command,
//               prints a backtrace and ends the whole job
//   abort       the controller calls Controller::abort(reason)
//   timeout     a get(timeout) expires with MESHRT_TIMEOUT_ACTION=abort: report, then abort
//   stopped     rank 2 stops (SIGSTOP) in a kernel: the next rank's heartbeat watch names
//               it and ends the job (MESHRT_PEER_TIMEOUT)
//   busy        rank 2 sleeps in a kernel past MESHRT_PEER_TIMEOUT: nothing ends, the
//               heartbeats come from a thread of their own
//   usr1        a worker receives SIGUSR1 and writes its flight recorder to its log
//   trace       a known program for the timeline's test (MESHRT_TRACE): calls, a reduce
//               over each dimension of a 2x2 mesh, a to_mesh, a fetch, a kernel that fails
//               on rank 1 and rank 3 sleeping 0.3 s before an all_reduce over 'gpu'
//   trace_term  for the timeline when a job is ended: a reduce over each dimension of a
//               2x2 mesh, then rank 2 sleeps 60 s in a kernel (the test sends SIGTERM)
//   trace_parts start_trace/stop_trace/write_trace(MESHRT_TEST_TRACE_OUT) around part of a run
//   serialized  a dedicated controller whose workers start MPI themselves at
//               MPI_THREAD_SERIALIZED: the heartbeat ring is off, and rank 0 says so
//   stall       rank 2 sleeps 3 s in a kernel while the controller waits without a timeout:
//               past MESHRT_STALL_WARNING the desync report is printed once, with the
//               kernel's and the controller's stacks from a provider this program registers
//   absent      every rank starts MPI itself (as mpi4py does), but rank 1 never calls run:
//               the start's deadline (MESHRT_START_TIMEOUT) names it and ends the job
//   device_fault rank 1's emulated stream faults as a GPU's on an illegal address: the
//               rank ends the job, naming the fault
//   plain       does a little work (with MESHRT_EXTRA_FUNCTION defined at compile time
//               the binary has one more function: the handshake must refuse to start)
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "meshrt/internal/stacks.hpp"
#include "meshrt/meshrt.hpp"

using namespace meshrt;

#ifdef MESHRT_EXTRA_FUNCTION
namespace {
Signature extra_shape(const ArgMetas&) {
  return {};
}
std::vector<Tensor> extra_kernel(CallContext&, Args&) {
  return {};
}
}  // namespace
MESHRT_REGISTER_FUNCTION("test.only_in_one_binary", extra_kernel, extra_shape);
#endif

namespace {

// A stack provider as a language binding registers one (docs: meshrt/internal/stacks.hpp):
// it says which thread asks, so the test sees a kernel's stack read from another thread.
std::string test_stack(const detail::StackOf& of) {
  if (of.owner == detail::StackOwner::Controller) return "controller frame: main, waiting in get()";
  return "kernel frame: " + std::string(of.function) + ", read from " +
         (of.thread != detail::this_thread_id() ? "another thread" : "the kernel's own thread");
}

// The MPI thread level this rank asks for, before it knows its rank: the launcher's
// variable says it (Open MPI's mpiexec, MPICH's hydra).
int serialized_unless_rank_0() {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMI_RANK"}) {
    if (const char* r = std::getenv(name))
      return std::strcmp(r, "0") == 0 ? MPI_THREAD_MULTIPLE : MPI_THREAD_SERIALIZED;
  }
  return MPI_THREAD_MULTIPLE;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "plain";
  if (mode == "absent") {
    int provided = 0, rank = 0;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (rank == 1) {
      std::this_thread::sleep_for(std::chrono::seconds(60));  // the job ends first
      MPI_Finalize();
      return 0;
    }
  }
  RuntimeOptions options;
  options.dedicated_controller = mode == "dedicated" || mode == "serialized";
  if (mode == "stall") detail::set_stack_provider("Test", test_stack);
  if (mode == "serialized") {
    int provided = 0;
    MPI_Init_thread(&argc, &argv, serialized_unless_rank_0(), &provided);
    const int rc = run(
        argc, argv,
        [](Controller& ctl) {
          Mesh mesh = ctl.world_mesh({{"w", ctl.worker_ranks().len()}});
          DTensor x = mesh.call("meshrt.full", {2}, DType::Float64, 1.5);
          const double got = ctl.fetch_shard(x.reduce("w", Reduction::Sum), {{"w", 0}}).get().span<double>()[0];
          std::printf("serialized workers: sum %.1f\n", got);
        },
        options);
    MPI_Finalize();
    return rc;
  }
  return run(
      argc, argv,
      [&](Controller& ctl) {
        const auto n = ctl.worker_ranks().len();
        Mesh mesh = ctl.world_mesh({{"w", n}});
        DTensor x = mesh.call("meshrt.full", {2}, DType::Float64, 1.5);
        const double got = ctl.fetch_shard(x.reduce("w", Reduction::Sum), {{"w", 0}}).get().span<double>()[0];
        if (got != 1.5 * static_cast<double>(n))
          throw Error("expected " + std::to_string(1.5 * n) + ", found " + std::to_string(got));
        if (mode == "dedicated") {
          if (ctl.worker_ranks().offset() != 1) throw Error("a dedicated controller's workers start at rank 1");
          std::printf("dedicated controller: %lld workers, sum %.1f\n", static_cast<long long>(n), got);
        }
        if (mode == "throws") throw std::runtime_error("the controller gave up on purpose");
        if (mode == "crash") {
          DTensor c = mesh.call("test.crash", {2});
          ctl.fetch_shard(c.reduce("w", Reduction::Sum), {{"w", 0}}).get();
          throw Error("the crash did not end the job");
        }
        if (mode == "abort") ctl.abort("the controller decided to stop here");
        if (mode == "timeout") {
          DTensor s = mesh.call("test.sleep", 30.0, {1});
          ctl.fetch_shard(s.reduce("w", Reduction::Sum), {{"w", 0}}).get(std::chrono::milliseconds(300));
          throw Error("the timeout did not end the job");
        }
        if (mode == "device_fault") {
          DTensor c = mesh.call("test.device_fault", {1});
          ctl.fetch_shard(c.reduce("w", Reduction::Sum), {{"w", 0}}).get();
          throw Error("the device fault did not end the job");
        }
        if (mode == "stopped") {
          DTensor c = mesh.call("test.stop", {2});
          ctl.fetch_shard(c.reduce("w", Reduction::Sum), {{"w", 0}}).get();
          throw Error("the stopped rank did not end the job");
        }
        if (mode == "busy") {
          DTensor s = mesh.call("test.sleep", 3.0, {2});
          ctl.fetch_shard(s.reduce("w", Reduction::Sum), {{"w", 0}}).get();
          std::printf("busy: done\n");
        }
        if (mode == "trace") {
          Mesh m = ctl.world_mesh({{"host", 2}, {"gpu", n / 2}});
          DTensor a = m.call("test.pattern", {4}, DType::Float32);
          DTensor b = m.call("meshrt.scale", a, 2.0).reduce("gpu", Reduction::Sum);
          DTensor c = b.reduce("host", Reduction::Max);
          (void)ctl.fetch_shard(c, {{"host", 1}, {"gpu", 1}}).get();
          DTensor moved = a.slice_mesh("host", 0).to_mesh(m.slice("host", 1));
          (void)ctl.fetch_shard(moved, {{"gpu", 0}}).get();
          DTensor bad = m.call("meshrt.fail", "failed on purpose", {1});
          try {
            ctl.synchronize();
          } catch (const RemoteError&) {
          }
          DTensor s = m.call("test.sleep", 0.3, {3});
          (void)ctl.fetch_shard(s.reduce("gpu", Reduction::Sum), {{"host", 0}, {"gpu", 0}}).get();
          std::printf("trace: done\n");
        }
        if (mode == "trace_term") {
          Mesh m = ctl.world_mesh({{"host", 2}, {"gpu", n / 2}});
          DTensor a = m.call("test.pattern", {4}, DType::Float32);
          DTensor b = a.reduce("gpu", Reduction::Sum).reduce("host", Reduction::Sum);
          (void)ctl.fetch_shard(b, {{"host", 0}, {"gpu", 0}}).get();
          DTensor s = m.call("test.sleep", 60.0, std::vector<std::int64_t>{2});
          auto last = ctl.fetch_shard(s.reduce("gpu", Reduction::Sum), {{"host", 1}, {"gpu", 0}});
          std::printf("trace_term: waiting for the end\n");
          std::fflush(stdout);
          (void)last.get();
          throw Error("the job was not ended");
        }
        if (mode == "trace_parts") {
          const char* out = std::getenv("MESHRT_TEST_TRACE_OUT");
          if (out == nullptr) throw Error("expected MESHRT_TEST_TRACE_OUT");
          try {
            ctl.write_trace(out);
            throw Error("write_trace before any recording did not refuse");
          } catch (const UsageError& e) {
            std::printf("trace_parts: refused: %s\n", e.what());
          }
          Mesh m = ctl.world_mesh({{"host", 2}, {"gpu", n / 2}});
          DTensor before = m.call("meshrt.full", {2}, DType::Float32, 1.0);
          ctl.start_trace();
          DTensor a = m.call("test.pattern", {4}, DType::Float32);
          DTensor b = a.reduce("gpu", Reduction::Sum);
          ctl.stop_trace();
          DTensor after = m.call("meshrt.scale", b, 3.0);
          ctl.synchronize();
          const std::uint64_t events = ctl.write_trace(out);
          std::printf("trace_parts: wrote %llu events\n", static_cast<unsigned long long>(events));
        }
        if (mode == "stall") {
          DTensor s = mesh.call("test.sleep", 3.0, {2});
          ctl.fetch_shard(s.reduce("w", Reduction::Sum), {{"w", 0}}).get();  // no timeout
          std::printf("stall: done\n");
        }
        if (mode == "usr1") {
          mesh.call("test.usr1", {1});
          ctl.synchronize();
          std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the watch thread polls every 2 ms
        }
      },
      options);
}
