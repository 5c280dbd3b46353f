#include "worker/recorder_words.hpp"

#include <fmt/format.h>

#include <type_traits>
#include <variant>

namespace meshrt::detail {

using namespace protocol;

void record(const Command& command, CommandRecord& r) {
  r.kind = name(command).data();
  r.tag = static_cast<std::uint8_t>(command.index());
  std::visit(
      [&r](const auto& c) {
        using C = std::decay_t<decltype(c)>;
        if constexpr (std::is_same_v<C, CallFunction>) {
          r.ident = c.ident;
          r.name.assign(c.function);
          r.mesh = c.mesh.id;
          r.stream = c.stream.id;
          if (!c.results.empty()) r.result = c.results.front().id;
        } else if constexpr (std::is_same_v<C, FetchValue>) {
          r.ident = c.ident;
          if (c.function) r.name.assign(*c.function);
          r.stream = c.stream.id;
        } else if constexpr (std::is_same_v<C, Reduce>) {
          r.ident = c.ident;
          r.name.assign(meshrt::name(c.reduction));
          if (c.scatter) r.name.append(" scatter");
          if (c.inplace) r.name.append(" in place");
          r.result = c.result.id;
          r.mesh = c.mesh.id;
          r.stream = c.stream.id;
          r.dim.assign(c.dim);
          r.bytes = c.factory.nbytes();
        } else if constexpr (std::is_same_v<C, Collective>) {
          r.ident = c.ident;
          r.name.assign(meshrt::name(c.kind));
          if (c.kind == CollectiveKind::Reduce) r.name.append(" ").append(meshrt::name(c.reduction));
          if (c.root >= 0)
            r.name.append(c.kind == CollectiveKind::Reduce ? " to " : " from ").append(std::to_string(c.root));
          if (c.scatter) r.name.append(" scatter");
          if (c.inplace) r.name.append(" in place");
          if (c.result.id != 0) r.result = c.result.id;
          r.mesh = c.mesh.id;
          r.stream = c.stream.id;
          for (const std::string& d : c.dims) r.dim.append(r.dim.empty() ? "" : ",").append(d);
          r.bytes = c.kind == CollectiveKind::Barrier ? 0 : c.factory.nbytes();
        } else if constexpr (std::is_same_v<C, SendTensor>) {
          r.ident = c.ident;
          r.result = c.result.id;
          r.stream = c.stream.id;
          r.bytes = c.factory.nbytes();
        } else if constexpr (std::is_same_v<C, RequestStatus>) {
          r.ident = c.ident;
        } else if constexpr (std::is_same_v<C, CreateDeviceMesh> || std::is_same_v<C, CreateStream> ||
                             std::is_same_v<C, BorrowCreate>) {
          r.result = c.result.id;
        }
      },
      command);
}

std::vector<int> peers_of(const SendTensor& s, int rank) {
  std::vector<int> peers;
  if (!s.from_order.empty()) {
    for (std::int64_t j = 0; j < s.to_ranks.len(); ++j) {
      const std::int64_t from = s.from_ranks[s.from_order[static_cast<std::size_t>(j)]];
      if (from == rank) peers.push_back(static_cast<int>(s.to_ranks[j]));
      if (s.to_ranks[j] == rank) peers.push_back(static_cast<int>(from));
    }
    return peers;
  }
  for (std::int64_t i = 0; i < s.from_ranks.len(); ++i) {
    const std::int64_t to = s.to_order.empty() ? i : s.to_order[static_cast<std::size_t>(i)];
    if (s.from_ranks[i] == rank) peers.push_back(static_cast<int>(s.to_ranks[to]));
    if (s.to_ranks[to] == rank) peers.push_back(static_cast<int>(s.from_ranks[i]));
  }
  return peers;
}

bool CollectiveWords::ReduceWords::matches(const Reduce& c) const {
  // The plain fields first: a step's reduces differ in their reduction more often than in
  // their dimension's name or their size (each compared at a cost).
  return !joining.empty() && mesh == c.mesh.id && reduction == c.reduction && scatter == c.scatter &&
         inplace == c.inplace && kind == c.factory.device().kind() && dim == c.dim && bytes == c.factory.nbytes();
}

bool CollectiveWords::SendWords::matches(const SendTensor& c) const {
  return bytes == c.factory.nbytes() && kind == c.factory.device().kind() && from == c.from_ranks && to == c.to_ranks &&
         order == c.to_order && sources == c.from_order;
}

void CollectiveWords::posting(Monitor& monitor, std::uint64_t seq, const Reduce& c, const WorkerMesh& mesh) {
  reduce_at_ = 0;
  while (reduce_at_ < kReduceWords && !reduce_[reduce_at_].matches(c)) ++reduce_at_;
  if (reduce_at_ == kReduceWords) {
    ReduceWords w{.mesh = c.mesh.id,
                  .dim = c.dim,
                  .reduction = c.reduction,
                  .scatter = c.scatter,
                  .inplace = c.inplace,
                  .bytes = c.factory.nbytes(),
                  .kind = c.factory.device().kind()};
    w.joining =
        fmt::format("{} over '{}', joining (a dimension's first use sets up its communicator with every mesh member)",
                    meshrt::name(c.reduction), c.dim);
    for (auto r : mesh.ranks()) w.members.push_back(static_cast<int>(r));
    reduce_at_ = reduce_next_;
    reduce_next_ = (reduce_next_ + 1) % kReduceWords;
    reduce_[reduce_at_] = std::move(w);
  }
  const ReduceWords& w = reduce_[reduce_at_];
  if (!w.running.empty())
    monitor.describe(seq, w.running, w.peers, c.factory.nbytes());
  else
    monitor.describe(seq, w.joining, w.members, c.factory.nbytes());
}

void CollectiveWords::posted(Monitor& monitor, std::uint64_t seq, const Reduce& c, const Pending& op,
                             const WorkerMesh& mesh) {
  // posting() chose the entry matching `c`; a collective that completes inside its call is
  // done before this could describe it, so its words are made here, once.
  ReduceWords& w = reduce_[reduce_at_];
  if (!w.running.empty()) return;
  w.running = op.describe();
  w.peers = mesh.line_world_ranks(mesh.dim_index(c.dim));
  monitor.describe(seq, w.running, w.peers, 0);
}

void CollectiveWords::posting(Monitor& monitor, std::uint64_t seq, const Collective& c, const WorkerMesh& mesh) {
  std::vector<int> members;
  for (auto r : mesh.ranks()) members.push_back(static_cast<int>(r));
  std::string dims;
  for (const std::string& d : c.dims) dims.append(dims.empty() ? "'" : ", '").append(d).append("'");
  monitor.describe(seq,
                   fmt::format("{} over [{}], joining (a set of dimensions' first use sets up its communicator with "
                               "the line's members)",
                               meshrt::name(c.kind), dims),
                   members, c.kind == CollectiveKind::Barrier ? 0 : c.factory.nbytes());
}

void CollectiveWords::posted(Monitor& monitor, std::uint64_t seq, const Collective& c, const Pending& op,
                             const WorkerMesh& mesh) {
  monitor.describe(seq, op.describe(), mesh.dims_world_ranks(mesh.dims_mask(c.dims)), 0);
}

void CollectiveWords::posting(Monitor& monitor, std::uint64_t seq, const SendTensor& c, int rank) {
  if (!send_.matches(c)) {
    send_ = SendWords{.from = c.from_ranks,
                      .to = c.to_ranks,
                      .order = c.to_order,
                      .sources = c.from_order,
                      .bytes = c.factory.nbytes(),
                      .kind = c.factory.device().kind()};
  }
  if (!send_.running.empty())
    monitor.describe(seq, send_.running, send_.peers, c.factory.nbytes());
  else
    monitor.describe(seq, "joining the send", peers_of(c, rank), c.factory.nbytes());
}

void CollectiveWords::posted(Monitor& monitor, std::uint64_t seq, const SendTensor& c, const Pending& op, int rank) {
  if (!send_.running.empty()) return;  // posting() left send_ matching `c`
  send_.running = op.describe();
  send_.peers = peers_of(c, rank);
  monitor.describe(seq, send_.running, send_.peers, 0);
}

}  // namespace meshrt::detail
