"""A rank that registered different Python functions fails the start on every rank.

Rank 1 registers one function more than the others: meshrt.run must raise meshrt.Error
naming the function on every rank (each rank then exits 3), and rank 0 prints the
handshake's verdict. CTest runs it expecting exit code 3 on every rank and the verdict in
the output (tests/python/CMakeLists.txt)."""
import os

import meshrt


def rank_from_launcher():
    for name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if name in os.environ:
            return int(os.environ[name])
    raise RuntimeError("expected to run under mpiexec (no rank in the environment)")


@meshrt.function("test.py_everywhere", shape=lambda: None)
def everywhere(ctx):
    pass


if rank_from_launcher() == 1:
    @meshrt.function("test.py_only_on_rank_1", shape=lambda: None)
    def only_here(ctx):
        pass


def main(ctl):
    raise AssertionError("the start should have failed")


try:
    meshrt.run(main)
except meshrt.Error as e:
    assert "test.py_only_on_rank_1" in str(e), str(e)
    print(f"rank {rank_from_launcher()}: the start failed as expected", flush=True)
    raise SystemExit(3)
raise SystemExit(f"rank {rank_from_launcher()}: expected the start to fail, found it succeeded")
