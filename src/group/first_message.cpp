// First messages (wire.hpp): packed, sent, received into each peer's inbox and checked
// against what this rank expects; the object of the wrong type taken off the wire.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <string_view>

#include "common/checks.hpp"
#include "group/impl.hpp"

namespace meshrt {

using namespace group_internal;

void StatelessGroup::Impl::post_first_recv(int src, Kind kind, MPI_Request& r) {
  MESHRT_MPI_CHECK(MPI_Irecv(inbox(src), static_cast<int>(kFirstMax), MPI_BYTE, src, header_tag(kind), comm, &r));
}

void StatelessGroup::Impl::first_failed(const char* op, int src, int rc) const {
  throw ProtocolError(
      fmt::format("{}: receiving the first message failed ({}): larger than any group message "
                  "(at most {} bytes), so not sent by a StatelessGroup",
                  who.where(op, src), detail::mpi_error_string(rc), kFirstMax));
}

int StatelessGroup::Impl::recv_first(const char* op, Kind kind, int src, Clock::time_point dl) {
  MPI_Request r = MPI_REQUEST_NULL;
  post_first_recv(src, kind, r);
  MPI_Status st;
  Backoff backoff(group_wait());
  for (;;) {
    int done = 0;
    const int rc = MPI_Test(&r, &done, &st);
    if (rc != MPI_SUCCESS) first_failed(op, src, rc);
    if (done) break;
    if (backoff.expired(dl)) {
      const Requests::Withdrawn w = Requests::withdraw(r, st);
      if (w == Requests::Withdrawn::Cancelled) return -1;
      if (w == Requests::Withdrawn::Stuck) {
        (void)buf.release();  // MPI may still write into the inbox
        buf = std::make_unique<Buffers>();
        return -2;
      }
      if (st.MPI_ERROR != MPI_SUCCESS) first_failed(op, src, st.MPI_ERROR);
      break;  // arrived just in time
    }
    backoff.pause();
  }
  int bytes = 0;
  MESHRT_MPI_CHECK(MPI_Get_count(&st, MPI_BYTE, &bytes));
  return bytes;
}

void StatelessGroup::Impl::pack_first(Kind kind, const detail::TypeTag& type, bool raw, std::span<const char> payload,
                                      int root, std::uint64_t op_seq) {
  WireHeader h{};
  h.magic = kMagic;
  h.version = kVersion;
  h.kind = static_cast<std::uint8_t>(kind);
  h.raw = raw ? 1 : 0;
  h.type_hash = type.hash;
  h.total = payload.size();
  const bool inl = goes_inline(payload.size(), chunk);
  h.inline_bytes = inl ? payload.size() : 0;
  h.chunk = wire_chunk();
  h.seq = op_seq;
  h.root = root;
  h.sender = who.rank;
  h.name_len = static_cast<std::uint32_t>(std::min(type.name.size(), kMaxTypeName));
  buf->first.resize(sizeof h + h.name_len + h.inline_bytes);
  std::memcpy(buf->first.data(), &h, sizeof h);
  std::memcpy(buf->first.data() + sizeof h, type.name.data(), h.name_len);
  if (inl && !payload.empty()) std::memcpy(buf->first.data() + sizeof h + h.name_len, payload.data(), payload.size());
}

WireHeader StatelessGroup::Impl::check_first(const char* op, Kind kind, const detail::TypeTag& type, bool raw, int src,
                                             int root, std::uint64_t my_seq, int bytes) {
  const char* data = buf->inbox[static_cast<std::size_t>(src)].data();
  const auto n = static_cast<std::size_t>(bytes);
  if (n < sizeof(WireHeader)) {
    throw ProtocolError(
        fmt::format("{}: expected a message of at least the {}-byte group header, found {} bytes "
                    "(truncated, or not sent by a StatelessGroup)",
                    who.where(op, src), sizeof(WireHeader), n));
  }
  WireHeader h;
  std::memcpy(&h, data, sizeof h);
  if (h.magic != kMagic || h.version != kVersion) {
    throw ProtocolError(
        fmt::format("{}: expected group header magic {:#x} version {}, found {:#x} version {} "
                    "(garbage, or not sent by a StatelessGroup)",
                    who.where(op, src), kMagic, kVersion, h.magic, h.version));
  }
  if (h.kind != static_cast<std::uint8_t>(kind) || h.sender != src) {
    // Relayed broadcasts carry the relaying rank as sender, so this holds for them too.
    throw ProtocolError(fmt::format("{}: expected a {} message from group rank {}, found kind {} from rank {}",
                                    who.where(op, src), kind_name(kind), src, h.kind, h.sender));
  }
  if (h.name_len > kMaxTypeName || h.inline_bytes > kInlineMax || n != sizeof h + h.name_len + h.inline_bytes) {
    throw ProtocolError(
        fmt::format("{}: header declares {} + {} name + {} payload bytes, found a {}-byte message "
                    "(truncated or corrupt)",
                    who.where(op, src), sizeof h, h.name_len, h.inline_bytes, n));
  }
  if (root >= 0 && (h.seq != my_seq || h.root != root)) {
    throw ProtocolError(
        fmt::format("{}: mismatched collective: expected {} #{} with root {}, found #{} with root {} "
                    "(the members did not make the same calls in the same order)",
                    who.where(op, src), kind_name(kind), my_seq, root, h.seq, h.root));
  }
  if (h.inline_bytes != h.total && (h.inline_bytes != 0 || h.chunk == 0 || h.chunk > INT32_MAX)) {
    throw ProtocolError(fmt::format("{}: header declares {} payload bytes, {} inline, chunks of {}: inconsistent",
                                    who.where(op, src), h.total, h.inline_bytes, h.chunk));
  }
  if (h.total > max_object) {
    throw ProtocolError(
        fmt::format("{}: header declares a {}-byte object, more than this machine's {} bytes of "
                    "memory (corrupt header)",
                    who.where(op, src), h.total, max_object));
  }
  const std::string_view their_name(data + sizeof h, h.name_len);
  if (h.type_hash != type.hash || their_name != type.name || h.raw != (raw ? 1 : 0)) {
    std::string message = fmt::format("{}: type mismatch: expected {} (tag {:016x}), found {} (tag {:016x})",
                                      who.where(op, src), type.name, type.hash, their_name, h.type_hash);
    // The whole object is taken off the wire, so the group stays usable and the next
    // receive from `src` gets the next object.
    if (kind == Kind::Send && !discard_payload(h, src)) {
      break_group(fmt::format("a type mismatch in {} whose chunks did not arrive", op));
      message += "; its chunks did not arrive in time: the group is unusable now";
    }
    throw UsageError(message);
  }
  return h;
}

bool StatelessGroup::Impl::discard_payload(const WireHeader& h, int src) {
  const std::size_t nchunks = chunks_of(h);
  if (nchunks == 0) return true;
  if (src == who.rank) {
    if (!self_chunks.empty()) self_chunks.pop_front();
    return true;
  }
  std::vector<char> sinkhole;
  for (std::size_t i = 0; i < nchunks; ++i) {
    MPI_Message msg = MPI_MESSAGE_NULL;
    int bytes = 0;
    if (!probe(src, chunk_tag(Kind::Send), dl_, msg, bytes)) return false;
    sinkhole.resize(static_cast<std::size_t>(std::max(bytes, 1)));
    MESHRT_MPI_CHECK(MPI_Mrecv(sinkhole.data(), bytes, MPI_BYTE, &msg, MPI_STATUS_IGNORE));
  }
  return true;
}

void StatelessGroup::Impl::post_sends(Kind kind, std::span<const char> payload, std::span<const int> dsts) {
  for (int dst : dsts) {
    MPI_Request r = MPI_REQUEST_NULL;
    MESHRT_MPI_CHECK(
        MPI_Isend(buf->first.data(), static_cast<int>(buf->first.size()), MPI_BYTE, dst, header_tag(kind), comm, &r));
    req.sends.push_back(r);
    post_chunk_sends(kind, payload, dst, req.sends);
    req.send_owner.resize(req.sends.size(), dst);
  }
}

bool StatelessGroup::Impl::probe(int src, int tag, Clock::time_point dl, MPI_Message& msg, int& bytes) {
  Backoff backoff(group_wait());
  for (;;) {
    int found = 0;
    MPI_Status st;
    MESHRT_MPI_CHECK(MPI_Improbe(src, tag, comm, &found, &msg, &st));
    if (found) {
      MESHRT_MPI_CHECK(MPI_Get_count(&st, MPI_BYTE, &bytes));
      return true;
    }
    if (backoff.expired(dl)) return false;
    backoff.pause();
  }
}

}  // namespace meshrt
