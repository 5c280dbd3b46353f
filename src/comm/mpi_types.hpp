// The MPI side of dtypes and reductions: which MPI datatype carries each DType and which
// MPI_Op computes each Reduction on it.
#pragma once

#include <mpi.h>

#include "meshrt/reduction.hpp"
#include "meshrt/tensor.hpp"

namespace meshrt::detail {

// bool travels as MPI_UINT8_T (meshrt's bool is one byte holding 0 or 1); float16 and
// bfloat16 as a committed 2-byte contiguous datatype that only meshrt's ops understand.
MPI_Datatype mpi_datatype(DType dtype);

// The MPI_Op of `reduction` on `dtype`: MPI_SUM for avg (the division comes after),
// user-defined ops for float16/bfloat16, and for min and max on float32/float64 (they
// propagate NaN from any rank, which MPI_MIN and MPI_MAX do not). The caller has
// already refused the pairs that make no sense (check_reduction); stack has no op.
MPI_Op mpi_op(Reduction reduction, DType dtype);

// avg: divides every element of `data` by `n` in place (float16/bfloat16: through
// float). Integer avg is refused by reduction_rule; here it would truncate.
void divide_in_place(void* data, std::int64_t numel, DType dtype, std::int64_t n);

}  // namespace meshrt::detail
