#include "meshrt/value.hpp"

#include <fmt/format.h>

#include <bit>

#include <boost/core/demangle.hpp>

namespace meshrt {

std::string_view Value::kind_name(Kind kind) noexcept {
  switch (kind) {
    case Kind::None:
      return "none";
    case Kind::Bool:
      return "bool";
    case Kind::Int:
      return "int";
    case Kind::Double:
      return "double";
    case Kind::String:
      return "string";
    case Kind::Ref:
      return "ref";
    case Kind::Tensor:
      return "tensor";
    case Kind::Meta:
      return "tensor meta";
    case Kind::List:
      return "list";
    case Kind::Dict:
      return "dict";
    case Kind::Object:
      return "worker object";
  }
  return "invalid";
}

void Value::throw_unsigned_overflow(std::uint64_t value) {
  throw UsageError(fmt::format("Value: expected an integer <= {}, found {}", INT64_MAX, value));
}

void Value::throw_kind(std::string_view expected) const {
  std::string shown = to_string();
  if (shown.size() > 80) shown = shown.substr(0, 77) + "...";
  throw UsageError(fmt::format("expected {}, found {} {}", expected, kind_name(kind()), shown));
}

bool Value::as_bool() const {
  if (!is_bool()) throw_kind("bool");
  return std::get<bool>(v_);
}
std::int64_t Value::as_int() const {
  if (!is_int()) throw_kind("int");
  return std::get<std::int64_t>(v_);
}
double Value::as_number() const {
  if (is_int()) return static_cast<double>(std::get<std::int64_t>(v_));
  if (!is_double()) throw_kind("a number (int or double)");
  return std::get<double>(v_);
}
const std::string& Value::as_string() const {
  if (!is_string()) throw_kind("string");
  return std::get<std::string>(v_);
}
meshrt::Ref Value::as_ref() const {
  if (!is_ref()) throw_kind("ref");
  return std::get<meshrt::Ref>(v_);
}
const meshrt::Tensor& Value::as_tensor() const {
  if (!is_tensor()) throw_kind("tensor");
  return std::get<meshrt::Tensor>(v_);
}
meshrt::Tensor& Value::as_tensor() {
  if (!is_tensor()) throw_kind("tensor");
  return std::get<meshrt::Tensor>(v_);
}
const TensorMeta& Value::as_meta() const {
  if (!is_meta()) throw_kind("tensor meta");
  return std::get<TensorMeta>(v_);
}
const Value::List& Value::as_list() const {
  if (!is_list()) throw_kind("list");
  return std::get<List>(v_);
}
Value::List& Value::as_list() {
  if (!is_list()) throw_kind("list");
  return std::get<List>(v_);
}
const Value::Dict& Value::as_dict() const {
  if (!is_dict()) throw_kind("dict");
  return std::get<Dict>(v_);
}
Value::Dict& Value::as_dict() {
  if (!is_dict()) throw_kind("dict");
  return std::get<Dict>(v_);
}
const WorkerObject& Value::as_object() const {
  if (!is_object()) throw_kind("worker object");
  return std::get<WorkerObject>(v_);
}

const Value& Value::at(std::string_view key) const {
  std::string keys;
  for (const auto& [k, v] : as_dict()) {
    if (k == key) return v;
    keys += (keys.empty() ? "'" : ", '") + k + "'";
  }
  throw UsageError(fmt::format("dict: expected a key '{}', found keys [{}]", key, keys));
}

const Value& Value::at(std::size_t index) const {
  const List& l = as_list();
  if (index >= l.size()) {
    throw UsageError(fmt::format("list: expected an index < {}, found {}", l.size(), index));
  }
  return l[index];
}

namespace {

template <class V, class Out>
void collect(V& v, const std::function<bool(const Value&)>& pred, Out& out) {
  if (v.is_list()) {
    for (auto& item : v.as_list()) collect(item, pred, out);
  } else if (v.is_dict()) {
    for (auto& entry : v.as_dict()) collect(entry.second, pred, out);
  } else if (pred(v)) {
    out.push_back(&v);
  }
}

}  // namespace

std::vector<const Value*> Value::flatten(const std::function<bool(const Value&)>& pred) const {
  std::vector<const Value*> out;
  collect(*this, pred, out);
  return out;
}

std::vector<Value*> Value::flatten(const std::function<bool(const Value&)>& pred) {
  std::vector<Value*> out;
  collect(*this, pred, out);
  return out;
}

std::vector<meshrt::Ref> Value::refs() const {
  std::vector<meshrt::Ref> out;
  for_each_leaf([&](const Value& v) {
    if (v.is_ref()) out.push_back(v.as_ref());
  });
  return out;
}

void Value::for_each_leaf(const std::function<void(const Value&)>& f) const {
  if (is_list()) {
    for (const auto& item : as_list()) item.for_each_leaf(f);
  } else if (is_dict()) {
    for (const auto& entry : as_dict()) entry.second.for_each_leaf(f);
  } else {
    f(*this);
  }
}

Value Value::map(const std::function<Value(const Value&)>& f) const {
  if (is_list()) {
    List out;
    out.reserve(as_list().size());
    for (const auto& item : as_list()) out.push_back(item.map(f));
    return Value(std::move(out));
  }
  if (is_dict()) {
    Dict out;
    out.reserve(as_dict().size());
    for (const auto& [k, v] : as_dict()) out.emplace_back(k, v.map(f));
    return Value(std::move(out));
  }
  return f(*this);
}

std::string Value::to_string() const {
  switch (kind()) {
    case Kind::None:
      return "none";
    case Kind::Bool:
      return std::get<bool>(v_) ? "true" : "false";
    case Kind::Int:
      return std::to_string(std::get<std::int64_t>(v_));
    case Kind::Double:
      return fmt::format("{}", std::get<double>(v_));
    case Kind::String:
      return fmt::format("'{}'", std::get<std::string>(v_));
    case Kind::Ref:
      return fmt::format("ref({})", std::get<meshrt::Ref>(v_).id);
    case Kind::Tensor:
      return std::get<meshrt::Tensor>(v_).to_string();
    case Kind::Meta:
      return std::get<TensorMeta>(v_).to_string();
    case Kind::List: {
      std::string s = "[";
      for (const auto& item : std::get<List>(v_)) s += (s.size() > 1 ? ", " : "") + item.to_string();
      return s + "]";
    }
    case Kind::Dict: {
      std::string s = "{";
      for (const auto& [k, v] : std::get<Dict>(v_))
        s += fmt::format("{}'{}': {}", s.size() > 1 ? ", " : "", k, v.to_string());
      return s + "}";
    }
    case Kind::Object:
      return fmt::format("worker object of type {}", boost::core::demangle(std::get<WorkerObject>(v_).type().name()));
  }
  return "invalid";
}

bool operator==(const Value& a, const Value& b) {
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Value::Kind::Double:
      return std::bit_cast<std::uint64_t>(std::get<double>(a.v_)) ==
             std::bit_cast<std::uint64_t>(std::get<double>(b.v_));
    case Value::Kind::Tensor:
      return std::get<meshrt::Tensor>(a.v_).equals(std::get<meshrt::Tensor>(b.v_));
    case Value::Kind::None:
      return true;
    case Value::Kind::Bool:
      return std::get<bool>(a.v_) == std::get<bool>(b.v_);
    case Value::Kind::Int:
      return std::get<std::int64_t>(a.v_) == std::get<std::int64_t>(b.v_);
    case Value::Kind::String:
      return std::get<std::string>(a.v_) == std::get<std::string>(b.v_);
    case Value::Kind::Ref:
      return std::get<meshrt::Ref>(a.v_) == std::get<meshrt::Ref>(b.v_);
    case Value::Kind::Meta:
      return std::get<TensorMeta>(a.v_) == std::get<TensorMeta>(b.v_);
    case Value::Kind::List:
      return std::get<Value::List>(a.v_) == std::get<Value::List>(b.v_);
    case Value::Kind::Dict:
      return std::get<Value::Dict>(a.v_) == std::get<Value::Dict>(b.v_);
    case Value::Kind::Object:
      return std::get<WorkerObject>(a.v_) == std::get<WorkerObject>(b.v_);
  }
  return false;
}

}  // namespace meshrt
