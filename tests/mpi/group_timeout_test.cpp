// StatelessGroup timeouts over 3 ranks: rank 2 never calls. Each case uses a fresh
// group, so one that becomes unusable does not affect the next; the create cases make
// no group of rank 2 at all.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <boost/serialization/string.hpp>
#include <chrono>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "meshrt/group.hpp"
#include "meshrt/internal/settings.hpp"

using meshrt::StatelessGroup;
using meshrt::TimeoutError;
using namespace std::chrono_literals;

namespace {

constexpr auto kShort = 300ms;

// Runs f, expecting a TimeoutError; returns it (or fails the test).
template <class F>
std::optional<TimeoutError> expect_timeout(F f) {
  const auto start = std::chrono::steady_clock::now();
  try {
    f();
  } catch (const TimeoutError& e) {
    const auto took = std::chrono::steady_clock::now() - start;
    EXPECT_GE(took, kShort - 10ms) << "timed out early";
    EXPECT_LT(took, 5s) << "the deadline was not honoured";
    return e;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected a TimeoutError, got: " << e.what();
    return std::nullopt;
  }
  ADD_FAILURE() << "expected a TimeoutError, the call returned";
  return std::nullopt;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Ranks 0 and 1 waiting together for an absent rank 2: rank 0's deadline comes first and
// rank 1 hears of its timeout (its notice) before its own, so each rank's error is certain,
// where two deadlines at once race.
std::chrono::milliseconds first_rank_0(int rank) {
  return rank == 0 ? kShort : kShort + 700ms;
}

// Rank 1's error in those tests: rank 0's timeout in `op`, told by its notice.
void expect_rank_0_broke_it(const TimeoutError& e, const std::string& op) {
  EXPECT_TRUE(e.missing_ranks().empty()) << e.what();
  EXPECT_TRUE(e.group_unusable());
  EXPECT_TRUE(contains(e.what(), "group rank 0 (parent rank 0) timed out in " + op + " #0 after 0.3 s")) << e.what();
}

int g_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

}  // namespace

TEST(GroupTimeout, RecvFromAbsentRankNamesItAndKeepsGroupUsable) {
  auto g = StatelessGroup::from_comm(MPI_COMM_WORLD);
  if (g.rank() == 0) {
    auto e = expect_timeout([&] { (void)g.recv_obj<std::string>(2, kShort); });
    ASSERT_TRUE(e);
    EXPECT_EQ(e->missing_ranks(), std::vector<int>{2});
    EXPECT_FALSE(e->group_unusable());
    EXPECT_TRUE(contains(e->what(), "recv_obj timed out after 0.3 s on group rank 0 (parent rank 0) of 3"))
        << e->what();
    EXPECT_TRUE(contains(e->what(), "missing group ranks [2] (parent ranks [2])")) << e->what();
    EXPECT_TRUE(contains(e->what(), "still usable")) << e->what();
    EXPECT_TRUE(g.usable());
  }
  MPI_Barrier(MPI_COMM_WORLD);
  // Still usable: the late message is the next one from rank 2.
  if (g.rank() == 2) g.send_obj(std::string("late"), 0);
  if (g.rank() == 0) EXPECT_EQ(g.recv_obj<std::string>(2, 10s), "late");
}

TEST(GroupTimeout, BarrierNamesMissingRankAndBreaksGroup) {
  auto g = StatelessGroup::from_comm(MPI_COMM_WORLD);
  if (g.rank() != 2) {
    auto e = expect_timeout([&] { g.barrier(first_rank_0(g.rank())); });
    ASSERT_TRUE(e);
    if (g.rank() == 0) {
      EXPECT_EQ(e->missing_ranks(), std::vector<int>{2});
      EXPECT_TRUE(e->group_unusable());
      EXPECT_TRUE(contains(e->what(), "barrier timed out")) << e->what();
      EXPECT_TRUE(contains(e->what(), "unusable")) << e->what();
    } else {
      expect_rank_0_broke_it(*e, "barrier");
    }
    EXPECT_FALSE(g.usable());
    try {
      g.send_obj(1, 0);
      ADD_FAILURE() << "an unusable group accepted a call";
    } catch (const meshrt::UsageError& u) {
      EXPECT_TRUE(contains(u.what(), g.rank() == 0 ? "group is unusable after a timeout in barrier"
                                                   : "group is unusable after group rank 0 (parent rank 0) timed out"))
          << u.what();
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST(GroupTimeout, AMemberArrivingAfterTheOthersTimedOutIsToldSo) {
  // Ranks 0 and 1 time out in a barrier without rank 2; rank 2 arrives afterwards. Their
  // first messages are waiting for it, but the barrier is over for them: rank 2 must not
  // complete it as if all had met.
  auto g = StatelessGroup::from_comm(MPI_COMM_WORLD);
  if (g.rank() != 2) {
    auto e = expect_timeout([&] { g.barrier(first_rank_0(g.rank())); });
    ASSERT_TRUE(e);
    if (g.rank() == 0) {
      EXPECT_EQ(e->missing_ranks(), std::vector<int>{2});
    } else {
      expect_rank_0_broke_it(*e, "barrier");
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);  // rank 2 comes only now
  if (g.rank() == 2) {
    try {
      g.barrier(10s);
      ADD_FAILURE() << "the late member's barrier completed although the others had given up";
    } catch (const TimeoutError& e) {
      EXPECT_TRUE(e.group_unusable());
      EXPECT_TRUE(contains(e.what(), "barrier on group rank 2 (parent rank 2) of 3: group rank ")) << e.what();
      EXPECT_TRUE(contains(e.what(), "timed out in barrier #0 after 0.3 s and broke the group")) << e.what();
      EXPECT_TRUE(contains(e.what(), "the group is unusable now")) << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "expected a TimeoutError, got: " << e.what();
    }
    EXPECT_FALSE(g.usable());
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST(GroupTimeout, AGroupMadeAfterABrokenOneIsNotTouchedByWhatItLeftBehind) {
  // Ranks 0 and 1 break a group in a barrier without rank 2: their first messages and
  // notices to rank 2 (and to each other) are never received. The next group made from
  // the same communicator must not take them as its own (an MPI may reuse the freed
  // group's context for it): every member's barrier and all_gather complete.
  {
    auto broken = StatelessGroup::from_comm(MPI_COMM_WORLD);
    if (broken.rank() != 2) EXPECT_TRUE(expect_timeout([&] { broken.barrier(kShort); }));
    MPI_Barrier(MPI_COMM_WORLD);
  }
  auto g = StatelessGroup::from_comm(MPI_COMM_WORLD);
  try {
    g.barrier(10s);
    EXPECT_EQ(g.all_gather_obj(g.rank(), 10s), (std::vector<int>{0, 1, 2}));
  } catch (const std::exception& e) {
    ADD_FAILURE() << "the new group failed on rank " << g.rank() << ": " << e.what();
  }
  EXPECT_TRUE(g.usable());
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST(GroupTimeout, AllGatherNamesEveryMissingPart) {
  auto g = StatelessGroup::from_comm(MPI_COMM_WORLD);
  if (g.rank() != 2) {
    auto e = expect_timeout([&] { (void)g.all_gather_obj(std::string(50, 'a'), first_rank_0(g.rank())); });
    ASSERT_TRUE(e);
    if (g.rank() == 0) {
      EXPECT_EQ(e->missing_ranks(), std::vector<int>{2});
      EXPECT_TRUE(e->group_unusable());
      EXPECT_TRUE(contains(e->what(), "all_gather_obj timed out")) << e->what();
    } else {
      expect_rank_0_broke_it(*e, "all_gather_obj");
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST(GroupTimeout, BroadcastFromAbsentRootNamesTheRoot) {
  auto g = StatelessGroup::from_comm(MPI_COMM_WORLD);
  if (g.rank() != 2) {
    auto e = expect_timeout([&] { (void)g.broadcast_obj(std::string(), 2, kShort); });
    ASSERT_TRUE(e);
    const auto& m = e->missing_ranks();
    EXPECT_TRUE(std::find(m.begin(), m.end(), 2) != m.end()) << e->what();
    EXPECT_TRUE(contains(e->what(), "no object from the root group rank 2")) << e->what();
    EXPECT_TRUE(e->group_unusable());
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST(GroupTimeout, LargeSendToAbsentRankBreaksGroup) {
  // Above the inline limit the payload is a rendezvous send that cannot complete.
  meshrt::GroupOptions opt;
  opt.timeout = kShort;  // the group default, no per-call override
  auto g = StatelessGroup::from_comm(MPI_COMM_WORLD, opt);
  EXPECT_EQ(g.default_timeout(), std::chrono::duration<double>(kShort));
  if (g.rank() == 0) {
    auto e = expect_timeout([&] { g.send_obj(std::vector<char>(4 << 20, 'x'), 2); });
    ASSERT_TRUE(e);
    EXPECT_EQ(e->missing_ranks(), std::vector<int>{2});
    EXPECT_TRUE(e->group_unusable());
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST(GroupTimeout, DefaultComesFromTheSetting) {
  setenv("MESHRT_GROUP_TIMEOUT", "0.25", 1);
  auto g = StatelessGroup::from_comm(MPI_COMM_WORLD);
  unsetenv("MESHRT_GROUP_TIMEOUT");
  EXPECT_DOUBLE_EQ(g.default_timeout().count(), 0.25);
  if (g.rank() == 1) {
    try {
      (void)g.recv_obj<int>(2);
      ADD_FAILURE() << "recv returned";
    } catch (const TimeoutError& e) {
      EXPECT_TRUE(contains(e.what(), "after 0.25 s")) << e.what();
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST(GroupTimeout, CreateWithAnAbsentMemberNamesIt) {
  // Ranks 0 and 1 create a group of all three; rank 2 never calls create. Before the
  // members' agreement, both waited in MPI_Comm_create_group for ever.
  meshrt::GroupOptions opt;
  opt.timeout = kShort;
  if (g_rank() != 2) {
    auto e = expect_timeout([&] { (void)StatelessGroup::create({0, 1, 2}, MPI_COMM_WORLD, opt); });
    ASSERT_TRUE(e);
    EXPECT_EQ(e->missing_ranks(), std::vector<int>{2});
    EXPECT_TRUE(contains(e->what(), "StatelessGroup::create timed out after 0.3 s on parent rank")) << e->what();
    EXPECT_TRUE(contains(e->what(), "parent rank [2] did not join the group [0, 1, 2]")) << e->what();
    // The members that did come can still make a group of themselves (the handshake's
    // leftover messages are skipped).
    auto pair = StatelessGroup::create({0, 1}, MPI_COMM_WORLD, opt);
    EXPECT_EQ(pair.all_gather_obj(pair.rank(), 10s), (std::vector<int>{0, 1}));
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST(GroupTimeout, CreateWithDifferentMemberListsIsAUsageError) {
  // Ranks 0 and 1 disagree on the third member: both are told, neither hangs.
  if (g_rank() != 2) {
    try {
      (void)StatelessGroup::create(g_rank() == 0 ? std::vector<int>{0, 1} : std::vector<int>{1, 0}, MPI_COMM_WORLD);
      ADD_FAILURE() << "create with different member lists returned";
    } catch (const meshrt::UsageError& e) {
      EXPECT_TRUE(contains(e.what(), "called it with a different member list")) << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "expected a UsageError, got: " << e.what();
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
}
