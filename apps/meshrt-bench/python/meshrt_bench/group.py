"""The Python group against mpi4py: broadcast_obj and all_gather_obj beside mpi4py's
pickle path (bcast, allgather) and its buffer path (Bcast, Allgather), in one run.

    mpiexec -n 2 python3 -m meshrt_bench group [--max-bytes N] [--reps R] [--json PATH]

Payloads: numpy float32 arrays from 8 B to 64 MiB, bytes from 8 B to 64 MiB, and a small
dict (a step's metadata); then barrier against comm.Barrier.
For every payload the columns run in turn, repeated R times, so that a change in the
machine's load hits every column alike; each repetition times enough operations to last
about --seconds, between two barriers, and the figure is the median time per operation.
`meshrt out=` is broadcast_obj into a preallocated array, the counterpart of Bcast. The
ratios are mpi4py's time over meshrt's: above 1 means meshrt is faster.

Needs mpi4py built for the same MPI as meshrt (Debian's is built for Open MPI).
"""

import argparse
import statistics
import sys
import time

import numpy as np


def _payloads(max_bytes):
    sizes = []
    n = 8
    while n <= max_bytes:
        sizes.append(n)
        n *= 8
    if sizes[-1] != max_bytes and max_bytes > 8:
        sizes.append(max_bytes)
    rows = [(f"{_human(n)} float32", lambda rank, n=n: np.full(n // 4 or 1, rank, np.float32)) for n in sizes]
    rows += [(f"{_human(n)} bytes", lambda rank, n=n: bytes([rank % 256]) * n) for n in sizes]
    rows.append(("small dict", lambda rank: {"step": 1000 + rank, "lr": 3e-4, "name": "layer.7.attn",
                                             "shape": [4096, 1024], "done": False}))
    return rows


def _human(n):
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n // size} {unit}"
    return f"{n} B"


def _time_block(comm, op, iters):
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        op()
    comm.Barrier()
    return (time.perf_counter() - t0) / iters


def _columns(comm, group, payload, is_array):
    """(name, op) for each column of one payload; the ops check nothing (the tests do)."""
    rank = comm.rank
    if payload is None:
        return [("meshrt", lambda: group.barrier()), ("mpi4py pickle", lambda: comm.Barrier())]
    cols = []
    cols.append(("meshrt", lambda: group.broadcast_obj(payload if rank == 0 else None, src=0)))
    cols.append(("mpi4py pickle", lambda: comm.bcast(payload if rank == 0 else None, root=0)))
    if is_array:
        out = np.empty_like(payload)
        buf = payload.copy() if rank == 0 else np.empty_like(payload)
        cols.append(("meshrt out=", lambda: group.broadcast_obj(payload if rank == 0 else None, src=0, out=out)))
        cols.append(("mpi4py Bcast", lambda: comm.Bcast(buf, root=0)))
    gathered = np.empty((comm.size,) + payload.shape, payload.dtype) if is_array else None
    cols.append(("meshrt all_gather", lambda: group.all_gather_obj(payload)))
    cols.append(("mpi4py allgather", lambda: comm.allgather(payload)))
    if is_array:
        cols.append(("mpi4py Allgather", lambda: comm.Allgather(payload, gathered)))
    return cols


def _measure(comm, group, max_bytes, reps, seconds):
    results = []
    for label, make in _payloads(max_bytes) + [("barrier", lambda rank: None)]:
        payload = make(comm.rank)
        is_array = isinstance(payload, np.ndarray)
        cols = _columns(comm, group, payload, is_array)
        # Every rank must run the same number of operations: rank 0 sizes each column from
        # one warm-up operation and tells the others.
        iters = {}
        for name, op in cols:
            t = _time_block(comm, op, 1)
            t = _time_block(comm, op, 1)
            iters[name] = max(1, min(100000, int(seconds / max(t, 1e-7))))
        iters = comm.bcast(iters, root=0)
        times = {name: [] for name, _ in cols}
        for _ in range(reps):
            for name, op in cols:
                times[name].append(_time_block(comm, op, iters[name]))
        nbytes = payload.nbytes if is_array else len(payload) if isinstance(payload, bytes) else None
        row = {"payload": label, "bytes": nbytes}
        row.update({name: statistics.median(ts) for name, ts in times.items()})
        results.append(row)
    return results


def _ratio(row, slower, faster):
    return row[slower] / row[faster] if slower in row and faster in row else None


def _print(results, ranks, reps, json_path):
    print(f"\nthe Python group against mpi4py at {ranks} ranks: time per operation, median of {reps}")
    print("(ratio: mpi4py's time over meshrt's; above 1, meshrt is faster)\n")
    head = (f"{'payload':<16} {'meshrt':>10} {'mpi4py':>10} {'ratio':>7} {'out=':>10} {'Bcast':>10} {'ratio':>7}"
            f" | {'meshrt':>10} {'mpi4py':>10} {'ratio':>7} {'Allgather':>10}")
    print(f"{'':<16} {'broadcast_obj / bcast (pickle)':^29} {'out= / Bcast (buffers)':^29}"
          f" | {'all_gather_obj / allgather':^40}")
    print(head)

    def us(row, key):
        return f"{row[key] * 1e6:8.1f}us" if key in row else f"{'-':>10}"

    def x(value):
        return f"{value:6.2f}x" if value is not None else f"{'-':>7}"

    pickle_holds, buffer_holds = True, True
    for r in results:
        bp = _ratio(r, "mpi4py pickle", "meshrt")
        bb = _ratio(r, "mpi4py Bcast", "meshrt out=")
        gp = _ratio(r, "mpi4py allgather", "meshrt all_gather")
        print(f"{r['payload']:<16} {us(r, 'meshrt')} {us(r, 'mpi4py pickle')} {x(bp)} {us(r, 'meshrt out=')}"
              f" {us(r, 'mpi4py Bcast')} {x(bb)} | {us(r, 'meshrt all_gather')} {us(r, 'mpi4py allgather')}"
              f" {x(gp)} {us(r, 'mpi4py Allgather')}")
        pickle_holds &= bp > 1 and (gp is None or gp > 1)
        if bb is not None and r["bytes"] >= (1 << 20):
            buffer_holds &= bb >= 1 / 1.2
    print("(barrier: meshrt's barrier against comm.Barrier, in the broadcast columns)")
    print(f"\ntarget: faster than mpi4py's pickle path at every size: {'holds' if pickle_holds else 'does not hold'}")
    print(f"target: within 1.2x of mpi4py's Bcast from 1 MiB: {'holds' if buffer_holds else 'does not hold'}")
    from meshrt_bench import write_json_lines  # meshrt after mpi4py (main)

    write_json_lines("python_group", ranks, results, json_path)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python3 -m meshrt_bench group", description=__doc__.split("\n")[0])
    parser.add_argument("--max-bytes", type=int, default=64 << 20, help="the largest array (default 64 MiB)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions; the median is reported (default 5)")
    parser.add_argument("--seconds", type=float, default=0.1, help="length of one timed block (default 0.1)")
    parser.add_argument("--quick", action="store_true", help="up to 64 KiB, 2 repetitions of 0.02 s")
    parser.add_argument("--json", default="", help="append one JSON line per payload to this file (rank 0)")
    args = parser.parse_args(argv)
    if args.quick:
        args.max_bytes, args.reps, args.seconds = 64 << 10, 2, 0.02

    from mpi4py import MPI

    import meshrt

    comm = MPI.COMM_WORLD
    with meshrt.StatelessGroup.from_mpi4py(comm, timeout=600) as group:
        results = _measure(comm, group, args.max_bytes, args.reps, args.seconds)
    if comm.rank == 0:
        _print(results, comm.size, args.reps, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
