// Writes encoded, valid messages (every command and reply kind, handshakes, values) as a
// seed corpus for protocol_fuzzer: protocol_fuzz_corpus <dir> [count].
#include <cstdio>
#include <fstream>
#include <string>

#include "../support/random_messages.hpp"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s <corpus dir> [count per kind, default 20]\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  const int count = argc > 2 ? std::stoi(argv[2]) : 20;
  meshrt::test::RandomMessages gen(2024);
  int written = 0;
  const auto write = [&](const std::vector<std::byte>& bytes) {
    std::ofstream out(dir + "/seed-" + std::to_string(written++), std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    if (!out) throw std::runtime_error("cannot write into " + dir);
  };
  using meshrt::protocol::Command;
  for (int i = 0; i < count; ++i) {
    for (int tag = 0; tag < static_cast<int>(std::variant_size_v<Command>); ++tag)
      write(meshrt::protocol::encode(gen.command(tag)));
    for (int tag = 0; tag < 5; ++tag) write(meshrt::protocol::encode(gen.reply(tag)));
    write(meshrt::protocol::encode(gen.handshake()));
    // The out-of-band queries: every op, with and without text.
    for (int op = 0; op < meshrt::protocol::kNumQueryOps; ++op) {
      const auto kind = static_cast<meshrt::protocol::QueryOp>(op);
      write(meshrt::protocol::encode(meshrt::protocol::Query{
          .id = static_cast<std::uint64_t>(i + 1), .op = kind, .limit = 20, .reason = i % 2 ? "timeout" : ""}));
      write(meshrt::protocol::encode(meshrt::protocol::QueryAnswer{.query = static_cast<std::uint64_t>(i + 1),
                                                                   .rank = i % 4,
                                                                   .op = kind,
                                                                   .payload = R"({"rank":1,"current":null})",
                                                                   .error = i % 3 ? "" : "bad query"}));
    }
    // A fan-out envelope around a command, for 1 to 4 ranks.
    {
      meshrt::protocol::Envelope e{.fanout = static_cast<std::uint32_t>(1 + i % 3)};
      for (int r = 0; r <= i % 4; ++r) {
        e.ranks.push_back(r + 1);
        e.seqs.push_back(static_cast<std::uint64_t>(i + 1));
      }
      e.payload = meshrt::protocol::encode(gen.command(i % static_cast<int>(std::variant_size_v<Command>)));
      write(meshrt::protocol::encode(e));
    }
    meshrt::protocol::Buffer b;
    meshrt::protocol::encode_value(gen.value(), b);
    write(std::vector<std::byte>(b.data(), b.data() + b.size()));
  }
  std::printf("wrote %d seed messages into %s\n", written, dir.c_str());
  return 0;
}
