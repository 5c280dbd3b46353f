"""mpi4py first (2 ranks): MPI initialised by mpi4py at MPI_THREAD_MULTIPLE (its default) is
accepted, and both work in one program, before and after a session."""
from mpi4py import MPI  # before meshrt: mpi4py initialises MPI

import numpy as np  # noqa: E402

import meshrt  # noqa: E402


def test_meshrt_runs_on_mpi_that_mpi4py_started():
    comm = MPI.COMM_WORLD
    assert MPI.Query_thread() == MPI.THREAD_MULTIPLE
    assert comm.allreduce(1) == 2
    assert (meshrt.rank(), meshrt.world_size()) == (comm.Get_rank(), comm.Get_size())

    def main(ctl):
        mesh = ctl.world_mesh({"x": 2})
        s = mesh.call("meshrt.full", (3,), meshrt.float32, 1.0).reduce("x", "sum")
        np.testing.assert_array_equal(ctl.fetch_shard(s, x=1).result(timeout=60).numpy(), [2, 2, 2])
        return "ok"

    assert meshrt.run(main) == ("ok" if comm.Get_rank() == 0 else None)
    assert comm.allreduce(comm.Get_rank()) == 1  # mpi4py still works after the session
