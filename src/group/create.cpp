// Making a group: its options, create() and from_comm() (a communicator made only after
// the members agree), and its accessors.
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>

#include "common/checks.hpp"
#include "common/comm_creation.hpp"
#include "group/impl.hpp"
#include "meshrt/internal/mpi_session.hpp"
#include "meshrt/internal/settings.hpp"

namespace meshrt {

namespace group_internal {

Seconds option_timeout(const GroupOptions& o) {
  if (o.timeout) {
    if (o.timeout->count() < 0)
      throw UsageError(fmt::format("GroupOptions::timeout: expected >= 0 s, found {} s", o.timeout->count()));
    return o.timeout->count() == 0 ? Seconds::max() : *o.timeout;
  }
  return settings::kGroupTimeout.get();
}

std::size_t option_chunk(const GroupOptions& o) {
  const std::int64_t c = o.chunk_bytes ? static_cast<std::int64_t>(*o.chunk_bytes) : settings::kGroupChunkBytes.get();
  if (c < 1 || c > INT32_MAX) {
    throw UsageError(fmt::format("group chunk size: expected 1..{} bytes (an MPI count is an int), found {}{}",
                                 INT32_MAX, c, o.chunk_bytes ? " in GroupOptions" : " in MESHRT_GROUP_CHUNK_BYTES"));
  }
  return static_cast<std::size_t>(c);
}

void require_mpi(const char* op) {
  mpi_session::require_running(fmt::format("StatelessGroup::{}", op).c_str());
}

}  // namespace group_internal

using namespace group_internal;

namespace {

// MPI_Comm_create_group and MPI_Comm_dup have no timeout: the members first agree, on the
// parent communicator with tag GroupOptions::create_tag (detail::CreationAgreement).
detail::CreationAgreement creation_agreement(const char* op, MPI_Comm parent, int me, const std::vector<int>& members,
                                             int tag, Seconds timeout) {
  detail::CreationWording wording{
      .op = op,
      .rank = [](int r) { return fmt::format("parent rank {}", r); },
      .ranks =
          [](const std::vector<int>& v) {
            return fmt::format("parent rank{} {}", v.size() == 1 ? "" : "s", int_list(v));
          },
      .what = "the group " + int_list(members),
      .late = fmt::format("(not called with this member list and tag {} within the timeout)", tag)};
  return detail::CreationAgreement(std::move(wording), parent, me, members, tag, timeout);
}

}  // namespace

StatelessGroup::StatelessGroup(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
StatelessGroup::StatelessGroup(StatelessGroup&&) noexcept = default;
StatelessGroup& StatelessGroup::operator=(StatelessGroup&&) noexcept = default;
StatelessGroup::~StatelessGroup() = default;

std::unique_ptr<StatelessGroup::Impl> StatelessGroup::make_impl(MPI_Comm comm, std::vector<int> parent_ranks,
                                                                const GroupOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->comm = comm;  // owned from here on: freed by ~Impl even if the rest throws
  detail::set_error_policy(comm);
  MESHRT_MPI_CHECK(MPI_Comm_rank(comm, &impl->who.rank));
  MESHRT_MPI_CHECK(MPI_Comm_size(comm, &impl->who.size));
  impl->who.parent_ranks = std::move(parent_ranks);
  impl->timeout = option_timeout(options);
  impl->chunk = option_chunk(options);
  return impl;
}

StatelessGroup StatelessGroup::create(const std::vector<int>& members, MPI_Comm parent, const GroupOptions& options) {
  require_mpi("create");
  int parent_rank = 0, parent_size = 0;
  MESHRT_MPI_CHECK(MPI_Comm_rank(parent, &parent_rank));
  MESHRT_MPI_CHECK(MPI_Comm_size(parent, &parent_size));
  std::vector<int> sorted = members;
  std::sort(sorted.begin(), sorted.end());
  if (members.empty() || sorted.front() < 0 || sorted.back() >= parent_size ||
      std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
    throw UsageError(
        fmt::format("StatelessGroup::create on parent rank {}: expected distinct parent ranks in 0..{}, "
                    "found {}",
                    parent_rank, parent_size - 1, int_list(members)));
  }
  if (!std::binary_search(sorted.begin(), sorted.end(), parent_rank)) {
    throw UsageError(
        fmt::format("StatelessGroup::create on parent rank {}: only members call it, and {} does not "
                    "contain this rank",
                    parent_rank, int_list(members)));
  }
  if (options.create_tag < 0) {
    throw UsageError(fmt::format("StatelessGroup::create on parent rank {}: expected a create_tag >= 0, found {}",
                                 parent_rank, options.create_tag));
  }
  auto creation_lock = creation_agreement("StatelessGroup::create", parent, parent_rank, members, options.create_tag,
                                          option_timeout(options))
                           .run();
  MPI_Group parent_group = MPI_GROUP_NULL, group = MPI_GROUP_NULL;
  MESHRT_MPI_CHECK(MPI_Comm_group(parent, &parent_group));
  const int rc = MPI_Group_incl(parent_group, static_cast<int>(members.size()), members.data(), &group);
  MESHRT_MPI_IGNORE(MPI_Group_free(&parent_group));  // rc is the one to report
  MESHRT_MPI_CHECK(rc);
  MPI_Comm comm = MPI_COMM_NULL;
  const int rc2 = MPI_Comm_create_group(parent, group, options.create_tag, &comm);
  creation_lock.unlock();
  MESHRT_MPI_IGNORE(MPI_Group_free(&group));
  MESHRT_MPI_CHECK(rc2);
  return StatelessGroup(make_impl(comm, members, options));
}

StatelessGroup StatelessGroup::from_comm(MPI_Comm comm, const GroupOptions& options) {
  require_mpi("from_comm");
  int inter = 0;
  MESHRT_MPI_CHECK(MPI_Comm_test_inter(comm, &inter));
  if (inter) {
    throw UsageError(
        "StatelessGroup::from_comm: expected an intracommunicator, found an intercommunicator "
        "(merge it with MPI_Intercomm_merge first)");
  }
  int size = 0, me = 0;
  MESHRT_MPI_CHECK(MPI_Comm_size(comm, &size));
  MESHRT_MPI_CHECK(MPI_Comm_rank(comm, &me));
  std::vector<int> parent(static_cast<std::size_t>(size));
  for (int i = 0; i < size; ++i) parent[static_cast<std::size_t>(i)] = i;
  MPI_Comm dup = MPI_COMM_NULL;
  {
    const auto creation_lock =
        creation_agreement("StatelessGroup::from_comm", comm, me, parent, options.create_tag, option_timeout(options))
            .run();
    MESHRT_MPI_CHECK(MPI_Comm_dup(comm, &dup));
  }
  return StatelessGroup(make_impl(dup, std::move(parent), options));
}

// ---- accessors ----------------------------------------------------------------------

int StatelessGroup::rank() const {
  return impl_->who.rank;
}
int StatelessGroup::world_size() const {
  return impl_->who.size;
}
int StatelessGroup::parent_rank(int i) const {
  impl_->who.check_peer("parent_rank", i, "group");
  return impl_->who.parent_ranks[static_cast<std::size_t>(i)];
}
std::vector<int> StatelessGroup::members() const {
  return impl_->who.parent_ranks;
}
bool StatelessGroup::usable() const {
  return impl_ && impl_->comm != MPI_COMM_NULL && impl_->unusable_after.empty();
}
MPI_Comm StatelessGroup::comm() const {
  return impl_->comm;
}
std::chrono::duration<double> StatelessGroup::default_timeout() const {
  return impl_->timeout;
}
std::size_t StatelessGroup::chunk_bytes() const {
  return impl_->chunk;
}
std::string& StatelessGroup::scratch() {
  return impl_->buf->scratch;
}
void StatelessGroup::disconnect() {
  if (impl_) impl_->release();
}

std::string StatelessGroup::where(const char* op, int peer) const {
  return fmt::format("{} on {} from {}", op, impl_->who.me(), impl_->who.peer(peer));
}

}  // namespace meshrt
