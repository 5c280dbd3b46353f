#include "worker/recordings.hpp"

#include <fmt/format.h>

#include <type_traits>
#include <utility>
#include <variant>

#include "meshrt/error.hpp"

namespace meshrt::detail {

using namespace protocol;

namespace {

// A recorded command's refs and ident as one replay sees them.
struct Instance {
  const std::vector<Ref>& actuals;
  std::uint32_t formals;
  std::uint64_t ref_base;
  Ident ident_base;

  Ref ref(Ref r) const {
    if ((r.id & kLocalRef) == 0) return r;
    const std::uint64_t slot = r.id & ~kLocalRef;
    return slot < formals ? actuals[slot] : Ref{ref_base + (slot - formals)};
  }
  void refs(std::vector<Ref>& rs) const {
    for (Ref& r : rs) r = ref(r);
  }
  Value value(const Value& v) const {
    if (v.is_ref()) return Value(ref(v.as_ref()));
    if (!v.is_list() && !v.is_dict()) return v;
    return v.map([this](const Value& leaf) { return leaf.is_ref() ? Value(ref(leaf.as_ref())) : leaf; });
  }
  Ident ident(Ident offset) const { return ident_base + offset - 1; }

  Command operator()(const Command& recorded) const {
    Command c = recorded;
    std::visit(
        [this](auto& m) {
          using C = std::decay_t<decltype(m)>;
          if constexpr (std::is_same_v<C, CallFunction>) {
            m.ident = ident(m.ident);
            refs(m.results);
            refs(m.mutates);
            for (Value& a : m.args) a = value(a);
          } else if constexpr (std::is_same_v<C, Reduce> || std::is_same_v<C, SendTensor> ||
                               std::is_same_v<C, Collective>) {
            m.ident = ident(m.ident);
            m.result = ref(m.result);
            m.tensor = ref(m.tensor);
          } else if constexpr (std::is_same_v<C, BorrowCreate>) {
            m.result = ref(m.result);
            m.tensor = ref(m.tensor);
          } else if constexpr (std::is_same_v<C, BorrowFirstUse> || std::is_same_v<C, BorrowDrop>) {
            m.borrow = ref(m.borrow);
          }
        },
        c);
    return c;
  }
};

// Every local ref of `c` within the recording's slots, and its ident within its offsets.
void check(const DefineRecording& d, const Command& c, std::size_t index) {
  const std::uint64_t slots = std::uint64_t{d.formals} + d.locals;
  auto bad = [&](std::string what) {
    throw ProtocolError(
        fmt::format("DefineRecording {}: command {} ({}): {}", d.recording.id, index + 1, name(c), what));
  };
  auto ref = [&](Ref r) {
    if ((r.id & kLocalRef) != 0 && (r.id & ~kLocalRef) >= slots)
      bad(fmt::format("expected a local slot below {}, found {}", slots, r.id & ~kLocalRef));
  };
  auto ident = [&](Ident k) {
    if (k == 0 || k > d.idents) bad(fmt::format("expected an ident offset in 1..{}, found {}", d.idents, k));
  };
  std::visit(
      [&](const auto& m) {
        using C = std::decay_t<decltype(m)>;
        if constexpr (std::is_same_v<C, CallFunction>) {
          ident(m.ident);
          for (Ref r : m.results) ref(r);
          for (Ref r : m.mutates) ref(r);
          for (const Value& a : m.args)
            a.for_each_leaf([&](const Value& leaf) {
              if (leaf.is_ref()) ref(leaf.as_ref());
            });
        } else if constexpr (std::is_same_v<C, Reduce> || std::is_same_v<C, SendTensor> ||
                             std::is_same_v<C, Collective>) {
          ident(m.ident);
          ref(m.result);
          ref(m.tensor);
        } else if constexpr (std::is_same_v<C, BorrowCreate>) {
          ref(m.result);
          ref(m.tensor);
        } else if constexpr (std::is_same_v<C, BorrowFirstUse> || std::is_same_v<C, BorrowDrop>) {
          ref(m.borrow);
        }
      },
      c);
}

}  // namespace

void Recordings::define(DefineRecording&& d) {
  for (std::size_t i = 0; i < d.commands.size(); ++i) check(d, d.commands[i], i);
  for (Ref t : d.temporaries) {
    if ((t.id & kLocalRef) == 0 || (t.id & ~kLocalRef) < d.formals || (t.id & ~kLocalRef) >= d.formals + d.locals) {
      throw ProtocolError(fmt::format("DefineRecording {}: expected temporaries among its local slots {}..{}, found {}",
                                      d.recording.id, d.formals, d.formals + d.locals - 1, t.id & ~kLocalRef));
    }
  }
  const std::uint64_t id = d.recording.id;
  if (!recordings_.emplace(id, std::make_shared<const DefineRecording>(std::move(d))).second) {
    throw ProtocolError(
        fmt::format("DefineRecording {} reached rank {}, which already has a recording {}", id, rank_, id));
  }
}

void Recordings::expand(const CallRecording& call,
                        const std::function<void(Command&&, std::uint32_t step)>& queue) const {
  const auto it = recordings_.find(call.recording.id);
  if (it == recordings_.end()) {
    throw ProtocolError(fmt::format("CallRecording of recording {} reached rank {}, which has no such recording",
                                    call.recording.id, rank_));
  }
  const DefineRecording& d = *it->second;
  if (call.actuals.size() != d.formals) {
    throw ProtocolError(fmt::format("CallRecording of recording {}: expected {} actual refs, found {}",
                                    call.recording.id, d.formals, call.actuals.size()));
  }
  const Instance instance{call.actuals, d.formals, call.ref_base, call.ident_base};
  for (std::size_t i = 0; i < d.commands.size(); ++i) queue(instance(d.commands[i]), static_cast<std::uint32_t>(i + 1));
  if (!d.temporaries.empty()) {
    DeleteRefs deletes;
    deletes.refs.reserve(d.temporaries.size());
    for (Ref t : d.temporaries) deletes.refs.push_back(instance.ref(t));
    queue(std::move(deletes), 0);
  }
}

void Recordings::forget(const std::vector<Ref>& refs) {
  for (Ref r : refs) recordings_.erase(r.id);
}

}  // namespace meshrt::detail
