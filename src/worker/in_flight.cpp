#include "worker/in_flight.hpp"

#include <fmt/format.h>

#include <boost/core/demangle.hpp>

#include <algorithm>
#include <string>
#include <typeinfo>

#include "meshrt/log.hpp"
#include "worker/env.hpp"
#include "worker/monitor.hpp"
#include "worker/reporter.hpp"

namespace meshrt::detail {

using namespace protocol;

InFlight::InFlight(Monitor& monitor, const WorkerOptions& options)
    : monitor_(monitor),
      rank_(options.rank),
      blocking_(options.status_parent == kNoStatusTree && options.block_in_mpi) {}

void InFlight::start(std::unique_ptr<Pending> op, std::optional<Ref> result, std::uint64_t seq, std::string_view kind,
                     Ident ident, std::optional<std::size_t> cpu_bytes, Footprint footprint) {
  const bool on_comm_thread = cpu_bytes && !blocking_ && *cpu_bytes >= kThreadMinBytes;
  current_.emplace(Current{std::move(op), result, seq, on_comm_thread, kind, ident, std::move(footprint)});
  monitor_.in_flight(seq);
}

namespace {

bool contains(const Footprint::Ids& ids, std::uint64_t id) {
  return std::find(ids.begin(), ids.end(), id) != ids.end();
}

}  // namespace

bool InFlight::admits(const Command& command) const {
  const Footprint& f = current_->footprint;
  // Reading what it writes, or writing (defining, mutating, deleting) what it touches.
  auto reads = [&](Ref r) { return contains(f.writes, r.id); };
  auto writes = [&](Ref r) { return contains(f.writes, r.id) || contains(f.reads, r.id); };
  auto reads_value = [&](const Value& v) {
    bool found = false;
    v.for_each_leaf([&](const Value& leaf) { found = found || (leaf.is_ref() && reads(leaf.as_ref())); });
    return found;
  };
  auto any = [](const std::vector<Ref>& refs, auto&& pred) { return std::any_of(refs.begin(), refs.end(), pred); };
  if (const auto* c = std::get_if<CallFunction>(&command)) {
    return c->stream.id != f.stream && !any(c->results, writes) && !any(c->mutates, writes) &&
           std::none_of(c->args.begin(), c->args.end(), reads_value);
  }
  if (const auto* c = std::get_if<FetchValue>(&command)) {
    return c->stream.id != f.stream && !any(c->mutates, writes) && !reads_value(c->value);
  }
  if (const auto* c = std::get_if<DeleteRefs>(&command)) return !any(c->refs, writes);
  // A borrow aliases its tensor under another ref: made, first used or dropped only when
  // the operation touches neither. (On the cpu, after a drop the origin stream uses the
  // tensor again under its own ref, which the operation's footprint does not name.)
  if (const auto* c = std::get_if<BorrowCreate>(&command)) return !writes(c->tensor);
  if (const auto* c = std::get_if<BorrowFirstUse>(&command)) return !writes(c->borrow);
  if (const auto* c = std::get_if<BorrowDrop>(&command)) return !writes(c->borrow);
  // A mesh's creation waits: it agrees with its members (MESHRT_GROUP_TIMEOUT), and would
  // hold this loop, and the operation's deadline, that long.
  return std::holds_alternative<CreateStream>(command) || std::holds_alternative<RequestStatus>(command);
}

bool InFlight::poll(Env& env, Reporter& reporter) {
  bool done = false;
  try {
    done = current_->op->test();
  } catch (...) {
    fail(env, reporter);
    return true;
  }
  if (done) finish(env, reporter);
  return done;
}

void InFlight::finish(Env& env, Reporter& reporter) {
  Outcome out;
  try {
    out = current_->op->take();
  } catch (...) {
    fail(env, reporter);
    return;
  }
  monitor_.in_flight(0);
  monitor_.finished(current_->seq, false);
  if (current_->result) {
    if (out.broken)
      env.define(*current_->result, *out.broken);
    else
      env.define(*current_->result, std::move(out.tensor));
  }
  if (current_->ident != 0) reporter.passed(current_->ident);
  current_.reset();
}

// - On the comm thread: wait in the Pending's idle() (a condition variable), which returns
//   the moment the job is done, for at most kControl.max_sleep between polls: no spinning
//   or yielding beside the comm thread and the peer ranks.
// - Non-blocking (MPI_I*, below kThreadMinBytes): it progresses only inside MPI calls, so
//   kInFlight's policy: a short spin, yields, then short sleeps.
void InFlight::pause(Backoff& flight) {
  if (current_->on_comm_thread) {
    current_->op->idle(kControl.max_sleep);
    return;
  }
  flight.pause([this](std::chrono::microseconds d) { current_->op->idle(d); });
}

// An input that does not match its factory, an MPI or device error: that command fails,
// the worker goes on. Its result becomes a failure marker, and the controller hears of it
// with the command's ident (ident 0, tied to no invocation, is raised at the next
// synchronize).
void InFlight::fail(Env& env, Reporter& reporter) {
  std::string message, type;
  try {
    throw;
  } catch (const std::exception& e) {
    message = e.what();
    type = boost::core::demangle(typeid(e).name());
  } catch (...) {
    message = "an exception not derived from std::exception";
    type = "unknown";
  }
  std::string what;
  try {
    what = current_->op->describe();
  } catch (...) {
    what = "the operation in flight";
  }
  MESHRT_LOG(error) << "rank " << rank_ << ": " << what << " failed: " << message;
  const Ident ident = current_->ident;
  if (current_->result) env.define(*current_->result, DependentOnError{ident});
  reporter.reply(RemoteFunctionFailed{.ident = ident,
                                      .error = fmt::format("{} failed on rank {}: {}", what, rank_, message),
                                      .rank = rank_,
                                      .function = std::string(current_->kind),
                                      .exception_type = type});
  monitor_.in_flight(0);
  monitor_.finished(current_->seq, true);
  if (ident != 0) reporter.passed(ident);
  current_.reset();
}

}  // namespace meshrt::detail
