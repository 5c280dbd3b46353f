"""mpi4py first at MPI_THREAD_FUNNELED (2 ranks): meshrt.run refuses on every rank, naming
the level it found and how to fix it."""
import mpi4py

mpi4py.rc.thread_level = "funneled"
from mpi4py import MPI  # noqa: E402

import pytest  # noqa: E402

import meshrt  # noqa: E402


def test_run_refuses_a_lower_thread_level():
    assert MPI.Query_thread() < MPI.THREAD_MULTIPLE
    with pytest.raises(meshrt.UsageError) as e:
        meshrt.run(lambda ctl: None)
    text = str(e.value)
    assert "thread level MPI_THREAD_FUNNELED" in text
    assert "needs MPI_THREAD_MULTIPLE" in text
    assert 'mpi4py.rc.thread_level at "multiple"' in text
    # Every rank refused: the job is still in step.
    assert MPI.COMM_WORLD.allreduce(1) == 2
