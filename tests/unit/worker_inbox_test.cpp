// The worker's inbox (src/worker/inbox.hpp) over the in-memory transport: envelopes run in
// the controller's numbered order and go to the fan-out children first, a bad frame is
// reported and dropped, and past kMaxQueued the batches wait in the transport.
#include <gtest/gtest.h>

#include <variant>

#include "meshrt/internal/control.hpp"
#include "worker/inbox.hpp"
#include "worker/monitor.hpp"
#include "worker/reporter.hpp"

namespace meshrt::detail {
namespace {

using namespace protocol;
using control::Tag;

struct Rig {
  Rig() {
    o.rank = 1;
    o.status_interval_seconds = 1000;
  }
  WorkerOptions o;
  std::shared_ptr<control::MemoryNetwork> net = control::MemoryNetwork::create();
  std::shared_ptr<control::Transport> controller = net->endpoint(0);
  std::shared_ptr<control::Transport> worker = net->endpoint(1);
  Monitor monitor{1, 64};
  Reporter reporter{*worker, monitor, o};
  Inbox inbox{*worker, monitor, 1};

  void send(const control::Bytes& frame) { controller->send(1, Tag::Command, std::make_shared<control::Bytes>(frame)); }
  // The idents of the RequestStatus commands queued, in order.
  std::vector<Ident> drain() {
    std::vector<Ident> out;
    while (!inbox.empty()) out.push_back(std::get<RequestStatus>(inbox.pop().command).ident);
    return out;
  }
};

control::Bytes envelope(std::vector<std::int32_t> ranks, std::vector<std::uint64_t> seqs, Ident ident) {
  return encode(Envelope{.fanout = 1,
                         .ranks = std::move(ranks),
                         .seqs = std::move(seqs),
                         .payload = encode(Command{RequestStatus{ident}})});
}

TEST(WorkerInbox, EnvelopesRunInTheirNumberedOrderAfterGoingToTheChildren) {
  Rig rig;
  // Rank 1 heads a chain 1 -> 2: it forwards each envelope to rank 2.
  rig.send(envelope({1, 2}, {2, 2}, 20));
  EXPECT_TRUE(rig.inbox.receive(rig.reporter));
  EXPECT_TRUE(rig.inbox.empty()) << "number 2 waits for number 1";
  EXPECT_EQ(rig.net->waiting(2, Tag::Command), 1u);
  rig.send(envelope({1, 2}, {1, 1}, 10));
  rig.send(encode(Command{CommandGroup{{RequestStatus{30}, RequestStatus{31}}}}));  // bare: number 3
  EXPECT_TRUE(rig.inbox.receive(rig.reporter));
  EXPECT_EQ(rig.drain(), (std::vector<Ident>{10, 20, 30, 31}));
  EXPECT_EQ(rig.net->waiting(2, Tag::Command), 2u);
  EXPECT_FALSE(rig.inbox.receive(rig.reporter));
}

TEST(WorkerInbox, ABadFrameIsReportedOutsideAnyInvocationAndTheNextStillRun) {
  Rig rig;
  rig.send(envelope({2, 3}, {1, 1}, 10));  // not for rank 1
  control::Bytes garbage = encode(Command{RequestStatus{5}});
  garbage[4] = std::byte{200};
  rig.send(garbage);
  rig.send(envelope({1}, {2}, 11));  // the undecodable bare frame took number 1
  EXPECT_TRUE(rig.inbox.receive(rig.reporter));
  EXPECT_EQ(rig.drain(), (std::vector<Ident>{11}));
  std::vector<std::string> errors;
  control::Bytes bytes;
  while (rig.controller->try_receive(control::kAnySource, Tag::Reply, bytes)) {
    const Reply r = decode_reply(bytes);
    ASSERT_TRUE(std::holds_alternative<RemoteFunctionFailed>(r));
    const auto& f = std::get<RemoteFunctionFailed>(r);
    EXPECT_EQ(f.ident, 0u);
    EXPECT_EQ(f.function, "<protocol>");
    EXPECT_EQ(f.exception_type, "meshrt::ProtocolError");
    errors.push_back(f.error);
  }
  ASSERT_EQ(errors.size(), 2u);
  EXPECT_NE(errors[0].find("envelope for ranks 2,3 reached rank 1, which is not one of them"), std::string::npos)
      << errors[0];
  EXPECT_NE(errors[1].find("expected a command tag in 0..15, found 200"), std::string::npos) << errors[1];
}

TEST(WorkerInbox, PastItsLimitBatchesWaitInTheTransport) {
  Rig rig;
  std::vector<Command> batch(Inbox::kMaxQueued - 1, Command{RequestStatus{1}});
  rig.send(encode(Command{CommandGroup{std::move(batch)}}));
  rig.send(encode(Command{CommandGroup{{RequestStatus{2}, RequestStatus{3}}}}));
  rig.send(encode(Command{RequestStatus{4}}));
  EXPECT_TRUE(rig.inbox.receive(rig.reporter));
  // The second batch took the queue past the limit: the third waits.
  EXPECT_EQ(rig.net->waiting(1, Tag::Command), 1u);
  const std::vector<Ident> first = rig.drain();
  EXPECT_EQ(first.size(), Inbox::kMaxQueued + 1);
  EXPECT_TRUE(rig.inbox.receive(rig.reporter));
  EXPECT_EQ(rig.drain(), (std::vector<Ident>{4}));
}

}  // namespace
}  // namespace meshrt::detail
