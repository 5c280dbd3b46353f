// A worker's environment: the value each ref names on this rank (a tensor, the marker of
// the failure it depends on, a mesh, a stream or a worker object), and the lookups commands make. A lookup
// returns the marker as a value: what depends on a failure is re-marked, not run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <variant>
#include <vector>

#include "meshrt/device.hpp"
#include "meshrt/functions.hpp"
#include "meshrt/internal/comm.hpp"
#include "meshrt/internal/protocol.hpp"
#include "worker/streams.hpp"

namespace meshrt::detail {

struct MeshValue {
  std::shared_ptr<WorkerMesh> mesh;
  Device::Kind kind = Device::Kind::Cpu;  // the device kind the mesh is placed on
};

struct StreamValue {
  std::uint64_t id = 0;
  bool is_default = true;
  StreamHandle handle;
};

using EnvValue = std::variant<Tensor, DependentOnError, MeshValue, StreamValue, WorkerObject>;
// The alternative of EnvValue that holds a T.
template <class T>
inline constexpr std::size_t kKindOf = std::is_same_v<T, Tensor>             ? 0
                                       : std::is_same_v<T, DependentOnError> ? 1
                                       : std::is_same_v<T, MeshValue>        ? 2
                                       : std::is_same_v<T, StreamValue>      ? 3
                                                                             : 4;

// What a lookup found: the value, or the marker of the failure it depends on.
template <class T>
struct Found {
  const T* value = nullptr;  // null when `failed` holds the marker
  DependentOnError failed{};
  explicit operator bool() const noexcept { return value != nullptr; }
  const T& operator*() const noexcept { return *value; }
  const T* operator->() const noexcept { return value; }
};

class Env {
 public:
  explicit Env(int rank) : rank_(rank) {}

  std::size_t size() const noexcept { return values_.size(); }

  void define(Ref r, EnvValue v);
  // Forgets `id` (an unknown id is ignored: the controller may delete what never came).
  void undefine(std::uint64_t id);

  // The value of `r`. A ref that is not defined here is the sender's fault: ProtocolError
  // naming the ref, its `role` in the command and this rank.
  const EnvValue& get(Ref r, std::string_view role) const;
  // The value of `r` as a T, or its marker; a value of another kind is a UsageError
  // naming both kinds.
  template <class T>
  Found<T> find(Ref r, std::string_view role) const {
    const EnvValue& v = get(r, role);
    if (const auto* t = std::get_if<T>(&v)) return {t, {}};
    if (const auto* marker = std::get_if<DependentOnError>(&v)) return {nullptr, *marker};
    throw_kind(r, role, kind_name(kKindOf<T>), v);
  }
  // The mesh `r` names, which must be one (a marker included: a mesh never fails).
  const MeshValue& mesh(Ref r, std::string_view role) const;
  // The stream `r` names, if it is one.
  const StreamHandle* stream_handle(Ref r) const;

  // A tensor input, or the marker that stands in for it.
  Input input(Ref r) const;
  // `v` with every Ref replaced by its tensor or worker object, or the first marker found
  // instead.
  std::variant<Value, DependentOnError> resolve(const Value& v) const;

  // "a tensor", "a failure marker", "a mesh", "a stream", "a worker object": the
  // alternative `index` of EnvValue.
  static std::string_view kind_name(std::size_t index) noexcept;

 private:
  [[noreturn]] void throw_kind(Ref r, std::string_view role, std::string_view expected, const EnvValue& found) const;

  int rank_;
  std::unordered_map<std::uint64_t, EnvValue> values_;
  // Nodes of deleted entries (values released), reused by the next definitions: a loop
  // defines one result per command and the controller deletes them in batches, which
  // would otherwise free and allocate a node per value.
  std::vector<decltype(values_)::node_type> spare_nodes_;
  static constexpr std::size_t kSpareNodes = 256;
};

}  // namespace meshrt::detail
