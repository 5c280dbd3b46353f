// Value: the argument tree of remote calls and fetches (the seed's pytree).
//
// Leaves are none, bool, int64, double, string, a tensor reference (Ref: the id of a
// value held by the workers), a Tensor, or a TensorMeta (what the controller knows of a
// tensor: shape functions see metas where workers see tensors), or a WorkerObject (what a
// kernel on a worker sees for an object handle; never on the wire). Inner nodes are lists and
// dicts with string keys (insertion-ordered, like a Python dict). flatten() and map()
// walk the leaves in a fixed order (lists in order, dicts in key order as stored), so the
// controller and every worker agree on the i-th leaf.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <variant>
#include <vector>

#include "meshrt/tensor.hpp"

namespace meshrt {

// A reference to a value held by the workers (tensor, mesh, stream, borrow).
struct Ref {
  std::uint64_t id = 0;
  friend bool operator==(Ref, Ref) = default;
  friend auto operator<=>(Ref, Ref) = default;
};

// An opaque object a worker keeps for a mesh (docs/guide.md, "Worker-side objects"): what
// an object-constructing function returned on this rank, shared by every kernel that is
// given its handle. It lives on its worker only: the codec refuses it.
class WorkerObject {
 public:
  WorkerObject() = default;
  template <class T>
  explicit WorkerObject(std::shared_ptr<T> object) : object_(std::move(object)), type_(&typeid(T)) {}

  bool defined() const noexcept { return object_ != nullptr; }
  // The object as a T, or nullptr when it is not a T.
  template <class T>
  T* get() const noexcept {
    return type_ != nullptr && *type_ == typeid(T) ? static_cast<T*>(object_.get()) : nullptr;
  }
  // The type it was made with (typeid(void) when undefined).
  const std::type_info& type() const noexcept { return type_ ? *type_ : typeid(void); }
  // The same object (identity, not contents).
  friend bool operator==(const WorkerObject& a, const WorkerObject& b) noexcept { return a.object_ == b.object_; }

 private:
  std::shared_ptr<void> object_;
  const std::type_info* type_ = nullptr;
};

class Value {
 public:
  enum class Kind : std::uint8_t { None, Bool, Int, Double, String, Ref, Tensor, Meta, List, Dict, Object };
  using List = std::vector<Value>;
  using Dict = std::vector<std::pair<std::string, Value>>;

  Value() = default;
  Value(std::nullptr_t) {}
  Value(bool b) : v_(b) {}
  // Every integer type becomes int64 (an unsigned value above INT64_MAX raises UsageError).
  template <class I>
  requires(std::is_integral_v<I> && !std::is_same_v<I, bool>) Value(I i) : v_(to_int64(i)) {}
  Value(double d) : v_(d) {}
  Value(float f) : v_(static_cast<double>(f)) {}
  Value(std::string s) : v_(std::move(s)) {}
  Value(const char* s) : v_(std::string(s)) {}
  Value(std::string_view s) : v_(std::string(s)) {}
  Value(meshrt::Ref r) : v_(r) {}
  Value(meshrt::Tensor t) : v_(std::move(t)) {}
  Value(TensorMeta m) : v_(std::move(m)) {}
  Value(List l) : v_(std::move(l)) {}
  Value(Dict d) : v_(std::move(d)) {}
  Value(WorkerObject o) : v_(std::move(o)) {}
  // {1, 2, 3} and {"a", 1.0} build lists.
  Value(std::initializer_list<Value> items) : v_(List(items)) {}
  template <class T>
  requires(!std::is_same_v<T, Value> && !std::is_same_v<T, std::pair<std::string, Value>>)
      Value(const std::vector<T>& items)
      : v_(List(items.begin(), items.end())) {}

  static Value list(List items = {}) { return Value(std::move(items)); }
  static Value dict(Dict items = {}) { return Value(std::move(items)); }

  Kind kind() const noexcept { return static_cast<Kind>(v_.index()); }
  bool is_none() const noexcept { return kind() == Kind::None; }
  bool is_bool() const noexcept { return kind() == Kind::Bool; }
  bool is_int() const noexcept { return kind() == Kind::Int; }
  bool is_double() const noexcept { return kind() == Kind::Double; }
  bool is_number() const noexcept { return is_int() || is_double(); }
  bool is_string() const noexcept { return kind() == Kind::String; }
  bool is_ref() const noexcept { return kind() == Kind::Ref; }
  bool is_tensor() const noexcept { return kind() == Kind::Tensor; }
  bool is_meta() const noexcept { return kind() == Kind::Meta; }
  bool is_list() const noexcept { return kind() == Kind::List; }
  bool is_dict() const noexcept { return kind() == Kind::Dict; }
  bool is_object() const noexcept { return kind() == Kind::Object; }
  bool is_leaf() const noexcept { return !is_list() && !is_dict(); }

  // Typed access; each throws UsageError "expected <kind>, found <kind> <value>".
  bool as_bool() const;
  std::int64_t as_int() const;
  double as_number() const;  // int or double
  const std::string& as_string() const;
  meshrt::Ref as_ref() const;
  const meshrt::Tensor& as_tensor() const;
  meshrt::Tensor& as_tensor();
  const TensorMeta& as_meta() const;
  const List& as_list() const;
  List& as_list();
  const Dict& as_dict() const;
  const WorkerObject& as_object() const;
  Dict& as_dict();
  // The dict entry `key`; throws UsageError naming the keys present.
  const Value& at(std::string_view key) const;
  const Value& at(std::size_t index) const;

  // Leaves for which pred is true, in tree order (pointers into this tree).
  std::vector<const Value*> flatten(const std::function<bool(const Value&)>& pred) const;
  std::vector<Value*> flatten(const std::function<bool(const Value&)>& pred);
  // Every Ref in tree order.
  std::vector<meshrt::Ref> refs() const;
  // A copy of the tree with f applied to every leaf (inner nodes keep their shape).
  Value map(const std::function<Value(const Value&)>& f) const;
  // Calls f on every leaf, in tree order.
  void for_each_leaf(const std::function<void(const Value&)>& f) const;

  // "[1, 'a', ref(3), float32[2] on cpu, {'k': none}]", for error messages and logs.
  std::string to_string() const;
  static std::string_view kind_name(Kind kind) noexcept;

  // Structural equality; tensors compare by meta and bytes, doubles by bits (so NaN == NaN
  // and a round trip through the codec compares equal).
  friend bool operator==(const Value& a, const Value& b);

 private:
  template <class I>
  static std::int64_t to_int64(I i) {
    if constexpr (std::is_unsigned_v<I> && sizeof(I) >= sizeof(std::int64_t)) {
      if (i > static_cast<I>(INT64_MAX)) throw_unsigned_overflow(static_cast<std::uint64_t>(i));
    }
    return static_cast<std::int64_t>(i);
  }
  [[noreturn]] static void throw_unsigned_overflow(std::uint64_t value);
  [[noreturn]] void throw_kind(std::string_view expected) const;

  std::variant<std::monostate, bool, std::int64_t, double, std::string, meshrt::Ref, meshrt::Tensor, TensorMeta, List,
               Dict, WorkerObject>
      v_;
};

}  // namespace meshrt
