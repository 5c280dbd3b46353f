// Micro-benchmarks of the wire codec against Boost.Serialization, the numbers behind the
// choice of a hand-written codec (src/protocol/codec.cpp). Targets: <= 1 us to encode and
// decode a small command; >= 2 GB/s for a 1 MiB FetchResult.
//
//   meshrt-bench codec                               # table
//   meshrt-bench codec --benchmark_format=json       # for scripts
//
// The Boost side is given every advantage: archives without headers, over reused string
// buffers through Boost.Iostreams devices (no std::stringstream reallocation), and the
// tensor bytes as one binary object.
#include <benchmark/benchmark.h>

#include <boost/archive/binary_iarchive.hpp>
#include <boost/archive/binary_oarchive.hpp>
#include <boost/iostreams/device/array.hpp>
#include <boost/iostreams/device/back_inserter.hpp>
#include <boost/iostreams/stream.hpp>
#include <boost/serialization/optional.hpp>
#include <boost/serialization/split_free.hpp>
#include <boost/serialization/string.hpp>
#include <boost/serialization/utility.hpp>
#include <boost/serialization/vector.hpp>
#include <string>

#include "bench.hpp"
#include "meshrt/internal/protocol.hpp"
#include "meshrt/tensor_serialization.hpp"

namespace boost::serialization {

template <class Archive>
void serialize(Archive& ar, meshrt::Ref& r, unsigned) {
  ar& r.id;
}

// A Value as a kind tag and its payload, recursively.
template <class Archive>
void save(Archive& ar, const meshrt::Value& v, unsigned) {
  const auto kind = static_cast<std::uint8_t>(v.kind());
  ar << kind;
  switch (v.kind()) {
    case meshrt::Value::Kind::None:
      break;
    case meshrt::Value::Kind::Bool: {
      const bool b = v.as_bool();
      ar << b;
      break;
    }
    case meshrt::Value::Kind::Int: {
      const std::int64_t i = v.as_int();
      ar << i;
      break;
    }
    case meshrt::Value::Kind::Double: {
      const double d = v.as_number();
      ar << d;
      break;
    }
    case meshrt::Value::Kind::String:
      ar << v.as_string();
      break;
    case meshrt::Value::Kind::Ref: {
      const meshrt::Ref r = v.as_ref();
      ar << r;
      break;
    }
    case meshrt::Value::Kind::Tensor:
      ar << v.as_tensor();
      break;
    case meshrt::Value::Kind::Meta:
      ar << v.as_meta();
      break;
    case meshrt::Value::Kind::List:
      ar << v.as_list();
      break;
    case meshrt::Value::Kind::Dict:
      ar << v.as_dict();
      break;
    case meshrt::Value::Kind::Object:
      throw meshrt::UsageError("the Boost.Serialization baseline: a worker object never travels");
  }
}

template <class Archive>
void load(Archive& ar, meshrt::Value& v, unsigned) {
  std::uint8_t kind = 0;
  ar >> kind;
  switch (static_cast<meshrt::Value::Kind>(kind)) {
    case meshrt::Value::Kind::None:
      v = meshrt::Value();
      break;
    case meshrt::Value::Kind::Bool: {
      bool b = false;
      ar >> b;
      v = meshrt::Value(b);
      break;
    }
    case meshrt::Value::Kind::Int: {
      std::int64_t i = 0;
      ar >> i;
      v = meshrt::Value(i);
      break;
    }
    case meshrt::Value::Kind::Double: {
      double d = 0;
      ar >> d;
      v = meshrt::Value(d);
      break;
    }
    case meshrt::Value::Kind::String: {
      std::string s;
      ar >> s;
      v = meshrt::Value(std::move(s));
      break;
    }
    case meshrt::Value::Kind::Ref: {
      meshrt::Ref r;
      ar >> r;
      v = meshrt::Value(r);
      break;
    }
    case meshrt::Value::Kind::Tensor: {
      meshrt::Tensor t;
      ar >> t;
      v = meshrt::Value(std::move(t));
      break;
    }
    case meshrt::Value::Kind::Meta: {
      meshrt::TensorMeta m;
      ar >> m;
      v = meshrt::Value(std::move(m));
      break;
    }
    case meshrt::Value::Kind::List: {
      meshrt::Value::List l;
      ar >> l;
      v = meshrt::Value(std::move(l));
      break;
    }
    case meshrt::Value::Kind::Dict: {
      meshrt::Value::Dict d;
      ar >> d;
      v = meshrt::Value(std::move(d));
      break;
    }
    case meshrt::Value::Kind::Object:
      throw meshrt::UsageError("the Boost.Serialization baseline: a worker object never travels");
  }
}

template <class Archive>
void serialize(Archive& ar, meshrt::protocol::CallFunction& c, unsigned) {
  ar& c.ident& c.results& c.mutates& c.function& c.args& c.stream;
}

template <class Archive>
void serialize(Archive& ar, meshrt::protocol::FetchResult& r, unsigned) {
  ar& r.ident& r.value;
}

}  // namespace boost::serialization

BOOST_SERIALIZATION_SPLIT_FREE(meshrt::Value)

namespace {

using namespace meshrt;
using namespace meshrt::protocol;
namespace io = boost::iostreams;
constexpr unsigned kArchiveFlags = boost::archive::no_header | boost::archive::no_codecvt;

CallFunction small_command() {
  return CallFunction{12345, {Ref{100}}, {}, "meshrt.add", {Value(Ref{1}), Value(Ref{2}), Value(Ref{3}), Value(Ref{4})},
                      Ref{7}};
}

FetchResult large_result() {
  Tensor t = Tensor::empty(TensorMeta({256, 1024}, DType::Float32));  // 1 MiB
  auto s = t.span<float>();
  for (std::size_t i = 0; i < s.size(); ++i) s[i] = static_cast<float>(i);
  return FetchResult{99, Value(t)};
}

void BM_Codec_SmallCommand(benchmark::State& state) {
  const Command c = small_command();
  Buffer buffer;
  for (auto _ : state) {
    buffer.clear();
    encode_into(c, buffer);
    Command back = decode_command(buffer.span());
    benchmark::DoNotOptimize(back);
  }
  state.counters["frame_bytes"] = static_cast<double>(buffer.size());
}

void BM_Codec_SmallCommand_EncodeOnly(benchmark::State& state) {
  const Command c = small_command();
  Buffer buffer;
  for (auto _ : state) {
    buffer.clear();
    encode_into(c, buffer);
    benchmark::DoNotOptimize(buffer.data());
  }
}

void BM_Codec_SmallCommand_DecodeOnly(benchmark::State& state) {
  const std::vector<std::byte> bytes = encode(Command{small_command()});
  for (auto _ : state) {
    Command back = decode_command(bytes);
    benchmark::DoNotOptimize(back);
  }
}

void BM_Codec_FetchResult1MiB(benchmark::State& state) {
  const Reply r = large_result();
  Buffer buffer;
  for (auto _ : state) {
    buffer.clear();
    encode_into(r, buffer);
    Reply back = decode_reply(buffer.span());
    benchmark::DoNotOptimize(back);
  }
  // Payload bytes through encode + decode (each moves them once).
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * (1 << 20));
}

void BM_Codec_FetchResult1MiB_EncodeOnly(benchmark::State& state) {
  const Reply r = large_result();
  Buffer buffer;
  for (auto _ : state) {
    buffer.clear();
    encode_into(r, buffer);
    benchmark::DoNotOptimize(buffer.data());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * (1 << 20));
}

void BM_Codec_FetchResult1MiB_DecodeOnly(benchmark::State& state) {
  const std::vector<std::byte> bytes = encode(Reply{large_result()});
  for (auto _ : state) {
    Reply back = decode_reply(bytes);
    benchmark::DoNotOptimize(back);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * (1 << 20));
}

template <class T>
void boost_round_trip(const T& message, std::string& buffer) {
  buffer.clear();
  {
    io::stream<io::back_insert_device<std::string>> out(buffer);
    boost::archive::binary_oarchive oa(out, kArchiveFlags);
    oa << message;
  }
  io::stream<io::array_source> in(buffer.data(), buffer.size());
  boost::archive::binary_iarchive ia(in, kArchiveFlags);
  T back;
  ia >> back;
  benchmark::DoNotOptimize(back);
}

void BM_Boost_SmallCommand(benchmark::State& state) {
  const CallFunction c = small_command();
  std::string buffer;
  for (auto _ : state) boost_round_trip(c, buffer);
  state.counters["frame_bytes"] = static_cast<double>(buffer.size());
}

void BM_Boost_FetchResult1MiB(benchmark::State& state) {
  const FetchResult r = large_result();
  std::string buffer;
  for (auto _ : state) boost_round_trip(r, buffer);
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * (1 << 20));
}

void register_codec(meshrt::bench::Context&) {
  benchmark::RegisterBenchmark("codec/Codec_SmallCommand", BM_Codec_SmallCommand);
  benchmark::RegisterBenchmark("codec/Codec_SmallCommand_EncodeOnly", BM_Codec_SmallCommand_EncodeOnly);
  benchmark::RegisterBenchmark("codec/Codec_SmallCommand_DecodeOnly", BM_Codec_SmallCommand_DecodeOnly);
  benchmark::RegisterBenchmark("codec/Codec_FetchResult1MiB", BM_Codec_FetchResult1MiB);
  benchmark::RegisterBenchmark("codec/Codec_FetchResult1MiB_EncodeOnly", BM_Codec_FetchResult1MiB_EncodeOnly);
  benchmark::RegisterBenchmark("codec/Codec_FetchResult1MiB_DecodeOnly", BM_Codec_FetchResult1MiB_DecodeOnly);
  benchmark::RegisterBenchmark("codec/Boost_SmallCommand", BM_Boost_SmallCommand);
  benchmark::RegisterBenchmark("codec/Boost_FetchResult1MiB", BM_Boost_FetchResult1MiB);
}

}  // namespace

namespace meshrt::bench {
MESHRT_BENCH_SUITE("codec", "encode + decode of commands: the hand-written codec against Boost.Serialization",
                   register_codec);
}  // namespace meshrt::bench
