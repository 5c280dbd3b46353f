// The controller's machinery: batching, replies, the completion rule and the dependency
// graph (DESIGN.md sections 3 and 8).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <filesystem>
#include <thread>

#include "controller/state.hpp"
#include "meshrt/log.hpp"
#include "meshrt/settings.hpp"
#include "worker/watch.hpp"

namespace meshrt::detail {

std::string describe(const std::source_location& where) {
  return fmt::format("{}:{} ({})", std::filesystem::path(where.file_name()).filename().string(), where.line(),
                     where.function_name());
}

std::vector<int> to_dests(const NDSlice& slice) {
  std::vector<int> out;
  out.reserve(static_cast<std::size_t>(slice.len()));
  for (auto r : slice) out.push_back(static_cast<int>(r));
  std::sort(out.begin(), out.end());
  return out;
}

std::string Node::issued_at() const {
  return describe(where);
}

std::string ControllerState::describe_ident(Ident ident) const {
  auto it = ident_what.find(ident);
  if (it == ident_what.end()) return "?";
  if (!it->second.what.empty()) return fmt::format("{}, issued at {}", it->second.what, describe(it->second.where));
  return it->second.label ? it->second.label : "?";
}

std::int64_t MeshState::dim_index(std::string_view dim) const {
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (names[i] == dim) return static_cast<std::int64_t>(i);
  }
  throw UsageError(
      fmt::format("unknown mesh dimension '{}': the mesh has dimensions [{}]", dim, fmt::join(names, ", ")));
}

TensorState::~TensorState() {
  auto ctl = controller.lock();
  if (!ctl || ctl->epoch != epoch || !home) return;
  if (origin && !dropped) {
    MESHRT_LOG(warning) << "a tensor borrowed on stream '" << stream->name
                        << "' was destroyed without drop(); dropping it now";
    origin->active_borrows--;
    if (borrow_mutable) origin->mutably_borrowed = false;
    ctl->pending_drops.emplace_back(home->dests, ref);
  }
  // Borrows share the origin's value on the workers under their own ref.
  ctl->pending_deletes[home->dests].push_back(ref);
  ctl->pending_delete_count++;
}

ControllerState::ControllerState(MPI_Comm control, int size, NDSlice workers_slice)
    : channel(control), world_size(size), worker_ranks(std::move(workers_slice)) {
  all_dests = to_dests(worker_ranks);
  for (int r : all_dests) workers[r];
  flusher = std::thread([this] {
    log::set_thread_role("controller flusher");
    while (!stop_flusher.load()) {
      std::this_thread::sleep_for(batch_time_limit / 2);
      std::lock_guard lock(batch_mutex);
      if (!batch.empty() && std::chrono::steady_clock::now() - batch_started > batch_time_limit) flush_locked();
    }
  });
}

ControllerState::~ControllerState() {
  stop_flusher.store(true);
  if (flusher.joinable()) flusher.join();
}

void ControllerState::check_epoch(std::uint64_t e, std::string_view what) const {
  if (e != epoch) {
    throw UsageError(fmt::format("this {} was made before restart_workers(); the workers no longer have it", what));
  }
}

std::shared_ptr<Node> ControllerState::make_node(Ident ident, std::string what, const std::source_location& where,
                                                 std::vector<std::shared_ptr<Node>> inputs) {
  auto n = std::make_shared<Node>();
  n->ident = ident;
  n->what = std::move(what);
  n->where = where;
  if (ident != 0) {
    if (auto it = ident_what.find(ident); it != ident_what.end()) {
      it->second.what = n->what;
      it->second.where = where;
    }
  }
  // Inputs already known clean add nothing: drop them so chains stay short.
  for (auto& i : inputs) {
    if (i && !i->clean) n->inputs.push_back(std::move(i));
  }
  young_nodes.push_back(n);
  // A program that never waits still gets its graph pruned.
  if (++nodes_since_prune >= 1024) {
    nodes_since_prune = 0;
    poll_replies();
  }
  return n;
}

void ControllerState::prune() {
  const Ident done = frontier();
  while (!young_nodes.empty()) {
    auto n = young_nodes.front().lock();
    if (!n) {
      young_nodes.pop_front();
      continue;
    }
    if (n->ident != 0 && n->ident > done) break;  // still running somewhere
    const bool failed = n->ident != 0 && failures.count(n->ident) > 0;
    bool inputs_settled = true, inputs_poisoned = false;
    for (const auto& in : n->inputs) {
      if (in->poisoned)
        inputs_poisoned = true;
      else if (!in->clean)
        inputs_settled = false;
    }
    if (failed || inputs_poisoned) {
      n->poisoned = true;
    } else if (inputs_settled) {
      n->clean = true;
      n->inputs.clear();
    } else {
      break;  // an input is still pending (e.g. a borrow's drop comes later)
    }
    young_nodes.pop_front();
  }
  // Futures dropped without get() leave only expired entries behind.
  if (fetches.size() > 1024) std::erase_if(fetches, [](const auto& f) { return f.second.expired(); });
}

std::shared_ptr<StreamState> ControllerState::stream(const std::string& name) {
  auto& s = streams[name];
  if (!s) {
    s = std::make_shared<StreamState>();
    s->controller = weak_from_this();
    s->epoch = epoch;
    s->ref = new_ref();
    s->name = name;
    s->is_default = name == "default";
  }
  return s;
}

void ControllerState::ensure_mesh(MeshState& mesh) {
  check_epoch(mesh.epoch, "mesh");
  if (mesh.created) return;
  mesh.created = true;
  append(mesh.dests, protocol::CreateDeviceMesh{mesh.ref, mesh.names, mesh.ranks, mesh.kind});
}

void ControllerState::ensure_stream(StreamState& stream) {
  check_epoch(stream.epoch, "stream");
  if (stream.created) return;
  stream.created = true;
  append(all_dests, protocol::CreateStream{stream.ref, stream.is_default});
}

void ControllerState::append(const std::vector<int>& dests, protocol::Command c, Ident ident) {
  std::unique_lock lock(batch_mutex);
  if (!batch.empty() && dests != batch_dests) flush_locked();
  if (batch.empty()) {
    batch_dests = dests;
    batch_started = std::chrono::steady_clock::now();
    // Deletes and drops ride ahead of the next command to their ranks.
    if (auto it = pending_deletes.find(dests); it != pending_deletes.end()) {
      pending_delete_count -= it->second.size();
      batch.emplace_back(protocol::DeleteRefs{std::move(it->second)});
      pending_deletes.erase(it);
    }
  }
  batch.push_back(std::move(c));
  if (ident != 0) {
    for (int r : dests) workers[r].outstanding.push_back(ident);
  }
  if (batch.size() >= batch_limit || std::chrono::steady_clock::now() - batch_started > batch_time_limit)
    flush_locked();
  lock.unlock();
  if (pending_delete_count > 4096) flush_deferred();
}

void ControllerState::flush() {
  std::lock_guard lock(batch_mutex);
  flush_locked();
}

void ControllerState::flush_locked() {
  if (batch.empty()) return;
  std::shared_ptr<Bytes> bytes;
  if (batch.size() == 1) {
    bytes = std::make_shared<Bytes>(protocol::encode(batch.front()));
  } else {
    bytes = std::make_shared<Bytes>(protocol::encode(protocol::Command{protocol::CommandGroup{std::move(batch)}}));
  }
  batch.clear();
  channel.send(batch_dests, kCommandTag, std::move(bytes));
}

void ControllerState::flush_deferred() {
  for (auto& [dests, ref] : pending_drops) append(dests, protocol::BorrowDrop{ref});
  pending_drops.clear();
  auto deletes = std::move(pending_deletes);
  pending_deletes.clear();
  pending_delete_count = 0;
  for (auto& [dests, refs] : deletes) append(dests, protocol::DeleteRefs{std::move(refs)});
  flush();
}

void ControllerState::poll_replies() {
  Bytes rx;
  int from = -1;
  while (channel.try_receive(MPI_ANY_SOURCE, kReplyTag, rx, &from)) {
    protocol::Reply reply = protocol::decode_reply(rx);
    WorkerTrack& w = workers[from];
    auto completed = [&w](Ident before) {
      w.reported = std::max(w.reported, before);
      while (!w.outstanding.empty() && w.outstanding.front() < before) w.outstanding.pop_front();
    };
    std::visit(
        [&](auto& r) {
          using R = std::decay_t<decltype(r)>;
          if constexpr (std::is_same_v<R, protocol::Status>) {
            completed(r.first_uncompleted_ident);
            w.live_values = r.live_values;
          } else if constexpr (std::is_same_v<R, protocol::RemoteFunctionFailed>) {
            // A worker reports a failure when the invocation ends, and runs in order.
            // Ident 0 is a failure outside any invocation (kept for synchronize).
            if (r.ident != 0)
              completed(r.ident + 1);
            else
              MESHRT_LOG(error) << "rank " << r.rank << ": " << r.error;
            Failure& f = failures[r.ident];
            f.function = r.function;
            f.message = r.error;
            f.exception_type = r.exception_type;
            f.ranks.insert(r.rank);
          } else if constexpr (std::is_same_v<R, protocol::FetchResult>) {
            completed(r.ident + 1);
            if (auto it = fetches.find(r.ident); it != fetches.end()) {
              if (auto fut = it->second.lock()) fut->value = std::move(r.value);
            }
          } else if constexpr (std::is_same_v<R, protocol::Restarted>) {
            restarted++;
          }
        },
        reply);
  }
  channel.reap();
  // Forget what every worker has finished.
  const Ident done = frontier();
  ident_what.erase(ident_what.begin(), ident_what.upper_bound(done));
  prune();
}

Ident ControllerState::frontier() const {
  Ident f = next_ident - 1;
  for (const auto& [rank, w] : workers) {
    if (!w.outstanding.empty()) f = std::min(f, w.outstanding.front() - 1);
  }
  return f;
}

void ControllerState::request_status(Ident ident) {
  std::vector<int> lagging;
  for (auto& [rank, w] : workers) {
    if (!w.outstanding.empty() && w.outstanding.front() <= ident && w.status_requested < ident) {
      lagging.push_back(rank);
      w.status_requested = ident;
    }
  }
  if (lagging.empty()) return;
  // One batch per rank keeps each rank's commands in order behind what it was sent.
  flush();
  for (int r : lagging) append({r}, protocol::RequestStatus{ident});
  flush();
}

std::string ControllerState::lagging_report(Ident ident) const {
  std::string out;
  for (const auto& [rank, w] : workers) {
    if (w.outstanding.empty() || w.outstanding.front() > ident) continue;
    const Ident on = w.outstanding.front();
    out += fmt::format("\n  rank {}: has not reported invocation {} done ({})", rank, on, describe_ident(on));
  }
  return out;
}

void ControllerState::wait_for(Ident ident, std::optional<std::chrono::duration<double>> timeout,
                               const std::string& what) {
  flush_deferred();
  const auto start = std::chrono::steady_clock::now();
  Backoff backoff;
  for (;;) {
    poll_replies();
    if (frontier() >= ident) return;
    request_status(ident);
    if (timeout && std::chrono::steady_clock::now() - start > *timeout) {
      std::vector<int> missing;
      for (const auto& [rank, w] : workers) {
        if (!w.outstanding.empty() && w.outstanding.front() <= ident) missing.push_back(rank);
      }
      const std::string head = fmt::format("{} did not complete within {:.3g} s: rank{} {} {} not reached it:{}", what,
                                           timeout->count(), missing.size() == 1 ? "" : "s", fmt::join(missing, ", "),
                                           missing.size() == 1 ? "has" : "have", lagging_report(ident));
      const std::string report = desync_report(head);
      MESHRT_LOG(warning) << head << "\n" << report;
      if (settings::get("MESHRT_TIMEOUT_ACTION") == "abort") abort_job(head + "\n" + report);
      throw TimeoutError(head + "\n" + report, missing);
    }
    backoff.pause();
  }
}

std::exception_ptr ControllerState::failure_of(const std::shared_ptr<Node>& root, const std::string& subject) {
  const Ident done = frontier();
  // Iterative search (chains can be long): the failed invocation with the smallest ident.
  struct Item {
    Node* node;
    std::size_t parent;
  };
  std::vector<Item> seen{{root.get(), SIZE_MAX}};
  std::set<Node*> visited{root.get()};
  std::size_t best = SIZE_MAX;
  for (std::size_t i = 0; i < seen.size(); ++i) {
    Node* n = seen[i].node;
    if (n->clean) continue;
    if (n->ident != 0) {
      if (auto f = failures.find(n->ident); f != failures.end()) {
        if (best == SIZE_MAX || n->ident < seen[best].node->ident) best = i;
        continue;
      }
    }
    for (auto& in : n->inputs) {
      if (visited.insert(in.get()).second) seen.push_back({in.get(), i});
    }
  }
  if (best == SIZE_MAX) {
    // Everything reachable is complete and clean: prune, so later checks stop here.
    for (auto& item : seen) {
      Node* n = item.node;
      if (!n->clean && (n->ident == 0 || n->ident <= done)) {
        bool inputs_clean = std::all_of(n->inputs.begin(), n->inputs.end(), [](auto& p) { return p->clean; });
        if (inputs_clean) {
          n->clean = true;
          n->inputs.clear();
        }
      }
    }
    // A second pass catches parents whose inputs became clean above (children come later
    // in `seen`, so walk backwards).
    for (auto it = seen.rbegin(); it != seen.rend(); ++it) {
      Node* n = it->node;
      if (!n->clean && (n->ident == 0 || n->ident <= done) &&
          std::all_of(n->inputs.begin(), n->inputs.end(), [](auto& p) { return p->clean; })) {
        n->clean = true;
        n->inputs.clear();
      }
    }
    return nullptr;
  }
  Node* cause = seen[best].node;
  Failure& f = failures.at(cause->ident);
  f.observed = true;
  const std::vector<int> ranks(f.ranks.begin(), f.ranks.end());
  std::string head =
      fmt::format("{} failed on rank{} {} (invocation {}, issued at {}): {}", f.function, ranks.size() == 1 ? "" : "s",
                  fmt::join(ranks, ", "), cause->ident, cause->issued_at(), f.message);
  std::string text;
  if (cause == root.get()) {
    text = head;
  } else {
    std::vector<std::string> chain;
    for (std::size_t i = best; i != SIZE_MAX; i = seen[i].parent) {
      const Node* n = seen[i].node;
      chain.push_back(n->ident ? fmt::format("{} (invocation {}, {})", n->what, n->ident, n->issued_at())
                               : fmt::format("{} ({})", n->what, n->issued_at()));
    }
    std::reverse(chain.begin(), chain.end());
    text = fmt::format("{} depends on a failed invocation: {}\n  chain: {}", subject, head, fmt::join(chain, " <- "));
  }
  return std::make_exception_ptr(RemoteError(text, cause->ident, f.function, ranks, f.message, cause->issued_at()));
}

}  // namespace meshrt::detail

namespace meshrt::detail {

std::map<int, nlohmann::json> ControllerState::query(nlohmann::json request, std::chrono::duration<double> timeout) {
  const std::uint64_t id = next_query++;
  request["query"] = id;
  const std::string text = request.dump();
  const auto* bytes = reinterpret_cast<const std::byte*>(text.data());
  channel.send(all_dests, kQueryTag, std::make_shared<Bytes>(bytes, bytes + text.size()));
  std::map<int, nlohmann::json> answers;
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::nanoseconds>(timeout);
  Bytes rx;
  int from = -1;
  Backoff backoff;
  while (answers.size() < all_dests.size() && std::chrono::steady_clock::now() < deadline) {
    if (!channel.try_receive(MPI_ANY_SOURCE, kStateTag, rx, &from)) {
      backoff.pause();
      continue;
    }
    try {
      auto j = nlohmann::json::parse(reinterpret_cast<const char*>(rx.data()),
                                     reinterpret_cast<const char*>(rx.data()) + rx.size());
      if (j.value("query", std::uint64_t{0}) == id) answers[from] = std::move(j);  // older answers are stale
    } catch (const std::exception& e) {
      MESHRT_LOG(warning) << "rank " << from << " answered a state query with something unreadable: " << e.what();
    }
  }
  channel.reap();
  return answers;
}

std::string ControllerState::desync_report(const std::string& what) {
  std::chrono::duration<double> wait{2.0};
  try {
    wait = settings::get_seconds("MESHRT_STATE_QUERY_TIMEOUT");
  } catch (const std::exception&) {
  }
  // Each worker writes the end of its flight recorder to its log; then the state table.
  query({{"op", "dump"}, {"limit", 20}, {"why", what.substr(0, what.find(':'))}}, wait);
  const auto states = query({{"op", "state"}}, wait);
  auto current_result = [&](int rank) -> std::uint64_t {
    auto it = states.find(rank);
    if (it == states.end() || it->second["current"].is_null()) return 0;
    return it->second["current"].value("result", std::uint64_t{0});
  };
  // "done before": every invocation this worker was sent before that ident has finished.
  auto done_before = [](const nlohmann::json& st) {
    const auto f = st.value("first_uncompleted", 0ull);
    return f == 0 ? std::string("-") : std::to_string(f);
  };
  std::string out = "desync report: what every worker is doing now\n";
  out += fmt::format("  {:>5}  {:>11}  {:>9}  {}\n", "rank", "done before", "for", "current command");
  for (int rank : all_dests) {
    auto it = states.find(rank);
    if (it == states.end()) {
      out +=
          fmt::format("  {:>5}  no answer within {:.3g} s (the process may be stopped or gone)\n", rank, wait.count());
      continue;
    }
    const nlohmann::json& st = it->second;
    const nlohmann::json& cur = st["current"];
    if (cur.is_null()) {
      out += fmt::format("  {:>5}  {:>11}  {:>9}  idle ({} queued)\n", rank, done_before(st), "",
                         st.value("queued", 0ull));
      continue;
    }
    std::string cmd = cur.value("kind", std::string("?"));
    const auto ident_of = cur.value("ident", 0ull);
    auto w = ident_of ? ident_what.find(ident_of) : ident_what.end();
    if (w != ident_what.end()) {
      cmd += fmt::format(" {} (invocation {})", describe_ident(ident_of), ident_of);
    } else {
      if (const auto n = cur.value("name", std::string()); !n.empty()) cmd += " " + n;
      if (ident_of) cmd += fmt::format(" (invocation {})", ident_of);
    }
    const std::uint64_t result = cur.value("result", std::uint64_t{0});
    std::vector<int> waiting;
    if (cur.contains("peers") && result != 0) {
      for (int p : cur["peers"].get<std::vector<int>>()) {
        if (p != rank && current_result(p) != result) waiting.push_back(p);
      }
    }
    if (!waiting.empty())
      cmd += fmt::format("; waiting for rank{} {} to join", waiting.size() == 1 ? "" : "s", fmt::join(waiting, ", "));
    out += fmt::format("  {:>5}  {:>11}  {:>7.3f} s  {}\n", rank, done_before(st), cur.value("seconds", 0.0), cmd);
  }
  return out;
}

void ControllerState::abort_job(const std::string& reason) {
  MESHRT_LOG(fatal) << "aborting the job: " << reason;
  std::fprintf(stderr, "meshrt: aborting the job: %s\n", reason.c_str());
  std::fflush(stderr);
  query({{"op", "abort"}, {"reason", reason}}, std::chrono::milliseconds(500));
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();
}

}  // namespace meshrt::detail
