// StatelessGroup over 6 ranks: the source document's scenario (groups {0,1} and
// {0,1,2,3} while 4 and 5 do their own thing), many senders to one receiver, type tags,
// corrupt messages, chunking and user structs.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <boost/serialization/map.hpp>
#include <boost/serialization/string.hpp>
#include <boost/serialization/vector.hpp>
#include <cstring>
#include <functional>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "../support/expect_error.hpp"
#include "../support/mpi_world.hpp"
#include "meshrt/group.hpp"

using meshrt::StatelessGroup;
using meshrt::test::error_text;
using meshrt::test::world_rank;
using namespace std::chrono_literals;

namespace {

// Tag of a send_obj first message in the group protocol (src/group/wire.hpp: header_tag(Send)).
// Tests use it to inject raw messages the receiver will take for send_obj's.
constexpr int kSendHeaderTag = 1;
// A tag the group protocol never uses (it uses tags below 64).
constexpr int kCaptureTag = 1000;

struct Params {
  std::string name;
  std::vector<double> weights;
  std::map<std::string, int> index;
  int step = 0;
  template <class Ar>
  void serialize(Ar& ar, unsigned) {
    ar& name& weights& index& step;
  }
  bool operator==(const Params&) const = default;
};

Params sample_params(int seed) {
  Params p;
  p.name = "layer" + std::to_string(seed);
  p.weights.resize(static_cast<std::size_t>(10 + seed));
  std::iota(p.weights.begin(), p.weights.end(), seed * 0.5);
  p.index = {{"a", seed}, {"bb", seed * 2}};
  p.step = seed * 7;
  return p;
}

std::string fmt_root(int root) {
  return "with root " + std::to_string(root);
}

}  // namespace

TEST(Group, SourceScenarioTwoGroupsWhileOthersDoSomethingElse) {
  const int w = world_rank();
  if (w >= 4) {
    // Ranks 4 and 5 never join {0,1} or {0,1,2,3}: they form their own group meanwhile.
    auto g45 = StatelessGroup::create({5, 4});  // order given defines group ranks
    EXPECT_EQ(g45.rank(), w == 5 ? 0 : 1);
    EXPECT_EQ(g45.members(), (std::vector<int>{5, 4}));
    auto all = g45.all_gather_obj(std::string("r") + std::to_string(w), 10s);
    EXPECT_EQ(all, (std::vector<std::string>{"r5", "r4"}));
    g45.barrier(10s);
    return;
  }
  std::optional<StatelessGroup> g01;
  if (w < 2) {
    g01.emplace(StatelessGroup::create({0, 1}));
    EXPECT_EQ(g01->world_size(), 2);
    EXPECT_EQ(g01->rank(), w);
    if (w == 0) g01->send_obj(std::string("hello from A"), 1);
    if (w == 1) EXPECT_EQ(g01->recv_obj<std::string>(0, 10s), "hello from A");
  }
  // Later A, B, C, D form another group, and both keep working, interleaved.
  auto g4 = StatelessGroup::create({0, 1, 2, 3});
  EXPECT_EQ(g4.world_size(), 4);
  for (int round = 0; round < 3; ++round) {
    const int root = round % 4;
    auto v = g4.broadcast_obj(w == root ? sample_params(round) : Params{}, root, 10s);
    EXPECT_EQ(v, sample_params(round));
    if (g01) {
      auto pair = g01->all_gather_obj(std::vector<int>{w, round}, 10s);
      EXPECT_EQ(pair, (std::vector<std::vector<int>>{{0, round}, {1, round}}));
      if (w == 1) g01->send_obj(round * 100, 0);
      if (w == 0) EXPECT_EQ(g01->recv_obj<int>(1, 10s), round * 100);
    }
    auto all = g4.all_gather_obj(w * 10 + round, 10s);
    EXPECT_EQ(all, (std::vector<int>{round, 10 + round, 20 + round, 30 + round}));
    g4.barrier(10s);
    if (g01) g01->barrier(10s);
  }
}

TEST(Group, ManySendersToOneReceiverStayFifoPerSender) {
  auto g = StatelessGroup::from_comm(MPI_COMM_WORLD);
  constexpr int kPerSender = 20;
  if (g.rank() != 0) {
    for (int i = 0; i < kPerSender; ++i) g.send_obj(std::vector<int>{g.rank(), i}, 0, 10s);
  } else {
    // Receive in an order unrelated to the send order: senders interleaved at random.
    std::vector<int> order;
    for (int s = 1; s < g.world_size(); ++s) order.insert(order.end(), kPerSender, s);
    std::shuffle(order.begin(), order.end(), std::mt19937(42));
    std::vector<int> next(static_cast<std::size_t>(g.world_size()), 0);
    for (int s : order) {
      auto msg = g.recv_obj<std::vector<int>>(s, 10s);
      ASSERT_EQ(msg.size(), 2u);
      EXPECT_EQ(msg[0], s) << "a message from another sender was delivered";
      EXPECT_EQ(msg[1], next[static_cast<std::size_t>(s)]++) << "out of order from sender " << s;
    }
  }
  g.barrier(10s);
}

TEST(Group, TypeMismatchNamesBothTypesAndLeavesGroupUsable) {
  auto g = StatelessGroup::from_comm(MPI_COMM_WORLD);
  if (g.rank() == 1) {
    g.send_obj(std::string("not an int"), 0);
    g.send_obj(std::map<std::string, int>{{"x", 1}}, 0);
    g.send_obj(42, 0);
  }
  if (g.rank() == 0) {
    const std::string e1 = error_text([&] { (void)g.recv_obj<int>(1, 10s); });
    EXPECT_NE(e1.find("type mismatch"), std::string::npos) << e1;
    EXPECT_NE(e1.find("expected int"), std::string::npos) << e1;
    EXPECT_NE(e1.find("found std::string"), std::string::npos) << e1;
    EXPECT_NE(e1.find("group rank 0 (parent rank 0)"), std::string::npos) << e1;
    EXPECT_NE(e1.find("from group rank 1 (parent rank 1)"), std::string::npos) << e1;
    using WrongMap = std::map<std::string, double>;
    EXPECT_THROW((void)g.recv_obj<WrongMap>(1, 10s), meshrt::UsageError);
    EXPECT_TRUE(g.usable());
    EXPECT_EQ(g.recv_obj<int>(1, 10s), 42);
  }
  g.barrier(10s);
}

TEST(Group, GarbageAndTruncatedMessagesRaiseNeverCrash) {
  auto g = StatelessGroup::from_comm(MPI_COMM_WORLD);
  const int n = g.world_size();
  (void)n;
  if (g.rank() == 1) {
    // 1. Ten bytes of garbage: shorter than any header.
    const char junk[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
    MPI_Send(junk, 10, MPI_BYTE, 0, kSendHeaderTag, g.comm());
    // 2. 200 bytes of garbage: long enough, wrong magic.
    std::vector<char> junk2(200, 'x');
    MPI_Send(junk2.data(), 200, MPI_BYTE, 0, kSendHeaderTag, g.comm());
    // Capture real messages: rank 2 takes them with plain MPI and sends their bytes back
    // (a send to self never goes through MPI).
    auto capture = [&](auto obj) {
      g.send_obj(obj, 2);
      MPI_Status st;
      MPI_Probe(2, kCaptureTag, g.comm(), &st);
      int bytes = 0;
      MPI_Get_count(&st, MPI_BYTE, &bytes);
      std::vector<char> raw(static_cast<std::size_t>(bytes));
      MPI_Recv(raw.data(), bytes, MPI_BYTE, 2, kCaptureTag, g.comm(), MPI_STATUS_IGNORE);
      return raw;
    };
    // 3. A real message cut short by 5 bytes.
    auto real = capture(std::string(100, 'y'));
    MPI_Send(real.data(), static_cast<int>(real.size()) - 5, MPI_BYTE, 0, kSendHeaderTag, g.comm());
    // 4. A valid header whose Boost payload is corrupt: the vector's element count (the
    //    payload's first 8 bytes, after the 64-byte header and the type name) claims 2^40.
    auto m = capture(std::vector<std::string>{"abc", "def"});
    std::uint32_t name_len = 0;
    std::memcpy(&name_len, m.data() + 56, 4);
    const std::uint64_t huge = std::uint64_t{1} << 40;
    std::memcpy(m.data() + 64 + name_len, &huge, 8);
    MPI_Send(m.data(), static_cast<int>(m.size()), MPI_BYTE, 0, kSendHeaderTag, g.comm());
    // 5. A header declaring a 1 TiB object in 1000-byte chunks (total at offset 16,
    //    inline bytes at 24, chunk at 32), with no payload inline.
    auto big = capture(std::vector<char>(10, 'z'));
    std::memcpy(&name_len, big.data() + 56, 4);
    const std::uint64_t tib = std::uint64_t{1} << 40, zero = 0, chunk = 1000;
    std::memcpy(big.data() + 16, &tib, 8);
    std::memcpy(big.data() + 24, &zero, 8);
    std::memcpy(big.data() + 32, &chunk, 8);
    MPI_Send(big.data(), static_cast<int>(64 + name_len), MPI_BYTE, 0, kSendHeaderTag, g.comm());
    // 6. Still usable afterwards: a good message.
    g.send_obj(std::string("fine"), 0);
  }
  if (g.rank() == 2) {
    for (int i = 0; i < 3; ++i) {
      MPI_Status st;
      MPI_Probe(1, kSendHeaderTag, g.comm(), &st);
      int bytes = 0;
      MPI_Get_count(&st, MPI_BYTE, &bytes);
      std::vector<char> raw(static_cast<std::size_t>(bytes));
      MPI_Recv(raw.data(), bytes, MPI_BYTE, 1, kSendHeaderTag, g.comm(), MPI_STATUS_IGNORE);
      MPI_Send(raw.data(), bytes, MPI_BYTE, 1, kCaptureTag, g.comm());
    }
  }
  if (g.rank() == 0) {
    const std::string e1 = error_text([&] { (void)g.recv_obj<std::string>(1, 10s); });
    EXPECT_NE(e1.find("found 10 bytes"), std::string::npos) << e1;
    EXPECT_NE(e1.find("recv_obj on group rank 0"), std::string::npos) << e1;
    const std::string e2 = error_text([&] { (void)g.recv_obj<std::string>(1, 10s); });
    EXPECT_NE(e2.find("magic"), std::string::npos) << e2;
    const std::string e3 = error_text([&] { (void)g.recv_obj<std::string>(1, 10s); });
    EXPECT_NE(e3.find("truncated"), std::string::npos) << e3;
    try {
      (void)g.recv_obj<std::vector<std::string>>(1, 10s);
      ADD_FAILURE() << "a corrupt element count decoded";
    } catch (const meshrt::ProtocolError& e) {
      EXPECT_NE(std::string(e.what()).find("does not decode as std::vector<std::string>"), std::string::npos)
          << e.what();
    }
    const std::string e5 = error_text([&] { (void)g.recv_obj<std::vector<char>>(1, 10s); });
    EXPECT_NE(e5.find("1099511627776-byte object"), std::string::npos) << e5;
    EXPECT_TRUE(g.usable());
    EXPECT_EQ(g.recv_obj<std::string>(1, 10s), "fine");
  }
  g.barrier(10s);
}

TEST(Group, ChunkedTransfersWithEveryOperation) {
  meshrt::GroupOptions opt;
  opt.chunk_bytes = 1000;
  auto g = StatelessGroup::from_comm(MPI_COMM_WORLD, opt);
  EXPECT_EQ(g.chunk_bytes(), 1000u);
  const int r = g.rank(), n = g.world_size();
  std::vector<double> big(5000 + static_cast<std::size_t>(r));  // 40 KB: 41 chunks, raw path
  std::iota(big.begin(), big.end(), r * 1000.0);
  std::map<std::string, std::string> boosted;  // Boost path, also chunked
  for (int i = 0; i < 300; ++i) boosted["key" + std::to_string(i)] = std::string(10, static_cast<char>('a' + r));

  if (r == 0) {
    for (int d = 1; d < n; ++d) g.send_obj(big, d, 10s);
  } else {
    auto got = g.recv_obj<std::vector<double>>(0, 10s);
    std::vector<double> want(5000);
    std::iota(want.begin(), want.end(), 0.0);
    EXPECT_EQ(got, want);
  }
  auto b = g.broadcast_obj(r == 2 ? boosted : std::map<std::string, std::string>{}, 2, 10s);
  EXPECT_EQ(b.size(), 300u);
  EXPECT_EQ(b["key7"], std::string(10, 'c'));
  auto all = g.all_gather_obj(big, 10s);
  ASSERT_EQ(all.size(), static_cast<std::size_t>(n));
  for (int p = 0; p < n; ++p) {
    ASSERT_EQ(all[static_cast<std::size_t>(p)].size(), 5000u + static_cast<std::size_t>(p));
    EXPECT_EQ(all[static_cast<std::size_t>(p)].back(), p * 1000.0 + 4999 + p);
  }
  auto maps = g.all_gather_obj(boosted, 10s);
  for (int p = 0; p < n; ++p)
    EXPECT_EQ(maps[static_cast<std::size_t>(p)]["key299"], std::string(10, static_cast<char>('a' + p)));
  // An empty object and one exactly at a chunk boundary.
  auto e = g.broadcast_obj(std::string(), 0, 10s);
  EXPECT_TRUE(e.empty());
  auto exact = g.broadcast_obj(r == 1 ? std::string(3000, 'q') : std::string(), 1, 10s);
  EXPECT_EQ(exact, std::string(3000, 'q'));
}

TEST(Group, UserStructsRoundTripThroughEveryOperation) {
  auto g = StatelessGroup::create({3, 1, 4, 0, 5, 2});  // a permutation of the world
  const int r = g.rank();
  EXPECT_EQ(g.parent_rank(r), world_rank());
  auto b = g.broadcast_obj(r == 4 ? sample_params(4) : Params{}, 4, 10s);
  EXPECT_EQ(b, sample_params(4));
  auto all = g.all_gather_obj(sample_params(r), 10s);
  for (int p = 0; p < g.world_size(); ++p) EXPECT_EQ(all[static_cast<std::size_t>(p)], sample_params(p));
  const int next = (r + 1) % g.world_size(), prev = (r + g.world_size() - 1) % g.world_size();
  g.send_obj(sample_params(100 + r), next, 10s);
  EXPECT_EQ(g.recv_obj<Params>(prev, 10s), sample_params(100 + prev));
}

TEST(Group, BadCallsAreUsageErrors) {
  const int w = world_rank();
  const std::string e1 = error_text([&] { (void)StatelessGroup::create({w == 0 ? 1 : 0, 7}); });
  EXPECT_NE(e1.find("expected distinct parent ranks in 0..5"), std::string::npos) << e1;
  const std::string e2 = error_text([&] { (void)StatelessGroup::create({(w + 1) % 6}); });
  EXPECT_NE(e2.find("does not contain this rank"), std::string::npos) << e2;
  auto g = StatelessGroup::from_comm(MPI_COMM_WORLD);
  const std::string e3 = error_text([&] { g.send_obj(1, 6); });
  EXPECT_NE(e3.find("destination rank 6 is not a group rank (expected 0..5)"), std::string::npos) << e3;
  // A moved-from group refuses politely; the moved-to one works.
  StatelessGroup h = std::move(g);
  h.barrier(10s);
}

TEST(Group, TypeMismatchOnAChunkedObjectTakesTheWholeObject) {
  // Above the 16 KiB inline limit the payload follows in chunks: a receive of the wrong
  // type takes them too, so the sender completes and the next receive gets the next object.
  auto g = StatelessGroup::from_comm(MPI_COMM_WORLD);
  if (g.rank() == 1) {
    g.send_obj(std::vector<char>(100 * 1024, 'c'), 0, 10s);  // completes only once taken
    g.send_obj(std::vector<double>(300 * 1024, 1.5), 0, 10s);
    g.send_obj(7, 0, 10s);
  }
  if (g.rank() == 0) {
    const std::string e1 = error_text([&] { (void)g.recv_obj<std::string>(1, 10s); });
    EXPECT_NE(e1.find("type mismatch: expected std::string"), std::string::npos) << e1;
    EXPECT_NE(e1.find("found std::vector<char"), std::string::npos) << e1;
    EXPECT_TRUE(g.usable());
    EXPECT_THROW((void)g.recv_obj<std::vector<float>>(1, 10s), meshrt::UsageError);
    EXPECT_TRUE(g.usable());
    EXPECT_EQ(g.recv_obj<int>(1, 10s), 7);
  }
  g.barrier(10s);
}

TEST(Group, SendToSelfOfAnySize) {
  auto g = StatelessGroup::from_comm(MPI_COMM_WORLD);
  const int me = g.rank();
  std::vector<double> big(1 << 20);  // 8 MiB: chunked
  std::iota(big.begin(), big.end(), me * 1.0);
  g.send_obj(big, me, 10s);
  g.send_obj(std::string("small"), me, 10s);
  g.send_obj(sample_params(me), me, 10s);
  g.send_obj(std::vector<char>(64 * 1024, 'x'), me, 10s);
  EXPECT_EQ(g.recv_obj<std::vector<double>>(me, 10s), big);
  EXPECT_EQ(g.recv_obj<std::string>(me, 10s), "small");
  EXPECT_EQ(g.recv_obj<Params>(me, 10s), sample_params(me));
  // A wrong type takes the whole object, as from any peer.
  EXPECT_THROW((void)g.recv_obj<std::string>(me, 10s), meshrt::UsageError);
  const std::string e = error_text([&] { (void)g.recv_obj<int>(me, 10s); });
  EXPECT_NE(e.find("from itself: expected an object sent to itself before, found none"), std::string::npos) << e;
  EXPECT_TRUE(g.usable());
  // Self messages and peers' do not mix (a ring of tiny sends: a blocking send larger than
  // MPI's eager limit around a ring would wait for a receive that comes after it).
  const int next = (me + 1) % g.world_size(), prev = (me + g.world_size() - 1) % g.world_size();
  g.send_obj(std::vector<int>(100, me), next, 10s);
  g.send_obj(std::vector<int>(10000, me), me, 10s);
  EXPECT_EQ(g.recv_obj<std::vector<int>>(me, 10s), std::vector<int>(10000, me));
  EXPECT_EQ(g.recv_obj<std::vector<int>>(prev, 10s), std::vector<int>(100, prev));
  g.barrier(10s);
}

TEST(Group, DisagreementOnACollectiveIsAnErrorOnEveryRank) {
  auto g = StatelessGroup::from_comm(MPI_COMM_WORLD);
  const int r = g.rank(), n = g.world_size();
  auto expect_disagreement = [&](const std::function<void()>& f, const std::vector<std::string>& parts) {
    try {
      f();
      ADD_FAILURE() << "rank " << r << ": expected a UsageError naming the disagreement, the call returned";
    } catch (const meshrt::UsageError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("the members disagree on the collective"), std::string::npos) << what;
      EXPECT_NE(what.find("the group is still usable"), std::string::npos) << what;
      for (const auto& p : parts) EXPECT_NE(what.find(p), std::string::npos) << "expected \"" << p << "\" in " << what;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "rank " << r << ": expected a UsageError, found: " << e.what();
    }
    EXPECT_TRUE(g.usable());
  };
  // A broadcast's root does not wait to hear back: a receiver that finds the disagreement
  // breaks the group and tells every member, which raise it in the call or, if their part
  // had completed (the root's), at their next call; the group is unusable afterwards.
  auto expect_broadcast_disagreement = [&](const std::function<void(StatelessGroup&)>& f,
                                           const std::vector<std::string>& parts) {
    auto h = StatelessGroup::from_comm(MPI_COMM_WORLD);
    std::string what;
    try {
      f(h);
      try {
        h.barrier(10s);
        ADD_FAILURE() << "rank " << r << ": expected a UsageError naming the disagreement, the calls returned";
      } catch (const meshrt::UsageError& e) {
        what = e.what();
      }
    } catch (const meshrt::UsageError& e) {
      what = e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "rank " << r << ": expected a UsageError, found: " << e.what();
    }
    EXPECT_NE(what.find("the members disagree on the collective"), std::string::npos) << what;
    EXPECT_NE(what.find("the group is unusable now"), std::string::npos) << what;
    for (const auto& p : parts) EXPECT_NE(what.find(p), std::string::npos) << "expected \"" << p << "\" in " << what;
    EXPECT_FALSE(h.usable());
  };
  // 1. The root: the first half says 0, the second half says 1 (small and chunked).
  for (std::size_t bytes : {std::size_t{8}, std::size_t{1} << 20}) {
    const int root = r < n / 2 ? 0 : 1;
    expect_broadcast_disagreement(
        [&](StatelessGroup& h) { (void)h.broadcast_obj(std::vector<char>(r == root ? bytes : 0, 'b'), root, 10s); },
        {fmt_root(root), fmt_root(1 - root)});
  }
  // 2. The operation: rank 0 calls a barrier, the others an all_gather.
  expect_disagreement(
      [&] {
        if (r == 0)
          g.barrier(10s);
        else
          (void)g.all_gather_obj(r, 10s);
      },
      {r == 0 ? "called all_gather_obj" : "called barrier"});
  // 3. The type of a broadcast, and a broadcast against an all_gather (either side).
  expect_broadcast_disagreement(
      [&](StatelessGroup& h) {
        if (r == n - 1)
          (void)h.broadcast_obj(std::string("s"), 0, 10s);
        else
          (void)h.broadcast_obj(5, 0, 10s);
      },
      {"of int", "of std::string",
       "group rank " + std::to_string(n - 1) + " (parent rank " + std::to_string(n - 1) + ")"});
  for (int caster : {0, 2}) {
    expect_broadcast_disagreement(
        [&](StatelessGroup& h) {
          if (r == caster)
            (void)h.broadcast_obj(7, caster, 10s);
          else
            (void)h.all_gather_obj(7, 10s);
        },
        {"broadcast_obj #0 with root", "all_gather_obj #0 of int"});
  }
  // A receiver that raised leaves nothing behind on the others: a new group works.
  auto fresh = StatelessGroup::from_comm(MPI_COMM_WORLD);
  EXPECT_EQ(fresh.broadcast_obj(r == 1 ? 42 : 0, 1, 10s), 42);
  // The group still works, and every member's calls are counted alike.
  auto all = g.all_gather_obj(r * 3, 10s);
  for (int p = 0; p < n; ++p) EXPECT_EQ(all[static_cast<std::size_t>(p)], p * 3);
  EXPECT_EQ(g.broadcast_obj(r == 2 ? std::string(40000, 'z') : std::string(), 2, 10s), std::string(40000, 'z'));
  g.barrier(10s);
}
