// Random, valid protocol messages for round-trip tests and the fuzzer's seed corpus.
// Header-only so both the unit tests and tests/fuzz can use it without libmeshrt's test
// targets. Every alternative of Command and Reply is reachable.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "meshrt/internal/protocol.hpp"

namespace meshrt::test {

class RandomMessages {
 public:
  explicit RandomMessages(std::uint64_t seed) : rng_(seed) {}

  std::int64_t uniform(std::int64_t lo, std::int64_t hi) {
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng_);
  }
  bool coin() { return uniform(0, 1) == 1; }
  Ref ref() { return Ref{coin() ? static_cast<std::uint64_t>(uniform(0, 100)) : rng_()}; }
  std::vector<Ref> refs(int max = 5) {
    std::vector<Ref> out(static_cast<std::size_t>(uniform(0, max)));
    for (auto& r : out) r = ref();
    return out;
  }
  std::string string(int max = 12) {
    std::string s(static_cast<std::size_t>(uniform(0, max)), ' ');
    for (auto& c : s) c = static_cast<char>(uniform(0, 255));  // any bytes, NUL included
    return s;
  }
  std::vector<std::int64_t> shape(int max_dims = 3, int max_size = 4) {
    std::vector<std::int64_t> s(static_cast<std::size_t>(uniform(0, max_dims)));
    for (auto& d : s) d = uniform(0, max_size);
    return s;
  }
  DType dtype() { return static_cast<DType>(uniform(0, kNumDTypes - 1)); }
  TensorMeta meta() {
    return TensorMeta(shape(), dtype(), coin() ? Device::cpu() : Device::cuda(static_cast<int>(uniform(0, 7))));
  }
  Tensor tensor() {
    Tensor t = Tensor::empty(TensorMeta(shape(), dtype()));
    auto* p = static_cast<std::uint8_t*>(t.raw_data());
    for (std::size_t i = 0; i < t.nbytes(); ++i)
      p[i] = static_cast<std::uint8_t>(t.dtype() == DType::Bool ? uniform(0, 1) : uniform(0, 255));
    return t;
  }
  NDSlice slice(std::vector<std::int64_t> sizes) {
    for (auto& s : sizes) s = std::max<std::int64_t>(s, 1);
    return NDSlice::row_major(std::move(sizes), uniform(0, 64));
  }
  Value value(int depth = 0) {
    const int kind = static_cast<int>(uniform(0, depth >= 3 ? 7 : 9));
    switch (kind) {
      case 0:
        return Value();
      case 1:
        return Value(coin());
      case 2:
        return Value(static_cast<std::int64_t>(rng_()));
      case 3:
        return Value(std::uniform_real_distribution<double>(-1e9, 1e9)(rng_));
      case 4:
        return Value(string());
      case 5:
        return Value(ref());
      case 6:
        return Value(tensor());
      case 7:
        return Value(meta());
      case 8: {
        Value::List l;
        for (int i = 0, n = static_cast<int>(uniform(0, 4)); i < n; ++i) l.push_back(value(depth + 1));
        return Value(std::move(l));
      }
      default: {
        Value::Dict d;
        for (int i = 0, n = static_cast<int>(uniform(0, 4)); i < n; ++i)
          d.emplace_back("k" + std::to_string(i), value(depth + 1));
        return Value(std::move(d));
      }
    }
  }

  protocol::Command command(int tag = -1, int depth = 0) {
    using namespace protocol;
    if (tag < 0) tag = static_cast<int>(uniform(0, static_cast<std::int64_t>(std::variant_size_v<Command>) - 1));
    switch (tag) {
      case 0: {
        CreateDeviceMesh m{ref(), {}, slice(shape(3, 4))};
        for (std::size_t i = 0; i < m.ranks.ndim(); ++i) m.names.push_back(string(6));
        return m;
      }
      case 1:
        return CreateStream{ref(), coin()};
      case 2: {
        CallFunction m{rng_(), refs(), refs(), string(20), {}, ref(), ref(), coin()};
        for (int i = 0, n = static_cast<int>(uniform(0, 5)); i < n; ++i) m.args.push_back(value());
        return m;
      }
      case 3: {
        FetchValue m{rng_(), refs(), std::nullopt, value(), ref()};
        if (coin()) m.function = string();
        return m;
      }
      case 4:
        return Reduce{
            ref(),  ref(), meta(), ref(), ref(), string(6), static_cast<Reduction>(uniform(0, kNumReductions - 1)),
            coin(), coin()};
      case 5: {
        const auto sizes = shape(3, 3);
        if (coin()) return SendTensor{ref(), slice(sizes), slice(sizes), ref(), meta(), ref()};
        // A broadcast send: a target of more dimensions, each naming a source position.
        SendTensor m{ref(), slice(sizes), slice(shape(3, 3)), ref(), meta(), ref()};
        m.to_ranks = NDSlice::row_major({m.to_ranks.len(), uniform(1, 3)}, m.to_ranks.offset());
        for (std::int64_t j = 0; j < m.to_ranks.len(); ++j) m.from_order.push_back(uniform(0, m.from_ranks.len() - 1));
        return m;
      }
      case 6:
        return BorrowCreate{ref(), ref(), ref(), ref(), coin()};
      case 7:
        return BorrowFirstUse{ref()};
      case 8:
        return BorrowDrop{ref()};
      case 9:
        return DeleteRefs{refs(20)};
      case 10: {
        CommandGroup g;
        for (int i = 0, n = static_cast<int>(uniform(0, depth >= 2 ? 3 : 5)); i < n; ++i) {
          // No nested group below depth 2 keeps messages small.
          int t = static_cast<int>(uniform(0, 12));
          if (t == 10 && depth >= 2) t = 12;
          g.commands.push_back(command(t, depth + 1));
        }
        return g;
      }
      case 11:
        return RequestStatus{rng_()};
      case 13: {
        // Only the recordable kinds may be recorded (the decoder refuses the others).
        DefineRecording d{ref(), static_cast<std::uint32_t>(uniform(0, 4)), rng_(), rng_(), refs(5), {}};
        constexpr int kRecordable[] = {2, 4, 5, 6, 7, 8, 15};
        for (int i = 0, n = static_cast<int>(uniform(0, 4)); i < n; ++i)
          d.commands.push_back(command(kRecordable[uniform(0, 6)], depth + 1));
        return d;
      }
      case 14:
        return CallRecording{ref(), refs(4), rng_(), rng_()};
      case 15: {
        Collective m{.kind = static_cast<CollectiveKind>(uniform(0, kNumCollectiveKinds - 1)),
                     .result = ref(),
                     .tensor = ref(),
                     .factory = meta(),
                     .mesh = ref(),
                     .stream = ref(),
                     .dims = {},
                     .reduction = static_cast<Reduction>(uniform(0, kNumReductions - 1)),
                     .scatter = coin(),
                     .inplace = coin(),
                     .root = uniform(-1, 7),
                     .ident = rng_()};
        for (int i = 0, n = static_cast<int>(uniform(0, 3)); i < n; ++i) m.dims.push_back(string(6));
        return m;
      }
      default:
        return Exit{coin()};
    }
  }

  protocol::Reply reply(int tag = -1) {
    using namespace protocol;
    if (tag < 0) tag = static_cast<int>(uniform(0, 4));
    switch (tag) {
      case 0:
        return Status{rng_(), rng_()};
      case 1:
        return RemoteFunctionFailed{rng_(), string(40), static_cast<std::int32_t>(uniform(-1, 1000)), string(),
                                    string()};
      case 2:
        return FetchResult{rng_(), value()};
      case 4: {
        TreeStatus t{rng_(), static_cast<std::uint32_t>(rng_()), {}, {}};
        for (int i = 0, n = static_cast<int>(uniform(0, 4)); i < n; ++i) {
          t.direct_ranks.push_back(static_cast<std::int32_t>(uniform(0, 1000)));
          t.direct_counts.push_back(rng_());
        }
        return t;
      }
      default:
        return Restarted{};
    }
  }

  protocol::Handshake handshake() {
    return protocol::Handshake{string(),
                               static_cast<std::uint32_t>(rng_()),
                               rng_(),
                               static_cast<std::int32_t>(uniform(0, 3)),
                               static_cast<std::int32_t>(uniform(0, 1000)),
                               string()};
  }

 private:
  std::mt19937_64 rng_;
};

}  // namespace meshrt::test
