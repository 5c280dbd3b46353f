// The MPI data plane for CPU tensors: Reduce as all_reduce / all_gather / all_to_all /
// reduce_scatter over a mesh dimension's communicator, a Collective the same over a set of
// dimensions' (or reduce, gather, broadcast, scatter to or from a root, or a barrier),
// SendTensor as point-to-point.
#include <fmt/format.h>

#include <boost/container/small_vector.hpp>

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

#include "comm/mpi_types.hpp"
#include "comm/output_pool.hpp"
#include "comm/plan.hpp"
#include "common/assert.hpp"
#include "common/checks.hpp"
#include "meshrt/internal/comm.hpp"

namespace meshrt {

Outcome Pending::take() {
  // The worker takes each outcome once, after test(): anything else is a meshrt bug.
  if (!finished_) {
    MESHRT_INTERNAL("Pending::take: expected a completed operation (test() returned true), found one in flight: " +
                    describe());
  }
  if (taken_) MESHRT_INTERNAL("Pending::take: expected an outcome not yet taken, found it taken: " + describe());
  taken_ = true;
  if (!deferred_error_.empty()) throw UsageError(deferred_error_);
  return std::move(outcome_);
}

void Pending::idle(std::chrono::microseconds at_most) {
  std::this_thread::sleep_for(at_most);
}

namespace {

// meshrt's comm thread (Completion::Thread): runs blocking MPI calls one after another,
// in the order they were started, off the caller's thread. One per process, started on
// first use and never joined (it holds no MPI state between jobs, and blocks on a
// condition variable when idle).
class CommThread {
 public:
  static CommThread& get() {
    static CommThread* t = new CommThread;  // never destroyed: see above
    return *t;
  }
  void submit(std::function<void()> job) {
    {
      std::lock_guard lock(mutex_);
      jobs_.push_back(std::move(job));
    }
    cv_.notify_one();
  }

 private:
  CommThread() {
    std::thread([this] { loop(); }).detach();
  }
  [[noreturn]] void loop() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock lock(mutex_);
        cv_.wait(lock, [this] { return !jobs_.empty(); });
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
    }
  }
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
};

// Completion of a job on the comm thread, shared by the job and its Pending.
struct ThreadJob {
  std::atomic<bool> done{false};
  std::mutex mutex;
  std::condition_variable cv;
  std::exception_ptr error;
  void finish(std::exception_ptr e) {
    {
      std::lock_guard lock(mutex);
      error = std::move(e);
      done.store(true, std::memory_order_release);
    }
    cv.notify_all();
  }
  void wait_for(std::chrono::microseconds at_most) {
    std::unique_lock lock(mutex);
    cv.wait_for(lock, at_most, [this] { return done.load(std::memory_order_acquire); });
  }
};

// One collective call, described once and run blocking, non-blocking or on the thread.
struct Call {
  enum class Kind : std::uint8_t {
    AllGather,
    AllToAll,
    ReduceScatter,
    AllReduce,
    Reduce,
    Gather,
    Bcast,
    Scatter,
    Barrier
  };
  Kind kind;
  const void* send;
  void* recv;
  int count;
  MPI_Datatype send_type;
  MPI_Datatype type;
  MPI_Op op;
  MPI_Comm comm;
  int root = 0;  // the rooted kinds'

  void run() const {
    switch (kind) {
      case Kind::AllGather:
        MESHRT_MPI_CHECK(MPI_Allgather(send, count, type, recv, count, type, comm));
        break;
      case Kind::AllToAll:
        MESHRT_MPI_CHECK(MPI_Alltoall(send, count, send_type, recv, count, type, comm));
        break;
      case Kind::ReduceScatter:
        MESHRT_MPI_CHECK(MPI_Reduce_scatter_block(send, recv, count, type, op, comm));
        break;
      case Kind::AllReduce:
        MESHRT_MPI_CHECK(MPI_Allreduce(send, recv, count, type, op, comm));
        break;
      case Kind::Reduce:
        MESHRT_MPI_CHECK(MPI_Reduce(send, recv, count, type, op, root, comm));
        break;
      case Kind::Gather:
        MESHRT_MPI_CHECK(MPI_Gather(send, count, type, recv, count, type, root, comm));
        break;
      case Kind::Bcast:
        MESHRT_MPI_CHECK(MPI_Bcast(recv, count, type, root, comm));
        break;
      case Kind::Scatter:
        MESHRT_MPI_CHECK(MPI_Scatter(send, count, type, recv, count, type, root, comm));
        break;
      case Kind::Barrier:
        MESHRT_MPI_CHECK(MPI_Barrier(comm));
        break;
    }
  }
  void post(MPI_Request* req) const {
    switch (kind) {
      case Kind::AllGather:
        MESHRT_MPI_CHECK(MPI_Iallgather(send, count, type, recv, count, type, comm, req));
        break;
      case Kind::AllToAll:
        MESHRT_MPI_CHECK(MPI_Ialltoall(send, count, send_type, recv, count, type, comm, req));
        break;
      case Kind::ReduceScatter:
        MESHRT_MPI_CHECK(MPI_Ireduce_scatter_block(send, recv, count, type, op, comm, req));
        break;
      case Kind::AllReduce:
        MESHRT_MPI_CHECK(MPI_Iallreduce(send, recv, count, type, op, comm, req));
        break;
      case Kind::Reduce:
        MESHRT_MPI_CHECK(MPI_Ireduce(send, recv, count, type, op, root, comm, req));
        break;
      case Kind::Gather:
        MESHRT_MPI_CHECK(MPI_Igather(send, count, type, recv, count, type, root, comm, req));
        break;
      case Kind::Bcast:
        MESHRT_MPI_CHECK(MPI_Ibcast(recv, count, type, root, comm, req));
        break;
      case Kind::Scatter:
        MESHRT_MPI_CHECK(MPI_Iscatter(send, count, type, recv, count, type, root, comm, req));
        break;
      case Kind::Barrier:
        MESHRT_MPI_CHECK(MPI_Ibarrier(comm, req));
        break;
    }
  }
};

// The storage of the last MpiPending freed on this thread, kept for the next one: a worker
// starts its collectives one at a time, so after the first none reaches the allocator.
// Initial-exec and trivially destroyed, so a use is a plain load; the thread's exit frees
// it through FreeSpare, set up the first time a spare is kept, and keeps no more after.
[[gnu::tls_model("initial-exec")]] thread_local void* spare_pending = nullptr;
enum class SpareState : std::uint8_t { Unset, Kept, Closed };
[[gnu::tls_model("initial-exec")]] thread_local SpareState spare_state = SpareState::Unset;

struct FreeSpare {
  ~FreeSpare() {
    spare_state = SpareState::Closed;
    ::operator delete(std::exchange(spare_pending, nullptr));
  }
};

// Whether `p` is kept as this thread's spare (otherwise the caller frees it).
bool keep_spare(void* p) {
  if (spare_pending || spare_state == SpareState::Closed) return false;
  if (spare_state == SpareState::Unset) {
    static thread_local FreeSpare at_exit;
    (void)at_exit;
    spare_state = SpareState::Kept;
  }
  spare_pending = p;
  return true;
}

// One MPI operation in flight: its requests (a send and a receive, or a broadcast send's) or a job on the
// comm thread, the tensors that must stay alive until it completes, and the avg division
// still to do.
class MpiPending final : public Pending {
 public:
  static void* operator new(std::size_t size) {
    if (size == sizeof(MpiPending) && spare_pending) return std::exchange(spare_pending, nullptr);
    return ::operator new(size);
  }
  static void operator delete(void* p, std::size_t size) noexcept {
    if (size != sizeof(MpiPending) || !keep_spare(p)) ::operator delete(p);
  }

  ~MpiPending() override {
    // MPI still reads and writes the buffers this object keeps alive.
    if (job) {
      while (!job->done.load(std::memory_order_acquire)) job->wait_for(std::chrono::milliseconds(1));
    } else if (!finished() && nreqs > 0) {
      MPI_Waitall(nreqs, reqs.data(), MPI_STATUSES_IGNORE);
    }
  }

  bool test() override {
    if (finished()) return true;
    if (job) {
      if (!job->done.load(std::memory_order_acquire)) return false;
      if (job->error) std::rethrow_exception(job->error);
    } else {
      int flag = 0;
      MESHRT_MPI_CHECK(MPI_Testall(nreqs, reqs.data(), &flag, MPI_STATUSES_IGNORE));
      if (!flag) return false;
    }
    complete();
    return true;
  }

  void idle(std::chrono::microseconds at_most) override {
    if (job)
      job->wait_for(at_most);
    else
      Pending::idle(at_most);
  }

  std::string describe() const override {
    if (mesh && set) return detail::describe_collective(*mesh, op, mask, collective, bytes, "MPI");
    if (mesh) return detail::describe_reduce(*mesh, dim, collective, reduction, bytes, "MPI");
    return detail::describe_send(send, my_rank, bytes, "MPI");
  }

  void complete() {
    if (divide_by > 1)
      detail::divide_in_place(result.tensor.raw_data(), result.tensor.numel(), result.tensor.dtype(), divide_by);
    sent = Tensor();
    finish(std::move(result));
  }

  // Runs `fn` (blocking MPI calls) to completion according to `completion`.
  template <class Fn>
  void run(Completion completion, Fn&& fn) {
    if (completion == Completion::Blocking) {
      fn();
      complete();
      return;
    }
    job = std::make_shared<ThreadJob>();
    CommThread::get().submit([j = job, f = std::forward<Fn>(fn)] {
      try {
        f();
        j->finish(nullptr);
      } catch (...) {
        j->finish(std::current_exception());
      }
    });
  }

  void defer(std::string message) { fail_after_completion(std::move(message)); }

  // Described lazily: formatting on every operation would cost more than an 8-byte
  // all_reduce. The mesh outlives every operation on it (the worker deletes a mesh only
  // after the commands that use it).
  const WorkerMesh* mesh = nullptr;
  std::size_t dim = 0;
  const char* collective = "";
  Reduction reduction = Reduction::Sum;
  bool set = false;  // a Collective's: over `mask`, as `op` says (its dims not kept)
  std::uint64_t mask = 0;
  CollectiveOp op;
  detail::SendPlan send;
  int my_rank = -1;
  std::size_t bytes = 0;

  // A send and a receive inline; a broadcast send's further sends beyond.
  boost::container::small_vector<MPI_Request, 2> reqs{MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  int nreqs = 0;
  std::shared_ptr<ThreadJob> job;
  Tensor sent;  // the input, kept alive while MPI reads it
  Outcome result;
  std::int64_t divide_by = 0;
};

int as_count(std::int64_t n) {
  return static_cast<int>(n);
}  // plan_* checked the range

Completion resolve(Completion c, std::size_t bytes) {
  if (c != Completion::Auto) return c;
  return bytes < kThreadMinBytes ? Completion::NonBlocking : Completion::Thread;
}

}  // namespace

namespace {

// The table's collective (docs/ARCHITECTURE.md section 3.6) over `comm`, a line of `n`
// ranks, into `p`; `where` names the line for a mismatched input.
template <class Where>
void post_table(MpiPending& p, MPI_Comm comm, std::int64_t n, const TensorMeta& out_meta, Reduction reduction,
                bool scatter, bool inplace, Input&& input, const TensorMeta& factory, Completion completion,
                Where&& where) {
  detail::Joined in = detail::join_input(std::move(input), factory, p.collective);
  if (!in.mismatch.empty()) p.defer(in.mismatch + where());
  p.result.broken = in.broken;

  const MPI_Datatype type = detail::mpi_datatype(factory.dtype());
  const std::int64_t numel = factory.numel();
  Call call{Call::Kind::AllReduce, in.tensor.raw_data(), nullptr, 0, type, type, MPI_OP_NULL, comm};
  Tensor out;
  if (reduction == Reduction::Stack && !scatter) {
    call.kind = Call::Kind::AllGather;
    call.count = as_count(numel);
    out = detail::output_tensor(out_meta);
  } else if (reduction == Reduction::Stack) {
    // In place is allowed (the prototype refused it: a known bug, not ported).
    call.kind = Call::Kind::AllToAll;
    call.count = as_count(numel / n);
    out = inplace ? in.tensor : detail::output_tensor(out_meta);
    if (inplace) {
      call.send = MPI_IN_PLACE;
      call.send_type = MPI_DATATYPE_NULL;
    }
  } else {
    call.op = detail::mpi_op(reduction, factory.dtype());
    if (scatter) {
      call.kind = Call::Kind::ReduceScatter;
      call.count = as_count(numel / n);
      out = detail::output_tensor(out_meta);
    } else {
      // In place, the output is the input's storage (for a broken input: the zeros).
      call.count = as_count(numel);
      out = inplace ? in.tensor : detail::output_tensor(out_meta);
      if (inplace) call.send = MPI_IN_PLACE;
    }
    if (reduction == Reduction::Avg) p.divide_by = n;
  }
  call.recv = out.raw_data();
  p.result.tensor = std::move(out);
  p.sent = std::move(in.tensor);
  if (completion == Completion::NonBlocking) {
    call.post(&p.reqs[0]);
    p.nreqs = 1;
  } else {
    p.run(completion, [call] { call.run(); });
  }
}

}  // namespace

std::unique_ptr<Pending> start_reduce(WorkerMesh& mesh, std::string_view dim, Reduction reduction, bool scatter,
                                      bool inplace, Input input, const TensorMeta& factory, Completion completion) {
  const detail::ReducePlan plan =
      detail::plan_reduce(mesh, dim, reduction, scatter, inplace, factory, detail::Backend::Mpi);
  completion = resolve(completion, factory.nbytes());
  auto p = std::make_unique<MpiPending>();
  p->mesh = &mesh;
  p->dim = plan.dim;
  p->collective = plan.collective;
  p->reduction = reduction;
  p->bytes = factory.nbytes();
  post_table(*p, mesh.dim_comm(plan.dim), plan.n, plan.out_meta(factory), reduction, scatter, inplace, std::move(input),
             factory, completion, [&] { return detail::where_reduce(mesh, plan.dim); });
  return p;
}

bool defines_result(const WorkerMesh& mesh, const CollectiveOp& op) {
  if (op.kind == CollectiveKind::Barrier) return false;
  if (op.kind != CollectiveKind::Reduce || op.root < 0) return true;
  return mesh.dims_position(mesh.dims_mask(op.dims)) == op.root;
}

bool reads_input(const WorkerMesh& mesh, const CollectiveOp& op) {
  if (op.kind == CollectiveKind::Barrier) return false;
  if (op.kind == CollectiveKind::Reduce) return true;
  return mesh.dims_position(mesh.dims_mask(op.dims)) == op.root;
}

std::unique_ptr<Pending> start_collective(WorkerMesh& mesh, const CollectiveOp& op, Input input,
                                          const TensorMeta& factory, Completion completion) {
  const detail::CollectivePlan plan = detail::plan_collective(mesh, op, factory, detail::Backend::Mpi);
  const std::size_t bytes = op.kind == CollectiveKind::Barrier ? 0 : factory.nbytes();
  completion = resolve(completion, bytes);
  auto p = std::make_unique<MpiPending>();
  p->mesh = &mesh;
  p->set = true;
  p->mask = plan.mask;
  p->op = CollectiveOp{.kind = op.kind,
                       .dims = {},
                       .reduction = op.reduction,
                       .scatter = op.scatter,
                       .inplace = op.inplace,
                       .root = op.root};
  p->collective = plan.collective;
  p->reduction = op.reduction;
  p->bytes = bytes;
  const auto where = [&] { return detail::where_collective(mesh, plan.mask); };
  MPI_Comm comm = mesh.dims_comm(plan.mask);
  if (op.kind == CollectiveKind::Reduce && op.root < 0) {
    post_table(*p, comm, plan.n, plan.out_meta(factory), op.reduction, op.scatter, op.inplace, std::move(input),
               factory, completion, where);
    return p;
  }
  const bool root = plan.is_root(op.root);
  const MPI_Datatype type = detail::mpi_datatype(factory.dtype());
  Call call{Call::Kind::Barrier, nullptr, nullptr, 0, type, type, MPI_OP_NULL, comm, static_cast<int>(op.root)};
  Tensor out;
  if (op.kind != CollectiveKind::Barrier && (op.kind == CollectiveKind::Reduce || root)) {
    // Every rank's input counts for a rooted reduce or gather; the root's alone for a
    // broadcast or scatter, where the others have none to give (a to_mesh broadcast).
    detail::Joined in = detail::join_input(std::move(input), factory, plan.collective);
    if (!in.mismatch.empty()) p->defer(in.mismatch + where());
    if (op.kind != CollectiveKind::Reduce || root) p->result.broken = in.broken;  // where a result is defined
    p->sent = std::move(in.tensor);
    call.send = p->sent.raw_data();
  }
  switch (op.kind) {
    case CollectiveKind::Reduce:
      if (root) out = detail::output_tensor(plan.out_meta(factory));
      if (op.reduction == Reduction::Stack) {
        call.kind = Call::Kind::Gather;
      } else {
        call.kind = Call::Kind::Reduce;
        call.op = detail::mpi_op(op.reduction, factory.dtype());
        if (op.reduction == Reduction::Avg && root) p->divide_by = plan.n;
      }
      call.count = as_count(factory.numel());
      break;
    case CollectiveKind::Broadcast:
      // The root's result is a copy of its input: a result never shares its input's memory.
      out = detail::output_tensor(factory);
      if (root && factory.nbytes() > 0) std::memcpy(out.raw_data(), p->sent.raw_data(), factory.nbytes());
      call.kind = Call::Kind::Bcast;
      call.count = as_count(factory.numel());
      break;
    case CollectiveKind::Scatter:
      out = detail::output_tensor(plan.out_meta(factory));
      call.kind = Call::Kind::Scatter;
      call.count = as_count(factory.numel() / plan.n);
      break;
    case CollectiveKind::Barrier:
      break;
  }
  call.recv = out.defined() ? out.raw_data() : nullptr;
  p->result.tensor = std::move(out);
  if (completion == Completion::NonBlocking) {
    call.post(&p->reqs[0]);
    p->nreqs = 1;
  } else {
    p->run(completion, [call] { call.run(); });
  }
  return p;
}

namespace {
// One tag for every SendTensor: MPI does not reorder messages of one (communicator,
// source, tag), and every rank issues SendTensor commands in the controller's order.
constexpr int kSendTensorTag = 0x5e4d;
}  // namespace

std::unique_ptr<Pending> start_send_tensor(MPI_Comm p2p, int my_rank, const NDSlice& from_ranks,
                                           const NDSlice& to_ranks, Input input, const TensorMeta& factory,
                                           Completion completion, std::span<const std::int64_t> to_order,
                                           std::span<const std::int64_t> from_order) {
  int comm_size = 0;
  MESHRT_MPI_CHECK(MPI_Comm_size(p2p, &comm_size));
  const detail::SendPlan plan =
      detail::plan_send(my_rank, comm_size, from_ranks, to_ranks, factory, detail::Backend::Mpi, to_order, from_order);
  completion = resolve(completion, factory.nbytes());
  auto p = std::make_unique<MpiPending>();
  p->send = plan;
  p->my_rank = my_rank;
  p->bytes = factory.nbytes();
  if (plan.send_to < 0 && plan.recv_from < 0) {
    p->complete();  // no part in this command: an undefined outcome
    return p;
  }
  if (plan.send_to >= 0) {
    detail::Joined in = detail::join_input(std::move(input), factory, "send_tensor");
    if (!in.mismatch.empty()) p->defer(in.mismatch + detail::where_send(my_rank, plan.send_to));
    if (plan.self) {
      // The local copy is a new tensor (the prototype handed back the input and then
      // overwrote it with the receive: a known bug, not ported). Only here can a
      // receiver know its value is broken: it is its own sender.
      p->result.tensor = detail::output_tensor(factory);
      std::memcpy(p->result.tensor.raw_data(), in.tensor.raw_data(), factory.nbytes());
      p->result.broken = in.broken;
      if (plan.also_to.empty()) {
        p->complete();
        return p;
      }
    }
    p->sent = std::move(in.tensor);
  }
  const MPI_Datatype type = detail::mpi_datatype(factory.dtype());
  const int count = as_count(factory.numel());
  if (!plan.also_to.empty()) p->reqs.resize(2 + plan.also_to.size(), MPI_REQUEST_NULL);
  const auto next = [&] { return &p->reqs[static_cast<std::size_t>(p->nreqs++)]; };
  // Receive first, then send: with both posted before waiting, a ring of ranks that each
  // send and receive cannot deadlock however large the message.
  if (plan.recv_from >= 0 && !plan.self) {
    p->result.tensor = detail::output_tensor(factory);
    MESHRT_MPI_CHECK(MPI_Irecv(p->result.tensor.raw_data(), count, type, plan.recv_from, kSendTensorTag, p2p, next()));
  }
  if (plan.send_to >= 0 && !plan.self)
    MESHRT_MPI_CHECK(MPI_Isend(p->sent.raw_data(), count, type, plan.send_to, kSendTensorTag, p2p, next()));
  for (int to : plan.also_to)
    MESHRT_MPI_CHECK(MPI_Isend(p->sent.raw_data(), count, type, to, kSendTensorTag, p2p, next()));
  if (completion != Completion::NonBlocking) {
    // The requests are posted here, in command order; only their completion moves to the
    // comm thread for Completion::Thread.
    MpiPending* raw = p.get();
    p->run(completion, [raw] { MESHRT_MPI_CHECK(MPI_Waitall(raw->nreqs, raw->reqs.data(), MPI_STATUSES_IGNORE)); });
  }
  return p;
}

Outcome reduce(WorkerMesh& mesh, std::string_view dim, Reduction reduction, bool scatter, bool inplace, Input input,
               const TensorMeta& factory) {
  auto p = start_reduce(mesh, dim, reduction, scatter, inplace, std::move(input), factory, kDefaultCompletion);
  return wait(*p);
}

Outcome send_tensor(MPI_Comm p2p, int my_rank, const NDSlice& from_ranks, const NDSlice& to_ranks, Input input,
                    const TensorMeta& factory) {
  auto p = start_send_tensor(p2p, my_rank, from_ranks, to_ranks, std::move(input), factory, kDefaultCompletion);
  return wait(*p);
}

}  // namespace meshrt
