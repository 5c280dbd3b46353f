// NCCL communicators of a WorkerMesh (built only with MESHRT_HAVE_NCCL).
#include <fmt/format.h>

#include <mutex>
#include <set>

#include "comm/mesh_impl.hpp"
#include "common/checks.hpp"
#include "meshrt/comm.hpp"

namespace meshrt {
namespace {

// Every NCCL communicator this process has alive, so an abort can reach them all.
std::mutex g_live_mutex;
std::set<ncclComm_t> g_live;

ncclComm_t remember(ncclComm_t c) {
  std::lock_guard lock(g_live_mutex);
  g_live.insert(c);
  return c;
}

// Destroys `c` unless an abort already took it.
void destroy(ncclComm_t c) noexcept {
  {
    std::lock_guard lock(g_live_mutex);
    if (g_live.erase(c) == 0) return;
  }
  ncclCommDestroy(c);
}

// Coordinate 0 of `comm` makes the unique id and broadcasts it; every rank then joins.
ncclComm_t init_rank(MPI_Comm comm) {
  int rank = 0;
  int size = 0;
  MESHRT_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  MESHRT_MPI_CHECK(MPI_Comm_size(comm, &size));
  ncclUniqueId id{};
  if (rank == 0) MESHRT_NCCL_CHECK(ncclGetUniqueId(&id));
  MESHRT_MPI_CHECK(MPI_Bcast(&id, static_cast<int>(sizeof id), MPI_BYTE, 0, comm));
  ncclComm_t out = nullptr;
  MESHRT_NCCL_CHECK(ncclCommInitRank(&out, size, id, rank));
  return remember(out);
}

}  // namespace

void WorkerMesh::Impl::free_nccl() noexcept {
  for (ncclComm_t& c : nccl_dims) {
    if (c) destroy(c);
    c = nullptr;
  }
  if (nccl_parent) destroy(nccl_parent);
  nccl_parent = nullptr;
}

void abort_nccl_communicators() noexcept {
  std::lock_guard lock(g_live_mutex);
  if (g_live.empty()) return;
  // Inside one group call, so communicators blocked on each other all let go.
  ncclGroupStart();
  for (ncclComm_t c : g_live) ncclCommAbort(c);
  ncclGroupEnd();
  g_live.clear();
}

void WorkerMesh::set_nccl_creation(NcclCreation how) noexcept {
  impl_->nccl_creation = how;
}

ncclComm_t WorkerMesh::nccl_mesh_comm() {
  if (!impl_->nccl_parent) impl_->nccl_parent = init_rank(impl_->comm);
  return impl_->nccl_parent;
}

ncclComm_t WorkerMesh::nccl_comm(std::size_t dim) {
  Impl& m = *impl_;
  (void)size(dim);
  if (m.nccl_dims[dim]) return m.nccl_dims[dim];
  if (m.nccl_creation == NcclCreation::InitRank) {
    m.nccl_dims[dim] = init_rank(dim_comm(dim));
  } else {
    // Same color and key as dim_comm's MPI_Comm_split, so both agree on the lines.
    std::int64_t color = 0;
    for (std::size_t d = 0; d < ndim(); ++d) {
      if (d != dim) color = color * m.ranks.sizes()[d] + m.coords[d];
    }
    ncclComm_t parent = nccl_mesh_comm();
    MESHRT_NCCL_CHECK(
        ncclCommSplit(parent, static_cast<int>(color), static_cast<int>(m.coords[dim]), &m.nccl_dims[dim], nullptr));
    remember(m.nccl_dims[dim]);
  }
  return m.nccl_dims[dim];
}

}  // namespace meshrt
