#include "worker/kernel_call.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string_view>

#include "meshrt/device.hpp"
#include "meshrt/error.hpp"

namespace meshrt::detail {
namespace {

// On the controller a device means "each rank's own device of this kind"
// (docs/ARCHITECTURE.md section 7): an output matches its declared meta when shape, dtype
// and device kind agree, and an accelerator output is on this rank's own device.
bool matches(const TensorMeta& got, const TensorMeta& want) {
  if (got.shape() != want.shape() || got.dtype() != want.dtype()) return false;
  if (got.device().kind() != want.device().kind()) return false;
  return got.device().is_cpu() || got.device() == device::rank_device(got.device().kind());
}

// Whether two tensors' bytes overlap: their byte ranges on one device, so a reshape of an
// input, or a view of it made through DLPack or a host library, counts as the input.
bool overlaps(const Tensor& a, const Tensor& b) noexcept {
  if (a.nbytes() == 0 || b.nbytes() == 0 || !(a.device() == b.device())) return false;
  const auto a0 = reinterpret_cast<std::uintptr_t>(a.raw_data());
  const auto b0 = reinterpret_cast<std::uintptr_t>(b.raw_data());
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

// Whether `inner`'s bytes lie inside `outer`'s, on the same device: a declared view.
bool within(const Tensor& inner, const Tensor& outer) noexcept {
  if (!(inner.device() == outer.device())) return false;
  if (inner.nbytes() == 0) return true;
  const auto i0 = reinterpret_cast<std::uintptr_t>(inner.raw_data());
  const auto o0 = reinterpret_cast<std::uintptr_t>(outer.raw_data());
  return o0 <= i0 && i0 + inner.nbytes() <= o0 + outer.nbytes();
}

// The tensor in `v` (an argument: a tensor, or lists and dicts of them) whose memory
// `out` overlaps, as where it sits in `v` (" item 2", " item 'w'"); nullopt when none.
std::optional<std::string> aliased_in(const Value& v, const Tensor& out) {
  if (v.is_tensor()) return overlaps(v.as_tensor(), out) ? std::optional<std::string>("") : std::nullopt;
  if (v.is_list()) {
    for (std::size_t i = 0; i < v.as_list().size(); ++i) {
      if (auto at = aliased_in(v.as_list()[i], out)) return fmt::format(" item {}{}", i, *at);
    }
  } else if (v.is_dict()) {
    for (const auto& [key, item] : v.as_dict()) {
      if (auto at = aliased_in(item, out)) return fmt::format(" item '{}'{}", key, *at);
    }
  }
  return std::nullopt;
}

}  // namespace

bool KernelCall::same_meta(const Value& meta, const Value& v) {
  if (v.is_tensor()) return meta.is_meta() && meta.as_meta() == v.as_tensor().meta();
  if (v.is_object()) return meta.is_none();
  if (v.is_list()) {
    if (!meta.is_list() || meta.as_list().size() != v.as_list().size()) return false;
    for (std::size_t i = 0; i < v.as_list().size(); ++i) {
      if (!same_meta(meta.as_list()[i], v.as_list()[i])) return false;
    }
    return true;
  }
  if (v.is_dict()) {
    if (!meta.is_dict() || meta.as_dict().size() != v.as_dict().size()) return false;
    for (std::size_t i = 0; i < v.as_dict().size(); ++i) {
      if (meta.as_dict()[i].first != v.as_dict()[i].first ||
          !same_meta(meta.as_dict()[i].second, v.as_dict()[i].second))
        return false;
    }
    return true;
  }
  return meta == v;
}

const Signature& KernelCall::expected(const functions::Function& fn, const Args& args, const Device& device) {
  if (last_ != &fn) {
    last_answers_ = &inferred_[&fn];
    last_ = &fn;
  }
  Answers& answers = *last_answers_;
  for (const Inferred& kept : answers.kept) {
    const ArgMetas& seen = kept.args;
    bool same = seen.device() == device && seen.size() == args.size();
    for (std::size_t i = 0; same && i < args.size(); ++i) same = same_meta(seen.value(i), args.value(i));
    if (same) return kept.signature;
  }
  std::vector<Value> metas;
  metas.reserve(args.size());
  for (std::size_t i = 0; i < args.size(); ++i) {
    // A worker object is None to shape functions, as on the controller (and the cache
    // must not keep it alive).
    metas.push_back(args.value(i).map([](const Value& leaf) {
      if (leaf.is_object()) return Value();
      return leaf.is_tensor() ? Value(leaf.as_tensor().meta()) : leaf;
    }));
  }
  ArgMetas seen(fn.name, std::move(metas), device);
  Signature signature = functions::infer(fn, seen);
  Inferred answer{std::move(seen), std::move(signature)};
  if (answers.kept.size() < kPerFunction) {
    answers.kept.reserve(kPerFunction);  // a caller's reference stays valid
    answers.kept.push_back(std::move(answer));
    return answers.kept.back().signature;
  }
  Inferred& replaced = answers.kept[answers.next];
  answers.next = (answers.next + 1) % kPerFunction;
  replaced = std::move(answer);
  return replaced.signature;
}

void KernelCall::check(const std::string& function, const Signature& expected, const std::vector<Tensor>& outputs,
                       const Args& inputs) const {
  if (outputs.size() != expected.outputs.size()) {
    throw UsageError(fmt::format("{} returned {} tensors on rank {}; its shape function declared {}", function,
                                 outputs.size(), rank_, expected.outputs.size()));
  }
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    const TensorMeta& want = expected.outputs[i];
    const Tensor& got = outputs[i];
    if (!got.defined() || !matches(got.meta(), want)) {
      throw UsageError(fmt::format("{} returned on rank {} as output {}: expected {} (its shape function), found {}",
                                   function, rank_, i, want.to_string(),
                                   got.defined() ? got.meta().to_string() : "an undefined tensor"));
    }
  }
  // An output is a new value to the controller, unless its shape function declares it a
  // view of an argument: one that is an input's memory (or another output's) without the
  // declaration would change when the other is changed in place later.
  constexpr std::string_view fix =
      "return a new tensor (a clone, or a copy into a new tensor), or declare the output a view of the argument "
      "in the shape function (Signature::views, {.output = k, .input = j}; views= in Python)";
  const auto view_of = [&](std::size_t i) -> const View* {
    for (const View& v : expected.views) {
      if (v.output == i) return &v;
    }
    return nullptr;
  };
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    if (const View* v = view_of(i)) {
      // A declared view lies inside its argument's storage; it may overlap the other views.
      const Value& arg = inputs.value(v->input);
      if (!arg.is_tensor() || !within(outputs[i], arg.as_tensor())) {
        throw UsageError(fmt::format(
            "{} returned on rank {} as output {} ({}) memory outside its argument {}{}, which its shape function "
            "declares it a view of: expected bytes within the argument's [{}, +{}), found [{}, +{}); return a "
            "view into the argument (a reshape, or rows of it), or a new tensor and no declared view",
            function, rank_, i, outputs[i].meta().to_string(), v->input,
            arg.is_tensor() ? " (" + arg.as_tensor().meta().to_string() + ")" : std::string(),
            arg.is_tensor() ? arg.as_tensor().raw_data() : nullptr, arg.is_tensor() ? arg.as_tensor().nbytes() : 0,
            outputs[i].raw_data(), outputs[i].nbytes()));
      }
      continue;
    }
    for (std::size_t a = 0; a < inputs.size(); ++a) {
      if (auto at = aliased_in(inputs.value(a), outputs[i])) {
        throw UsageError(fmt::format(
            "{} returned on rank {} as output {} ({}) the memory of its argument {}{}: an output must be a new tensor, "
            "not an undeclared view of an input; {}",
            function, rank_, i, outputs[i].meta().to_string(), a, *at, fix));
      }
    }
    for (std::size_t j = 0; j < outputs.size(); ++j) {
      if (j != i && (j < i || view_of(j) != nullptr) && overlaps(outputs[j], outputs[i])) {
        throw UsageError(fmt::format(
            "{} returned on rank {} outputs {} and {} in the same memory: each output must be a new tensor of its "
            "own; {}",
            function, rank_, std::min(i, j), std::max(i, j), fix));
      }
    }
  }
}

}  // namespace meshrt::detail
