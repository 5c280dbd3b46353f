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
  // `to` holds `from`'s refs as this replay sees them (the same count: `to` is its copy).
  void refs(const std::vector<Ref>& from, std::vector<Ref>& to) const {
    for (std::size_t i = 0; i < from.size(); ++i) to[i] = ref(from[i]);
  }
  // An argument without refs (a number, a string) is left as recorded.
  void value(const Value& from, Value& to) const {
    if (from.is_ref()) {
      to = Value(ref(from.as_ref()));
    } else if (from.is_list() || from.is_dict()) {
      to = from.map([this](const Value& leaf) { return leaf.is_ref() ? Value(ref(leaf.as_ref())) : leaf; });
    }
  }
  Ident ident(Ident offset) const { return ident_base + offset - 1; }

  // Rewrites the refs and ident of `to`, a copy of `recorded`, for this replay.
  void operator()(const Command& recorded, Command& to) const {
    std::visit(
        [&](auto& m) {
          using C = std::decay_t<decltype(m)>;
          const C& r = *std::get_if<C>(&recorded);
          if constexpr (std::is_same_v<C, CallFunction>) {
            m.ident = ident(r.ident);
            refs(r.results, m.results);
            refs(r.mutates, m.mutates);
            for (std::size_t i = 0; i < r.args.size(); ++i) value(r.args[i], m.args[i]);
          } else if constexpr (std::is_same_v<C, Reduce> || std::is_same_v<C, SendTensor> ||
                               std::is_same_v<C, Collective>) {
            m.ident = ident(r.ident);
            m.result = ref(r.result);
            m.tensor = ref(r.tensor);
          } else if constexpr (std::is_same_v<C, BorrowCreate>) {
            m.result = ref(r.result);
            m.tensor = ref(r.tensor);
          } else if constexpr (std::is_same_v<C, BorrowFirstUse> || std::is_same_v<C, BorrowDrop>) {
            m.borrow = ref(r.borrow);
          }
        },
        to);
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

Recording::Recording(DefineRecording&& d)
    : define_(std::move(d)), instance_(define_.commands), deletes_(DeleteRefs{define_.temporaries}) {}

Command& Recording::step(std::size_t i, const CallRecording& call) {
  const Instance instance{call.actuals, define_.formals, call.ref_base, call.ident_base};
  if (i < instance_.size()) {
    instance(define_.commands[i], instance_[i]);
    return instance_[i];
  }
  instance.refs(define_.temporaries, std::get_if<DeleteRefs>(&deletes_)->refs);
  return deletes_;
}

void Recordings::define(DefineRecording&& d) {
  for (std::size_t i = 0; i < d.commands.size(); ++i) check(d, d.commands[i], i);
  for (Ref t : d.temporaries) {
    if ((t.id & kLocalRef) == 0 || (t.id & ~kLocalRef) < d.formals || (t.id & ~kLocalRef) >= d.formals + d.locals) {
      throw ProtocolError(fmt::format("DefineRecording {}: expected temporaries among its local slots {}..{}, found {}",
                                      d.recording.id, d.formals, d.formals + d.locals - 1, t.id & ~kLocalRef));
    }
  }
  const std::uint64_t id = d.recording.id;
  if (recordings_.contains(id)) {
    throw ProtocolError(
        fmt::format("DefineRecording {} reached rank {}, which already has a recording {}", id, rank_, id));
  }
  recordings_.emplace(id, std::make_shared<Recording>(std::move(d)));
}

std::shared_ptr<Recording> Recordings::find(const CallRecording& call) const {
  const auto it = recordings_.find(call.recording.id);
  if (it == recordings_.end()) {
    throw ProtocolError(fmt::format("CallRecording of recording {} reached rank {}, which has no such recording",
                                    call.recording.id, rank_));
  }
  if (call.actuals.size() != it->second->formals()) {
    throw ProtocolError(fmt::format("CallRecording of recording {}: expected {} actual refs, found {}",
                                    call.recording.id, it->second->formals(), call.actuals.size()));
  }
  return it->second;
}

void Recordings::forget(const std::vector<Ref>& refs) {
  for (Ref r : refs) recordings_.erase(r.id);
}

}  // namespace meshrt::detail
