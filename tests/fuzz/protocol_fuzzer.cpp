// libFuzzer target for the wire decoder: any byte string must either decode or raise
// ProtocolError, never crash, leak, trip a sanitizer or throw anything else. What decodes
// must re-encode to the same bytes (the codec is canonical), which also catches a decoder
// that accepts a frame it misreads.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "meshrt/internal/protocol.hpp"

namespace {

template <class Decode>
void check(std::span<const std::byte> bytes, Decode&& decode, const char* what) {
  try {
    const auto message = decode(bytes);
    const std::vector<std::byte> again = meshrt::protocol::encode(message);
    if (again.size() != bytes.size() || std::memcmp(again.data(), bytes.data(), bytes.size()) != 0) {
      std::fprintf(stderr, "%s: decoded frame of %zu bytes re-encodes to %zu different bytes\n", what, bytes.size(),
                   again.size());
      std::abort();
    }
  } catch (const meshrt::ProtocolError&) {
    // The expected outcome for almost every input.
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  check(bytes, meshrt::protocol::decode_command, "command");
  check(bytes, meshrt::protocol::decode_reply, "reply");
  check(bytes, meshrt::protocol::decode_handshake, "handshake");
  check(bytes, meshrt::protocol::decode_query, "query");
  check(bytes, meshrt::protocol::decode_query_answer, "query answer");
  check(bytes, meshrt::protocol::decode_envelope, "envelope");
  // A worker decodes what an envelope carries as a command.
  try {
    const meshrt::protocol::Envelope e = meshrt::protocol::decode_envelope(bytes);
    check(e.payload, meshrt::protocol::decode_command, "envelope payload");
  } catch (const meshrt::ProtocolError&) {
  }
  try {
    const meshrt::Value v = meshrt::protocol::decode_value(bytes);
    meshrt::protocol::Buffer again;
    meshrt::protocol::encode_value(v, again);
    if (again.size() != size || std::memcmp(again.data(), data, size) != 0) std::abort();
  } catch (const meshrt::ProtocolError&) {
  }
  return 0;
}
