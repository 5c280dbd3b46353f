"""Ended by SIGTERM (sigterm_test.py sends it to mpiexec): rank 0's main is inside
ctl.synchronize() while rank 1 runs a kernel that never ends by itself; its finally: block
must run, and say so, before the job ends."""
import ctypes
import os
import sys

import meshrt

ctypes.CDLL(os.environ["MESHRT_PYTHON_TEST_FUNCTIONS"])
NEVER = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"meshrt-sigterm-never-{os.getppid()}")


def main(ctl):
    mesh = ctl.world_mesh({"x": meshrt.world_size()})
    mesh.call("test.block", NEVER, [1])
    print("sigterm_program: waiting", flush=True)
    try:
        ctl.synchronize()
    except meshrt.Terminated as e:
        print(f"sigterm_program: main raised meshrt.Terminated: {e}", flush=True)
        raise
    finally:
        print("sigterm_program: finally ran on rank 0", flush=True)


meshrt.run(main)
sys.exit(3)  # not reached on rank 0
