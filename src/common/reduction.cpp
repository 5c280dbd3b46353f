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
  throw UsageError(fmt::format(
      "unknown reduction \"{}\": expected one of stack, sum, avg, product, min, max, band, bor, bxor", text));
}

ReductionRule reduction_rule(const TensorMeta& in, std::int64_t n, Reduction reduction, bool scatter, bool inplace,
                             Device::Kind device) {
  ReductionRule rule;
  const DType dtype = in.dtype();
  if (is_bitwise(reduction)) {
    if (device != Device::Kind::Cpu) {  // cuda, and emulated, which keeps NCCL's rules
      rule.error = fmt::format(
          "bitwise reduction {} is not supported by NCCL, found {} tensor {}; move it to the CPU or use another "
          "reduction",
          name(reduction),
          device == Device::Kind::Cuda ? "a CUDA" : "an emulated-accelerator (which keeps NCCL's rules)",
          in.to_string());
      return rule;
    }
    if (is_floating(dtype)) {
      rule.error =
          fmt::format("bitwise reduction {} needs an integer or bool dtype, found {}", name(reduction), name(dtype));
      return rule;
    }
  }
  if (dtype == DType::Bool &&
      (reduction == Reduction::Sum || reduction == Reduction::Avg || reduction == Reduction::Product)) {
    rule.error = fmt::format(
        "reduction {} needs a numeric dtype, found bool; on bool use max or bor (any), min or band (all), bxor "
        "(parity)",
        name(reduction));
    return rule;
  }
  // An integer average would truncate (the average of 0..3 would be 1): refused as torch
  // refuses mean() on integers, with both ways to get the intended value.
  if (reduction == Reduction::Avg && !is_floating(dtype)) {
    rule.error = fmt::format(
        "reduction avg needs a floating-point dtype, found {} (an integer average would truncate); use sum and "
        "divide, or cast to a float dtype first",
        name(dtype));
    return rule;
  }
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

}  // namespace meshrt
