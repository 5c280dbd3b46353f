// Recorded steps (Controller::record): every command kind inside a recording gives what
// the same commands issued one by one give; replays interleave with ordinary calls and
// feed one another; a failure inside a replay on one rank of four poisons exactly its
// dependents and names the recorded line and the replay's; what a recording cannot hold is
// refused at the call; 10^5 replays leave the workers' values and the controller's memory
// flat. Runs at 4 ranks as a 2x2 mesh; with MESHRT_TEST_PLACEMENT=emulated (and
// MESHRT_ACCELERATOR=emulated) on the emulated accelerator (recording_emulated).
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "runtime_support.hpp"

using namespace meshrt;
using meshrt::test::session;

MESHRT_RUNTIME_TEST_ENVIRONMENT();

namespace {

Mesh mesh2x2(Controller& ctl) {
  return ctl.world_mesh({{"host", 2}, {"gpu", ctl.world_size() / 2}}, test::test_placement());
}

// Every shard of `t` (float32), rank by rank in row-major order of the mesh.
std::vector<float> shards(Controller& ctl, const DTensor& t) {
  std::vector<float> out;
  const NDSlice& ranks = t.mesh().ranks();
  for (auto rank : ranks) {
    const auto c = ranks.coordinates(rank);
    const Tensor v = ctl.fetch_shard(t, {{"host", c[0]}, {"gpu", c[1]}}).get();
    const auto s = v.span<float>();
    out.insert(out.end(), s.begin(), s.end());
  }
  return out;
}

// The step every test records: a call, a reduction over each dimension (one in place on a
// temporary), a rotation, and a borrow onto another stream; mutates `acc` (captured).
std::vector<DTensor> step(Controller& ctl, Mesh& mesh, const DTensor& x, DTensor& acc) {
  DTensor y = mesh.call("meshrt.scale", x, 2.0);
  DTensor g = y.reduce("gpu", Reduction::Sum);
  g.reduce_("host", Reduction::Avg);
  DTensor r = g.rotate("gpu", 1);
  Stream side = ctl.stream("side");
  DTensor b = side.borrow(r);
  DTensor c = mesh.call_on(side, "meshrt.scale", {b, 0.5})[0];
  b.drop();
  DTensor back = ctl.default_stream().borrow(c);
  DTensor out = mesh.call("meshrt.copy", back);
  back.drop();
  mesh.call("meshrt.add_", acc, out);
  DTensor h = x.reduce("host", Reduction::Sum, true);  // reduce_scatter
  return {out, h};
}

TEST(Recording, ReplaysGiveWhatTheCommandsGiveOneByOne) {
  session([](Controller& ctl) {
    Mesh mesh = mesh2x2(ctl);
    DTensor acc_a = mesh.call("meshrt.zeros", {2}, DType::Float32);
    DTensor acc_b = mesh.call("meshrt.zeros", {2}, DType::Float32);
    DTensor x0 = mesh.call("test.pattern", {2}, DType::Float32);
    Recording rec = ctl.record({x0}, [&](const std::vector<DTensor>& in) { return step(ctl, mesh, in[0], acc_b); });
    EXPECT_EQ(rec.num_inputs(), 1u);
    EXPECT_EQ(rec.num_outputs(), 2u);
    EXPECT_GE(rec.num_commands(), 10u);
    DTensor x = x0;
    for (int i = 0; i < 5; ++i) {
      const std::vector<DTensor> want = step(ctl, mesh, x, acc_a);
      const std::vector<DTensor> got = rec({x});
      ASSERT_EQ(got.size(), 2u);
      EXPECT_EQ(got[0].meta(), want[0].meta());
      EXPECT_EQ(shards(ctl, got[0]), shards(ctl, want[0])) << "replay " << i;
      EXPECT_EQ(shards(ctl, got[1]), shards(ctl, want[1])) << "replay " << i;
      EXPECT_EQ(shards(ctl, acc_b), shards(ctl, acc_a)) << "the captured tensor, after replay " << i;
      x = mesh.call("meshrt.scale", got[0], 1.5);  // the next input depends on this replay's result
    }
    ctl.synchronize();
  });
}

// The collectives of a Collective command record and replay: a broadcast, a reduction over
// several dimensions, and a rooted reduce whose result lives on the root's slice.
std::vector<DTensor> collective_step(const DTensor& x) {
  DTensor b = x.broadcast("gpu", 1);
  DTensor all = b.reduce({"host", "gpu"}, Reduction::Sum);
  DTensor rooted = x.reduce("host", Reduction::Max, Dst{0});
  return {all, rooted};
}

TEST(Recording, CollectivesOfSeveralDimensionsAndRootsReplay) {
  session([](Controller& ctl) {
    Mesh mesh = mesh2x2(ctl);
    DTensor x = mesh.call("test.pattern", {2}, DType::Float32);
    Recording rec = ctl.record({x}, [&](const std::vector<DTensor>& in) { return collective_step(in[0]); });
    for (int i = 0; i < 2; ++i) {
      const std::vector<DTensor> want = collective_step(x);
      const std::vector<DTensor> got = rec({x});
      ASSERT_EQ(got.size(), 2u);
      EXPECT_EQ(shards(ctl, got[0]), shards(ctl, want[0])) << "replay " << i;
      EXPECT_TRUE(got[1].mesh() == mesh.slice("host", 0));
      for (std::int64_t g = 0; g < mesh.size("gpu"); ++g) {
        EXPECT_TRUE(ctl.fetch_shard(got[1], {{"gpu", g}}).get().equals(ctl.fetch_shard(want[1], {{"gpu", g}}).get()))
            << "replay " << i << ", gpu " << g;
      }
      x = mesh.call("meshrt.scale", got[0], 0.5);
    }
    ctl.synchronize();
  });
}

// A broadcast to_mesh records and replays: from a rooted reduce's slice and from a slice
// of the mesh, onto the mesh; the values are closed forms of test.pattern's.
TEST(Recording, ABroadcastToMeshReplays) {
  session([](Controller& ctl) {
    Mesh mesh = mesh2x2(ctl);
    const std::int64_t gpus = mesh.size("gpu");
    DTensor x = mesh.call("test.pattern", {2}, DType::Float32);  // rank r: [100r + 1, 100r + 2]
    Recording rec = ctl.record({x}, [&](const std::vector<DTensor>& in) {
      return std::vector<DTensor>{in[0].reduce("gpu", Reduction::Sum, Dst{0}).to_mesh(mesh),
                                  in[0].slice_mesh("host", 1).to_mesh(mesh)};
    });
    for (const float scale : {1.0f, 2.0f}) {
      const std::vector<DTensor> got = rec({mesh.call("meshrt.scale", x, static_cast<double>(scale))});
      ASSERT_EQ(got.size(), 2u);
      EXPECT_TRUE(got[0].mesh() == mesh);
      std::vector<float> rooted, host1;
      for (std::int64_t h = 0; h < 2; ++h) {
        for (std::int64_t g = 0; g < gpus; ++g) {
          for (std::int64_t i = 0; i < 2; ++i) {
            float sum = 0;
            for (std::int64_t k = 0; k < gpus; ++k) sum += static_cast<float>(100 * (h * gpus + k) + i + 1);
            rooted.push_back(scale * sum);
            host1.push_back(scale * static_cast<float>(100 * (gpus + g) + i + 1));
          }
        }
      }
      EXPECT_EQ(shards(ctl, got[0]), rooted) << "scale " << scale;
      EXPECT_EQ(shards(ctl, got[1]), host1) << "scale " << scale;
    }
    ctl.synchronize();
  });
}

TEST(Recording, ResultsFeedReplaysAndOrdinaryCalls) {
  session([](Controller& ctl) {
    Mesh mesh = mesh2x2(ctl);
    DTensor x = mesh.call("test.pattern", {2}, DType::Float32);
    Recording twice = ctl.record({x}, [&](const std::vector<DTensor>& in) {
      return std::vector<DTensor>{mesh.call("meshrt.scale", in[0], 2.0), in[0]};
    });
    DTensor v = x;
    for (int i = 0; i < 10; ++i) {
      auto out = twice({v});
      EXPECT_EQ(shards(ctl, out[1]), shards(ctl, v)) << "an input returned is the input";
      v = mesh.call("meshrt.scale", out[0], 0.5);  // ordinary, between replays
      v = twice({v})[0];
    }
    const std::vector<float> got = shards(ctl, v), start = shards(ctl, x);
    for (std::size_t i = 0; i < got.size(); ++i) EXPECT_FLOAT_EQ(got[i], start[i] * 1024.0f);
    // Replays leave no temporaries behind: only what handles hold.
    const DTensor keep = twice({x})[0];
    ctl.synchronize();
    const std::uint64_t before = ctl.live_values(1);
    for (int i = 0; i < 50; ++i) (void)twice({keep});
    ctl.synchronize();
    EXPECT_LE(ctl.live_values(1), before + 1);
  });
}

TEST(Recording, AFailureInAReplayPoisonsItsDependentsAndNamesBothLines) {
  session([](Controller& ctl) {
    Mesh mesh = mesh2x2(ctl);
    DTensor x = mesh.call("test.pattern", {2}, DType::Float32);
    const int bad = 2;
    int recorded_line = 0;
    Recording rec = ctl.record({x}, [&](const std::vector<DTensor>& in) {
      DTensor fine = mesh.call("meshrt.scale", in[0], 3.0).reduce("gpu", Reduction::Sum);
      recorded_line = __LINE__ + 1;
      DTensor f = mesh.call("meshrt.fail", "boom in the middle", std::vector<std::int64_t>{bad});
      DTensor joined = f.reduce("gpu", Reduction::Sum);  // the bad rank joins it with zeros
      DTensor after = mesh.call("meshrt.scale", joined, 1.0);
      return std::vector<DTensor>{after, fine};
    });
    const int replay_line = __LINE__ + 1;
    const auto out = rec({x});
    const NDSlice& ranks = mesh.ranks();
    for (auto rank : ranks) {
      const auto c = ranks.coordinates(rank);
      try {
        ctl.fetch_shard(out[0], {{"host", c[0]}, {"gpu", c[1]}}).get();
        ADD_FAILURE() << "expected RemoteError at rank " << rank;
      } catch (const RemoteError& e) {
        EXPECT_EQ(e.function(), "meshrt.fail");
        EXPECT_EQ(e.ranks(), std::vector<int>{bad});
        EXPECT_NE(e.issued_at().find("recording_test.cpp:" + std::to_string(recorded_line)), std::string::npos)
            << e.issued_at();
        EXPECT_NE(e.issued_at().find("replayed at recording_test.cpp:" + std::to_string(replay_line)),
                  std::string::npos)
            << e.issued_at();
      }
    }
    // The replay's other result does not depend on the failure.
    const std::vector<float> fine = shards(ctl, out[1]);
    EXPECT_EQ(fine.size(), 8u);
    ctl.synchronize();  // the fetches raised the failure: it is observed
    // The workers live on: another replay's good half; its failure, not fetched, is
    // raised by the next synchronize.
    EXPECT_EQ(shards(ctl, rec({x})[1]), fine);
    EXPECT_THROW(ctl.synchronize(), RemoteError);
    ctl.synchronize();
  });
}

TEST(Recording, WhatARecordingCannotHoldIsRefusedAtTheCall) {
  session([](Controller& ctl) {
    Mesh mesh = mesh2x2(ctl);
    DTensor x = mesh.call("test.pattern", {2}, DType::Float32);
    auto refused = [&](const std::function<void()>& f, const std::string& part) {
      try {
        f();
        ADD_FAILURE() << "expected UsageError with \"" << part << "\"";
      } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("recording_test.cpp:"), std::string::npos) << e.what();
      }
    };
    refused(
        [&] {
          ctl.record({x}, [&](const std::vector<DTensor>& in) {
            (void)ctl.fetch_shard(in[0], {{"host", 0}, {"gpu", 0}});
            return in;
          });
        },
        "fetch_shard inside a recording");
    refused(
        [&] {
          ctl.record({x}, [&](const std::vector<DTensor>& in) {
            ctl.synchronize();
            return in;
          });
        },
        "synchronize inside a recording");
    DTensor leaked;
    Recording rec = ctl.record({x}, [&](const std::vector<DTensor>& in) {
      leaked = mesh.call("meshrt.scale", in[0], 2.0);
      return std::vector<DTensor>{leaked};
    });
    refused([&] { (void)leaked.reduce("gpu", Reduction::Sum); }, "made inside a recording");
    DTensor other = mesh.call("test.pattern", {3}, DType::Float32);
    refused([&] { (void)rec({other}); }, "expected float32[2]");
    refused([&] { (void)rec({}); }, "expected 1 input(s), found 0");
    refused(
        [&] {
          ctl.record({x}, [&](const std::vector<DTensor>& in) {
            DTensor b = ctl.stream("side").borrow(in[0]);
            return std::vector<DTensor>{mesh.call_on(ctl.stream("side"), "meshrt.scale", {b, 1.0})[0]};
          });
        },
        "was not dropped");
    // Recordings do not nest: said as such, not as a value brought back.
    auto refused_not = [&](const std::function<void()>& f, const std::string& part, const std::string& not_part) {
      try {
        f();
        ADD_FAILURE() << "expected UsageError with \"" << part << "\"";
      } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("recordings do not nest"), std::string::npos) << e.what();
        EXPECT_EQ(std::string(e.what()).find(not_part), std::string::npos) << e.what();
      }
    };
    refused_not([&] { ctl.record({x}, [&](const std::vector<DTensor>& in) { return rec(in); }); },
                "a replay of the recording made at", "cannot bring values back");
    refused_not(
        [&] {
          ctl.record({x}, [&](const std::vector<DTensor>& in) {
            (void)ctl.record({in[0]}, [&](const std::vector<DTensor>& inner) { return inner; });
            return in;
          });
        },
        "record inside a recording", "cannot bring values back");
    // A tensor like the example on a mesh of other dimension names: the message says that.
    DTensor renamed = mesh.rename("gpu", "tp").call("test.pattern", {2}, DType::Float32);
    refused([&] { (void)rec({renamed}); }, "the dimension names are [host, tp], recorded [host, gpu]");
    // Nothing refused was sent: the session goes on, and x is intact.
    EXPECT_EQ(shards(ctl, rec({x})[0]).size(), 8u);
    ctl.synchronize();
  });
}

// A declared view (test.view: the halves of a [4, 2] tensor's rows) is an input of a
// replay like any tensor: the replay's in-place reduce and x += x reach the base's rows.
// Making a view inside a recording, and one step or replay holding two tensors of one
// storage, are refused at the call.
TEST(Recording, DeclaredViewsAreInputsOfReplaysAndRefusedInside) {
  session([](Controller& ctl) {
    Mesh mesh = mesh2x2(ctl);
    const std::int64_t gpus = mesh.size("gpu");
    DTensor base = mesh.call("test.pattern", {4, 2}, DType::Float32);
    std::vector<DTensor> halves = mesh.call_n("test.view", {"chunks", base});
    Recording rec = ctl.record({halves[0]}, [&](const std::vector<DTensor>& in) {
      DTensor top = in[0];
      top.reduce_("gpu", Reduction::Sum);
      (void)mesh.call_n("meshrt.add_", {top, top});
      return std::vector<DTensor>{};
    });
    // test.pattern: element i on rank r is r * 100 + i + 1; the replays reach rows 0 and 1.
    const auto want = [&](double factor) {
      std::vector<float> out;
      for (std::int64_t r = 0; r < 2 * gpus; ++r) {
        for (std::int64_t i = 0; i < 8; ++i) {
          double line = 0;
          for (std::int64_t g = 0; g < gpus; ++g) line += static_cast<double>((r / gpus * gpus + g) * 100 + i + 1);
          out.push_back(static_cast<float>(i < 4 ? factor * line : static_cast<double>(r * 100 + i + 1)));
        }
      }
      return out;
    };
    (void)rec({halves[0]});
    EXPECT_EQ(shards(ctl, base), want(2.0)) << "a sum over gpu, doubled";
    (void)rec({halves[0]});
    EXPECT_EQ(shards(ctl, base), want(2.0 * 2.0 * gpus)) << "the equal rows summed over gpu, doubled";
    auto refused = [&](const std::function<void()>& f, const std::string& part) {
      try {
        f();
        ADD_FAILURE() << "expected UsageError with \"" << part << "\"";
      } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
      }
    };
    refused(
        [&] {
          ctl.record({base}, [&](const std::vector<DTensor>& in) {
            return mesh.call_n("test.view", {"chunks", in[0]});
          });
        },
        "its shape function declares views, which a recorded step cannot make");
    refused(
        [&] {
          ctl.record({halves[0]}, [&](const std::vector<DTensor>& in) {
            (void)mesh.call_n("meshrt.add_", {halves[1], in[0]});
            (void)mesh.call_n("meshrt.add_", {base, base});
            return in;
          });
        },
        "already uses a declared view of this tensor's storage");
    Recording two = ctl.record({halves[0], halves[1]}, [&](const std::vector<DTensor>& in) {
      (void)mesh.call_n("meshrt.add_", {in[0], in[1]});
      return std::vector<DTensor>{};
    });
    refused([&] { (void)two({halves[0], halves[1]}); }, "input 0 and input 1 share one storage");
    EXPECT_EQ(shards(ctl, base), want(2.0 * 2.0 * gpus)) << "nothing refused was sent";
    ctl.synchronize();
  });
}

TEST(Recording, RestartDropsRecordings) {
  session([](Controller& ctl) {
    Mesh mesh = mesh2x2(ctl);
    DTensor x = mesh.call("test.pattern", {2}, DType::Float32);
    Recording rec = ctl.record(
        {x}, [&](const std::vector<DTensor>& in) { return std::vector<DTensor>{mesh.call("meshrt.copy", in[0])}; });
    (void)rec({x});
    ctl.restart_workers();
    Mesh fresh = mesh2x2(ctl);
    DTensor y = fresh.call("test.pattern", {2}, DType::Float32);
    EXPECT_THROW((void)rec({y}), UsageError);
    Recording again = ctl.record(
        {y}, [&](const std::vector<DTensor>& in) { return std::vector<DTensor>{fresh.call("meshrt.copy", in[0])}; });
    EXPECT_EQ(shards(ctl, again({y})[0]), shards(ctl, y));
  });
}

TEST(Recording, TheFlightRecorderNamesTheReplay) {
  session([](Controller& ctl) {
    Mesh mesh = mesh2x2(ctl);
    DTensor x = mesh.call("test.pattern", {2}, DType::Float32);
    Recording rec = ctl.record(
        {x}, [&](const std::vector<DTensor>& in) { return std::vector<DTensor>{in[0].reduce("gpu", Reduction::Sum)}; });
    auto replays = [](const std::string& dump) {
      std::size_t entries = 0;
      for (std::size_t at = dump.find("(replay of recording"); at != std::string::npos;
           at = dump.find("(replay of recording", at + 1))
        ++entries;
      return entries;
    };
    ctl.synchronize();
    const std::size_t before = replays(ctl.dump_flight_recorder());  // the job's earlier tests'
    (void)rec({x});
    (void)rec({x});
    ctl.synchronize();
    const std::string dump = ctl.dump_flight_recorder();
    EXPECT_NE(dump.find("Reduce all_reduce sum"), std::string::npos) << dump;
    // One entry per replay on each rank, naming its command and how many it has.
    EXPECT_EQ(replays(dump) - before, 2u * static_cast<std::size_t>(ctl.world_size())) << dump;
    EXPECT_NE(dump.find(", command 1 of 1)"), std::string::npos) << dump;
  });
}

TEST(Recording, TheFlightRecorderNamesTheFailedCommandOfAReplay) {
  session([](Controller& ctl) {
    Mesh mesh = mesh2x2(ctl);
    DTensor x = mesh.call("test.pattern", {2}, DType::Float32);
    const int bad = 1;
    Recording rec = ctl.record({x}, [&](const std::vector<DTensor>& in) {
      DTensor f = mesh.call("meshrt.fail", "boom in a replay", std::vector<std::int64_t>{bad});
      DTensor joined = f.reduce("gpu", Reduction::Sum);
      return std::vector<DTensor>{mesh.call("meshrt.scale", joined, 2.0), mesh.call("meshrt.scale", in[0], 2.0)};
    });
    (void)rec({x});
    EXPECT_THROW(ctl.synchronize(), RemoteError);
    const std::string dump = ctl.dump_flight_recorder();
    // The bad rank's entry keeps naming the failed command, not the ones after it (earlier
    // tests' entries are in the dump too).
    std::size_t named = 0;
    std::istringstream lines(dump);
    for (std::string line; std::getline(lines, line);) {
      if (line.find("CallFunction meshrt.fail") != std::string::npos &&
          line.find(", command 1 of 4)") != std::string::npos && line.find(" failed ") != std::string::npos)
        ++named;
    }
    EXPECT_EQ(named, 1u) << dump;
    ctl.synchronize();
  });
}

TEST(Recording, TheDesyncReportNamesTheReplayedLine) {
  session([](Controller& ctl) {
    // On the CPU in every run: test.sleep makes host tensors.
    Mesh mesh = ctl.world_mesh({{"host", 2}, {"gpu", ctl.world_size() / 2}});
    const int slow = ctl.world_size() - 1;
    DTensor x = mesh.call("test.pattern", {2}, DType::Float32);
    double seconds = 0.0;
    Recording rec = ctl.record({x}, [&](const std::vector<DTensor>& in) {
      DTensor s = mesh.call("test.sleep", seconds, std::vector<std::int64_t>{slow});
      return std::vector<DTensor>{s.reduce("gpu", Reduction::Sum), in[0]};
    });
    // The sleep's length is recorded with the call: a second recording sleeps 2 s. The
    // first replay makes the communicators, so the timed part is the sleep alone.
    (void)rec({x});
    ctl.synchronize();
    seconds = 2.0;
    Recording slow_rec = ctl.record({x}, [&](const std::vector<DTensor>& in) {
      DTensor s = mesh.call("test.sleep", seconds, std::vector<std::int64_t>{slow});
      return std::vector<DTensor>{s.reduce("gpu", Reduction::Sum), in[0]};
    });
    const int replay_line = __LINE__ + 1;
    const auto out = slow_rec({x});
    auto fut = ctl.fetch_shard(out[0], {{"host", 0}, {"gpu", 0}});
    try {
      fut.get(std::chrono::milliseconds(300));
      ADD_FAILURE() << "expected a TimeoutError";
    } catch (const TimeoutError& e) {
      const std::string what = e.what();
      EXPECT_EQ(e.missing_ranks(), std::vector<int>{slow}) << what;
      EXPECT_NE(what.find("desync report"), std::string::npos) << what;
      EXPECT_NE(what.find("replayed at recording_test.cpp:" + std::to_string(replay_line)), std::string::npos) << what;
    }
    EXPECT_EQ(fut.get().item(), 0.0f);
  });
}

std::uint64_t resident_kib() {
  std::ifstream statm("/proc/self/statm");
  std::uint64_t size = 0, resident = 0;
  statm >> size >> resident;
  return resident * 4;
}

TEST(Recording, ManyReplaysKeepMemoryFlat) {
  session([](Controller& ctl) {
    Mesh mesh = mesh2x2(ctl);
    DTensor x = mesh.call("meshrt.zeros", {2}, DType::Float32);
    Recording rec = ctl.record({x}, [&](const std::vector<DTensor>& in) {
      DTensor t = mesh.call("meshrt.scale", in[0], 1.0);
      return std::vector<DTensor>{t.reduce("gpu", Reduction::Sum)};
    });
    // A loop that waits now and then (as one that fetches its loss does): the controller
    // is never more than 10^4 replays ahead, so what it and worker 0 buffer is bounded.
    const int n = 100000, every = 10000;
    DTensor v = x;
    std::uint64_t values = 0, rss = 0;
    for (int i = 0; i < n; ++i) {
      v = rec({v})[0];
      if ((i + 1) % every == 0) {
        ctl.synchronize();
        if (i + 1 == 2 * every) {  // after a warm-up
          values = ctl.live_values(1);
          rss = resident_kib();
        }
      }
    }
    EXPECT_LE(ctl.live_values(1), values) << "values on a worker grow with replays";
    // Growth bound, not a timing: the controller's graph and tracker are pruned as the
    // frontier passes.
#if !defined(__SANITIZE_ADDRESS__)
    // (Not under AddressSanitizer, whose quarantine of freed memory reads as growth.)
    EXPECT_LE(resident_kib(), rss + 16 * 1024) << "the controller's resident memory grew by more than 16 MiB";
#else
    (void)rss;
#endif
    EXPECT_EQ(shards(ctl, v), std::vector<float>(8, 0.0f));
  });
}

}  // namespace
