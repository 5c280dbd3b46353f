// comm: device meshes on a worker, their communicators, and the data plane that moves
// tensors between ranks (docs/ARCHITECTURE.md sections 1 and 3.2: Reduce and SendTensor).
//
// CPU tensors go through MPI; accelerator tensors (cuda, emulated) through the device
// layer's communicators (start_*_device; NCCL on cuda).
// Every operation exists in two forms: start_*() returns a Pending that the worker's
// event loop polls between control messages (so it keeps answering the controller while
// a collective is in flight), and a blocking convenience (reduce(), send_tensor()).
//
// Broken inputs (docs/ARCHITECTURE.md section 3.4, "Collectives with broken inputs"): an Input holding
// DependentOnError still joins the collective or send, with factory.zeros(), so that no
// peer deadlocks. The Outcome of a reduction on that rank is marked broken with the same
// ident. Peers of a broken rank cannot know locally that the values they received are
// poisoned (zeros arrive like any other data): their Outcome is NOT marked broken, and it
// is the controller, which saw the failure first, that marks the dependent values.
//
// mpi.h appears here because the worker owns communicators directly (control, p2p).
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "meshrt/config.hpp"
#include "meshrt/ndslice.hpp"
#include "meshrt/reduction.hpp"
#include "meshrt/tensor.hpp"

namespace meshrt {

// A poisoned value: the ident of the invocation whose failure it depends on.
struct DependentOnError {
  std::uint64_t ident = 0;
  friend bool operator==(const DependentOnError&, const DependentOnError&) = default;
};

// What a command hands to the data plane: a tensor, or the marker of a broken one.
using Input = std::variant<Tensor, DependentOnError>;

// What a command defines. `tensor` is undefined on a rank that only sends.
struct Outcome {
  Tensor tensor;
  std::optional<DependentOnError> broken;
};

// One device mesh as one of its members sees it: names of dimensions, the NDSlice of
// world ranks, this rank's coordinates and the communicators of each dimension.
//
// Constructing it is collective over the members only (MPI_Comm_create_group): ranks
// outside the mesh take no part and may be busy with anything else. Per-dimension
// communicators are created on first use; that is safe because every member receives
// the command that triggers it in the same order.
class WorkerMesh {
 public:
  // `ranks` holds ranks of `world`, which must include the calling rank. Throws
  // UsageError for names.size() != ranks.ndim(), a repeated or empty name, or a caller
  // that is not a member.
  WorkerMesh(std::vector<std::string> names, NDSlice ranks, MPI_Comm world);
  ~WorkerMesh();
  // The MPI communicators every WorkerMesh of this process holds (mesh and dimension
  // communicators): flat when meshes are freed as their handles drop.
  static std::int64_t live_communicators() noexcept;
  WorkerMesh(const WorkerMesh&) = delete;
  WorkerMesh& operator=(const WorkerMesh&) = delete;

  const std::vector<std::string>& names() const noexcept;
  const NDSlice& ranks() const noexcept;
  std::size_t ndim() const noexcept;
  // This rank's coordinates in the mesh, one per dimension.
  const std::vector<std::int64_t>& coordinates() const noexcept;
  // This rank in `world`.
  int world_rank() const noexcept;
  std::int64_t size(std::size_t dim) const;
  std::int64_t size(std::string_view name) const;
  // Throws UsageError naming the mesh's dimensions for an unknown name.
  std::size_t dim_index(std::string_view name) const;

  // The communicator of all members, rank = index in ranks().
  MPI_Comm comm() const noexcept;
  // The communicator of this rank's line along `dim` (rank = coordinate), created on
  // first use and freed with the mesh. Collective over the members on first use, and
  // blocking: MPI_Comm_split has no non-blocking form, so the first operation on a
  // dimension holds its caller until every member has reached it.
  MPI_Comm dim_comm(std::size_t dim);
  // World ranks of this rank's line along `dim`, by coordinate.
  std::vector<int> line_world_ranks(std::size_t dim) const;

  // Several dimensions as one line (docs/ARCHITECTURE.md section 3.6): the ranks that
  // share this rank's coordinates along the other dimensions, ranked row-major over the
  // set's dimensions in the mesh's order. A set is a mask of dimension indices (bit d:
  // dimension d; at most 64).
  // The mask of `dims`; UsageError naming the mesh's dimensions for an unknown one, or
  // one given twice.
  std::uint64_t dims_mask(std::span<const std::string> dims) const;
  // The line's size (the product of the set's sizes; 1 for none) and this rank's position
  // on it.
  std::int64_t dims_size(std::uint64_t mask) const;
  std::int64_t dims_position(std::uint64_t mask) const;
  // The line's world ranks, by position.
  std::vector<int> dims_world_ranks(std::uint64_t mask) const;
  // Its communicator (rank = position): a single dimension's is dim_comm's, every
  // dimension's is comm(); another set's is made on first use by the line's members only
  // (after their agreement, within MESHRT_GROUP_TIMEOUT), and freed with the mesh.
  MPI_Comm dims_comm(std::uint64_t mask);
  // "'a', 'b'" (or "no dimension")
  std::string dims_names(std::uint64_t mask) const;

  // "[host=2, gpu=2]"
  std::string to_string() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// An operation in flight. The worker's event loop calls test() between control messages;
// test() makes progress (MPI_Test or a CUDA event query) and returns true once complete.
//
// Destroying a Pending that has not completed waits for it: MPI or the comm thread still
// use the buffers it keeps alive.
class Pending {
 public:
  virtual ~Pending() = default;
  // Progress; true once the operation is complete (and from then on).
  [[nodiscard]] virtual bool test() = 0;
  // The result; only after test() returned true, once. Throws UsageError otherwise, and
  // for an input that did not match its factory (that rank joined with zeros so its
  // peers could complete).
  Outcome take();
  // What wait() does between two test() calls once spinning and yielding are over: sleep
  // for at most `at_most`. An operation that can signal its completion (one run on the
  // comm thread) wakes the caller as soon as it is done instead.
  virtual void idle(std::chrono::microseconds at_most);
  // For desync and timeout reports: "all_reduce sum over dimension 'gpu' of mesh
  // [host=2, gpu=2], 4096 bytes, peers world ranks 1,3".
  virtual std::string describe() const = 0;
  // Whether it completed inside its start (a blocking MPI call) with an outcome that
  // take() returns without throwing: the caller may take it at once, without test().
  bool done_at_start() const noexcept { return finished_ && !taken_ && deferred_error_.empty(); }

 protected:
  // Called by subclasses once the operation completed.
  void finish(Outcome outcome) {
    outcome_ = std::move(outcome);
    finished_ = true;
  }
  void fail_after_completion(std::string message) { deferred_error_ = std::move(message); }
  bool finished() const noexcept { return finished_; }

 private:
  Outcome outcome_;
  bool finished_ = false;
  bool taken_ = false;
  std::string deferred_error_;
};

// How the CPU data plane drives MPI:
// - NonBlocking posts MPI_I* and completes through test(). Open MPI's non-blocking
//   collectives progress only inside MPI calls, so an idle (sleeping) wait stalls them.
// - Blocking runs the plain blocking call inside start_* (test() is then true at once);
//   the calling thread cannot answer anything meanwhile.
// - Thread runs the plain blocking call on meshrt's comm thread (one per process, FIFO,
//   so operations keep the order they were started in); test() reads a flag, so the
//   caller's loop stays free for its control channel. Needs MPI_THREAD_MULTIPLE.
// - Auto: NonBlocking below kThreadMinBytes (a small collective completes while wait()
//   still spins, cheaper than the hand-off to the comm thread), Thread from there on
//   (where NonBlocking stalls between tests). Neither holds the caller's thread: the
//   worker loop's mode with the status tree or more ranks than cores (otherwise the
//   worker blocks: src/worker/worker.cpp, cpu_completion). The crossover is where
//   runtime-collectives finds Thread ahead (docs/benchmarks.md, "Older figures").
// Modes may be mixed only between operations, not while one is in flight: MPI needs the
// collectives of one communicator issued in the same order everywhere, and one thread
// at a time.
enum class Completion : std::uint8_t { NonBlocking, Blocking, Thread, Auto };
inline constexpr std::size_t kThreadMinBytes = std::size_t{256} << 10;

// Reduce over mesh dimension `dim` (docs/ARCHITECTURE.md section 3.6). Usage errors
// that every member sees alike (unknown dimension, dtype, scatter size, in place where
// the collective has no in-place form) are thrown before anything is posted, so every
// member throws and none waits. `factory` is the tensor the controller expects.
//
// Dtypes: bitwise reductions (band, bor, bxor) need an integer or bool dtype. bool
// supports stack, min (all), max (any), band, bor and bxor; sum, avg and product are
// refused (their result is not a bool). avg needs a floating-point dtype: on integers
// it would truncate, so it is refused like torch's mean(). float16 and bfloat16 reduce
// through MPI user-defined operations that compute each step in float and round to
// nearest even, as NCCL does on the GPU.
[[nodiscard]] std::unique_ptr<Pending> start_reduce(WorkerMesh& mesh, std::string_view dim, Reduction reduction,
                                                    bool scatter, bool inplace, Input input, const TensorMeta& factory,
                                                    Completion completion = Completion::Auto);

// A Collective command's operation (docs/ARCHITECTURE.md section 3.6): `kind` over the line
// of the mesh dimensions `dims` (several as one; WorkerMesh::dims_mask), rooted at position
// `root` of that line (-1: none). A Reduce without a root is the table's collective; with
// one, a reduce (stack: a gather) to the root, whose Outcome is undefined on other ranks.
// A Broadcast or Scatter reads the input on the root's ranks only (others pass an undefined
// tensor). A Barrier has no tensor: `factory` is ignored; it completes once every rank of
// the line has reached it.
struct CollectiveOp {
  CollectiveKind kind = CollectiveKind::Reduce;
  std::span<const std::string> dims;
  Reduction reduction = Reduction::Sum;
  bool scatter = false;
  bool inplace = false;
  std::int64_t root = -1;
};
// Whether this rank holds the result of `op` on `mesh` (UsageError as start_collective for
// an unknown dimension): every rank of the line, or for a rooted reduce only the root.
bool defines_result(const WorkerMesh& mesh, const CollectiveOp& op);
// Whether this rank reads its input: every rank, or for a broadcast or scatter the root.
bool reads_input(const WorkerMesh& mesh, const CollectiveOp& op);
// As start_reduce, over MPI: MPI_(I)allreduce .. alltoall over the line's communicator,
// MPI_(I)reduce, gather, bcast, scatter and barrier for the rooted kinds. Usage errors
// (the rules of collective_rule, a dimension not in the mesh) are thrown before anything
// is posted, alike on every member.
[[nodiscard]] std::unique_ptr<Pending> start_collective(WorkerMesh& mesh, const CollectiveOp& op, Input input,
                                                        const TensorMeta& factory,
                                                        Completion completion = Completion::Auto);

// Positional point-to-point over `p2p`: from_ranks[i] sends to to_ranks[i] (ranks of
// `p2p`; `my_rank` is this rank in it), or to to_ranks[to_order[i]] when `to_order` (a
// permutation of the positions) is given; or, when `from_order` is given (a broadcast
// send), to_ranks[j] receives from from_ranks[from_order[j]] and a source sends to every
// target that names it. A rank may send and receive in one command; a rank paired with
// itself copies locally. The Outcome holds the received tensor on a rank in to_ranks, and
// is undefined on a rank that only sends or takes no part.
[[nodiscard]] std::unique_ptr<Pending> start_send_tensor(MPI_Comm p2p, int my_rank, const NDSlice& from_ranks,
                                                         const NDSlice& to_ranks, Input input,
                                                         const TensorMeta& factory,
                                                         Completion completion = Completion::Auto,
                                                         std::span<const std::int64_t> to_order = {},
                                                         std::span<const std::int64_t> from_order = {});

// Completes `pending` without burning a core: spins a few microseconds, then yields,
// then sleeps with growing intervals up to about 1 ms, testing in between.
Outcome wait(Pending& pending);

// The completion the blocking conveniences (reduce, send_tensor) use: the plain blocking
// call, the fastest on a node with a core per rank (docs/benchmarks.md, "Collectives").
inline constexpr Completion kDefaultCompletion = Completion::Blocking;

// Blocking conveniences: start, then wait.
Outcome reduce(WorkerMesh& mesh, std::string_view dim, Reduction reduction, bool scatter, bool inplace, Input input,
               const TensorMeta& factory);
Outcome send_tensor(MPI_Comm p2p, int my_rank, const NDSlice& from_ranks, const NDSlice& to_ranks, Input input,
                    const TensorMeta& factory);

// CPU outputs of 256 KiB and more come from a pool of warm buffers (first touch of fresh
// memory costs far more than a copy into a warm page): a buffer returns to it when the
// last handle of its tensor goes, up to MESHRT_COMM_POOL_BYTES per rank (by default
// min(1 GiB, an eighth of one core's share of physical memory)).
struct OutputPoolStats {
  std::uint64_t hits = 0;    // outputs served by a cached buffer
  std::uint64_t misses = 0;  // outputs that needed a fresh one
  std::size_t cached_bytes = 0;
};
OutputPoolStats output_pool_stats();
// Frees every buffer the pool holds for reuse (Controller::release_cached_memory runs it
// on every worker); returns the bytes freed.
std::size_t release_output_pool();

// As start_reduce / start_send_tensor, for accelerator tensors (cuda or emulated), over
// the device layer's communicators, on the device stream of meshrt stream `stream_id`
// (docs/ARCHITECTURE.md section 7). A reduction's communicator is the line's (made from the MPI
// split of the dimension); a send's is made over exactly its moving ranks (from_ranks ∪
// to_ranks less those sent only to themselves, which copy locally); both are cached by rank
// set. test() polls an event and the communicator's asynchronous error: a device error
// makes take() raise it (the failed communicator is aborted and dropped); a failure of
// this rank's part once the communicator exists, an error at enqueue included, drops it
// too and throws. Bitwise reductions are refused, as NCCL has none.
[[nodiscard]] std::unique_ptr<Pending> start_reduce_device(WorkerMesh& mesh, std::string_view dim, Reduction reduction,
                                                           bool scatter, bool inplace, Input input,
                                                           const TensorMeta& factory, std::uint64_t stream_id);
// A Collective's operation on accelerator tensors, over the device communicator of the
// line (made from dims_comm): the table as start_reduce_device; reduce and broadcast as
// ncclReduce / ncclBroadcast (the emulator's alike); gather and scatter as one group of
// sends and receives at the root. A barrier is never a device operation (start_collective).
[[nodiscard]] std::unique_ptr<Pending> start_collective_device(WorkerMesh& mesh, const CollectiveOp& op, Input input,
                                                               const TensorMeta& factory, std::uint64_t stream_id);
[[nodiscard]] std::unique_ptr<Pending> start_send_tensor_device(MPI_Comm p2p, int my_rank, const NDSlice& from_ranks,
                                                                const NDSlice& to_ranks, Input input,
                                                                const TensorMeta& factory, std::uint64_t stream_id,
                                                                std::span<const std::int64_t> to_order = {},
                                                                std::span<const std::int64_t> from_order = {});

// Destroys the cached device communicators (the runtime calls it before MPI_Finalize);
// the next device operation makes new ones.
void free_device_communicators() noexcept;

}  // namespace meshrt
