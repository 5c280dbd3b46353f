// The controller's session: handles' states and the glue between the batcher, the
// completion tracker, the dependency graph, diagnostics and the recorder (docs/ARCHITECTURE.md
// sections 3 and 6; recorded steps' glue in recording.cpp).
#include "controller/state.hpp"
#include "common/checks.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "common/backoff.hpp"
#include "common/trace.hpp"
#include "meshrt/internal/controller.hpp"
#include "meshrt/internal/settings.hpp"
#include "meshrt/internal/worker.hpp"
#include "meshrt/log.hpp"

namespace meshrt::detail {

namespace {
std::atomic<WaitCheck> wait_check{nullptr};
}  // namespace

void set_wait_check(WaitCheck check) noexcept {
  wait_check.store(check, std::memory_order_relaxed);
}

void refuse_on_worker_thread(std::string_view what) {
  const WorkerThread* w = worker_thread();
  if (w == nullptr) return;
  const std::string inside =
      w->function.empty() ? std::string("a command") : fmt::format("the kernel of {}", w->function);
  throw UsageError(fmt::format(
      "{} called from inside {} running on rank {}'s worker: a kernel cannot drive the controller (the controller "
      "runs the program on rank 0's main thread and waits for this very worker); return values from the kernel "
      "instead, and call the controller from the program",
      what, inside, w->rank));
}

std::vector<int> to_dests(const NDSlice& slice) {
  std::vector<int> out;
  out.reserve(static_cast<std::size_t>(slice.len()));
  for (auto r : slice) out.push_back(static_cast<int>(r));
  std::sort(out.begin(), out.end());
  return out;
}

std::int64_t MeshState::dim_index(std::string_view dim) const {
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (names[i] == dim) return static_cast<std::int64_t>(i);
  }
  throw UsageError(
      fmt::format("unknown mesh dimension '{}': the mesh has dimensions [{}]", dim, fmt::join(names, ", ")));
}

MeshState::~MeshState() {
  if (!created) return;
  auto ctl = controller.lock();
  if (!ctl || ctl->epoch() != epoch) return;
  ctl->defer_delete(dests, ref);
}

StreamState::~StreamState() {
  if (!created) return;
  auto ctl = controller.lock();
  if (!ctl || ctl->epoch() != epoch) return;
  ctl->defer_delete(ctl->workers(), ref);
}

TensorState::~TensorState() {
  if (recorded != 0) return;  // a value of a recorded step: the replays define and delete it
  if (dropped) return;        // drop() deleted it
  auto ctl = controller.lock();
  if (!ctl || ctl->epoch() != epoch || !home) return;
  if (borrow.origin && !borrow.dropped) {
    // Exactly drop(): the origin's value is what the borrower wrote (a failed write
    // poisons it), and the BorrowDrop precedes the origin's next use.
    MESHRT_LOG(warning) << "a tensor borrowed on stream '" << stream->name
                        << "' was destroyed without drop(); dropping it now";
    TensorState& origin = *borrow.origin;
    origin.lent().active--;
    if (borrow.is_mutable) {
      origin.lent().mutably = false;
      try {
        origin.node() = ctl->make_node_quietly(
            fmt::format("implicit drop of borrow on stream '{}' (made at {})", stream->name, describe(borrow.where)),
            borrow.where, {origin.node(), node()});
      } catch (...) {
        // Out of memory in a destructor: the drop still goes out below.
      }
    }
    ctl->defer_drop(home->dests, ref);
  }
  // Borrows share the origin's value on the workers under their own ref. A small value's
  // delete waits for others (Batcher::defer_delete): an out-of-place 8 B collective in a
  // loop then costs every worker no delete command of its own.
  // An object's size is unknown (a model): its delete goes with the next command.
  ctl->defer_delete(home->dests, ref, object ? std::nullopt : std::optional<std::size_t>(meta.nbytes()));
}

ControllerState::ControllerState(std::shared_ptr<control::Transport> transport, int size, NDSlice workers_slice)
    : world_size_(size),
      worker_ranks_(std::move(workers_slice)),
      workers_(to_dests(worker_ranks_)),
      batcher_(std::move(transport)),
      tracker_(workers_),
      diagnostics_(batcher_, tracker_, workers_),
      stall_warning_(settings::kStallWarning.get()) {
  // The workers build the same tree from the same settings (Runtime's worker options).
  tree_ = control::StatusTree::for_job(workers_, batcher_.fanout(), batcher_.fanout_threshold());
  if (tree_) {
    std::map<int, std::vector<int>> subtrees;
    for (int top : tree_->top()) subtrees[top] = tree_->subtree(top);
    tracker_.use_tree(std::move(subtrees));
    diagnostics_.use_tree(&*tree_);
  }
}

ControllerState::~ControllerState() = default;

std::vector<Value> ControllerState::argument_metas(const std::vector<Arg>& args, std::vector<DTensor>& tensors) {
  std::vector<Value> metas;
  metas.reserve(args.size());
  for (const Arg& a : args) {
    std::size_t next = tensors.size();
    for (const DTensor& t : a.tensors()) tensors.push_back(t);
    metas.push_back(a.value().map([&](const Value& leaf) -> Value {
      if (!leaf.is_ref()) return leaf;
      const TensorState& t = *tensors[next++].state_;
      return t.object ? Value() : Value(t.meta);
    }));
  }
  return metas;
}

Ref ControllerState::new_tensor_ref() {
  if (recorder_.active()) return recorder_.new_ref();
  return new_ref();
}

Ident ControllerState::new_ident(const char* label) {
  if (recorder_.active()) return recorder_.new_ident();
  return tracker_.new_ident(label);
}

void ControllerState::check_epoch(std::uint64_t e, std::string_view what) const {
  if (e != epoch_) {
    throw UsageError(fmt::format("this {} was made before restart_workers(); the workers no longer have it", what));
  }
}

const MeshState::SendWords& MeshState::send_words(const MeshState& to) {
  if (!send_words_cache || !(send_words_cache->to == to.ranks)) {
    std::vector<int> both = dests;
    both.insert(both.end(), to.dests.begin(), to.dests.end());
    std::sort(both.begin(), both.end());
    both.erase(std::unique(both.begin(), both.end()), both.end());
    send_words_cache =
        SendWords{.to = to.ranks,
                  .what = Words(fmt::format("to_mesh [{}] -> [{}]", fmt::join(dests, ","), fmt::join(to.dests, ","))),
                  .dests = std::move(both)};
  }
  return *send_words_cache;
}

const Words& MeshState::reduce_words(std::int64_t d, Reduction reduction, bool scatter, bool inplace) {
  const std::size_t per_dim = kNumReductions * 4;
  if (reduce_words_cache.empty()) reduce_words_cache.resize(names.size() * per_dim);
  Words& w = reduce_words_cache[static_cast<std::size_t>(d) * per_dim + static_cast<std::size_t>(reduction) * 4 +
                                (scatter ? 2 : 0) + (inplace ? 1 : 0)];
  if (w.empty()) {
    const std::string& dim = names[static_cast<std::size_t>(d)];
    std::string s;
    s.reserve(48);
    s.append(inplace ? "reduce_ " : "reduce ").append(name(reduction));
    if (scatter) s.append(" with scatter");
    s.append(" over '").append(dim).append("'");
    w = Words(std::move(s));
  }
  return w;
}

std::shared_ptr<Node> ControllerState::make_node(Ident ident, Words what, const CallSite& where,
                                                 std::span<const std::shared_ptr<Node>> inputs) {
  if (recorder_.active()) return recorder_.node(ident, std::move(what), where);
  if (ident != 0) tracker_.describe(ident, what, where);
  if (ident != 0 && trace::enabled()) trace_call(ident, what, where, {});
  auto n = graph_.make_node(ident, std::move(what), where, inputs);
  // A program that never waits still gets its graph pruned.
  if (graph_.prune_due()) poll_replies();
  return n;
}

std::exception_ptr ControllerState::failure_of(const std::shared_ptr<Node>& node, const Subject& subject) {
  return graph_.failure_of(node, subject, tracker_.frontier());
}

void ControllerState::raise_unobserved_failures() {
  int more = 0;
  std::exception_ptr first = graph_.take_unobserved(&more);
  if (more > 0) {
    MESHRT_LOG(warning) << "synchronize: " << more << " more failures after the first";
  }
  if (first) std::rethrow_exception(first);
}

std::shared_ptr<StreamState> ControllerState::stream(const std::string& name) {
  auto& w = streams_[name];
  auto s = w.lock();
  if (!s) {
    s = std::make_shared<StreamState>();
    s->controller = weak_from_this();
    s->epoch = epoch_;
    s->ref = new_ref();
    s->name = name;
    s->is_default = name == "default";
    w = s;
    if (s->is_default) default_stream_ = s;
  }
  return s;
}

std::shared_ptr<MeshState> ControllerState::find_mesh(const std::string& key) {
  auto it = meshes_.find(key);
  if (it == meshes_.end()) return nullptr;
  auto m = it->second.lock();
  if (!m) {
    meshes_.erase(it);
    return nullptr;
  }
  remember_mesh(key, m);
  return m;
}

void ControllerState::remember_mesh(const std::string& key, const std::shared_ptr<MeshState>& mesh) {
  meshes_[key] = mesh;
  recent_meshes_.push_back(mesh);
  if (recent_meshes_.size() > kRecentMeshes) recent_meshes_.pop_front();
  // Names of meshes no handle holds any more.
  if (meshes_.size() > 4 * kRecentMeshes) std::erase_if(meshes_, [](const auto& m) { return m.second.expired(); });
}

void ControllerState::ensure_mesh(MeshState& mesh) {
  check_epoch(mesh.epoch, "mesh");
  if (recorder_.active()) recorder_.keep(mesh.shared_from_this());
  if (mesh.created) return;
  mesh.created = true;
  append_now(mesh.dests, protocol::CreateDeviceMesh{
                             .result = mesh.ref, .names = mesh.names, .ranks = mesh.ranks, .device = mesh.kind});
}

void ControllerState::ensure_stream(StreamState& stream) {
  check_epoch(stream.epoch, "stream");
  if (recorder_.active()) recorder_.keep(stream.shared_from_this());
  if (stream.created) return;
  stream.created = true;
  append_now(workers_, protocol::CreateStream{.result = stream.ref, .is_default = stream.is_default});
}

void ControllerState::send_deferred_drops() {
  if (pending_drops_.empty()) return;
  // A drop leaves the list once queued: a flush that fails on the way keeps the rest.
  std::size_t queued = 0;
  try {
    for (; queued < pending_drops_.size(); ++queued)
      batcher_.append(pending_drops_[queued].first, protocol::BorrowDrop{pending_drops_[queued].second});
  } catch (...) {
    pending_drops_.erase(pending_drops_.begin(), pending_drops_.begin() + static_cast<std::ptrdiff_t>(queued));
    throw;
  }
  pending_drops_.clear();
}

void ControllerState::flush_deferred() {
  send_deferred_drops();
  batcher_.flush_deferred();
}

void ControllerState::append_now(const std::vector<int>& dests, protocol::Command&& c, std::size_t payload) {
  batcher_.take_failure();
  send_deferred_drops();
  batcher_.append(dests, std::move(c), payload);
}

void ControllerState::append(const std::vector<int>& dests, protocol::Command&& c, Ident ident, std::size_t payload) {
  refuse_on_worker_thread(protocol::name(c));
  batcher_.take_failure();  // an earlier batch the flusher could not send: raised before anything changes
  send_deferred_drops();    // implicit drops first: the origin's next use must find the borrow dropped
  if (recorder_.active()) return recorder_.capture(dests, std::move(c), payload);
  // Outstanding once queued (a failed flush before it queues nothing). Replies are read on
  // this thread only, so none for `ident` is taken before this.
  batcher_.append(dests, std::move(c), payload);
  if (ident != 0) tracker_.sent(dests, ident);
}

const Words& ControllerState::fetch_words(int rank) {
  const auto at = static_cast<std::size_t>(rank);
  if (at >= fetch_words_.size()) fetch_words_.resize(at + 1);
  if (fetch_words_[at].empty()) fetch_words_[at] = Words(fmt::format("fetch from rank {}", rank));
  return fetch_words_[at];
}

void ControllerState::poll_replies() {
  protocol::Reply reply;
  int from = -1;
  while (batcher_.try_receive_reply(reply, from)) {
    std::visit(
        [&](auto& r) {
          using R = std::decay_t<decltype(r)>;
          if constexpr (std::is_same_v<R, protocol::Status>) {
            tracker_.status(from, r);
          } else if constexpr (std::is_same_v<R, protocol::RemoteFunctionFailed>) {
            // A worker reports a failure when the invocation ends, and runs in order.
            // Ident 0 is a failure outside any invocation (kept for synchronize). The
            // command's name and call site are read before completion forgets them.
            graph_.record_failure(r, tracker_.what_of(r.ident), tracker_.site_of(r.ident));
            if (r.ident != 0)
              tracker_.completed(from, r.ident + 1);
            else
              MESHRT_LOG(error) << "rank " << r.rank << ": " << r.error;
            // Last: a subtree report held for this failure may apply now.
            if (tree_) tracker_.direct_reply(from);
          } else if constexpr (std::is_same_v<R, protocol::FetchResult>) {
            tracker_.completed(from, r.ident + 1);
            if (auto it = fetches_.find(r.ident); it != fetches_.end()) {
              if (auto fut = it->second.lock()) fut->value = std::move(r.value);
            }
            if (tree_) tracker_.direct_reply(from);
          } else if constexpr (std::is_same_v<R, protocol::TreeStatus>) {
            tracker_.tree_status(from, std::move(r));
          } else if constexpr (std::is_same_v<R, protocol::Restarted>) {
            tracker_.worker_restarted();
          }
        },
        reply);
  }
  batcher_.reap();
  // Forget what every worker has finished.
  tracker_.forget_complete();
  graph_.prune(tracker_.frontier());
  // Futures dropped without get() leave only expired entries behind.
  if (fetches_.size() > 1024) std::erase_if(fetches_, [](const auto& f) { return f.second.expired(); });
}

void ControllerState::request_status(Ident ident, bool idle_too) {
  refuse_in_recording("waiting for the workers");
  // A status tree node reports when asked (and about once a second), not when it runs
  // out of work: with the tree every laggard is asked at once.
  const std::vector<int> lagging = tracker_.to_ask(ident, idle_too || tree_.has_value());
  if (lagging.empty()) return;
  // One batch for every lagging rank: it goes down the fan-out tree when they are many,
  // and each rank runs it behind what it was sent (envelopes are numbered per rank).
  // With the status tree every worker is asked: a subtree's minimum passes `ident` only
  // once each of its ranks has, and a rank that was never sent `ident` (a call on part
  // of the job, a fetch from another rank) passes it only by running this.
  flush();
  append(tree_ ? workers_ : lagging, protocol::RequestStatus{ident});
  flush();
}

void ControllerState::trace_call(Ident ident, const Words& what, const CallSite& where, const CallSite& replayed_at) {
  trace::Event e;
  e.track = trace::Track::Controller;
  e.kind = trace::Kind::Call;
  e.start_ns = e.end_ns = trace::now_ns();
  e.ident = ident;
  e.a = what.trace_name();
  e.b = trace::intern_site(where);
  e.c = trace::intern_site(replayed_at);
  trace::record(e);
}

void ControllerState::wait_for(Ident ident, std::optional<std::chrono::duration<double>> timeout,
                               const Subject& subject) {
  if (worker_thread() != nullptr) refuse_on_worker_thread(subject.str());
  if (recorder_.active()) refuse_in_recording(subject.str());
  // The wait as a span of the controller's track, however it ends.
  struct Traced {
    std::int64_t start = trace::enabled() ? trace::now_ns() : 0;
    const Subject& what;
    Ident ident;
    ~Traced() {
      if (start == 0) return;
      trace::Event e;
      e.kind = trace::Kind::Wait;
      e.start_ns = start;
      e.end_ns = trace::now_ns();
      e.ident = ident;
      e.a = trace::intern(what.str());
      trace::record(e);
    }
  } traced{.what = subject, .ident = ident};
  flush_deferred();
  const auto start = std::chrono::steady_clock::now();
  Backoff backoff;
  // While worker 0 (which shares this rank's core) still owes `ident`, the wait cannot end
  // before worker 0 replies: sleep on the doorbell its replies ring instead (kReplyBell).
  // Not with the status tree, where worker 0's report may travel through a parent.
  const bool bell = !tree_ && batcher_.has_reply_doorbell();
  Backoff bell_backoff(detail::kReplyBell);
  auto next_check = start + kWaitCheckInterval;
  // A wait that passes MESHRT_STALL_WARNING says once who it waits for, and goes on;
  // one whose own timeout comes first reports there instead.
  const bool warns = stall_warning_ != settings::Seconds::max() && (!timeout || *timeout > stall_warning_);
  bool warned = false;
  for (;;) {
    const std::uint64_t rung = bell ? batcher_.reply_rings() : 0;
    poll_replies();
    if (frontier() >= ident) return;
    // Without the status tree, ask at once only the workers with later work queued behind
    // `ident`; one whose last command is `ident` reports by itself when it runs out of
    // work, so asking it too would double a fetch's messages (a RequestStatus and a
    // Status beside the request and its FetchResult). After kAskIdleAfter, ask every
    // laggard: the safety net.
    const auto waited = std::chrono::steady_clock::now() - start;
    request_status(ident, waited > kAskIdleAfter);
    if (timeout && waited > *timeout) {
      // Who is behind comes from the workers' own answers: a worker blocked in a
      // collective, or a status tree node busy in a command, cannot report what it has
      // finished, so the controller's own record names too many ranks.
      const std::string what = subject.str();
      const std::string expired = fmt::format("{} did not complete within {:.3g} s", what, timeout->count());
      const DesyncReport report = diagnostics_.desync_report(ident, expired);
      const std::string head = expired + ": " + report.summary;
      // Reported once: the error's text carries the report, the log one line, and the
      // flight recorders go to the log directory, or to stderr if nobody handles it.
      MESHRT_LOG(info) << head;
      std::string text = head + "\n" + report.table;
      if (auto dir = settings::kLogDir.from_environment(); dir && !dir->empty()) {
        const auto path = std::filesystem::path(*dir) / "meshrt.flight-recorders.log";
        std::error_code ec;
        std::filesystem::create_directories(*dir, ec);
        if (std::ofstream file(path, std::ios::app); file << "== " << head << "\n" << report.dumps << std::flush) {
          text += fmt::format("  flight recorders: {}\n", path.string());
        } else {
          MESHRT_LOG(warning) << "cannot write the flight recorders to " << path.string();
        }
        timeout_dumps_.clear();
      } else {
        timeout_dumps_ = report.dumps;
      }
      if (settings::kTimeoutAction.get() == "abort") {
        if (!timeout_dumps_.empty())
          std::fprintf(stderr, "meshrt: the workers' flight recorders at the timeout:\n%s", timeout_dumps_.c_str());
        abort_job(text);
      }
      timeout_what_ = text;
      throw TimeoutError(text, report.behind);
    }
    if (warns && !warned && waited > stall_warning_) {
      warned = true;
      report_stall(ident, subject.str(), std::chrono::duration<double>(waited));
    }
    // The embedding program's check (a Ctrl-C in Python), which may end the wait.
    if (const WaitCheck check = wait_check.load(std::memory_order_relaxed); check && start + waited >= next_check) {
      next_check = start + waited + kWaitCheckInterval;
      check();
    }
    if (bell && tracker_.owes(control::kControllerRank, ident))
      bell_backoff.pause([&](std::chrono::microseconds d) { batcher_.wait_reply_ring(rung, d); });
    else
      backoff.pause();
  }
}

void ControllerState::report_stall(Ident ident, const std::string& what, std::chrono::duration<double> waited) {
  const std::string head = fmt::format("{} has waited {:.3g} s and still waits (MESHRT_STALL_WARNING={:g})", what,
                                       waited.count(), stall_warning_.count());
  const DesyncReport report = diagnostics_.desync_report(ident, head);
  MESHRT_LOG(info) << head << ": " << report.summary;
  const std::string text = fmt::format(
      "meshrt: {}: {}\n{}  The wait goes on: a timeout given to it would end it with a TimeoutError. "
      "This report comes once per wait (MESHRT_STALL_WARNING sets after how long; 0 turns it off).\n",
      head, report.summary, report.table);
  std::fputs(text.c_str(), stderr);
  std::fflush(stderr);
}

std::string ControllerState::unhandled_dumps(const std::exception_ptr& error) const {
  if (timeout_dumps_.empty() || !error) return {};
  try {
    std::rethrow_exception(error);
  } catch (const TimeoutError& e) {
    if (e.what() == timeout_what_) return timeout_dumps_;
  } catch (...) {
  }
  return {};
}

void ControllerState::restart_workers() {
  refuse_in_recording("restart_workers");
  if (trace::enabled()) {
    trace::Event e;
    e.kind = trace::Kind::Mark;
    e.start_ns = e.end_ns = trace::now_ns();
    e.a = trace::intern("restart_workers");
    trace::record(e);
  }
  flush_deferred();
  tracker_.expect_restart();
  append(workers_, protocol::Exit{.restart = true});
  flush();
  Backoff backoff;
  while (!tracker_.all_restarted()) {
    poll_replies();
    backoff.pause();
  }
  // Nothing from before the restart exists any more.
  epoch_++;
  streams_.clear();
  default_stream_.reset();
  meshes_.clear();
  recent_meshes_.clear();
  pending_drops_.clear();
  // A new session starts with no failures: the old session's are not its to raise.
  graph_ = DependencyGraph();
  fetches_.clear();
  batcher_.restart();
  tracker_.restart();
}

void ControllerState::wait_for_issued(std::optional<std::chrono::duration<double>> timeout, const char* what) {
  const Ident ident = new_ident(what);
  flush_deferred();
  append(workers_, protocol::RequestStatus{ident}, ident);
  flush();
  wait_for(ident, timeout, what);
}

void ControllerState::shutdown(std::chrono::duration<double> timeout) {
  // A batch the flusher could not send, which the program made no call to hear of: sent
  // again below, and its error raised once the workers have ended.
  std::exception_ptr unheard;
  try {
    batcher_.take_failure();
  } catch (const Error&) {
    unheard = std::current_exception();
  }
  const Ident ident = new_ident("shutdown");
  try {
    flush_deferred();
    append(workers_, protocol::RequestStatus{ident}, ident);
    append(workers_, protocol::Exit{.restart = false});
    flush();
  } catch (const std::exception& e) {
    // The workers cannot be told to end: none may be left waiting for a command.
    std::fprintf(stderr, "meshrt: shutdown cannot reach the workers (%s); aborting the job\n", e.what());
    MESHRT_MPI_IGNORE(MPI_Abort(MPI_COMM_WORLD, 1));  // ignored on purpose: it does not return when it works
  }
  // No RequestStatus may follow Exit (the next session would receive it), so wait here
  // without asking again.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  Backoff backoff;
  while (frontier() < ident) {
    poll_replies();
    if (std::chrono::steady_clock::now() > deadline) {
      const std::string report = tracker_.lagging_report(ident);
      MESHRT_LOG(fatal) << "shutdown: workers did not finish within " << timeout.count()
                        << " s; aborting the job:" << report;
      std::fprintf(stderr, "meshrt: shutdown timed out; aborting the job:%s\n", report.c_str());
      // Ignored on purpose: MPI_Abort does not return when it works.
      MESHRT_MPI_IGNORE(MPI_Abort(MPI_COMM_WORLD, 1));
    }
    backoff.pause();
  }
  batcher_.drain(timeout);
  if (unheard) std::rethrow_exception(unheard);
}

}  // namespace meshrt::detail
