// A live worker fed garbage (issue 9): rank 1 runs a meshrt::Worker on communicators this
// test makes; rank 0 plays the controller by hand on the control channel. Every frame
// that does not decode (random bytes, empty and huge frames, valid frames cut short or
// with bits flipped) must be answered with RemoteFunctionFailed of ident 0 from
// "<protocol>", and the worker must then still run valid commands correctly and exit on
// Exit. Commands that decode but make no sense (unknown function, undefined refs) must
// be reported against their own invocation, and must not break the worker either.
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "meshrt/internal/control.hpp"
#include "meshrt/internal/protocol.hpp"
#include "meshrt/internal/worker.hpp"

using namespace meshrt;
namespace p = meshrt::protocol;

namespace {

constexpr int kWorker = 1;
using Bytes = std::vector<std::byte>;

// The controller's side of the control channel, by hand.
class FakeController {
 public:
  explicit FakeController(MPI_Comm control) : control_(control) {}

  void send(const Bytes& frame) {
    MPI_Send(frame.data(), static_cast<int>(frame.size()), MPI_BYTE, kWorker, static_cast<int>(control::Tag::Command),
             control_);
  }
  void send(const p::Command& c) { send(p::encode(c)); }

  // The next reply, or a failure naming what was awaited if none comes within `timeout`
  // (a worker that died or hangs must fail this test, not hang it).
  // The next reply; Status replies, which the worker also sends whenever it runs out of
  // work, are skipped unless `awaiting` is one.
  p::Reply receive(const std::string& awaiting, std::chrono::seconds timeout = std::chrono::seconds(20)) {
    const bool want_status = awaiting.rfind("Status", 0) == 0;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      int flag = 0;
      MPI_Status status;
      MPI_Iprobe(kWorker, static_cast<int>(control::Tag::Reply), control_, &flag, &status);
      if (flag) {
        int count = 0;
        MPI_Get_count(&status, MPI_BYTE, &count);
        Bytes bytes(static_cast<std::size_t>(count));
        MPI_Recv(bytes.data(), count, MPI_BYTE, kWorker, static_cast<int>(control::Tag::Reply), control_,
                 MPI_STATUS_IGNORE);
        p::Reply reply = p::decode_reply(bytes);
        if (!want_status && std::holds_alternative<p::Status>(reply)) continue;
        return reply;
      }
      if (std::chrono::steady_clock::now() > deadline) {
        ADD_FAILURE() << "no reply from the worker within " << timeout.count() << " s, awaiting " << awaiting;
        throw std::runtime_error("no reply awaiting " + awaiting);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  // Sends an undecodable frame and checks the worker reports it as a protocol failure.
  void expect_refused(const Bytes& frame, const std::string& what) {
    send(frame);
    const p::Reply r = receive("the refusal of " + what);
    const auto* f = std::get_if<p::RemoteFunctionFailed>(&r);
    ASSERT_NE(f, nullptr) << what << ": expected RemoteFunctionFailed, found " << p::name(r);
    EXPECT_EQ(f->ident, 0u) << what;
    EXPECT_EQ(f->rank, kWorker) << what;
    EXPECT_EQ(f->function, "<protocol>") << what;
    EXPECT_EQ(f->exception_type, "meshrt::ProtocolError") << what;
    EXPECT_EQ(f->error.rfind("undecodable command: protocol: decoding ", 0), 0u) << what << ": " << f->error;
    refused_++;
  }

  int refused() const noexcept { return refused_; }

 private:
  MPI_Comm control_;
  int refused_ = 0;
};

bool decodes(std::span<const std::byte> frame) {
  try {
    (void)p::decode_command(frame);
    return true;
  } catch (const ProtocolError&) {
    return false;
  }
}

// Valid frames of every command kind, to cut and mutate.
std::vector<Bytes> valid_frames() {
  std::vector<p::Command> commands{
      p::CreateDeviceMesh{Ref{10}, {"a", "b"}, NDSlice(0, {2, 1}, {1, 1})},
      p::CreateStream{Ref{11}, false},
      p::CallFunction{5,
                      {Ref{12}},
                      {Ref{13}},
                      "meshrt.add",
                      {Value(Ref{1}), Value::list({Value(2.5), Value("x")})},
                      Ref{4},
                      Ref{5}},
      p::FetchValue{6, {}, std::string("meshrt.copy"), Value(Ref{12}), Ref{11}},
      p::Reduce{Ref{14}, Ref{12}, TensorMeta({2, 3}, DType::Float32), Ref{10}, Ref{11}, "a", Reduction::Sum, true,
                false},
      p::SendTensor{Ref{15}, NDSlice(0, {2}, {1}), NDSlice(2, {2}, {1}), Ref{12}, TensorMeta({4}, DType::Int64),
                    Ref{11}},
      p::BorrowCreate{Ref{16}, Ref{12}, Ref{11}, Ref{17}, false},
      p::BorrowFirstUse{Ref{16}},
      p::BorrowDrop{Ref{16}},
      p::DeleteRefs{{Ref{12}, Ref{13}}},
      p::RequestStatus{9},
      p::Exit{true},
  };
  p::CommandGroup group;
  group.commands = {p::CreateStream{Ref{20}, true}, p::DeleteRefs{{Ref{20}}}};
  commands.emplace_back(std::move(group));
  std::vector<Bytes> out;
  for (const auto& c : commands) out.push_back(p::encode(c));
  return out;
}

void rank0_plays_controller(MPI_Comm control) {
  FakeController ctl(control);
  std::mt19937_64 rng(20240909);

  // 1. Random bytes of many sizes, including the empty frame, with and without a valid
  //    magic and version (so the body decoder is reached too), and one of 1 MiB.
  for (int i = 0; i < 300; ++i) {
    Bytes frame(static_cast<std::size_t>(i < 10 ? i : rng() % 200));
    for (auto& b : frame) b = static_cast<std::byte>(rng());
    if (i % 3 != 0 && frame.size() >= 4) {
      frame[0] = std::byte{'m'};
      frame[1] = std::byte{'r'};
      frame[2] = std::byte{p::kVersion};
      frame[3] = std::byte{static_cast<unsigned char>(rng() % 16)};
    }
    if (decodes(frame)) continue;  // astronomically unlikely; it would be a real command
    ctl.expect_refused(frame, "random frame " + std::to_string(i) + " of " + std::to_string(frame.size()) + " bytes");
  }
  {
    Bytes big(std::size_t{1} << 20);
    for (auto& b : big) b = static_cast<std::byte>(rng());
    big[0] = std::byte{'m'};
    big[1] = std::byte{'r'};
    big[2] = std::byte{p::kVersion};
    big[3] = std::byte{2};
    ctl.expect_refused(big, "a 1 MiB random frame");
  }

  // 2. Every proper prefix of each valid frame (a frame cut short anywhere), and each
  //    valid frame with a trailing byte.
  std::size_t kinds = 0;
  for (const Bytes& frame : valid_frames()) {
    for (std::size_t n = 0; n < frame.size(); ++n) {
      const Bytes cut(frame.begin(), frame.begin() + static_cast<std::ptrdiff_t>(n));
      // A canonical codec cannot decode a proper prefix of a frame; never send one that does.
      if (decodes(cut)) {
        ADD_FAILURE() << "kind " << kinds << " cut to " << n << " bytes still decodes";
        continue;
      }
      ctl.expect_refused(cut, "kind " + std::to_string(kinds) + " cut to " + std::to_string(n) + " bytes");
    }
    Bytes longer = frame;
    longer.push_back(std::byte{0});
    ctl.expect_refused(longer, "kind " + std::to_string(kinds) + " with a trailing byte");
    kinds++;
  }

  // 3. Bit flips and byte overwrites of valid frames. Some mutations still decode (a
  //    flipped bit in an id is another valid command, which could for instance start a
  //    collective): only the undecodable ones are sent.
  int skipped = 0;
  for (const Bytes& frame : valid_frames()) {
    for (int m = 0; m < 60; ++m) {
      Bytes mutated = frame;
      const std::size_t at = rng() % mutated.size();
      if (m % 2 == 0)
        mutated[at] ^= static_cast<std::byte>(1u << (rng() % 8));
      else
        mutated[at] = static_cast<std::byte>(rng());
      if (decodes(mutated)) {
        skipped++;
        continue;
      }
      ctl.expect_refused(mutated, "kind frame mutated at byte " + std::to_string(at));
    }
  }
  std::printf("worker refused %d undecodable frames (%d mutations that still decode were not sent)\n", ctl.refused(),
              skipped);

  // 4. The worker still works: define a stream and a tensor, fetch it, ask for status.
  ctl.send(p::CreateStream{Ref{1}, true});
  ctl.send(p::CallFunction{1,
                           {Ref{2}},
                           {},
                           "meshrt.full",
                           {Value(std::vector<std::int64_t>{3}), Value("float32"), Value(2.5)},
                           Ref{1},
                           Ref{0}});
  ctl.expect_refused(Bytes{std::byte{'m'}, std::byte{'r'}}, "a header cut short between valid commands");
  ctl.send(p::FetchValue{2, {}, std::nullopt, Value(Ref{2}), Ref{1}});
  {
    const p::Reply r = ctl.receive("FetchResult of invocation 2");
    const auto* f = std::get_if<p::FetchResult>(&r);
    ASSERT_NE(f, nullptr) << "expected FetchResult, found " << p::name(r);
    EXPECT_EQ(f->ident, 2u);
    ASSERT_TRUE(f->value.is_tensor()) << f->value.to_string();
    const Tensor& t = f->value.as_tensor();
    ASSERT_EQ(t.shape(), std::vector<std::int64_t>{3});
    for (float x : t.span<float>()) EXPECT_EQ(x, 2.5f);
  }

  // 5. Commands that decode but make no sense are reported against their invocation.
  ctl.send(p::CallFunction{3, {Ref{3}}, {}, "no.such.function", {}, Ref{1}, Ref{0}});
  {
    const p::Reply r = ctl.receive("the failure of invocation 3");
    const auto* f = std::get_if<p::RemoteFunctionFailed>(&r);
    ASSERT_NE(f, nullptr) << "expected RemoteFunctionFailed, found " << p::name(r);
    EXPECT_EQ(f->ident, 3u);
    EXPECT_EQ(f->function, "no.such.function");
    EXPECT_NE(f->error.find("unknown function 'no.such.function'"), std::string::npos) << f->error;
  }
  ctl.send(p::CallFunction{4, {Ref{4}}, {}, "meshrt.copy", {Value(Ref{999})}, Ref{1}, Ref{0}});
  {
    const p::Reply r = ctl.receive("the failure of invocation 4");
    const auto* f = std::get_if<p::RemoteFunctionFailed>(&r);
    ASSERT_NE(f, nullptr) << "expected RemoteFunctionFailed, found " << p::name(r);
    EXPECT_EQ(f->ident, 4u);
    EXPECT_NE(f->error.find("rank 1: argument ref 999 is not defined on this worker"), std::string::npos) << f->error;
  }
  // A stream ref that is not a stream, outside any invocation's results: ident 0.
  ctl.send(p::BorrowCreate{Ref{5}, Ref{777}, Ref{1}, Ref{6}, false});
  {
    const p::Reply r = ctl.receive("the failure of a BorrowCreate of an undefined ref");
    const auto* f = std::get_if<p::RemoteFunctionFailed>(&r);
    ASSERT_NE(f, nullptr) << "expected RemoteFunctionFailed, found " << p::name(r);
    EXPECT_EQ(f->ident, 0u);
    EXPECT_EQ(f->function, "BorrowCreate");
    EXPECT_NE(f->error.find("ref 777 is not defined"), std::string::npos) << f->error;
  }
  ctl.send(p::DeleteRefs{{Ref{3}, Ref{4}, Ref{12345}}});  // unknown refs are ignored

  // 6. Status: everything before invocation 6 has run; the stream and ref 2 are alive.
  ctl.send(p::RequestStatus{5});
  {
    const p::Reply r = ctl.receive("Status after RequestStatus 5");
    const auto* s = std::get_if<p::Status>(&r);
    ASSERT_NE(s, nullptr) << "expected Status, found " << p::name(r);
    EXPECT_EQ(s->first_uncompleted_ident, 6u);
    EXPECT_EQ(s->live_values, 2u) << "the stream and the tensor of invocation 1";
  }

  // 7. A collective or send whose pending operation throws (here: an input that does not
  //    match its factory) fails that command only (review finding E2): reported with
  //    ident 0, its result a failure marker that a fetch reports, the worker alive.
  ctl.send(p::CreateDeviceMesh{Ref{30}, {"a"}, NDSlice(kWorker, {1}, {1})});
  ctl.send(p::CallFunction{6,
                           {Ref{31}},
                           {},
                           "meshrt.full",
                           {Value(std::vector<std::int64_t>{3}), Value("float32"), Value(1.5)},
                           Ref{1},
                           Ref{0}});
  const auto expect_in_flight_failure = [&](const p::Command& c, const std::string& kind) {
    ctl.send(c);
    const p::Reply r = ctl.receive("the failure of a " + kind + " with a mismatched input");
    const auto* f = std::get_if<p::RemoteFunctionFailed>(&r);
    ASSERT_NE(f, nullptr) << "expected RemoteFunctionFailed, found " << p::name(r);
    EXPECT_EQ(f->ident, 0u);
    EXPECT_EQ(f->function, kind);
    EXPECT_NE(f->error.find("expected an input float32[4] on cpu as the controller computed, found float32[3] on cpu"),
              std::string::npos)
        << f->error;
  };
  expect_in_flight_failure(
      p::Reduce{Ref{32}, Ref{31}, TensorMeta({4}, DType::Float32), Ref{30}, Ref{1}, "a", Reduction::Sum, false, false},
      "Reduce");
  expect_in_flight_failure(p::SendTensor{Ref{33}, NDSlice(kWorker, {1}, {1}), NDSlice(kWorker, {1}, {1}), Ref{31},
                                         TensorMeta({4}, DType::Float32), Ref{1}},
                           "SendTensor");
  for (const auto& [ident, ref] : {std::pair{p::Ident{7}, Ref{32}}, std::pair{p::Ident{8}, Ref{33}}}) {
    ctl.send(p::FetchValue{ident, {}, std::nullopt, Value(ref), Ref{1}});
    const p::Reply r = ctl.receive("the failure of fetch " + std::to_string(ident));
    const auto* f = std::get_if<p::RemoteFunctionFailed>(&r);
    ASSERT_NE(f, nullptr) << "expected RemoteFunctionFailed, found " << p::name(r);
    EXPECT_EQ(f->ident, ident);
    EXPECT_NE(f->error.find("failed outside any invocation"), std::string::npos) << f->error;
  }
  ctl.send(p::FetchValue{9, {}, std::nullopt, Value(Ref{31}), Ref{1}});
  {
    const p::Reply r = ctl.receive("FetchResult of invocation 9");
    const auto* f = std::get_if<p::FetchResult>(&r);
    ASSERT_NE(f, nullptr) << "expected FetchResult, found " << p::name(r);
    ASSERT_TRUE(f->value.is_tensor()) << f->value.to_string();
    for (float x : f->value.as_tensor().span<float>()) EXPECT_EQ(x, 1.5f);
  }
}

}  // namespace

TEST(WorkerGarbage, SurvivesUndecodableFramesAndStillAnswers) {
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  ASSERT_EQ(size, 2) << "this test runs at 2 ranks: a controller by hand and one worker";
  MPI_Comm world, control, p2p;
  MPI_Comm_dup(MPI_COMM_WORLD, &world);
  MPI_Comm_dup(MPI_COMM_WORLD, &control);
  MPI_Comm_dup(MPI_COMM_WORLD, &p2p);
  if (rank == kWorker) {
    // No periodic Status: every reply rank 0 receives is one it asked for.
    Worker worker(WorkerOptions{rank, world, control, p2p, 3600.0});
    EXPECT_EQ(worker.run(), WorkerExit::Shutdown);
  } else {
    try {
      rank0_plays_controller(control);
    } catch (const std::exception& e) {
      ADD_FAILURE() << e.what();
    }
    // Also after a failed check, so the worker always leaves its loop.
    FakeController(control).send(p::Command{p::Exit{false}});
  }
  MPI_Barrier(world);
  if (rank == 0) {
    // Nothing but status may be left over: another reply would mean a frame was answered twice.
    for (;;) {
      int flag = 0;
      MPI_Status status;
      MPI_Iprobe(kWorker, static_cast<int>(control::Tag::Reply), control, &flag, &status);
      if (!flag) break;
      int count = 0;
      MPI_Get_count(&status, MPI_BYTE, &count);
      Bytes bytes(static_cast<std::size_t>(count));
      MPI_Recv(bytes.data(), count, MPI_BYTE, kWorker, static_cast<int>(control::Tag::Reply), control,
               MPI_STATUS_IGNORE);
      const p::Reply r = p::decode_reply(bytes);
      EXPECT_TRUE(std::holds_alternative<p::Status>(r)) << "an unexpected " << p::name(r) << " is waiting after Exit";
    }
  }
  MPI_Comm_free(&p2p);
  MPI_Comm_free(&control);
  MPI_Comm_free(&world);
}
