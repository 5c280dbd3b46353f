#include "meshrt/internal/protocol.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <deque>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "../support/expect_error.hpp"
#include "../support/random_messages.hpp"

namespace meshrt::protocol {
namespace {

using Bytes = std::vector<std::byte>;

constexpr auto* protocol_error = &test::error_of<ProtocolError>;  // another exception fails the test

void expect_contains(const std::string& text, const std::string& part) {
  EXPECT_NE(text.find(part), std::string::npos) << "'" << part << "' not in: " << text;
}

TEST(Protocol, EveryCommandRoundTrips) {
  test::RandomMessages gen(1);
  std::set<std::size_t> seen;
  for (int i = 0; i < 3000; ++i) {
    const Command c = gen.command(i % static_cast<int>(std::variant_size_v<Command>));
    seen.insert(c.index());
    const Bytes bytes = encode(c);
    const Command back = decode_command(bytes);
    ASSERT_EQ(back, c) << "command " << name(c) << " #" << i;
    // Canonical: re-encoding the decoded message gives the same bytes.
    ASSERT_EQ(encode(back), bytes) << name(c);
    // Counted without encoding: the size the controller checks against the limit.
    ASSERT_EQ(encoded_size(c), bytes.size()) << name(c);
    if (const auto* call = std::get_if<CallFunction>(&c)) {
      for (const Value& v : call->args) {
        Buffer framed;
        encode_value(v, framed);
        ASSERT_EQ(encoded_size(v) + 4, framed.size()) << v.to_string();  // + the frame's header
      }
    }
  }
  EXPECT_EQ(seen.size(), std::variant_size_v<Command>);
}

// A group's commands one by one, nested groups flattened: what a worker's queue holds.
void flatten(Command c, std::vector<Command>& out) {
  if (auto* g = std::get_if<CommandGroup>(&c)) {
    for (Command& inner : g->commands) flatten(std::move(inner), out);
  } else {
    out.push_back(std::move(c));
  }
}

TEST(Protocol, DecodeCommandsFlattensAsDecodeCommand) {
  test::RandomMessages gen(7);
  std::mt19937_64 rng(8);
  int refused = 0;
  for (int i = 0; i < 2000; ++i) {
    const Command one = gen.command(i % static_cast<int>(std::variant_size_v<Command>));
    const Command c = i % 3 == 0 ? one : Command(CommandGroup{{one, CommandGroup{{gen.command(), one}}, Exit{}}});
    Bytes b = encode(c);
    if (i % 2) b[rng() % b.size()] = static_cast<std::byte>(rng());  // corrupt half of them
    std::deque<Command> slots;
    std::string in_place_error, whole_error;
    try {
      decode_commands(b, [&]() -> Command& { return slots.emplace_back(); });
    } catch (const ProtocolError& e) {
      in_place_error = e.what();
    }
    std::vector<Command> expected;
    try {
      flatten(decode_command(b), expected);
    } catch (const ProtocolError& e) {
      whole_error = e.what();
    }
    ASSERT_EQ(in_place_error, whole_error) << "#" << i;
    if (!whole_error.empty()) {
      ++refused;
      continue;
    }
    ASSERT_EQ(std::vector<Command>(slots.begin(), slots.end()), expected) << "#" << i;
  }
  EXPECT_GT(refused, 0);
}

TEST(Protocol, EveryReplyAndHandshakeRoundTrips) {
  test::RandomMessages gen(2);
  for (int i = 0; i < 2000; ++i) {
    const Reply r = gen.reply(i % 5);
    const Bytes bytes = encode(r);
    ASSERT_EQ(decode_reply(bytes), r) << name(r);
    ASSERT_EQ(encode(decode_reply(bytes)), bytes);
    const Handshake h = gen.handshake();
    ASSERT_EQ(decode_handshake(encode(h)), h);
  }
}

TEST(Protocol, ValueRoundTripAndNames) {
  test::RandomMessages gen(3);
  for (int i = 0; i < 500; ++i) {
    const Value v = gen.value();
    Buffer b;
    encode_value(v, b);
    EXPECT_EQ(decode_value(b.span()), v);
  }
  EXPECT_EQ(name(Command{CallFunction{}}), "CallFunction");
  EXPECT_EQ(name(Reply{Restarted{}}), "Restarted");
  EXPECT_EQ(name(Reduction::Bxor), "bxor");
  EXPECT_EQ(parse_reduction("avg"), Reduction::Avg);
  EXPECT_EQ(parse_reduction("mean"), Reduction::Avg);  // torch's name
  EXPECT_THROW(parse_reduction("average"), UsageError);
}

TEST(Protocol, BufferIsReused) {
  Buffer b;
  encode_into(Command{RequestStatus{7}}, b);
  const std::size_t first = b.size();
  const std::byte* storage = b.data();
  b.clear();
  encode_into(Command{RequestStatus{8}}, b);
  EXPECT_EQ(b.size(), first);
  EXPECT_EQ(b.data(), storage);
  EXPECT_EQ(std::get<RequestStatus>(decode_command(b.span())).ident, 8u);
}

TEST(Protocol, LargeTensorPayload) {
  Tensor t = Tensor::empty(TensorMeta({256, 1024}, DType::Float32));
  auto s = t.span<float>();
  for (std::size_t i = 0; i < s.size(); ++i) s[i] = static_cast<float>(i) * 0.5f;
  const Reply r = FetchResult{42, Value(t)};
  const Reply back = decode_reply(encode(r));
  const auto& v = std::get<FetchResult>(back).value;
  ASSERT_TRUE(v.is_tensor());
  EXPECT_FALSE(v.as_tensor().same_storage(t));
  EXPECT_TRUE(v.as_tensor().equals(t));
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(v.as_tensor().raw_data()) % 64, 0u);
}

TEST(Protocol, HeaderErrors) {
  const Bytes good = encode(Command{Exit{}});
  expect_contains(protocol_error([] { decode_command({}); }), "expected 4 more bytes, found 0");
  Bytes b = good;
  b[0] = std::byte{'x'};
  expect_contains(protocol_error([&] { decode_command(b); }), "expected the magic bytes 'm' 'r', found 0x78");
  b = good;
  b[2] = std::byte{5};
  const std::string version = protocol_error([&] { decode_command(b); });
  expect_contains(version, "expected protocol version 4, found 5");
  expect_contains(version, "at byte 2");
  expect_contains(protocol_error([&] { decode_reply(good); }), "expected frame kind 2 (reply), found 1");
  b = good;
  b[4] = std::byte{99};
  expect_contains(protocol_error([&] { decode_command(b); }), "expected a command tag in 0..15, found 99");
  b = encode(Reply{Restarted{}});
  b[4] = std::byte{5};
  expect_contains(protocol_error([&] { decode_reply(b); }), "expected a reply tag in 0..4, found 5");
  // A subtree report names ranks >= 0, with one count each.
  Bytes tree = encode(Reply{TreeStatus{7, 1, {3}, {2}}});
  tree[4 + 1 + 8 + 4 + 4 + 3] = std::byte{0x80};  // rank 3's high byte: negative
  expect_contains(protocol_error([&] { decode_reply(tree); }), "TreeStatus.direct_ranks");
  expect_contains(protocol_error([&] { encode(Reply{TreeStatus{7, 1, {3}, {}}}); }), "one count per rank (1), found 0");
  b = good;
  b.push_back(std::byte{0});
  expect_contains(protocol_error([&] { decode_command(b); }), "expected the frame to end, found 1 more bytes");
}

TEST(Protocol, EnumAndBoolErrors) {
  // Reduce layout: header 4, tag 1, result 8, tensor 8, 0-d meta 10, mesh 8, stream 8,
  // dim "x" 5 -> reduction at byte 52, scatter 53, inplace 54, ident 55..62.
  const Bytes good =
      encode(Command{Reduce{Ref{1}, Ref{2}, TensorMeta(), Ref{3}, Ref{4}, "x", Reduction::Max, false, true}});
  ASSERT_EQ(good.size(), 63u);
  Bytes b = good;
  b[52] = std::byte{9};
  const std::string e = protocol_error([&] { decode_command(b); });
  expect_contains(e, "Reduce.reduction at byte 52");
  expect_contains(e, "expected a value in 0..8, found 9");
  b = good;
  b[53] = std::byte{2};
  expect_contains(protocol_error([&] { decode_command(b); }),
                  "Reduce.scatter at byte 53 of a 63-byte frame: expected a bool byte 0 or 1, found 2");
  b = good;
  b[4 + 1 + 16] = std::byte{8};  // factory dtype
  expect_contains(protocol_error([&] { decode_command(b); }), "expected a value in 0..7, found 8");
}

TEST(Protocol, LengthsPastTheBuffer) {
  CallFunction call{1, {Ref{1}}, {}, "meshrt.add", {Value(Ref{2}), Value(Ref{3})}, Ref{0}};
  Bytes b = encode(Command{call});
  // The args count sits after header 4, tag 1, ident 8, results 4+8, mutates 4, name 4+10.
  const std::size_t args_at = 4 + 1 + 8 + 12 + 4 + 14;
  std::uint32_t count = 0;
  std::memcpy(&count, b.data() + args_at, 4);
  ASSERT_EQ(count, 2u);
  count = 0xffffffffu;
  std::memcpy(b.data() + args_at, &count, 4);
  const std::string e = protocol_error([&] { decode_command(b); });
  expect_contains(e, "CallFunction.args at byte 43");
  expect_contains(e, "found 4294967295");

  // Every strict prefix of every message is refused cleanly.
  test::RandomMessages gen(4);
  for (int i = 0; i < 200; ++i) {
    const Bytes full = encode(gen.command());
    for (std::size_t n = 0; n < full.size(); ++n) {
      EXPECT_THROW(decode_command(std::span(full.data(), n)), ProtocolError) << "prefix " << n << " of " << full.size();
    }
  }
}

TEST(Protocol, TensorValidation) {
  const Tensor t = Tensor::from<std::int32_t>({2, 2}, {1, 2, 3, 4});
  Bytes good = encode(Reply{FetchResult{5, Value(t)}});
  // header 4, tag 1, ident 8, value tag 1, dtype 1, ndim 4, dims 16 -> nbytes at 35.
  Bytes b = good;
  std::uint64_t nbytes = 0;
  std::memcpy(&nbytes, b.data() + 35, 8);
  ASSERT_EQ(nbytes, 16u);
  nbytes = 15;
  std::memcpy(b.data() + 35, &nbytes, 8);
  expect_contains(protocol_error([&] { decode_reply(b); }), "expected nbytes = numel 4 x 4 bytes = 16, found 15");
  b = good;
  const std::int64_t negative = -3;
  std::memcpy(b.data() + 19, &negative, 8);
  expect_contains(protocol_error([&] { decode_reply(b); }), "expected every dimension >= 0, found -3 at dimension 0");
  // A shape whose byte size overflows int64 is refused before anything is allocated.
  b = good;
  const std::int64_t huge = std::int64_t{1} << 62;
  std::memcpy(b.data() + 19, &huge, 8);
  std::memcpy(b.data() + 27, &huge, 8);
  expect_contains(protocol_error([&] { decode_reply(b); }), "overflows");
  // More than the bytes left.
  b = good;
  const std::int64_t big = 1 << 20;
  std::memcpy(b.data() + 19, &big, 8);
  nbytes = std::uint64_t{1} << 23;  // 2^20 x 2 int32 values
  std::memcpy(b.data() + 35, &nbytes, 8);
  expect_contains(protocol_error([&] { decode_reply(b); }), "expected 8388608 more bytes, found 16");

  EXPECT_THROW(encode(Reply{FetchResult{1, Value(Tensor())}}), ProtocolError);
}

TEST(Protocol, BadSliceAndMeshNames) {
  Bytes b = encode(Command{CreateDeviceMesh{Ref{1}, {"a", "b"}, NDSlice(0, {2, 2}, {2, 1})}});
  // header 4, tag 1, result 8, names 4 + (4+1)*2, offset 8, ndim 4, sizes 16 -> strides at 55.
  const std::int64_t zero = 0;
  std::memcpy(b.data() + 55, &zero, 8);
  const std::string e = protocol_error([&] { decode_command(b); });
  expect_contains(e, "CreateDeviceMesh.ranks at byte 27");
  expect_contains(e, "expected a valid NDSlice");
  // 4M ranks, or a rank past int32: refused before NDSlice validates (and, for interleaved
  // strides, enumerates) them.
  const std::string big = protocol_error([] {
    decode_command(encode(Command{CreateDeviceMesh{Ref{1}, {"a", "b"}, NDSlice(0, {1 << 11, 1 << 11}, {1 << 11, 1})}}));
  });
  expect_contains(big, "expected at most 1048576 ranks, each <= 2147483647, found sizes [2048, 2048]");
  const std::string far = protocol_error([] {
    decode_command(encode(Command{CreateDeviceMesh{Ref{1}, {"a"}, NDSlice(std::int64_t{1} << 31, {1}, {1})}}));
  });
  expect_contains(far, "each <= 2147483647");
  expect_contains(protocol_error([] {
                    decode_command(encode(Command{CreateDeviceMesh{Ref{1}, {"a"}, NDSlice::row_major({2, 2})}}));
                  }),
                  "expected one name per mesh dimension (2), found 1 names");
  expect_contains(protocol_error([] {
                    decode_command(encode(Command{SendTensor{Ref{1}, NDSlice::row_major({2}), NDSlice::row_major({3}),
                                                             Ref{2}, TensorMeta(), Ref{3}}}));
                  }),
                  "expected from_ranks and to_ranks of one length, found 2 and 3");
  // A permutation send: to_order round-trips, and must be a permutation of the positions.
  const SendTensor rotated{Ref{1},   NDSlice::row_major({3}), NDSlice::row_major({3}), Ref{2}, TensorMeta(), Ref{3},
                           {1, 2, 0}};
  EXPECT_EQ(std::get<SendTensor>(decode_command(encode(Command{rotated}))), rotated);
  for (const auto& [order, message] : std::vector<std::pair<std::vector<std::int64_t>, std::string>>{
           {{1, 1, 0}, "expected to_order to be a permutation of 0..2, found 1"},
           {{0, 3, 1}, "expected to_order to be a permutation of 0..2, found 3"},
           {{1, 0}, "expected to_order of length 3 (the ranks), found 2"}}) {
    SendTensor bad = rotated;
    bad.to_order = order;
    expect_contains(protocol_error([&] { decode_command(encode(Command{bad})); }), message);
  }
  // A broadcast send: from_order round-trips, names a source position for each target,
  // and excludes to_order.
  const SendTensor broadcast{
      Ref{1}, NDSlice::row_major({2}), NDSlice::row_major({2, 2}), Ref{2}, TensorMeta(), Ref{3}, {}, {0, 1, 0, 1}};
  EXPECT_EQ(std::get<SendTensor>(decode_command(encode(Command{broadcast}))), broadcast);
  for (const auto& [to, from, message] :
       std::vector<std::tuple<std::vector<std::int64_t>, std::vector<std::int64_t>, std::string>>{
           {{}, {0, 1, 0}, "expected from_order of length 4 (the target ranks), found 3"},
           {{}, {0, 1, 2, 1}, "expected from_order's positions in 0..1 (the source ranks), found 2"},
           {{0, 1}, {0, 1, 0, 1}, "expected to_order or from_order, found both (2 and 4 positions)"}}) {
    SendTensor bad = broadcast;
    bad.to_order = to;
    bad.from_order = from;
    expect_contains(protocol_error([&] { decode_command(encode(Command{bad})); }), message);
  }
}

TEST(Protocol, DepthAndDuplicateKeysAreBounded) {
  Value v = Value(1);
  for (int i = 0; i < kMaxDepth + 5; ++i) v = Value(Value::List{v});
  expect_contains(protocol_error([&] { decode_reply(encode(Reply{FetchResult{1, v}})); }), "nested at most 64 deep");
  Command c = Exit{};
  for (int i = 0; i < kMaxDepth + 1; ++i) c = CommandGroup{{c}};
  expect_contains(protocol_error([&] { decode_command(encode(c)); }), "groups nested at most 64 deep");
  const Value dup = Value::dict({{"a", Value(1)}, {"a", Value(2)}});
  expect_contains(protocol_error([&] {
                    decode_reply(encode(Reply{FetchResult{1, dup}}));
                  }),
                  "expected unique dict keys, found 'a' twice");
}

TEST(Protocol, CorruptBytesNeverCrash) {
  test::RandomMessages gen(5);
  std::mt19937_64 rng(6);
  int refused = 0, accepted = 0;
  for (int i = 0; i < 3000; ++i) {
    Bytes b = encode(gen.command());
    for (int flips = 0; flips < 3; ++flips) b[rng() % b.size()] = static_cast<std::byte>(rng());
    try {
      const Command c = decode_command(b);
      ++accepted;
      EXPECT_EQ(encode(c), b);  // whatever decodes is canonical
    } catch (const ProtocolError&) {
      ++refused;
    }
  }
  EXPECT_GT(refused, 0);
  EXPECT_GT(accepted, 0);
}

}  // namespace
}  // namespace meshrt::protocol
