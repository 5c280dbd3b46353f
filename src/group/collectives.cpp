// The collectives (broadcast_obj, all_gather_obj, barrier) and how their members agree.
// Every first message's header says what its sender called (operation, sequence number,
// root, type), so the agreement rides in the payload's own message:
// - all_gather_obj and barrier start with an exchange: each member sends its first
//   message to every other member and receives theirs, all on the collective's tag, so
//   members that disagree on the operation, its type or their order of calls all see it,
//   each raises a UsageError naming the disagreement, and nothing of the operation is left
//   in flight (the group stays usable). Small parts ride inside the first messages, so
//   that exchange is the whole operation.
// - broadcast_obj is one first message per receiver, the root's: each receiver checks
//   the root's header against its own call. The root does not wait to hear back, so a
//   receiver that finds a disagreement breaks the group and tells every member (the
//   notice of a broken group): each raises the same UsageError, in its wait or, if its
//   part had completed (the root's), at its next call. A receiver waiting for its root
//   also watches for another member's first message of the same collective: in a
//   broadcast only the root sends one, so it means that member called something else.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstring>
#include <string_view>

#include "common/checks.hpp"
#include "group/impl.hpp"

namespace meshrt {

using namespace group_internal;

namespace {

const detail::TypeTag& barrier_tag() {
  static const detail::TypeTag tag{"(barrier)", detail::fnv1a("(barrier)")};
  return tag;
}

std::string describe_call(std::uint8_t kind, std::uint64_t seq, std::int32_t root, std::string_view type) {
  std::string what = kind >= 1 && kind <= 4 ? kind_name(static_cast<Kind>(kind)) : fmt::format("kind {}", kind);
  what += fmt::format(" #{}", seq);
  if (kind == static_cast<std::uint8_t>(Kind::Broadcast)) what += fmt::format(" with root {}", root);
  if (kind != static_cast<std::uint8_t>(Kind::Barrier)) what += fmt::format(" of {}", type);
  return what;
}

}  // namespace

// Posts the first-message receives from every peer, sends this rank's first message
// (buf->first) to every peer, and waits for every peer's: their sizes by group rank.
// Times out (breaking the group) naming the peers that did not arrive.
const std::vector<int>& StatelessGroup::Impl::exchange_first(const char* op, const Timeout& call_timeout, int root,
                                                             std::uint64_t seq) {
  const int n = who.size;
  const int tag = collective_tag(seq);
  std::vector<int>& sizes = first_sizes;
  sizes.assign(static_cast<std::size_t>(n), -1);
  for (int i = 1; i < n; ++i) {
    const int p = (who.rank - i + n) % n;
    req.recvs.push_back(MPI_REQUEST_NULL);
    req.recv_owner.push_back(p);
    MESHRT_MPI_CHECK(MPI_Irecv(inbox(p), static_cast<int>(kFirstMax), MPI_BYTE, p, tag, comm, &req.recvs.back()));
  }
  for (int i = 1; i < n; ++i) {
    const int p = (who.rank + i) % n;
    req.sends.push_back(MPI_REQUEST_NULL);
    req.send_owner.push_back(p);
    MESHRT_MPI_CHECK(
        MPI_Isend(buf->first.data(), static_cast<int>(buf->first.size()), MPI_BYTE, p, tag, comm, &req.sends.back()));
  }
  Backoff backoff(group_wait());
  req.idx.resize(req.recvs.size());
  req.statuses.resize(req.recvs.size());
  // A broadcast's member sends no first message to the others: once one of its first
  // messages is here, the rest need not be awaited (agree names the disagreement).
  bool broadcast_seen = false;
  auto withdraw_pending = [&] {
    for (std::size_t i = 0; i < req.recvs.size(); ++i) {
      if (req.recvs[i] == MPI_REQUEST_NULL) continue;
      MPI_Status st;
      if (Requests::withdraw(req.recvs[i], st) == Requests::Withdrawn::Completed && st.MPI_ERROR == MPI_SUCCESS) {
        MPI_Get_count(&st, MPI_BYTE, &sizes[static_cast<std::size_t>(req.recv_owner[i])]);
      }
    }
  };
  unsigned idle = 0;
  // Counted down: the call that completes the last receive ends the wait.
  auto pending = static_cast<std::size_t>(
      std::count_if(req.recvs.begin(), req.recvs.end(), [](MPI_Request r) { return r != MPI_REQUEST_NULL; }));
  for (;;) {
    int outcount = 0;
    const int rc = MPI_Testsome(static_cast<int>(req.recvs.size()), req.recvs.data(), &outcount, req.idx.data(),
                                req.statuses.data());
    if (rc != MPI_SUCCESS && rc != MPI_ERR_IN_STATUS) MESHRT_MPI_CHECK(rc);
    if (outcount == MPI_UNDEFINED) break;
    for (int k = 0; k < outcount; ++k) {
      const auto i = static_cast<std::size_t>(req.idx[static_cast<std::size_t>(k)]);
      const MPI_Status& st = req.statuses[static_cast<std::size_t>(k)];
      const int p = req.recv_owner[i];
      if (rc == MPI_ERR_IN_STATUS && st.MPI_ERROR != MPI_SUCCESS) {
        for (auto& r : req.recvs) {
          MPI_Status ignored;
          if (r != MPI_REQUEST_NULL) (void)Requests::withdraw(r, ignored);
        }
        break_group(fmt::format("a failed {}", op));
        first_failed(op, p, st.MPI_ERROR);
      }
      MPI_Get_count(&st, MPI_BYTE, &sizes[static_cast<std::size_t>(p)]);
      if (sizes[static_cast<std::size_t>(p)] >= static_cast<int>(sizeof(WireHeader)) &&
          static_cast<std::uint8_t>(inbox(p)[offsetof(WireHeader, kind)]) == static_cast<std::uint8_t>(Kind::Broadcast))
        broadcast_seen = true;
    }
    if (broadcast_seen) {
      withdraw_pending();
      break;
    }
    if (outcount > 0) {
      pending -= std::min(pending, static_cast<std::size_t>(outcount));
      if (pending == 0) break;
      backoff.reset();
      continue;
    }
    if ((++idle & 15U) == 0 && notice_waiting()) {
      withdraw_pending();
      check_not_broken(op);
    }
    if (backoff.expired(dl_)) {
      // Missing: the peers whose first message has not arrived (withdrawing a receive
      // that completes meanwhile means that peer did arrive).
      std::vector<int> missing;
      for (std::size_t i = 0; i < req.recvs.size(); ++i) {
        if (req.recvs[i] == MPI_REQUEST_NULL) continue;
        MPI_Status st;
        if (Requests::withdraw(req.recvs[i], st) != Requests::Withdrawn::Completed)
          missing.push_back(req.recv_owner[i]);
      }
      std::sort(missing.begin(), missing.end());
      const bool root_missing = root >= 0 && std::find(missing.begin(), missing.end(), root) != missing.end();
      std::vector<int> others;
      for (int m : missing) {
        if (m != root) others.push_back(m);
      }
      std::string waiting_for = fmt::format("the first messages of {} did not arrive", who.peers(missing));
      if (root_missing) {
        waiting_for = fmt::format("no object from the root {} arrived", who.peer(root));
        if (!others.empty()) waiting_for += fmt::format(", nor the first messages of {}", who.peers(others));
      }
      timed_out(op, call_timeout, waiting_for, missing, true);
    }
    backoff.pause();
  }
  return sizes;
}

// Reads the first message `bytes` long in p's inbox into `v`. A corrupt message is a
// ProtocolError and breaks the group.
void StatelessGroup::Impl::read_first(const char* op, int p, int bytes, WireHeaderView& v) {
  const char* data = buf->inbox[static_cast<std::size_t>(p)].data();
  const auto n = static_cast<std::size_t>(bytes);
  std::string problem;
  if (n < sizeof(WireHeader)) {
    problem =
        fmt::format("expected a message of at least the {}-byte group header, found {} bytes", sizeof(WireHeader), n);
  } else {
    std::memcpy(&v.h, data, sizeof v.h);
    const WireHeader& h = v.h;
    if (h.magic != kMagic || h.version != kVersion) {
      problem = fmt::format("expected group header magic {:#x} version {}, found {:#x} version {}", kMagic, kVersion,
                            h.magic, h.version);
    } else if (h.sender != p || h.name_len > kMaxTypeName || h.inline_bytes > kInlineMax ||
               n != sizeof h + h.name_len + h.inline_bytes) {
      problem = fmt::format("header from rank {} declares {} + {} name + {} payload bytes, found a {}-byte message",
                            h.sender, sizeof h, h.name_len, h.inline_bytes, n);
    } else if (h.inline_bytes != h.total && (h.inline_bytes != 0 || h.chunk == 0 || h.chunk > INT32_MAX)) {
      problem = fmt::format("header declares {} payload bytes, {} inline, chunks of {}: inconsistent", h.total,
                            h.inline_bytes, h.chunk);
    } else if (h.total > max_object) {
      problem = fmt::format("header declares a {}-byte object, more than this machine's {} bytes of memory", h.total,
                            max_object);
    }
  }
  if (!problem.empty()) {
    break_group(fmt::format("a corrupt message in {}", op));
    throw ProtocolError(
        fmt::format("{}: {} (garbage, truncated, or not sent by a StatelessGroup)", who.where(op, p), problem));
  }
  v.type_name = std::string_view(data + sizeof v.h, v.h.name_len);
}

// Whether a first message's header says its sender made this rank's call.
bool StatelessGroup::Impl::same_call(const WireHeaderView& v, Kind kind, const detail::TypeTag& type, bool raw,
                                     int root, std::uint64_t seq) {
  const WireHeader& h = v.h;
  return h.kind == static_cast<std::uint8_t>(kind) && h.seq == seq && (kind != Kind::Broadcast || h.root == root) &&
         (kind == Kind::Barrier || (h.type_hash == type.hash && v.type_name == type.name && h.raw == (raw ? 1 : 0)));
}

// Checks every peer's first message against this rank's call (kind, sequence number,
// root, type): their headers, by group rank (this rank's own: from buf->first). A
// disagreement is a UsageError naming every member that called something else, and
// leaves the group usable once this rank's first messages are taken (nothing else of the
// operation was sent) unless a member called a broadcast, which exchanges nothing: then
// the group breaks and every member hears of it (disagreed).
const std::vector<WireHeaderView>& StatelessGroup::Impl::agree(const char* op, Kind kind, const detail::TypeTag& type,
                                                               bool raw, int root, std::uint64_t seq,
                                                               const std::vector<int>& sizes) {
  std::vector<WireHeaderView>& headers = first_headers;
  headers.assign(sizes.size(), WireHeaderView{});
  std::vector<std::string> others;
  bool broadcast = false;
  for (int p = 0; p < who.size; ++p) {
    WireHeaderView& v = headers[static_cast<std::size_t>(p)];
    if (p == who.rank) {
      std::memcpy(&v.h, buf->first.data(), sizeof v.h);
      continue;
    }
    if (sizes[static_cast<std::size_t>(p)] < 0) continue;  // not awaited: a broadcast's member was seen
    read_first(op, p, sizes[static_cast<std::size_t>(p)], v);
    if (!same_call(v, kind, type, raw, root, seq)) {
      const WireHeader& h = v.h;
      broadcast = broadcast || h.kind == static_cast<std::uint8_t>(Kind::Broadcast);
      others.push_back(fmt::format("{} called {}", who.peer(p), describe_call(h.kind, h.seq, h.root, v.type_name)));
    }
  }
  if (!others.empty()) {
    const std::string what = fmt::format("{} called {}, but {}", who.peer(who.rank),
                                         describe_call(static_cast<std::uint8_t>(kind), seq, root,
                                                       kind == Kind::Barrier ? std::string_view() : type.name),
                                         fmt::join(others, "; "));
    if (broadcast) disagreed(op, seq, what);
    // Every member received every first message: nothing but this rank's own sends is
    // pending, and those its peers have taken or are taking.
    if (!req.wait_all(req.sends, dl_, 0)) break_group(fmt::format("a mismatched {}", op));
    throw UsageError(
        fmt::format("{} on {}: the members disagree on the collective: {}{}", op, who.me(), what,
                    unusable_after.empty() ? "; the group is still usable" : "; the group is unusable now"));
  }
  return headers;
}

// A broadcast's receiver: the root's first message, checked against this rank's call.
// While it waits, a first message of the same collective from another member (which
// only the root sends in a broadcast) or another member's notice ends the wait.
const StatelessGroup::Impl::WireHeader& StatelessGroup::Impl::recv_root_first(const char* op,
                                                                              const Timeout& call_timeout,
                                                                              const detail::TypeTag& type, bool raw,
                                                                              int src, std::uint64_t seq) {
  const int tag = collective_tag(seq);
  MPI_Request r = MPI_REQUEST_NULL;
  MESHRT_MPI_CHECK(MPI_Irecv(inbox(src), static_cast<int>(kFirstMax), MPI_BYTE, src, tag, comm, &r));
  MPI_Status st;
  Backoff backoff(group_wait());
  // Withdraws the receive; true if the root's message arrived meanwhile.
  auto withdraw = [&] {
    const Requests::Withdrawn w = Requests::withdraw(r, st);
    if (w == Requests::Withdrawn::Stuck) break_group(fmt::format("a receive in {} that could not be withdrawn", op));
    return w == Requests::Withdrawn::Completed && st.MPI_ERROR == MPI_SUCCESS;
  };
  auto mine = [&] { return describe_call(static_cast<std::uint8_t>(Kind::Broadcast), seq, src, type.name); };
  unsigned idle = 0;
  for (;;) {
    int done = 0;
    const int rc = MPI_Test(&r, &done, &st);
    if (rc != MPI_SUCCESS) first_failed(op, src, rc);
    if (done) break;
    if ((++idle & 15U) == 0) {
      int found = 0;
      MPI_Status other;
      MESHRT_MPI_CHECK(MPI_Iprobe(MPI_ANY_SOURCE, tag, comm, &found, &other));
      if (found && other.MPI_SOURCE != src) {
        const int p = other.MPI_SOURCE;
        (void)withdraw();
        MESHRT_MPI_CHECK(MPI_Recv(inbox(p), static_cast<int>(kFirstMax), MPI_BYTE, p, tag, comm, &other));
        int bytes = 0;
        MESHRT_MPI_CHECK(MPI_Get_count(&other, MPI_BYTE, &bytes));
        WireHeaderView v;
        read_first(op, p, bytes, v);
        disagreed(op, seq,
                  fmt::format("{} called {}, but {} called {}", who.peer(who.rank), mine(), who.peer(p),
                              describe_call(v.h.kind, v.h.seq, v.h.root, v.type_name)));
      }
      if (notice_waiting()) {
        (void)withdraw();
        check_not_broken(op);
      }
    }
    if (backoff.expired(dl_)) {
      if (withdraw()) break;  // arrived just in time
      timed_out(op, call_timeout, fmt::format("no object from the root {} arrived", who.peer(src)), {src}, true);
    }
    backoff.pause();
  }
  int bytes = 0;
  MESHRT_MPI_CHECK(MPI_Get_count(&st, MPI_BYTE, &bytes));
  WireHeaderView& v = root_header;
  read_first(op, src, bytes, v);
  if (!same_call(v, Kind::Broadcast, type, raw, src, seq)) {
    disagreed(op, seq,
              fmt::format("{} called {}, but the root {} called {}", who.peer(who.rank), mine(), who.peer(src),
                          describe_call(v.h.kind, v.h.seq, v.h.root, v.type_name)));
  }
  return v.h;
}

// Waits for this rank's sends; another member's notice ends the wait (it raises).
bool StatelessGroup::Impl::wait_sends(const char* op, std::size_t bytes) {
  if (req.sends.empty()) return true;
  Backoff backoff(group_wait(bytes));
  req.idx.resize(req.sends.size());
  // Counted down, so the call that completes the last send ends the wait (another
  // MPI_Testsome only to hear that none is left would progress MPI once more).
  auto pending = static_cast<std::size_t>(
      std::count_if(req.sends.begin(), req.sends.end(), [](MPI_Request r) { return r != MPI_REQUEST_NULL; }));
  unsigned idle = 0;
  for (;;) {
    int outcount = 0;
    MESHRT_MPI_CHECK(MPI_Testsome(static_cast<int>(req.sends.size()), req.sends.data(), &outcount, req.idx.data(),
                                  MPI_STATUSES_IGNORE));
    if (outcount == MPI_UNDEFINED) return true;
    if (outcount > 0) {
      pending -= std::min(pending, static_cast<std::size_t>(outcount));
      if (pending == 0) return true;
      backoff.reset();
      continue;
    }
    if ((++idle & 15U) == 0 && notice_waiting()) check_not_broken(op);
    if (backoff.expired(dl_)) return false;
    backoff.pause();
  }
}

void StatelessGroup::broadcast_bytes(const detail::TypeTag& type, bool raw, std::span<const char> payload,
                                     detail::PayloadSink& sink, int src, Timeout timeout) {
  Impl& g = *impl_;
  const char* op = "broadcast_obj";
  g.check_usable(op);
  g.who.check_peer(op, src, "root");
  const std::uint64_t seq = g.coll_seq++;
  g.begin(timeout);
  const int n = g.who.size;
  const bool root = g.who.rank == src;
  // Chunks of a large payload go down a binomial tree over ranks relative to the root:
  // log2(n) rounds, like MPI_Bcast.
  const int rel = (g.who.rank - src + n) % n;
  int parent = -1;
  int top = 1;
  while (top < n) top <<= 1;
  int limit = top;
  for (int mask = 1; mask < n; mask <<= 1) {
    if (rel & mask) {
      parent = (rel - mask + src) % n;
      limit = mask;
      break;
    }
  }
  std::array<int, 32> child_buf{};
  std::size_t nchildren = 0;
  for (int mask = limit >> 1; mask >= 1; mask >>= 1) {
    if (rel + mask < n) child_buf[nchildren++] = (rel + mask + src) % n;
  }
  const std::span<const int> children(child_buf.data(), nchildren);
  std::size_t total = payload.size();
  if (root) {
    // The root's first message (the payload inline when small) goes to every receiver
    // at once: it is what each one checks the call against.
    g.pack_first(Kind::Broadcast, type, raw, payload, src, seq);
    const int tag = collective_tag(seq);
    for (int i = 1; i < n; ++i) {
      const int p = (src + i) % n;
      g.req.sends.push_back(MPI_REQUEST_NULL);
      g.req.send_owner.push_back(p);
      MESHRT_MPI_CHECK(MPI_Isend(g.buf->first.data(), static_cast<int>(g.buf->first.size()), MPI_BYTE, p, tag, g.comm,
                                 &g.req.sends.back()));
    }
    for (int c : children) {
      g.post_chunk_sends(Kind::Broadcast, payload, c, g.req.sends);
      g.req.send_owner.resize(g.req.sends.size(), c);
    }
  } else {
    // The root's message may be one it sent before it timed out in its sends: the object
    // is whole all the same (chunks that do not come end in the notice), so this rank
    // completes and hears of it at its next call.
    const WireHeader h = g.recv_root_first(op, timeout, type, raw, src, seq);
    total = h.total;
    char* out = nullptr;
    if (!g.start_payload(op, Kind::Broadcast, h, src, sink, g.dl_, &out, parent) ||
        !g.finish_payload_in_order(op, Kind::Broadcast, out, h.chunk, children, h.total)) {
      g.timed_out(op, timeout,
                  fmt::format("the header of a {}-byte object from the root {} arrived, its chunks from {} did not",
                              h.total, g.who.peer(src), g.who.peer(parent)),
                  {parent}, true);
    }
  }
  if (!g.wait_sends(op, total * nchildren)) {
    const auto late = g.req.late_of(g.req.sends, g.req.send_owner);
    g.timed_out(op, timeout,
                fmt::format("{} did not receive this rank's first message or its chunks", g.who.peers(late)), late,
                true);
  }
}

void StatelessGroup::all_gather_bytes(const detail::TypeTag& type, bool raw, std::span<const char> payload,
                                      std::span<detail::PayloadSink* const> sinks, Timeout timeout) {
  Impl& g = *impl_;
  const char* op = "all_gather_obj";
  g.check_usable(op);
  const std::uint64_t seq = g.coll_seq++;
  g.begin(timeout);
  const int n = g.who.size;
  g.pack_first(Kind::AllGather, type, raw, payload, -1, seq);
  const auto& headers = g.agree(op, Kind::AllGather, type, raw, -1, seq, g.exchange_first(op, timeout, -1, seq));
  g.check_not_broken(op);
  char* own = sinks[static_cast<std::size_t>(g.who.rank)]->prepare(payload.size());
  if (!payload.empty()) std::memcpy(own, payload.data(), payload.size());
  // Direct exchange of the chunks of large parts: every rank sends to every other, so each
  // rank knows exactly whose part is missing. Peers in ring order spread the load. This
  // rank's chunks are posted before it waits for anyone's.
  for (int i = 1; i < n; ++i) {
    const int dst = (g.who.rank + i) % n;
    g.post_chunk_sends(Kind::AllGather, payload, dst, g.req.sends);
    g.req.send_owner.resize(g.req.sends.size(), dst);
  }
  std::size_t expected = payload.size() * static_cast<std::size_t>(n);
  try {
    for (int i = 1; i < n; ++i) {
      const int p = (g.who.rank - i + n) % n;
      const WireHeader& h = headers[static_cast<std::size_t>(p)].h;
      if (!g.start_payload(op, Kind::AllGather, h, p, *sinks[static_cast<std::size_t>(p)], g.dl_)) {
        g.timed_out(
            op, timeout,
            fmt::format("the header of a {}-byte part from {} arrived, its chunks did not", h.total, g.who.peer(p)),
            {p}, true);
      }
      expected += static_cast<std::size_t>(h.total);
    }
  } catch (...) {
    Requests::cancel_receives(g.req.chunks);
    if (g.unusable_after.empty()) g.break_group(fmt::format("a failed {}", op));
    throw;
  }
  if (!g.finish_payload_any(op, expected)) {
    const auto late = g.req.late_of(g.req.chunks, g.req.chunk_owner);
    Requests::cancel_receives(g.req.chunks);
    g.timed_out(op, timeout, fmt::format("the chunks of {}'s parts did not arrive", g.who.peers(late)), late, true);
  }
  if (!g.req.wait_all(g.req.sends, g.dl_, payload.size() * static_cast<std::size_t>(n))) {
    const auto late = g.req.late_of(g.req.sends, g.req.send_owner);
    g.timed_out(op, timeout, fmt::format("{} did not receive this rank's part", g.who.peers(late)), late, true);
  }
}

void StatelessGroup::barrier(Timeout timeout) {
  Impl& g = *impl_;
  const char* op = "barrier";
  g.check_usable(op);
  const std::uint64_t seq = g.coll_seq++;
  g.begin(timeout);
  if (g.who.size == 1) return;
  // Every rank tells every other that it arrived (n - 1 first messages of 64 bytes per
  // rank: at 2 and 4 ranks as many as a dissemination barrier's), so every rank can name
  // exactly who did not arrive.
  g.pack_first(Kind::Barrier, barrier_tag(), true, {}, -1, seq);
  (void)g.agree(op, Kind::Barrier, barrier_tag(), true, -1, seq, g.exchange_first(op, timeout, -1, seq));
  // Every first message is here, but one may be what a member sent before it timed out.
  g.check_not_broken(op);
  if (!g.req.wait_all(g.req.sends, g.dl_, 0)) {
    g.timed_out(op, timeout, "every rank arrived, but this rank's tokens were not taken", {}, true);
  }
}

}  // namespace meshrt
