// Payloads larger than a first message carries: sent and received in chunks of at most
// wire_chunk() bytes, straight from and into the object's memory, each checked against
// its expected length, and relayed down a broadcast's tree as soon as it is in.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <new>

#include "common/checks.hpp"
#include "group/impl.hpp"

namespace meshrt {

using namespace group_internal;

void StatelessGroup::Impl::post_chunk_sends(Kind kind, std::span<const char> payload, int dst,
                                            std::vector<MPI_Request>& reqs) {
  if (goes_inline(payload.size(), chunk)) return;
  const std::size_t piece = wire_chunk();
  for (std::size_t off = 0; off < payload.size(); off += piece) {
    const std::size_t n = std::min(piece, payload.size() - off);
    MPI_Request r = MPI_REQUEST_NULL;
    MESHRT_MPI_CHECK(MPI_Isend(payload.data() + off, static_cast<int>(n), MPI_BYTE, dst, chunk_tag(kind), comm, &r));
    reqs.push_back(r);
  }
}

bool StatelessGroup::Impl::start_payload(const char* op, Kind kind, const WireHeader& h, int first_src,
                                         detail::PayloadSink& sink, Clock::time_point dl, char** out_ptr,
                                         int chunk_src) {
  const std::size_t nchunks = chunks_of(h);
  if (nchunks == 0) {
    char* out = sink.prepare(h.total);
    if (h.total) {
      std::memcpy(out, buf->inbox[static_cast<std::size_t>(first_src)].data() + sizeof h + h.name_len, h.total);
    }
    return true;
  }
  // The chunks come from `chunk_src` (a broadcast's parent in the tree) or the sender.
  const int src = chunk_src >= 0 ? chunk_src : first_src;
  if (src == who.rank) {
    // A send to self: the payload was queued locally (MPI would need a posted receive).
    if (self_chunks.empty() || self_chunks.front().size() != h.total) {
      throw ProtocolError(
          fmt::format("{}: expected a {}-byte payload sent to itself, found {}", who.where(op, src), h.total,
                      self_chunks.empty() ? std::string("none") : fmt::format("{} bytes", self_chunks.front().size())));
    }
    char* out = sink.prepare(h.total);
    std::memcpy(out, self_chunks.front().data(), h.total);
    self_chunks.pop_front();
    if (out_ptr) *out_ptr = out;
    return true;
  }
  auto len = [&](std::size_t i) { return std::min<std::size_t>(h.chunk, h.total - i * h.chunk); };
  if (h.total <= kTrustedAlloc) {
    // Small enough to allocate on the header's word: every chunk's receive is posted
    // at once (MPI checks the sizes: a longer chunk fails, a shorter one is caught by
    // check_chunk), so the transfer starts without a probe round.
    char* out = sink.prepare(h.total);
    if (out_ptr) *out_ptr = out;
    post_chunk_recvs(kind, h, src, out, 0, nchunks, len);
    return true;
  }
  // Allocate only once the first chunk is really there and has the declared size: a
  // corrupt header alone never makes this rank allocate what it declares.
  MPI_Message msg = MPI_MESSAGE_NULL;
  int bytes = 0;
  if (!probe(src, chunk_tag(kind), dl, msg, bytes)) return false;
  const std::size_t first_len = std::min<std::size_t>(h.chunk, h.total);
  char* out = nullptr;
  std::string problem;
  if (static_cast<std::size_t>(bytes) != first_len) {
    problem = fmt::format("expected a first chunk of {} bytes, found {} (corrupt stream)", first_len, bytes);
  } else {
    try {
      out = sink.prepare(h.total);
    } catch (const std::bad_alloc&) {
      problem = fmt::format("cannot allocate the declared {}-byte object", h.total);
    }
  }
  if (!problem.empty()) {
    std::vector<char> sinkhole(static_cast<std::size_t>(std::max(bytes, 1)));  // a matched message must be received
    MESHRT_MPI_IGNORE(MPI_Mrecv(sinkhole.data(), bytes, MPI_BYTE, &msg, MPI_STATUS_IGNORE));  // the problem is raised
    break_group(fmt::format("a broken chunked message in {}", op));
    throw ProtocolError(fmt::format("{}: {}", who.where(op, src), problem));
  }
  if (out_ptr) *out_ptr = out;
  req.chunks.push_back(MPI_REQUEST_NULL);
  req.chunk_len.push_back(len(0));
  req.chunk_owner.push_back(src);
  MESHRT_MPI_CHECK(MPI_Imrecv(out, bytes, MPI_BYTE, &msg, &req.chunks.back()));
  post_chunk_recvs(kind, h, src, out, 1, nchunks, len);
  return true;
}

template <class Len>
void StatelessGroup::Impl::post_chunk_recvs(Kind kind, const WireHeader& h, int src, char* out, std::size_t from,
                                            std::size_t nchunks, const Len& len) {
  for (std::size_t i = from; i < nchunks; ++i) {
    req.chunks.push_back(MPI_REQUEST_NULL);
    req.chunk_len.push_back(len(i));
    req.chunk_owner.push_back(src);
    MESHRT_MPI_CHECK(MPI_Irecv(out + i * h.chunk, static_cast<int>(len(i)), MPI_BYTE, src, chunk_tag(kind), comm,
                               &req.chunks.back()));
  }
}

void StatelessGroup::Impl::chunk_failed(const char* op, int src, std::size_t i, const std::string& what) {
  Requests::cancel_receives(req.chunks);
  break_group(fmt::format("a broken chunked message in {}", op));
  throw ProtocolError(fmt::format("{}: chunk {}: {}", who.where(op, src), i, what));
}

void StatelessGroup::Impl::check_chunk(const char* op, std::size_t i, const MPI_Status& st, int rc) {
  const int src = req.chunk_owner[i];
  if (rc != MPI_SUCCESS) {
    chunk_failed(op, src, i,
                 fmt::format("{} bytes expected, failed: {}", req.chunk_len[i], detail::mpi_error_string(rc)));
  }
  int got = 0;
  MESHRT_MPI_CHECK(MPI_Get_count(&st, MPI_BYTE, &got));
  if (static_cast<std::size_t>(got) != req.chunk_len[i]) {
    chunk_failed(op, src, i, fmt::format("expected {} bytes, found {} (truncated stream)", req.chunk_len[i], got));
  }
}

bool StatelessGroup::Impl::finish_payload_in_order(const char* op, Kind kind, const char* out, std::size_t chunk_size,
                                                   std::span<const int> forward, std::size_t total) {
  Backoff backoff(group_wait(total));
  unsigned idle = 0;
  for (std::size_t i = 0; i < req.chunks.size(); ++i) {
    MPI_Status st;
    for (;;) {
      int done = 0;
      const int rc = MPI_Test(&req.chunks[i], &done, &st);
      if (rc != MPI_SUCCESS) check_chunk(op, i, st, rc);
      if (done) break;
      if ((++idle & 15U) == 0 && notice_waiting()) {
        // A member that raised (a disagreement on this broadcast) sends no more chunks.
        Requests::cancel_receives(req.chunks);
        check_not_broken(op);
      }
      if (backoff.expired(dl_)) {
        Requests::cancel_receives(req.chunks);
        return false;
      }
      backoff.pause();
    }
    backoff.reset();
    check_chunk(op, i, st, MPI_SUCCESS);
    for (int dst : forward) {
      MPI_Request r = MPI_REQUEST_NULL;
      MESHRT_MPI_CHECK(MPI_Isend(out + i * chunk_size, static_cast<int>(req.chunk_len[i]), MPI_BYTE, dst,
                                 chunk_tag(kind), comm, &r));
      req.sends.push_back(r);
      req.send_owner.push_back(dst);
    }
  }
  return true;
}

bool StatelessGroup::Impl::finish_payload_any(const char* op, std::size_t total) {
  if (req.chunks.empty()) return true;
  Backoff backoff(group_wait(total));
  req.idx.resize(req.chunks.size());
  req.statuses.resize(req.chunks.size());
  for (;;) {
    int outcount = 0;
    const int rc = MPI_Testsome(static_cast<int>(req.chunks.size()), req.chunks.data(), &outcount, req.idx.data(),
                                req.statuses.data());
    if (outcount == MPI_UNDEFINED) return true;
    if (rc != MPI_SUCCESS && rc != MPI_ERR_IN_STATUS) {
      chunk_failed(op, req.chunk_owner[0], 0, detail::mpi_error_string(rc));
    }
    for (int k = 0; k < outcount; ++k) {
      const auto i = static_cast<std::size_t>(req.idx[static_cast<std::size_t>(k)]);
      const MPI_Status& st = req.statuses[static_cast<std::size_t>(k)];
      check_chunk(op, i, st, rc == MPI_ERR_IN_STATUS ? st.MPI_ERROR : MPI_SUCCESS);
    }
    if (outcount > 0) {
      backoff.reset();
      continue;
    }
    if (backoff.expired(dl_)) return false;
    backoff.pause();
  }
}

}  // namespace meshrt
