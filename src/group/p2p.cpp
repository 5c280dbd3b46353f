// Point to point: send_obj and recv_obj of one object (a send to self is queued locally,
// never through MPI).
#include <fmt/format.h>

#include <cstring>

#include "group/impl.hpp"

namespace meshrt {

using namespace group_internal;

void StatelessGroup::send_bytes(const detail::TypeTag& type, bool raw, std::span<const char> payload, int dst,
                                Timeout timeout) {
  Impl& g = *impl_;
  g.check_usable("send_obj");
  g.who.check_peer("send_obj", dst, "destination");
  g.begin(timeout);
  g.pack_first(Kind::Send, type, raw, payload, g.who.rank, 0);
  if (dst == g.who.rank) {
    g.self_first.push_back(g.buf->first);
    if (!goes_inline(payload.size(), g.chunk)) g.self_chunks.emplace_back(payload.data(), payload.size());
    return;
  }
  const int dsts[] = {dst};
  g.post_sends(Kind::Send, payload, dsts);
  if (!g.req.wait_all(g.req.sends, g.dl_, payload.size())) {
    g.timed_out("send_obj", timeout,
                fmt::format("{} has not received the {}-byte object", g.who.peer(dst), payload.size()), {dst}, true);
  }
}

void StatelessGroup::recv_bytes(const detail::TypeTag& type, bool raw, detail::PayloadSink& sink, int src,
                                Timeout timeout) {
  Impl& g = *impl_;
  g.check_usable("recv_obj");
  g.who.check_peer("recv_obj", src, "source");
  g.begin(timeout);
  int bytes = 0;
  if (src == g.who.rank) {
    if (g.self_first.empty()) {
      // Nothing can arrive while this rank waits: only this rank sends to itself.
      throw UsageError(
          fmt::format("recv_obj on {} from itself: expected an object sent to itself before, found none", g.who.me()));
    }
    const std::string first = std::move(g.self_first.front());
    g.self_first.pop_front();
    std::memcpy(g.inbox(src), first.data(), first.size());
    bytes = static_cast<int>(first.size());
  } else {
    bytes = g.recv_first("recv_obj", Kind::Send, src, g.dl_);
  }
  if (bytes < 0) {
    g.timed_out("recv_obj", timeout,
                bytes == -1 ? fmt::format("no {} object from {} arrived", type.name, g.who.peer(src))
                            : fmt::format("a message from {} was still arriving", g.who.peer(src)),
                {src}, bytes != -1);
  }
  const WireHeader h = g.check_first("recv_obj", Kind::Send, type, raw, src, -1, 0, bytes);
  char* out = nullptr;
  if (!g.start_payload("recv_obj", Kind::Send, h, src, sink, g.dl_, &out) ||
      !g.finish_payload_in_order("recv_obj", Kind::Send, out, h.chunk, {}, h.total)) {
    g.timed_out(
        "recv_obj", timeout,
        fmt::format("the header of a {}-byte object from {} arrived, its chunks did not", h.total, g.who.peer(src)),
        {src}, true);
  }
}

}  // namespace meshrt
