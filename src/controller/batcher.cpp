#include "controller/batcher.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <utility>

#include "common/trace.hpp"
#include "meshrt/error.hpp"
#include "meshrt/internal/settings.hpp"
#include "meshrt/log.hpp"

namespace meshrt::detail {

namespace {
std::atomic<std::size_t> payload_limit_override{0};
}  // namespace

void set_payload_limit(std::size_t bytes) noexcept {
  payload_limit_override.store(bytes, std::memory_order_relaxed);
}

std::size_t payload_limit() noexcept {
  const std::size_t o = payload_limit_override.load(std::memory_order_relaxed);
  return o != 0 ? o : kControlMessageLimit - kCommandRoom;
}

Batcher::Batcher(std::shared_ptr<control::Transport> transport) : transport_(std::move(transport)) {
  fanout_ = static_cast<std::size_t>(settings::kFanout.get());  // both settings take counts >= 0
  fanout_threshold_ = static_cast<std::size_t>(settings::kFanoutThreshold.get());
  flusher_ = std::thread([this] {
    log::set_thread_role("controller flusher");
    std::unique_lock lock(mutex_);
    // Set from the wake-up a batch's start gives until that batch's deadline: the program
    // usually flushes the batch itself before this thread even runs (a fetch does at
    // once), and parking again then would cost a wake-up per batch.
    bool started = false;
    while (!stop_flusher_) {
      if ((batch_.empty() && !started) || flusher_failure_) {
        // Nothing to flush, or a batch this thread could not send (the controller's thread
        // raises its error and sends it again): sleep until a batch starts.
        flusher_parked_ = true;
        flusher_wake_.wait(lock);
        flusher_parked_ = false;
        started = true;
        ++flusher_wakeups_;
        continue;
      }
      // Until the deadline of the batch now (or last) started; the next turn flushes it
      // if the program left it alone, else finds a younger batch, or parks.
      if (const auto deadline = batch_started_ + batch_time_limit_; std::chrono::steady_clock::now() < deadline) {
        flusher_wake_.wait_until(lock, deadline);
        ++flusher_wakeups_;
        continue;
      }
      started = false;
      try {
        flush_locked();  // nothing when the batch is empty
      } catch (...) {
        // Never out of this thread (std::terminate): the controller's next call raises it.
        flusher_failure_ = std::current_exception();
        failed_.store(true, std::memory_order_release);
      }
    }
  });
}

Batcher::~Batcher() {
  {
    std::lock_guard lock(mutex_);
    stop_flusher_ = true;
  }
  flusher_wake_.notify_one();
  if (flusher_.joinable()) flusher_.join();
}

std::uint64_t Batcher::flusher_wakeups() {
  std::lock_guard lock(mutex_);
  return flusher_wakeups_;
}

void Batcher::take_failure() {
  if (!failed_.load(std::memory_order_acquire)) return;  // one load per command, no lock
  std::exception_ptr failure;
  std::size_t commands = 0;
  std::vector<int> dests;
  {
    std::lock_guard lock(mutex_);
    failed_.store(false, std::memory_order_relaxed);
    failure = std::exchange(flusher_failure_, nullptr);
    commands = batch_.size();
    dests = batch_dests_;
  }
  if (!failure) return;
  std::string what = "an exception not derived from std::exception";
  try {
    std::rethrow_exception(failure);
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
  }
  throw Error(fmt::format(
      "the controller's flusher thread could not send a batch of {} command{} to ranks [{}]: {}; the batch stays "
      "queued and is sent again with the next call that sends",
      commands, commands == 1 ? "" : "s", fmt::join(dests, ", "), what));
}

void Batcher::append(const std::vector<int>& dests, protocol::Command&& c, std::size_t payload) {
  take_failure();
  std::unique_lock lock(mutex_);
  if (flusher_failure_) {
    // The flusher failed while this call waited for the lock (it holds it while it sends).
    lock.unlock();
    take_failure();
    lock.lock();
  }
  if (!batch_.empty() && (dests != batch_dests_ || batch_payload_ + payload > payload_limit())) flush_locked();
  if (batch_.empty()) {
    batch_dests_ = dests;
    batch_started_ = std::chrono::steady_clock::now();
    if (flusher_parked_) flusher_wake_.notify_one();
  }
  // Deletes ride ahead of the next command to their ranks, inside a batch too: a loop of
  // collectives in one batch then frees each output before the next one needs a buffer,
  // so the output pool hands it back warm instead of a fresh (cold) allocation per call.
  // The deletes of any ranks among `dests` ride along, not only those of exactly these
  // ranks: a loop of to_mesh sends goes to the union of both meshes while its outputs die
  // on the destination mesh alone, and each receive would otherwise take a cold buffer
  // until the next synchronize. A rank that does not hold a ref ignores its delete (refs
  // are unique to the session). Measured: docs/benchmarks.md, "Older figures".
  if (pending_delete_count_ > 0) ride_deletes(dests);
  batch_.push_back(std::move(c));
  batch_payload_ += payload;
  // The age is checked every 16th command (the flusher thread also flushes a batch past
  // its time limit): a clock read per command shows in the controller's profile.
  if (batch_.size() >= batch_limit_ ||
      (batch_.size() % 16 == 0 && std::chrono::steady_clock::now() - batch_started_ > batch_time_limit_)) {
    try {
      flush_locked();
    } catch (...) {
      // `c` is queued (the caller counts it sent): the next call raises the error.
      flusher_failure_ = std::current_exception();
      failed_.store(true, std::memory_order_release);
    }
  }
  lock.unlock();
  if (pending_delete_count_ > 4096) flush_deferred();
}

void Batcher::ride_deletes(const std::vector<int>& dests) {
  // An emptied entry keeps its place (its key, a copy of the ranks): a loop's outputs die
  // under the same ranks every time, and erasing and re-inserting the entry would cost two
  // allocations and two frees per delete. defer_delete bounds the empty entries.
  if (auto it = pending_deletes_.find(dests); it != pending_deletes_.end() && it->second.rides())
    batch_.emplace_back(protocol::DeleteRefs{take(it->second)});
  // Subsets, when both rank lists are sorted (meshes list their ranks in layout order,
  // which a permuted mesh does not sort): std::includes needs sorted ranges.
  if (pending_delete_count_ == 0 || !std::is_sorted(dests.begin(), dests.end())) return;
  std::vector<Ref> refs;
  for (auto& [owners, pending] : pending_deletes_) {
    if (pending.rides() && owners.size() < dests.size() && std::is_sorted(owners.begin(), owners.end()) &&
        std::includes(dests.begin(), dests.end(), owners.begin(), owners.end())) {
      const std::vector<Ref> taken = take(pending);
      refs.insert(refs.end(), taken.begin(), taken.end());
    }
  }
  if (!refs.empty()) batch_.emplace_back(protocol::DeleteRefs{std::move(refs)});
}

std::vector<Ref> Batcher::take(PendingDeletes& p) {
  pending_delete_count_ -= p.refs.size();
  std::vector<Ref> refs = std::move(p.refs);
  p.refs.clear();  // moved from: valid, made empty
  p.due = false;
  return refs;
}

void Batcher::flush() {
  take_failure();
  std::lock_guard lock(mutex_);
  flush_locked();
}

void Batcher::flush_locked() {
  if (batch_.empty()) return;
  // MESHRT_TRACE: the batch as a span of the controller's track, however it is sent.
  struct Traced {
    std::int64_t start;
    std::uint64_t commands, ranks, bytes = 0;
    ~Traced() {
      if (start == 0) return;
      trace::Event e;
      e.kind = trace::Kind::Flush;
      e.start_ns = start;
      e.end_ns = trace::now_ns();
      e.a = bytes;
      e.b = commands;
      e.c = ranks;
      trace::record(e);
    }
  } traced{trace::enabled() ? trace::now_ns() : 0, batch_.size(), batch_dests_.size()};
  // A batch that cannot be encoded or sent stays queued, in order, for the next flush:
  // nothing is dropped, and the error is the caller's (or, from the flusher thread, the
  // controller's next call's).
  std::shared_ptr<control::Bytes> bytes;
  if (batch_.size() == 1) {
    bytes = std::make_shared<control::Bytes>(protocol::encode(batch_.front()));
  } else {
    protocol::Command group{protocol::CommandGroup{std::move(batch_)}};
    struct Restore {
      protocol::Command& group;
      std::vector<protocol::Command>& batch;
      ~Restore() { batch = std::move(std::get<protocol::CommandGroup>(group).commands); }
    } restore{group, batch_};
    bytes = std::make_shared<control::Bytes>(protocol::encode(group));
  }
  traced.bytes = bytes->size();
  send_locked(std::move(bytes));
  batch_.clear();
  batch_payload_ = 0;
}

void Batcher::send_locked(std::shared_ptr<control::Bytes> bytes) {
  if (fanout_ == 0) {
    transport_->send(batch_dests_, control::Tag::Command, std::move(bytes));
    return;
  }
  // Every message is numbered per rank, so a rank that hears from the controller and from
  // parents runs them in the order sent. A batch below the threshold to ranks that never
  // heard from a parent goes bare, as the next number of each: it comes straight from the
  // controller, behind everything else sent to them (MPI keeps one sender's order), so
  // the number needs no envelope (which cost a second encode and copy here, and a decode
  // and a reorder map on every worker, per batch).
  const std::size_t n = batch_dests_.size();
  const bool tree = n > fanout_threshold_;
  if (!tree && std::none_of(batch_dests_.begin(), batch_dests_.end(), [&](int r) { return treed_.contains(r); })) {
    transport_->send(batch_dests_, control::Tag::Command, std::move(bytes));
    for (int r : batch_dests_) ++sent_seq_[r];  // once sent: a batch sent again keeps its numbers
    return;
  }
  // One envelope for every destination: below the threshold its fanout is its size, so
  // the controller is every rank's parent; above it, the controller sends to the first
  // `fanout_` ranks and they forward (and those ranks are enveloped from then on).
  protocol::Envelope e;
  e.fanout = static_cast<std::uint32_t>(tree ? fanout_ : n);
  e.ranks.assign(batch_dests_.begin(), batch_dests_.end());
  e.seqs.reserve(n);
  for (int r : batch_dests_) {
    const auto it = sent_seq_.find(r);
    e.seqs.push_back((it == sent_seq_.end() ? 0 : it->second) + 1);
  }
  e.payload = std::move(*bytes);
  auto envelope = std::make_shared<control::Bytes>(protocol::encode(e));
  const auto [first, end] = protocol::tree_children(n, e.fanout, -1);
  transport_->send(std::vector<int>(batch_dests_.begin() + static_cast<std::ptrdiff_t>(first),
                                    batch_dests_.begin() + static_cast<std::ptrdiff_t>(end)),
                   control::Tag::Command, std::move(envelope));
  // Once sent: a batch sent again keeps its numbers.
  for (int r : batch_dests_) ++sent_seq_[r];
  if (tree) treed_.insert(batch_dests_.begin(), batch_dests_.end());
}

void Batcher::defer_delete(const std::vector<int>& dests, Ref ref, std::optional<std::size_t> value_bytes) {
  // Borrows share the origin's value on the workers under their own ref.
  // Emptied entries stay (ride_deletes) until there are many of them: a program that
  // drops values on many different rank sets must not make every ride scan them all.
  if (pending_deletes_.size() > 64)
    std::erase_if(pending_deletes_, [](const auto& e) { return e.second.refs.empty(); });
  PendingDeletes& p = pending_deletes_[dests];
  p.refs.push_back(ref);
  p.due = p.due || !value_bytes || *value_bytes > kSmallDeleteBytes;
  pending_delete_count_++;
}

void Batcher::flush_deferred() {
  take_failure();
  // Each entry leaves once its deletes are queued: a flush that fails on the way keeps
  // the rest (and that entry) for the next call.
  while (!pending_deletes_.empty()) {
    const auto it = pending_deletes_.begin();
    const std::vector<int> dests = it->first;
    std::vector<Ref> refs = take(it->second);
    pending_deletes_.erase(it);
    if (refs.empty()) continue;
    try {
      append(dests, protocol::DeleteRefs{refs});
    } catch (...) {
      PendingDeletes& p = pending_deletes_[dests];
      p.refs.insert(p.refs.end(), refs.begin(), refs.end());
      p.due = true;
      pending_delete_count_ += refs.size();
      throw;
    }
  }
  flush();
}

bool Batcher::try_receive_reply(protocol::Reply& reply, int& from) {
  if (!transport_->try_receive(control::kAnySource, control::Tag::Reply, rx_, &from)) return false;
  reply = protocol::decode_reply(rx_);
  return true;
}

void Batcher::send_query(const std::vector<int>& dests, const protocol::Query& query) {
  transport_->send(dests, control::Tag::Query, std::make_shared<control::Bytes>(protocol::encode(query)));
}

bool Batcher::try_receive_answer(protocol::QueryAnswer& answer, int& from) {
  if (!transport_->try_receive(control::kAnySource, control::Tag::Answer, rx_, &from)) return false;
  answer = protocol::decode_query_answer(rx_);
  return true;
}

void Batcher::reap() {
  transport_->reap();
}

bool Batcher::drain(std::chrono::duration<double> timeout) {
  return transport_->drain(timeout);
}

void Batcher::restart() {
  // The workers' fresh loops number their messages from 1 again.
  sent_seq_.clear();
  treed_.clear();
  pending_deletes_.clear();
  pending_delete_count_ = 0;
}

}  // namespace meshrt::detail
