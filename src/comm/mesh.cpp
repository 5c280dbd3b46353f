#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <functional>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "comm/mesh_impl.hpp"
#include "common/checks.hpp"
#include "common/comm_creation.hpp"
#include "meshrt/internal/comm.hpp"
#include "meshrt/internal/settings.hpp"

namespace meshrt {
namespace {

// MPI_Comm_create_group's tag only separates concurrent creations on one communicator
// by different threads; every mesh is created from the worker thread, in command order.
// The members' agreement before it has a tag of its own on the same parent.
constexpr int kCreateGroupTag = 0x6d73;
constexpr int kAgreeMeshTag = 0x6d74;
// A line's, on the mesh's communicator: one tag per dimension, so that what a failed
// agreement left over is never taken for another dimension's.
constexpr int kAgreeLineTag = 0x6c00;
constexpr int kCreateLineTag = 0x6b00;
// A set of several dimensions': a tag per set (its mask, folded into 11 bits, within the
// 32767 every MPI allows), for the same reason.
constexpr int kAgreeSetTag = 0x7000;
constexpr int kCreateSetTag = 0x7800;
constexpr std::uint64_t kSetTagMask = 0x7ff;

std::string join_names(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "'" : ", '") + n + "'";
  return out;
}

}  // namespace

namespace {
// Communicators the meshes of this process hold (the soak checks it stays flat).
std::atomic<std::int64_t> g_live_communicators{0};

std::string world_rank_list(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
  return out;
}
}  // namespace

MPI_Comm create_agreed(const std::string& what, MPI_Comm parent, int me, const std::vector<int>& members,
                       const std::function<int(int)>& world_of, int agree_tag, int create_tag) {
  const std::chrono::duration<double> timeout = settings::kGroupTimeout.get();
  std::vector<int> world;
  for (int r : members) world.push_back(world_of(r));
  const auto ranks = [world_of](const std::vector<int>& v) {
    std::vector<int> w;
    for (int r : v) w.push_back(world_of(r));
    return fmt::format("world rank{} {}", w.size() == 1 ? "" : "s", world_rank_list(w));
  };
  detail::CreationWording wording{.op = "creating " + what,
                                  .rank = [world_of](int r) { return fmt::format("world rank {}", world_of(r)); },
                                  .ranks = ranks,
                                  .what = fmt::format("it (world ranks {})", world_rank_list(world)),
                                  .late = fmt::format("within {:g} s (MESHRT_GROUP_TIMEOUT): it is not at this command "
                                                      "yet, or stuck before it (its flight recorder "
                                                      "says where); a longer MESHRT_GROUP_TIMEOUT waits longer",
                                                      timeout.count())};
  detail::CreationAgreement agreement(std::move(wording), parent, me, members, agree_tag, timeout);
  MPI_Group parent_group = MPI_GROUP_NULL;
  MPI_Group group = MPI_GROUP_NULL;
  MESHRT_MPI_CHECK(MPI_Comm_group(parent, &parent_group));
  int rc = MPI_Group_incl(parent_group, static_cast<int>(members.size()), members.data(), &group);
  MESHRT_MPI_IGNORE(MPI_Group_free(&parent_group));  // rc is the one to report
  MESHRT_MPI_CHECK(rc);
  MPI_Comm comm = MPI_COMM_NULL;
  try {
    // Every member is known to enter the creation now, each holding its creation lock.
    const auto lock = agreement.run();
    rc = MPI_Comm_create_group(parent, group, create_tag, &comm);
  } catch (...) {
    MESHRT_MPI_IGNORE(MPI_Group_free(&group));
    throw;
  }
  MESHRT_MPI_IGNORE(MPI_Group_free(&group));
  MESHRT_MPI_CHECK(rc);
  return comm;
}

std::int64_t WorkerMesh::live_communicators() noexcept {
  return g_live_communicators.load();
}

WorkerMesh::WorkerMesh(std::vector<std::string> names, NDSlice ranks, MPI_Comm world)
    : impl_(std::make_unique<Impl>(Impl{std::move(names), std::move(ranks), {}, -1, MPI_COMM_NULL, {}})) {
  Impl& m = *impl_;
  MESHRT_MPI_CHECK(MPI_Comm_rank(world, &m.world_rank));
  int world_size = 0;
  MESHRT_MPI_CHECK(MPI_Comm_size(world, &world_size));
  // Every check below fails alike on every member (they all see the same command), so
  // throwing before the collective creation cannot leave a member waiting.
  if (m.names.size() != m.ranks.ndim()) {
    throw UsageError(
        fmt::format("device mesh: expected one name per dimension of the ranks {} ({}), found {} names "
                    "[{}] (world rank {})",
                    m.ranks.to_string(), m.ranks.ndim(), m.names.size(), join_names(m.names), m.world_rank));
  }
  std::set<std::string> seen;
  for (const auto& n : m.names) {
    if (n.empty()) {
      throw UsageError(fmt::format("device mesh: expected non-empty dimension names, found [{}] (world rank {})",
                                   join_names(m.names), m.world_rank));
    }
    if (!seen.insert(n).second) {
      throw UsageError(
          fmt::format("device mesh: expected unique dimension names, found '{}' twice in [{}] (world "
                      "rank {})",
                      n, join_names(m.names), m.world_rank));
    }
  }
  const std::vector<NDSlice::Int> members = m.ranks.to_vector();
  const auto max_rank = *std::max_element(members.begin(), members.end());
  if (max_rank >= world_size) {
    throw UsageError(
        fmt::format("device mesh: expected ranks below the world size {}, found rank {} in {} (world "
                    "rank {})",
                    world_size, max_rank, m.ranks.to_string(), m.world_rank));
  }
  if (!m.ranks.contains(m.world_rank)) {
    throw UsageError(
        fmt::format("device mesh: world rank {} is not a member of {}; only members construct a "
                    "WorkerMesh",
                    m.world_rank, m.ranks.to_string()));
  }
  m.coords = m.ranks.coordinates(m.world_rank);
  m.dim_comms.assign(m.ranks.ndim(), MPI_COMM_NULL);

  // Members in row-major order, so that the mesh communicator's rank is the index.
  std::vector<int> group_ranks(members.begin(), members.end());
  m.comm = create_agreed(
      fmt::format("device mesh {}", to_string()), world, m.world_rank, group_ranks, [](int r) { return r; },
      kAgreeMeshTag, kCreateGroupTag);
  if (m.comm != MPI_COMM_NULL) g_live_communicators++;
  detail::set_error_policy(m.comm);  // and the splits inherit it (set again there)
}

WorkerMesh::~WorkerMesh() {
  if (!impl_) return;
  // A destructor cannot raise; a failed free leaves nothing to act on.
  for (MPI_Comm& c : impl_->dim_comms) {
    if (c != MPI_COMM_NULL) {
      MESHRT_MPI_IGNORE(MPI_Comm_free(&c));
      g_live_communicators--;
    }
  }
  for (auto& [mask, c] : impl_->set_comms) {
    if (c != MPI_COMM_NULL) {
      MESHRT_MPI_IGNORE(MPI_Comm_free(&c));
      g_live_communicators--;
    }
  }
  if (impl_->comm != MPI_COMM_NULL) {
    MESHRT_MPI_IGNORE(MPI_Comm_free(&impl_->comm));
    g_live_communicators--;
  }
}

const std::vector<std::string>& WorkerMesh::names() const noexcept {
  return impl_->names;
}
const NDSlice& WorkerMesh::ranks() const noexcept {
  return impl_->ranks;
}
std::size_t WorkerMesh::ndim() const noexcept {
  return impl_->names.size();
}
const std::vector<std::int64_t>& WorkerMesh::coordinates() const noexcept {
  return impl_->coords;
}
int WorkerMesh::world_rank() const noexcept {
  return impl_->world_rank;
}
MPI_Comm WorkerMesh::comm() const noexcept {
  return impl_->comm;
}

std::int64_t WorkerMesh::size(std::size_t dim) const {
  if (dim >= ndim()) {
    throw UsageError(fmt::format("device mesh {}: expected a dimension index below {}, found {} (world rank {})",
                                 to_string(), ndim(), dim, impl_->world_rank));
  }
  return impl_->ranks.sizes()[dim];
}

std::int64_t WorkerMesh::size(std::string_view name) const {
  return size(dim_index(name));
}

std::size_t WorkerMesh::dim_index(std::string_view name) const {
  const auto& names = impl_->names;
  const auto it = std::find(names.begin(), names.end(), name);
  if (it == names.end()) {
    throw UsageError(fmt::format("device mesh {}: unknown dimension '{}', expected one of {} (world rank {})",
                                 to_string(), name, names.empty() ? std::string("(none: 0-d mesh)") : join_names(names),
                                 impl_->world_rank));
  }
  return static_cast<std::size_t>(it - names.begin());
}

MPI_Comm WorkerMesh::dim_comm(std::size_t dim) {
  Impl& m = *impl_;
  (void)size(dim);  // range check with a readable error
  if (m.dim_comms[dim] == MPI_COMM_NULL) {
    // The ranks of this rank's line, as ranks of the mesh's communicator (a member's
    // row-major index), in coordinate order: the line's communicator ranks them so. Only
    // the line's members make it, after their agreement.
    const std::vector<std::int64_t>& sizes = m.ranks.sizes();
    const auto index = [&](const std::vector<std::int64_t>& at) {
      std::int64_t i = 0;
      for (std::size_t d = 0; d < ndim(); ++d) i = i * sizes[d] + at[d];
      return static_cast<int>(i);
    };
    std::vector<std::int64_t> at = m.coords;
    std::vector<int> line;
    for (std::int64_t k = 0; k < sizes[dim]; ++k) {
      at[dim] = k;
      line.push_back(index(at));
    }
    const std::vector<NDSlice::Int> world = m.ranks.to_vector();
    m.dim_comms[dim] = create_agreed(
        fmt::format("the communicator of dimension '{}' of device mesh {}", m.names[dim], to_string()), m.comm,
        index(m.coords), line, [&world](int r) { return static_cast<int>(world[static_cast<std::size_t>(r)]); },
        kAgreeLineTag + static_cast<int>(dim), kCreateLineTag + static_cast<int>(dim));
    if (m.dim_comms[dim] != MPI_COMM_NULL) g_live_communicators++;
    detail::set_error_policy(m.dim_comms[dim]);
  }
  return m.dim_comms[dim];
}

std::vector<int> WorkerMesh::line_world_ranks(std::size_t dim) const {
  std::vector<std::int64_t> c = impl_->coords;
  std::vector<int> out(static_cast<std::size_t>(size(dim)));
  for (std::size_t i = 0; i < out.size(); ++i) {
    c[dim] = static_cast<std::int64_t>(i);
    out[i] = static_cast<int>(impl_->ranks.location(c));
  }
  return out;
}

std::uint64_t WorkerMesh::dims_mask(std::span<const std::string> dims) const {
  std::uint64_t mask = 0;
  for (const std::string& d : dims) {
    const std::size_t i = dim_index(d);  // names the mesh's dimensions when unknown
    if (mask & (std::uint64_t{1} << i)) {
      throw UsageError(fmt::format(
          "device mesh {}: expected distinct dimensions, found '{}' twice in [{}] (world rank "
          "{})",
          to_string(), d, join_names(std::vector<std::string>(dims.begin(), dims.end())), impl_->world_rank));
    }
    mask |= std::uint64_t{1} << i;
  }
  return mask;
}

std::int64_t WorkerMesh::dims_size(std::uint64_t mask) const {
  std::int64_t n = 1;
  for (std::size_t d = 0; d < ndim(); ++d)
    if (mask & (std::uint64_t{1} << d)) n *= impl_->ranks.sizes()[d];
  return n;
}

std::int64_t WorkerMesh::dims_position(std::uint64_t mask) const {
  std::int64_t p = 0;
  for (std::size_t d = 0; d < ndim(); ++d)
    if (mask & (std::uint64_t{1} << d)) p = p * impl_->ranks.sizes()[d] + impl_->coords[d];
  return p;
}

namespace {
// The coordinates of position `p` on the line of `mask` through `at` (row-major over the
// set's dimensions, the last moving fastest).
std::vector<std::int64_t> line_coordinates(std::vector<std::int64_t> at, const std::vector<std::int64_t>& sizes,
                                           std::uint64_t mask, std::int64_t p) {
  for (std::size_t d = at.size(); d-- > 0;) {
    if ((mask & (std::uint64_t{1} << d)) == 0) continue;
    at[d] = p % sizes[d];
    p /= sizes[d];
  }
  return at;
}
}  // namespace

std::vector<int> WorkerMesh::dims_world_ranks(std::uint64_t mask) const {
  const std::int64_t n = dims_size(mask);
  std::vector<int> out(static_cast<std::size_t>(n));
  for (std::int64_t p = 0; p < n; ++p) {
    out[static_cast<std::size_t>(p)] =
        static_cast<int>(impl_->ranks.location(line_coordinates(impl_->coords, impl_->ranks.sizes(), mask, p)));
  }
  return out;
}

MPI_Comm WorkerMesh::dims_comm(std::uint64_t mask) {
  Impl& m = *impl_;
  const std::uint64_t all = ndim() == 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << ndim()) - 1;
  if ((mask & ~all) != 0) {
    throw UsageError(fmt::format("device mesh {}: expected dimensions below {}, found the set {:#x} (world rank {})",
                                 to_string(), ndim(), mask, m.world_rank));
  }
  if (mask == all) return m.comm;
  if (std::popcount(mask) == 1) return dim_comm(static_cast<std::size_t>(std::countr_zero(mask)));
  if (auto it = m.set_comms.find(mask); it != m.set_comms.end()) return it->second;
  // The members as ranks of the mesh's communicator (a member's row-major index), by
  // position on the line: the new communicator ranks them so.
  const std::vector<std::int64_t>& sizes = m.ranks.sizes();
  const auto index = [&](const std::vector<std::int64_t>& at) {
    std::int64_t i = 0;
    for (std::size_t d = 0; d < ndim(); ++d) i = i * sizes[d] + at[d];
    return static_cast<int>(i);
  };
  std::vector<int> line;
  for (std::int64_t p = 0, n = dims_size(mask); p < n; ++p)
    line.push_back(index(line_coordinates(m.coords, sizes, mask, p)));
  const std::vector<NDSlice::Int> world = m.ranks.to_vector();
  const int fold = static_cast<int>(mask & kSetTagMask);
  MPI_Comm comm = create_agreed(
      fmt::format("the communicator of dimensions {} of device mesh {}", dims_names(mask), to_string()), m.comm,
      index(m.coords), line, [&world](int r) { return static_cast<int>(world[static_cast<std::size_t>(r)]); },
      kAgreeSetTag + fold, kCreateSetTag + fold);
  if (comm != MPI_COMM_NULL) g_live_communicators++;
  detail::set_error_policy(comm);
  m.set_comms.emplace(mask, comm);
  return comm;
}

std::string WorkerMesh::dims_names(std::uint64_t mask) const {
  std::vector<std::string> names;
  for (std::size_t d = 0; d < ndim(); ++d)
    if (mask & (std::uint64_t{1} << d)) names.push_back(impl_->names[d]);
  return names.empty() ? std::string("no dimension") : join_names(names);
}

std::string WorkerMesh::to_string() const {
  std::string out = "[";
  for (std::size_t d = 0; d < ndim(); ++d) {
    out += fmt::format("{}{}={}", d ? ", " : "", impl_->names[d], impl_->ranks.sizes()[d]);
  }
  return out + "]";
}

}  // namespace meshrt
