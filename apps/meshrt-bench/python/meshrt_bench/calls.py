"""Dispatch from Python: trivial calls per second from a Python controller against the C++
controller, and a Python kernel's dispatch cost against a C++ kernel's, in one run.

    mpiexec -n 2 python3 -m meshrt_bench calls [--calls N] [--reps R] [--json PATH]

Each row issues N trivial calls on a mesh of every rank, then synchronizes; the figure is
the median over R repetitions of the time per call (calls per second per worker). The
C++ controller column runs the same calls from a C++ loop in the same session
(meshrt_bench._loop.call_loop), alternating with the Python loop, so the two columns differ
only in who issues the calls; the ratio is the median of the repetitions' ratios.
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np

import meshrt
from meshrt_bench import _loop
from meshrt_bench import write_json_lines


@meshrt.function("bench.py_noop", shape=lambda: None)
def _noop(ctx):
    """Nothing: no outputs."""
    return None


@meshrt.function("bench.py_scalar", shape=lambda: meshrt.TensorMeta((), meshrt.float32))
def _scalar(ctx):
    """A 0-d float32 zero, as meshrt.full((), float32, 0.0) makes in C++."""
    return np.zeros((), np.float32)


# (label, function, args): the C++ kernel and the Python kernels with the same outputs.
ROWS = [
    ("meshrt.full 0-d (C++ kernel)", "meshrt.full", ((), meshrt.float32, 0.0)),
    ("bench.py_scalar 0-d (Python kernel)", "bench.py_scalar", ()),
    ("bench.py_noop (Python kernel, no output)", "bench.py_noop", ()),
]


def _seconds_per_call(ctl, issue, calls):
    t0 = time.perf_counter()
    issue(calls)
    ctl.synchronize()
    return (time.perf_counter() - t0) / calls


def _measure(ctl, calls, reps):
    mesh = ctl.world_mesh({"rank": _world_size()})
    results = []
    for label, fn, args in ROWS:
        def python_loop(n, fn=fn, args=args):
            call = mesh.call
            for _ in range(n):
                call(fn, *args)

        def cpp_loop(n, fn=fn, args=args):
            _loop.call_loop(mesh, fn, args, n)

        # Warm up (caches, pools, the workers' shape-function answers), then the two
        # loops alternate, so that a change in the machine's load hits both alike.
        for loop in (cpp_loop, python_loop):
            _seconds_per_call(ctl, loop, max(calls // 10, 1))
        cpp, py = [], []
        for _ in range(reps):
            cpp.append(_seconds_per_call(ctl, cpp_loop, calls))
            py.append(_seconds_per_call(ctl, python_loop, calls))
        results.append({"op": label, "function": fn, "cpp_controller_s": statistics.median(cpp),
                        "python_controller_s": statistics.median(py),
                        "ratio": statistics.median(c / p for c, p in zip(cpp, py))})
    return results


def _world_size():
    # The launcher's (Open MPI, MPICH, PMIx, Slurm): the controller has no world size yet.
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_NTASKS"):
        if name in os.environ:
            return int(os.environ[name])
    return 1


def _print(results, ranks, calls, reps, json_path):
    print(f"\ndispatch from Python at {ranks} ranks: {calls} trivial calls per repetition, median of {reps}")
    print(f"{'operation':<42} {'C++ controller':>16} {'Python controller':>18} {'Python/C++':>11}")
    for r in results:
        cpp, py = r["cpp_controller_s"], r["python_controller_s"]
        print(f"{r['op']:<42} {1 / cpp:>10.0f} /s {'':>4}{1 / py:>12.0f} /s {r['ratio']:>10.2f}x")
    by_fn = {r["function"]: r for r in results}
    base = by_fn["meshrt.full"]
    print("\na Python kernel's dispatch cost against a C++ kernel's (per call, both issued from C++):")
    for fn in ("bench.py_scalar", "bench.py_noop"):
        extra = by_fn[fn]["cpp_controller_s"] - base["cpp_controller_s"]
        print(f"  {fn:<18} {by_fn[fn]['cpp_controller_s'] * 1e6:7.2f} us vs meshrt.full "
              f"{base['cpp_controller_s'] * 1e6:7.2f} us: {extra * 1e6:+.2f} us")
    target = base["ratio"]
    print(f"\ntarget: a Python controller issues at least 0.6x the C++ controller's trivial calls per second: "
          f"{target:.2f}x, {'holds' if target >= 0.6 else 'does not hold'}")
    write_json_lines("python_dispatch", ranks, results, json_path)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python3 -m meshrt_bench calls", description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20000, help="calls per repetition (default 20000)")
    parser.add_argument("--reps", type=int, default=7, help="repetitions; the median is reported (default 7)")
    parser.add_argument("--quick", action="store_true", help="2000 calls, 3 repetitions")
    parser.add_argument("--json", default="", help="append one JSON line per row to this file")
    args = parser.parse_args(argv)
    calls, reps = (2000, 3) if args.quick else (args.calls, args.reps)

    def controller(ctl):
        ranks = _world_size()
        results = _measure(ctl, calls, reps)
        _print(results, ranks, calls, reps, args.json)

    meshrt.run(controller)
    return 0


if __name__ == "__main__":
    sys.exit(main())
