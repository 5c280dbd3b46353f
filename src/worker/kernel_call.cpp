#include "worker/kernel_call.hpp"

#include <fmt/format.h>

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

}  // namespace

bool KernelCall::same_meta(const Value& meta, const Value& v) {
  if (v.is_tensor()) return meta.is_meta() && meta.as_meta() == v.as_tensor().meta();
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
  if (auto it = inferred_.find(&fn); it != inferred_.end()) {
    const ArgMetas& seen = it->second.args;
    bool same = seen.device() == device && seen.size() == args.size();
    for (std::size_t i = 0; same && i < args.size(); ++i) same = same_meta(seen.value(i), args.value(i));
    if (same) return it->second.signature;
  }
  std::vector<Value> metas;
  metas.reserve(args.size());
  for (std::size_t i = 0; i < args.size(); ++i) {
    metas.push_back(
        args.value(i).map([](const Value& leaf) { return leaf.is_tensor() ? Value(leaf.as_tensor().meta()) : leaf; }));
  }
  ArgMetas seen(fn.name, std::move(metas), device);
  Signature signature = functions::infer(fn, seen);
  auto& entry = inferred_.insert_or_assign(&fn, Inferred{std::move(seen), std::move(signature)}).first->second;
  return entry.signature;
}

void KernelCall::check(const std::string& function, const Signature& expected,
                       const std::vector<Tensor>& outputs) const {
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
}

}  // namespace meshrt::detail
