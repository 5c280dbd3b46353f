#include "meshrt/reduction.hpp"

#include <fmt/format.h>

#include <array>

#include "meshrt/error.hpp"

namespace meshrt {
namespace {
constexpr std::array<std::string_view, kNumReductions> kNames{"stack", "sum",  "avg", "product", "min",
                                                              "max",   "band", "bor", "bxor"};

TensorMeta without_dim0(const TensorMeta& in) {
  return in.with_shape({in.shape().begin() + 1, in.shape().end()});
}
}  // namespace

std::string_view name(Reduction reduction) noexcept {
  const auto i = static_cast<std::size_t>(reduction);
  return i < kNames.size() ? kNames[i] : std::string_view("?");
}

Reduction parse_reduction(std::string_view text) {
  for (std::size_t i = 0; i < kNames.size(); ++i) {
    if (kNames[i] == text) return static_cast<Reduction>(i);
  }
  // torch.distributed and numpy users say mean.
  if (text == "mean") return Reduction::Avg;
  throw UsageError(fmt::format(
      "unknown reduction \"{}\": expected one of stack, sum, avg (or mean), product, min, max, band, bor, bxor", text));
}

namespace {

// The dtype and device rules of `reduction` (every collective that combines values): why
// `in` is refused, or empty.
std::string dtype_error(const TensorMeta& in, Reduction reduction, Device::Kind device) {
  const DType dtype = in.dtype();
  if (is_bitwise(reduction)) {
    if (device != Device::Kind::Cpu) {  // cuda, and emulated, which keeps NCCL's rules
      return fmt::format(
          "bitwise reduction {} is not supported by NCCL, found {} tensor {}; move it to the CPU or use another "
          "reduction",
          name(reduction),
          device == Device::Kind::Cuda ? "a CUDA" : "an emulated-accelerator (which keeps NCCL's rules)",
          in.to_string());
    }
    if (is_floating(dtype)) {
      return fmt::format("bitwise reduction {} needs an integer or bool dtype, found {}", name(reduction), name(dtype));
    }
  }
  if (dtype == DType::Bool &&
      (reduction == Reduction::Sum || reduction == Reduction::Avg || reduction == Reduction::Product)) {
    return fmt::format(
        "reduction {} needs a numeric dtype, found bool; on bool use max or bor (any), min or band (all), bxor "
        "(parity)",
        name(reduction));
  }
  // An integer average would truncate (the average of 0..3 would be 1): refused as torch
  // refuses mean() on integers, with both ways to get the intended value.
  if (reduction == Reduction::Avg && !is_floating(dtype)) {
    return fmt::format(
        "reduction avg needs a floating-point dtype, found {} (an integer average would truncate); use sum and "
        "divide, or cast to a float dtype first",
        name(dtype));
  }
  return {};
}

}  // namespace

ReductionRule reduction_rule(const TensorMeta& in, std::int64_t n, Reduction reduction, bool scatter, bool inplace,
                             Device::Kind device) {
  ReductionRule rule;
  rule.error = dtype_error(in, reduction, device);
  if (!rule.error.empty()) return rule;
  const bool stack = reduction == Reduction::Stack;
  if (scatter && (in.ndim() == 0 || in.shape()[0] != n)) {
    rule.error = fmt::format("{} with scatter over a dimension of size {} needs an input with size(0) == {}, found {}",
                             name(reduction), n, n, in.to_string());
    return rule;
  }
  if (inplace && !scatter && stack) {
    rule.error = fmt::format("stack (all_gather) cannot run in place: its output [{}, ...] is larger than its input {}",
                             n, in.to_string());
    return rule;
  }
  if (inplace && scatter && !stack) {
    rule.error =
        fmt::format("{} with scatter (reduce_scatter) cannot run in place: its output {} is smaller than its input {}",
                    name(reduction), without_dim0(in).to_string(), in.to_string());
    return rule;
  }
  if (stack && !scatter) {
    rule.collective = "all_gather";
    std::vector<std::int64_t> shape{n};
    shape.insert(shape.end(), in.shape().begin(), in.shape().end());
    rule.reshaped = in.with_shape(std::move(shape));
  } else if (stack) {
    rule.collective = "all_to_all";
  } else if (scatter) {
    rule.collective = "reduce_scatter";
    rule.reshaped = without_dim0(in);
  } else {
    rule.collective = "all_reduce";
  }
  return rule;
}

std::string_view name(CollectiveKind kind) noexcept {
  constexpr std::array<std::string_view, kNumCollectiveKinds> kKinds{"reduce", "broadcast", "scatter", "barrier"};
  const auto i = static_cast<std::size_t>(kind);
  return i < kKinds.size() ? kKinds[i] : std::string_view("?");
}

ReductionRule collective_rule(const TensorMeta& in, std::int64_t n, CollectiveKind kind, Reduction reduction,
                              bool scatter, bool inplace, std::int64_t root, Device::Kind device) {
  if (kind == CollectiveKind::Reduce && root < 0) return reduction_rule(in, n, reduction, scatter, inplace, device);
  ReductionRule rule;
  if (kind == CollectiveKind::Barrier) {
    rule.collective = "barrier";
    return rule;
  }
  const bool stack = kind == CollectiveKind::Reduce && reduction == Reduction::Stack;
  const char* collective = kind == CollectiveKind::Broadcast ? "broadcast"
                           : kind == CollectiveKind::Scatter ? "scatter"
                           : stack                           ? "gather"
                                                             : "reduce";
  if (root < 0 || root >= n) {
    rule.error = fmt::format("{} over {} rank{}: expected a root coordinate in 0..{}, found {}", collective, n,
                             n == 1 ? "" : "s", n - 1, root < 0 ? std::string("none") : std::to_string(root));
    return rule;
  }
  if (scatter) {
    rule.error = fmt::format(
        "{} to a root cannot scatter (a reduce_scatter has no root): expected scatter=false with a root, found "
        "scatter=true; reduce with scatter and no root, or scatter the rooted result from its root",
        collective);
    return rule;
  }
  if (inplace) {
    rule.error = fmt::format(
        "{} with a root cannot run in place: expected an out-of-place call, found in place (a rooted result is not "
        "the input's on every rank); call it out of place",
        collective);
    return rule;
  }
  if (kind == CollectiveKind::Reduce && !stack) {
    rule.error = dtype_error(in, reduction, device);
    if (!rule.error.empty()) return rule;
  }
  if (kind == CollectiveKind::Scatter && (in.ndim() == 0 || in.shape()[0] % n != 0)) {
    rule.error = fmt::format("scatter over {} ranks needs an input whose size(0) splits into {} equal parts, found {}",
                             n, n, in.to_string());
    return rule;
  }
  rule.collective = collective;
  if (stack) {
    std::vector<std::int64_t> shape{n};
    shape.insert(shape.end(), in.shape().begin(), in.shape().end());
    rule.reshaped = in.with_shape(std::move(shape));
  } else if (kind == CollectiveKind::Scatter) {
    std::vector<std::int64_t> shape = in.shape();
    shape[0] /= n;
    rule.reshaped = in.with_shape(std::move(shape));
  }
  return rule;
}

}  // namespace meshrt
