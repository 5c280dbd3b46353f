// NCCL communicators of a WorkerMesh (built only with MESHRT_HAVE_NCCL).
#include <fmt/format.h>

#include "comm/mesh_impl.hpp"
#include "common/checks.hpp"
#include "meshrt/comm.hpp"

namespace meshrt {
namespace {

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
  return out;
}

}  // namespace

void WorkerMesh::Impl::free_nccl() noexcept {
  for (ncclComm_t& c : nccl_dims) {
    if (c) ncclCommDestroy(c);
    c = nullptr;
  }
  if (nccl_parent) ncclCommDestroy(nccl_parent);
  nccl_parent = nullptr;
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
  }
  return m.nccl_dims[dim];
}

}  // namespace meshrt
