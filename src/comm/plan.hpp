// What the MPI and device data planes share: the checks of a Reduce or SendTensor command
// before anything is posted, and the substitution of zeros for a broken input.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "meshrt/internal/comm.hpp"

namespace meshrt::detail {

enum class Backend : std::uint8_t { Mpi, Device };

struct ReducePlan {
  std::size_t dim = 0;
  std::int64_t n = 1;           // size of the dimension
  const char* collective = "";  // "all_reduce", "all_gather", "all_to_all", "reduce_scatter"
  // The output's meta when it differs from the factory's (all_gather, reduce_scatter);
  // not copied otherwise: a TensorMeta copy allocates, and this is the 8-byte hot path.
  std::optional<TensorMeta> reshaped;
  const TensorMeta& out_meta(const TensorMeta& factory) const { return reshaped ? *reshaped : factory; }
};

// A Collective's operation on this rank: the line (a set of dimensions), its size and this
// rank's position, and what collective_rule says.
struct CollectivePlan {
  std::uint64_t mask = 0;
  std::int64_t n = 1;
  std::int64_t position = 0;
  const char* collective = "";
  std::optional<TensorMeta> reshaped;
  const TensorMeta& out_meta(const TensorMeta& factory) const { return reshaped ? *reshaped : factory; }
  bool is_root(std::int64_t root) const noexcept { return root == position; }
};

// Every check depends only on the command (the mesh, `factory`, the flags), never on the
// local input, so every member of the line throws alike and none is left waiting.
CollectivePlan plan_collective(const WorkerMesh& mesh, const CollectiveOp& op, const TensorMeta& factory,
                               Backend backend);
ReducePlan plan_reduce(const WorkerMesh& mesh, std::string_view dim, Reduction reduction, bool scatter, bool inplace,
                       const TensorMeta& factory, Backend backend);

// The tensor a rank joins an operation with: its input, or factory.zeros() when the
// input is broken or does not match the factory. `mismatch` then holds the error that
// take() raises once the operation has completed (so the peers complete too), naming
// `op`; the caller appends where it happened (where_reduce, where_send) only then, as
// formatting that on every operation cost a tenth of worker 0's part in an 8 B to_mesh.
struct Joined {
  Tensor tensor;
  std::optional<DependentOnError> broken;
  std::string mismatch;
};
Joined join_input(Input&& input, const TensorMeta& factory, std::string_view op);
// The same without the zeros: `tensor` stays undefined where join_input makes them (the
// device data plane makes them on the operation's stream).
Joined check_input(Input&& input, const TensorMeta& factory, std::string_view op);

// " (dimension 'gpu' of mesh [host=2, gpu=2], world rank 3)"
std::string where_reduce(const WorkerMesh& mesh, std::size_t dim);
// " (world rank 3, sending to rank 5)"
std::string where_send(int my_rank, int send_to);

// " (dimensions 'host', 'gpu' of mesh [host=2, gpu=2], world rank 3)"
std::string where_collective(const WorkerMesh& mesh, std::uint64_t mask);

// "all_reduce sum over dimension 'gpu' of mesh [host=2, gpu=2], 4096 bytes, peers world
// ranks 1,3"
std::string describe_reduce(const WorkerMesh& mesh, std::size_t dim, const char* collective, Reduction reduction,
                            std::size_t bytes, std::string_view backend);

// "reduce sum to position 1 over dimensions 'host', 'gpu' of mesh [host=2, gpu=2], 4096
// bytes, peers world ranks 0,1,2,3 (MPI)"
std::string describe_collective(const WorkerMesh& mesh, const CollectiveOp& op, std::uint64_t mask,
                                const char* collective, std::size_t bytes, std::string_view backend);

// SendTensor: from_ranks[i] -> to_ranks[i], or to_ranks[to_order[i]] for a permutation
// send (to_order: a permutation of the positions, checked by the decoder), or
// from_ranks[from_order[j]] -> to_ranks[j] for a broadcast send (a source may send to
// several targets); this rank's send peer and receive peer (-1 when none), and a
// broadcast's further send peers. A self-pair has send_to == recv_from == my_rank.
struct SendPlan {
  int send_to = -1;
  int recv_from = -1;
  bool self = false;
  std::vector<int> also_to;  // a broadcast source's other targets, never this rank
};
SendPlan plan_send(int my_rank, int comm_size, const NDSlice& from_ranks, const NDSlice& to_ranks,
                   const TensorMeta& factory, Backend backend, std::span<const std::int64_t> to_order = {},
                   std::span<const std::int64_t> from_order = {});
std::string describe_send(const SendPlan& plan, int my_rank, std::size_t bytes, std::string_view backend);

// MPI's counts are int: more elements than that in one message over MPI (the emulated
// accelerator's collectives included) are refused; NCCL's counts are size_t.
void check_count(std::int64_t count, std::string_view what);

}  // namespace meshrt::detail
