"""StatelessGroup.from_mpi4py (4 ranks) where mpi4py uses meshrt's MPI library; where it
uses another (Debian's mpi4py is built for Open MPI, and CI also builds meshrt with
MPICH), the tests are skipped and from_mpi4py's refusal is checked in a separate process,
because two MPI libraries must never be loaded into one.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

import meshrt

T = 30


def mpi4py_library():
    """mpi4py's MPI vendor and library version, read in a separate process that loads its
    MPI without initialising it; None without mpi4py."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_", "HYDRA_", "MPIR_"))}
    code = ("import mpi4py\nmpi4py.rc.initialize = False\nmpi4py.rc.finalize = False\nfrom mpi4py import MPI\n"
            "print(MPI.get_vendor()[0])\nprint(MPI.Get_library_version().replace(chr(0), '').strip())\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        return None
    vendor, _, library = r.stdout.partition("\n")
    return vendor, library.strip()


MPI4PY = mpi4py_library()
SAME_MPI = MPI4PY is not None and MPI4PY == (meshrt._core._mpi_vendor(), meshrt._core._mpi_library_version())
needs_same_mpi = pytest.mark.skipif(not SAME_MPI, reason=f"mpi4py uses another MPI ({MPI4PY}) than meshrt "
                                    f"({meshrt._core._mpi_vendor()})")


@needs_same_mpi
def test_group_over_mpi4py_communicators():
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    g = meshrt.StatelessGroup.from_mpi4py(world, timeout=T)
    assert (g.rank, g.size, g.members) == (world.rank, world.size, list(range(world.size)))
    got = g.all_gather_obj({"rank": g.rank, "a": np.full(20000, g.rank, np.int16)})
    for r, part in enumerate(got):
        assert part["rank"] == r
        np.testing.assert_array_equal(part["a"], np.full(20000, r, np.int16))
    # A sub-communicator: its own ranks; the group works on a duplicate (mpi4py's traffic
    # on the communicator itself does not mix with the group's).
    half = world.Split(world.rank % 2, world.rank)
    h = meshrt.StatelessGroup.from_mpi4py(half, timeout=T)
    assert h.members == [0, 1] and h.rank == half.rank
    x = h.broadcast_obj(f"from {world.rank}" if h.rank == 0 else None, 0)
    assert half.bcast(x, root=1) == f"from {world.rank % 2}"
    h.close()
    half.Free()
    # A communicator that mpi4py also uses, in between.
    assert world.allreduce(g.broadcast_obj(7 if g.rank == 3 else None, 3)) == 7 * world.size
    g.barrier()


@needs_same_mpi
def test_from_mpi4py_refuses_what_is_not_an_intracommunicator():
    from mpi4py import MPI

    with pytest.raises(meshrt.UsageError, match="expected an mpi4py.MPI.Intracomm, found int"):
        meshrt.StatelessGroup.from_mpi4py(5)
    with pytest.raises(meshrt.UsageError, match="expected an mpi4py.MPI.Intracomm, found Comm"):
        meshrt.StatelessGroup.from_mpi4py(MPI.COMM_NULL)
    with pytest.raises(meshrt.UsageError, match="expected a communicator, found MPI.COMM_NULL"):
        meshrt.StatelessGroup.from_mpi4py(MPI.Intracomm())
    MPI.COMM_WORLD.Barrier()


@pytest.mark.skipif(SAME_MPI or MPI4PY is None, reason="mpi4py uses meshrt's MPI, or is not installed")
def test_from_mpi4py_refuses_another_mpi_library():
    if meshrt.rank() == 0:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_", "HYDRA_"))}
        code = ("import meshrt, mpi4py\nmpi4py.rc.initialize = False\nmpi4py.rc.finalize = False\n"
                "from mpi4py import MPI\ntry:\n    meshrt.StatelessGroup.from_mpi4py(MPI.COMM_WORLD)\n"
                "except meshrt.UsageError as e:\n    print(e)\n")
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        if r.returncode < 0 and not r.stdout:
            # Two MPI libraries in one process: mpi4py's import itself can die (MPICH's
            # meshrt beside Open MPI's mpi4py: "stack smashing detected") before from_mpi4py
            # is reached. docs/python.md says so; nothing meshrt does can run first.
            pytest.skip(f"loading mpi4py's MPI beside meshrt's killed the process (signal {-r.returncode}): "
                        f"{r.stderr.strip()[:200]}")
        assert f"mpi4py is built for {MPI4PY[0]}" in r.stdout, r.stdout + r.stderr
        assert "cannot be used by another; build mpi4py and meshrt against the same MPI" in r.stdout
