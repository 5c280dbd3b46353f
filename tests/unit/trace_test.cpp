// The timeline's records (src/common/trace.hpp) and files (src/common/timeline.hpp): a
// command's peers in one word of its event, and the "peers" the file gives its span.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/timeline.hpp"
#include "common/trace.hpp"

namespace meshrt::detail::trace {
namespace {

std::vector<int> round_trip(const std::vector<int>& peers, std::size_t* count = nullptr) {
  const Peers back = decode_peers(encode_peers(peers));
  if (count) *count = back.count;
  return back.ranks;
}

TEST(TracePeers, ARunOfRanksComesBackInItsOrder) {
  for (const std::vector<int>& line : std::vector<std::vector<int>>{
           {0, 1}, {2, 3}, {1, 3}, {7}, {5, 3, 1}, {0, 16, 32, 48, 64, 80}, {1000000, 1000001}, {3, 3}}) {
    std::size_t count = 0;
    EXPECT_EQ(round_trip(line, &count), line);
    EXPECT_EQ(count, line.size());
  }
  std::vector<int> wide(4096);
  for (int i = 0; i < 4096; ++i) wide[static_cast<std::size_t>(i)] = 8191 - 2 * i;  // descending, 4096 ranks
  EXPECT_EQ(round_trip(wide), wide);
}

TEST(TracePeers, OtherRanksBelow62ComeBackAsTheirSet) {
  EXPECT_EQ(round_trip({5, 0, 2}), (std::vector<int>{0, 2, 5}));
  EXPECT_EQ(round_trip({61, 0, 1}), (std::vector<int>{0, 1, 61}));
}

TEST(TracePeers, RanksThatFitNeitherFormKeepOnlyTheirCount) {
  std::size_t count = 0;
  EXPECT_TRUE(round_trip({0, 1, 62}, &count).empty());
  EXPECT_EQ(count, 3u);
  EXPECT_TRUE(round_trip({2000000, 2000001}, &count).empty());  // a first rank beyond the run's 20 bits
  EXPECT_EQ(count, 2u);
  EXPECT_EQ(encode_peers({}), 0u);
  EXPECT_EQ(decode_peers(0).count, 0u);
}

TEST(TraceFile, ACommandsSpanNamesItsPeers) {
  const std::string path = ::testing::TempDir() + "meshrt_trace_peers.json";
  RankEvents rank{.rank = 2, .host = "n2"};
  const std::vector<std::vector<int>> peers{{2, 3}, {1, 2, 5}, {2, 64, 70}, {}};
  for (std::size_t i = 0; i < peers.size(); ++i) {
    Event e{.start_ns = 1000 * static_cast<std::int64_t>(i + 1),
            .end_ns = 1000 * static_cast<std::int64_t>(i + 1) + 500,
            .ident = i + 1,
            .queued_ns = 1000 * static_cast<std::int64_t>(i + 1),
            .a = 64,
            .c = encode_peers(peers[i]),
            .track = Track::Worker,
            .kind = Kind::Command};
    rank.events.push_back(e);
  }
  write_chrome_trace(path, {rank}, {}, true, "test");
  std::ifstream in(path);
  const nlohmann::json trace = nlohmann::json::parse(in);
  std::vector<nlohmann::json> args;
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] == "X") args.push_back(e["args"]);
  }
  ASSERT_EQ(args.size(), 4u);
  EXPECT_EQ(args[0]["peers"], nlohmann::json({2, 3}));
  EXPECT_EQ(args[1]["peers"], nlohmann::json({1, 2, 5}));
  EXPECT_FALSE(args[2].contains("peers"));
  EXPECT_EQ(args[2]["peer_count"], 3);
  EXPECT_FALSE(args[3].contains("peers") || args[3].contains("peer_count")) << args[3];
  std::remove(path.c_str());
}

}  // namespace
}  // namespace meshrt::detail::trace
