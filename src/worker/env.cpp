#include "worker/env.hpp"

#include <fmt/format.h>

#include <iterator>
#include <optional>

#include "meshrt/error.hpp"

namespace meshrt::detail {

void Env::define(Ref r, EnvValue v) {
  if (spare_nodes_.empty()) {
    values_.insert_or_assign(r.id, std::move(v));
    return;
  }
  if (auto it = values_.find(r.id); it != values_.end()) {
    it->second = std::move(v);
    return;
  }
  auto node = std::move(spare_nodes_.back());
  spare_nodes_.pop_back();
  node.key() = r.id;
  node.mapped() = std::move(v);
  values_.insert(std::move(node));
}

void Env::undefine(std::uint64_t id) {
  auto node = values_.extract(id);
  if (node.empty()) return;
  node.mapped() = EnvValue();  // the value goes now, the node stays for the next one
  if (spare_nodes_.size() < kSpareNodes) spare_nodes_.push_back(std::move(node));
}

const EnvValue& Env::get(Ref r, std::string_view role) const {
  auto it = values_.find(r.id);
  if (it == values_.end()) {
    throw ProtocolError(fmt::format("rank {}: {} ref {} is not defined on this worker (deleted, or never sent here)",
                                    rank_, role, r.id));
  }
  return it->second;
}

const MeshValue& Env::mesh(Ref r, std::string_view role) const {
  const EnvValue& v = get(r, role);
  if (const auto* m = std::get_if<MeshValue>(&v)) return *m;
  throw_kind(r, role, kind_name(kKindOf<MeshValue>), v);
}

const StreamHandle* Env::stream_handle(Ref r) const {
  auto it = values_.find(r.id);
  if (it == values_.end()) return nullptr;
  const auto* s = std::get_if<StreamValue>(&it->second);
  return s ? &s->handle : nullptr;
}

Input Env::input(Ref r) const {
  const EnvValue& v = get(r, "tensor");
  if (const auto* t = std::get_if<Tensor>(&v)) return *t;
  if (const auto* marker = std::get_if<DependentOnError>(&v)) return *marker;
  throw_kind(r, "tensor", kind_name(kKindOf<Tensor>), v);
}

std::variant<Value, DependentOnError> Env::resolve(const Value& v) const {
  std::optional<DependentOnError> marker;
  Value out = v.map([&](const Value& leaf) -> Value {
    if (!leaf.is_ref() || marker) return leaf;
    if (const auto* object = std::get_if<WorkerObject>(&get(leaf.as_ref(), "argument"))) return Value(*object);
    const Found<Tensor> t = find<Tensor>(leaf.as_ref(), "argument");
    if (t) return Value(*t);
    marker = t.failed;
    return leaf;
  });
  if (marker) return *marker;
  return out;
}

std::string_view Env::kind_name(std::size_t index) noexcept {
  constexpr std::string_view kNames[] = {"a tensor", "a failure marker", "a mesh", "a stream", "a worker object"};
  return index < std::size(kNames) ? kNames[index] : "a value of an unknown kind";
}

void Env::throw_kind(Ref r, std::string_view role, std::string_view expected, const EnvValue& found) const {
  throw UsageError(
      fmt::format("rank {}: {} ref {}: expected {}, found {}", rank_, role, r.id, expected, kind_name(found.index())));
}

}  // namespace meshrt::detail
