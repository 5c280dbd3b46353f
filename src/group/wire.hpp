// The group's wire format (docs/ARCHITECTURE.md section 5): tags, the first message's
// header, chunking, and the notice of a broken group. Private to src/group/.
//
// Wire protocol. Every object travels as one "first message": a 64-byte WireHeader (the
// operation, its sequence number, root and type, the payload's size), the sender's type
// name, and (for small objects) the whole payload, so a small object costs exactly one
// MPI message and the header is the members' agreement. Larger payloads follow on the
// operation's chunk tag as ceil(total / chunk) messages of at most `chunk` bytes, sent
// from and received into the object's own memory where the type allows (raw types) or the
// serialization buffer. MPI matches by (source, tag) and never overtakes between a pair,
// so messages of different senders never mix and one sender's are FIFO.
//
// A collective's first messages travel on a tag that carries its sequence number (modulo
// kCollectiveTags): a broadcast's receiver waiting for its root can tell a first message
// of the same collective from another member (a disagreement: in a broadcast only the
// root sends) from one of a later collective without receiving it.
//
// Receiving: a first message is received with a pre-posted MPI_Irecv into a per-peer
// buffer of the largest first-message size (kFirstMax), straight from MPI's eager path
// (no probe, no unexpected-queue copy), so a receiver need not know the size ahead; a
// receive that times out is cancelled, so the late message stays queued for the next
// call. The first chunk of a large payload is probed before anything is allocated (a
// corrupt header never makes a rank allocate), then every chunk is received in place.
// all_gather_obj posts all its receives before it sends, and takes the parts in whatever
// order they come.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace meshrt::group_internal {

// One tag pair per operation kind, so a send can never be taken for a broadcast.
enum class Kind : std::uint8_t { Send = 1, Broadcast = 2, AllGather = 3, Barrier = 4 };
constexpr int header_tag(Kind k) {
  return 2 * static_cast<int>(k) - 1;
}
constexpr int chunk_tag(Kind k) {
  return 2 * static_cast<int>(k);
}
constexpr const char* kind_name(Kind k) {
  switch (k) {
    case Kind::Send:
      return "send_obj/recv_obj";
    case Kind::Broadcast:
      return "broadcast_obj";
    case Kind::AllGather:
      return "all_gather_obj";
    case Kind::Barrier:
      return "barrier";
  }
  return "?";
}

constexpr std::uint32_t kMagic = 0x4752544d;  // "MTRG"
constexpr std::uint16_t kVersion = 2;
// Objects up to this size travel inside the first message (one MPI message in all);
// above it the payload is sent from the object's memory without a packing copy.
constexpr std::size_t kInlineMax = 16 * 1024;
constexpr std::size_t kMaxTypeName = 4096;
// The largest first message: what a first-message receive is posted for.
constexpr std::size_t kFirstMax = 64 + kMaxTypeName + kInlineMax;
// Payloads move in messages of at most this size (or the group's chunk size if smaller):
// shared-memory transfers only advance while a rank calls into MPI, and a completed
// piece is the progress signal that keeps the waiting loop from sleeping mid-transfer.
constexpr std::size_t kPipelineBytes = std::size_t{1} << 20;
// Payloads up to this size are allocated as soon as their header is checked and every
// chunk's receive posted at once; larger ones only once their first chunk is there.
constexpr std::size_t kTrustedAlloc = std::size_t{1} << 20;

struct WireHeader {
  std::uint32_t magic;
  std::uint16_t version;
  std::uint8_t kind;
  std::uint8_t raw;
  std::uint64_t type_hash;
  std::uint64_t total;         // payload bytes
  std::uint64_t inline_bytes;  // payload bytes inside this message (0 or total)
  std::uint64_t chunk;         // size of every continuation chunk but the last
  std::uint64_t seq;           // the sender's count of operations of this kind
  std::int32_t root;           // broadcast: the root; otherwise the sender
  std::int32_t sender;
  std::uint32_t name_len;
  std::uint32_t reserved;
};
static_assert(sizeof(WireHeader) == 64);

// A collective's first message from one member: its header and the type name it carries
// (pointing into that member's inbox).
struct WireHeaderView {
  WireHeader h{};
  std::string_view type_name;
};

// The most bytes a header may declare: this machine's memory.
inline std::size_t physical_memory() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page <= 0) return std::size_t{1} << 40;
  return static_cast<std::size_t>(pages) * static_cast<std::size_t>(page);
}

// A member's word to the others that it broke the group, in a timeout or on finding that
// the members disagree on a broadcast (on its own tag, after every operation's): a member
// that arrives late, or completed its part already, takes it and raises too, instead of
// completing with what the others left in flight.
constexpr int kBrokenTag = 2 * 5;
constexpr std::uint32_t kBrokenMagic = 0x6b6f7262;  // "brok"
enum class BrokenWhy : std::uint32_t { Timeout = 0, Disagreement = 1 };
struct BrokenNotice {
  std::uint32_t magic = kBrokenMagic;
  BrokenWhy why = BrokenWhy::Timeout;
  std::uint64_t seq = 0;  // the collective's sequence number (0 for a send or recv)
  double seconds = 0;     // the timeout that expired
  char op[32] = {};       // the operation, NUL-terminated
  char text[448] = {};    // a disagreement: what the member found, NUL-terminated
};

// Every collective's first messages travel on the tag of its sequence number, after every
// Kind's header and chunk tags and the broken-group tag (MPI guarantees tags to 32767).
constexpr int kFirstCollectiveTag = 2 * 5 + 1;
constexpr std::uint64_t kCollectiveTags = 1024;
constexpr int collective_tag(std::uint64_t seq) {
  return kFirstCollectiveTag + static_cast<int>(seq % kCollectiveTags);
}

// Objects up to kInlineMax (and the chunk size) travel inside the first message.
inline bool goes_inline(std::size_t size, std::size_t chunk) {
  return size <= std::min(kInlineMax, chunk);
}

}  // namespace meshrt::group_internal
