// The MPI data plane's SendTensor: positional from_ranks[i] -> to_ranks[i] between
// sub-meshes, in both directions, with self-pairs, with ranks that both send and
// receive, with a broken sender, and its usage errors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "comm_test_util.hpp"

namespace meshrt::test {
namespace {

using ::testing::HasSubstr;

// Runs one SendTensor on every rank and checks each rank's outcome against the pairing
// computed here. `broken_sender` sends DependentOnError{7}.
void check_send(const NDSlice& from, const NDSlice& to, const TensorMeta& meta, Completion completion,
                int broken_sender = -1, const std::vector<std::int64_t>& from_order = {}) {
  World world;
  const int me = world_rank();
  const Tensor input = make_input(meta, Reduction::Sum, me);
  const Tensor pristine = input.clone();
  Input in = me == broken_sender ? Input(DependentOnError{7}) : Input(input);
  auto p = start_send_tensor(world.comm(), me, from, to, std::move(in), meta, completion, {}, from_order);
  const Outcome out = wait(*p);
  int expected_from = -1;
  for (std::int64_t i = 0; i < to.len(); ++i) {
    const std::int64_t source = from_order.empty() ? i : from_order[static_cast<std::size_t>(i)];
    if (to[i] == me) expected_from = static_cast<int>(from[source]);
  }
  if (expected_from < 0) {
    EXPECT_FALSE(out.tensor.defined()) << "a rank that receives nothing has no outcome";
    EXPECT_FALSE(out.broken.has_value());
  } else {
    ASSERT_TRUE(out.tensor.defined());
    const Tensor expected =
        expected_from == broken_sender ? meta.zeros() : make_input(meta, Reduction::Sum, expected_from);
    EXPECT_EQ(compare(out.tensor, expected), "") << "received from rank " << expected_from;
    EXPECT_FALSE(out.tensor.same_storage(input)) << "the outcome must be a new tensor, even for a self-pair";
    // Only a rank that is its own sender can know its received value is broken.
    if (expected_from == me && me == broken_sender) {
      ASSERT_TRUE(out.broken.has_value());
      EXPECT_EQ(out.broken->ident, 7u);
    } else {
      EXPECT_FALSE(out.broken.has_value());
    }
  }
  EXPECT_EQ(compare(input, pristine), "") << "the sender's input must be left alone";
}

TEST(CommSend, FirstHalfToSecondHalfAndBack) {
  if (world_size() % 2 != 0) GTEST_SKIP() << "needs an even world";
  const int h = world_size() / 2;
  const NDSlice first(0, {h}, {1}), second(h, {h}, {1});
  for (Completion c : {Completion::NonBlocking, Completion::Blocking, Completion::Thread, Completion::Auto}) {
    check_send(first, second, TensorMeta({3, 5}, DType::Float32), c);
    check_send(second, first, TensorMeta({3, 5}, DType::Int64), c);
  }
}

TEST(CommSend, SelfPairsCopy) {
  const NDSlice all = NDSlice::row_major({world_size()});
  for (Completion c : {Completion::NonBlocking, Completion::Blocking, Completion::Thread, Completion::Auto}) {
    check_send(all, all, TensorMeta({7}, DType::Float16), c);
    check_send(all, all, TensorMeta({7}, DType::Bool), c, /*broken_sender=*/0);
  }
}

// 0 -> 1 -> 2 -> ...: every middle rank both sends and receives, with messages large
// enough for MPI's rendezvous protocol.
TEST(CommSend, ChainSendsAndReceives) {
  const int n = world_size();
  const NDSlice from(0, {n - 1}, {1}), to(1, {n - 1}, {1});
  for (Completion c : {Completion::NonBlocking, Completion::Blocking, Completion::Thread, Completion::Auto}) {
    check_send(from, to, TensorMeta({1 << 18}, DType::Float32), c);
    check_send(to, from, TensorMeta({5}, DType::BFloat16), c);
  }
}

// On 6 ranks: [0..5] -> the transposed order [0,2,4,1,3,5]: self-pairs at 0 and 5, and
// every other rank sends to one peer while receiving from another.
TEST(CommSend, TransposedPairingMixesSelfAndPeers) {
  if (world_size() != 6) GTEST_SKIP() << "written for 6 ranks";
  const NDSlice from = NDSlice::row_major({2, 3});
  const NDSlice to(0, {2, 3}, {1, 2});
  for (Completion c : {Completion::NonBlocking, Completion::Blocking, Completion::Thread, Completion::Auto}) {
    check_send(from, to, TensorMeta({2, 2}, DType::UInt8), c);
    check_send(from, to, TensorMeta({2, 2}, DType::Int32), c, /*broken_sender=*/1);
    check_send(from, to, TensorMeta({2, 2}, DType::Int32), c, /*broken_sender=*/5);
  }
}

// A broadcast send (from_order): one source to every rank, itself included (a local copy
// and sends to the others); a source that is no target; a half onto [2, half].
TEST(CommSend, BroadcastSendsReachEveryTargetOfTheirSource) {
  const int n = world_size();
  const NDSlice all = NDSlice::row_major({n});
  const std::vector<std::int64_t> zeros(static_cast<std::size_t>(n), 0);
  const std::vector<std::int64_t> to_others(static_cast<std::size_t>(n - 1), 0);
  for (Completion c : {Completion::NonBlocking, Completion::Blocking, Completion::Thread, Completion::Auto}) {
    check_send(NDSlice(0, {1}, {1}), all, TensorMeta({3, 5}, DType::Float32), c, -1, zeros);
    check_send(NDSlice(0, {1}, {1}), all, TensorMeta({3}, DType::Int64), c, /*broken_sender=*/0, zeros);
    check_send(NDSlice(n - 1, {1}, {1}), NDSlice(0, {n - 1}, {1}), TensorMeta({2}, DType::Int32), c, -1, to_others);
    if (n % 2 == 0) {
      const int h = n / 2;
      std::vector<std::int64_t> halves;
      for (int j = 0; j < n; ++j) halves.push_back(j % h);
      check_send(NDSlice(0, {h}, {1}), NDSlice::row_major({2, h}), TensorMeta({1 << 18}, DType::Float32), c, -1,
                 halves);
    }
  }
  World world;
  const int me = world_rank();
  const TensorMeta meta({4}, DType::Float32);
  auto p =
      start_send_tensor(world.comm(), me, NDSlice(0, {1}, {1}), all, meta.zeros(), meta, Completion::Auto, {}, zeros);
  std::string others;
  for (int r = 1; r < n; ++r) others += fmt::format("{}{}", r == 1 ? "" : ",", r);
  EXPECT_EQ(p->describe(), me == 0 ? fmt::format("send_tensor on rank 0: local copy and send to rank{} {}, 16 bytes "
                                                 "(MPI)",
                                                 n > 2 ? "s" : "", others)
                                   : fmt::format("send_tensor on rank {}: receive from rank 0, 16 bytes (MPI)", me));
  (void)wait(*p);
}

TEST(CommSend, BrokenSenderSendsZeros) {
  if (world_size() % 2 != 0) GTEST_SKIP() << "needs an even world";
  const int h = world_size() / 2;
  check_send(NDSlice(0, {h}, {1}), NDSlice(h, {h}, {1}), TensorMeta({4}, DType::Float64), Completion::NonBlocking, 0);
}

TEST(CommSend, UsageErrors) {
  World world;
  const int me = world_rank();
  const int n = world_size();
  const TensorMeta meta({2}, DType::Float32);
  auto send = [&](const NDSlice& from, const NDSlice& to, const TensorMeta& m) {
    // The input is a broken marker: no tensor of a (possibly absent) device is needed.
    return usage_error([&] { (void)start_send_tensor(world.comm(), me, from, to, DependentOnError{1}, m); });
  };
  EXPECT_EQ(send(NDSlice(0, {1}, {1}), NDSlice(0, {2}, {1}), meta),
            fmt::format("send_tensor: expected from_ranks and to_ranks of equal length, found 1 (NDSlice(offset=0, "
                        "sizes=[1], strides=[1])) and 2 (NDSlice(offset=0, sizes=[2], strides=[1])) (world rank {})",
                        me));
  EXPECT_THAT(
      send(NDSlice(0, {1}, {1}), NDSlice(n, {1}, {1}), meta),
      HasSubstr(fmt::format("send_tensor: expected ranks below the communicator size {}, found rank {} in", n, n)));
  EXPECT_THAT(send(NDSlice(0, {1}, {1}), NDSlice(0, {1}, {1}), meta.with_device(Device::cuda(0))),
              HasSubstr("send_tensor over MPI: expected a CPU tensor, found float32[2] on cuda:0"));
  // A sender whose input does not match the factory sends zeros and raises after.
  const NDSlice all = NDSlice::row_major({n});
  auto p = start_send_tensor(world.comm(), me, all, all, TensorMeta({3}, DType::Float32).zeros(), meta);
  EXPECT_TRUE(p->test());
  EXPECT_THAT(usage_error([&] { (void)p->take(); }),
              HasSubstr(fmt::format("send_tensor: expected an input float32[2] on cpu as the controller computed, "
                                    "found float32[3] on cpu; this rank joined with zeros so that its peers complete "
                                    "(world rank {}, sending to rank {})",
                                    me, me)));
}

TEST(CommSend, DescribeNamesPeers) {
  if (world_size() < 3) GTEST_SKIP() << "needs 3 ranks";
  World world;
  const int me = world_rank();
  const NDSlice from(0, {2}, {1}), to(1, {2}, {1});  // 0 -> 1 -> 2
  const TensorMeta meta({4}, DType::Float32);
  auto p = start_send_tensor(world.comm(), me, from, to, meta.zeros(), meta);
  const std::string d = p->describe();
  std::string expected = fmt::format("send_tensor on rank {}: no part, 16 bytes (MPI)", me);
  if (me == 0) expected = "send_tensor on rank 0: send to rank 1, 16 bytes (MPI)";
  if (me == 1) expected = "send_tensor on rank 1: send to rank 2 and receive from rank 0, 16 bytes (MPI)";
  if (me == 2) expected = "send_tensor on rank 2: receive from rank 1, 16 bytes (MPI)";
  EXPECT_EQ(d, expected);
  (void)wait(*p);
}

}  // namespace
}  // namespace meshrt::test
