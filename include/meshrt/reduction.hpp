// The reductions over a mesh dimension (or several as one) and the rooted collectives, and
// their rules (docs/ARCHITECTURE.md section 3.6, "Reductions"). The rules live here once:
// the controller checks them at the call site and every worker checks them again before
// posting (a worker cannot trust a frame).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "meshrt/tensor.hpp"

namespace meshrt {

enum class Reduction : std::uint8_t { Stack, Sum, Avg, Product, Min, Max, Band, Bor, Bxor };
inline constexpr int kNumReductions = 9;

// "stack", "sum", "avg", "product", "min", "max", "band", "bor", "bxor".
std::string_view name(Reduction reduction) noexcept;
// Parses the names above, and "mean" (avg); throws UsageError listing them.
Reduction parse_reduction(std::string_view text);
inline bool is_bitwise(Reduction r) noexcept {
  return r == Reduction::Band || r == Reduction::Bor || r == Reduction::Bxor;
}

// What the rules say of one reduction: the collective it becomes and its output, or why
// it is refused.
struct ReductionRule {
  // Empty when the reduction is allowed; otherwise what was expected and what was found.
  // The caller adds where (the call site, or the worker's mesh and rank).
  std::string error;
  // "all_reduce", "all_gather", "all_to_all" or "reduce_scatter"; "" when refused.
  const char* collective = "";
  // The output's meta when it differs from the input's (all_gather, reduce_scatter). Not
  // a copy otherwise: a TensorMeta copy allocates, and a worker checks every reduction.
  std::optional<TensorMeta> reshaped;

  bool allowed() const noexcept { return error.empty(); }
  const TensorMeta& out_meta(const TensorMeta& in) const { return reshaped ? *reshaped : in; }
};

// The rules of a reduction of a tensor `in` over a mesh dimension of `n` ranks, run on
// `device` (Cuda: NCCL, which has no bitwise operations, and Emulated, which keeps NCCL's
// rules; Cpu: MPI). Pure: it throws
// nothing and depends on nothing but its arguments, so the controller and the workers
// agree by construction.
//
//   reduction        scatter  collective      shape in -> out     in place
//   stack            no       all_gather      S -> [n, *S]        no
//   stack            yes      all_to_all      [n, ...] -> same    yes
//   sum .. bxor      no       all_reduce      S -> S              yes
//   sum .. bxor      yes      reduce_scatter  [n, *R] -> R        no
//
// Besides: bitwise reductions need an integer or bool dtype and a CPU tensor; sum, avg
// and product need a numeric dtype (not bool); avg needs a floating-point dtype (an
// integer average would truncate).
ReductionRule reduction_rule(const TensorMeta& in, std::int64_t n, Reduction reduction, bool scatter, bool inplace,
                             Device::Kind device);

// What a Collective command runs over its ranks (a mesh dimension, or several as one):
// the table above (Reduce without a root), a rooted reduce (with a root; stack is a
// gather), a broadcast and a scatter from a root, or a barrier.
enum class CollectiveKind : std::uint8_t { Reduce, Broadcast, Scatter, Barrier };
inline constexpr int kNumCollectiveKinds = 4;
// "reduce", "broadcast", "scatter", "barrier".
std::string_view name(CollectiveKind kind) noexcept;

// The rules of a collective of `kind` of `in` over `n` ranks, rooted at position `root`
// (0..n-1; -1: none), run on `device`. Without a root, Reduce is reduction_rule. With one:
//
//   kind       reduction     collective  shape in -> out           the result lives on
//   Reduce     sum .. bxor   reduce      S -> S                    the root
//   Reduce     stack         gather      S -> [n, *S]              the root
//   Broadcast  (none)        broadcast   S -> S                    every rank
//   Scatter    (none)        scatter     [k*n, *R] -> [k, *R]      every rank (part i on i)
//   Barrier    (none)        barrier     no tensor                 no tensor
//
// Refused besides reduction_rule's dtype and device rules: a root outside 0..n-1 (or
// none for Broadcast and Scatter), scatter or in place with a root (a reduce_scatter has
// no root, and a rooted result is not on every rank of the input), a scatter whose input
// has no dimension 0 that splits into n equal parts. Pure, as reduction_rule.
ReductionRule collective_rule(const TensorMeta& in, std::int64_t n, CollectiveKind kind, Reduction reduction,
                              bool scatter, bool inplace, std::int64_t root, Device::Kind device);

}  // namespace meshrt
