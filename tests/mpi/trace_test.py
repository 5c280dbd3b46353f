#!/usr/bin/python3
"""The timeline of a known program (runtime_program trace, 4 ranks as a 2x2 mesh):

    trace_test.py MESHRT_TRACE_TOOL MPIEXEC -n 4 RUNTIME_PROGRAM

runs it with MESHRT_TRACE set, then checks the file: the format (meshrt-trace check:
every event of a known phase and fields, a process per rank, flows that start where
they end, no execution before its call after alignment), every invocation of the whole
mesh on every rank, each collective's and send's peers, the failed kernel marked on rank
1 only, rank 3's sleep making it the one late rank of its line in the next all_reduce
(rank 2 waiting for it), and meshrt-trace summary naming it."""
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import tempfile


def main():
    tool, command = sys.argv[1], sys.argv[2:]
    loader = importlib.machinery.SourceFileLoader("meshrt_trace", tool)
    spec = importlib.util.spec_from_loader("meshrt_trace", loader)
    mt = importlib.util.module_from_spec(spec)
    loader.exec_module(mt)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        env = dict(os.environ, MESHRT_TRACE=path)
        run = subprocess.run(command + ["trace"], env=env, capture_output=True, text=True, timeout=90)
        sys.stdout.write(run.stdout)
        sys.stderr.write(run.stderr)
        assert run.returncode == 0, f"the program failed ({run.returncode})"
        assert "meshrt: wrote the timeline of 4 ranks" in run.stderr, run.stderr
        trace = mt.load(path)
        summary = subprocess.run([sys.executable, tool, "summary", path], capture_output=True, text=True, check=True)
    print(summary.stdout)

    problems, ran = mt.check(trace, 4)
    assert not problems, "\n".join(problems)
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    commands = [e for e in spans if e["tid"] == 1]
    calls = {e["args"]["ident"]: e for e in spans if e["tid"] == 0 and e["cat"] == "call"}
    # Every call of the 2x2 mesh (test.pattern, the scale, both reduces, the failing kernel
    # and the sleep) ran on all four ranks, and its span names the function.
    for name in ("test.pattern", "meshrt.scale", "meshrt.fail", "test.sleep"):
        idents = [i for i, c in calls.items() if c["name"] == name]
        assert len(idents) == 1, f"expected one call of {name}, found {len(idents)}"
        assert ran[idents[0]] == {0, 1, 2, 3}, f"{name} ran on ranks {sorted(ran[idents[0]])}, expected 0-3"
        assert calls[idents[0]]["args"]["site"].startswith("runtime_programs.cpp:"), calls[idents[0]]
    # The failure, marked on rank 1 only.
    failed = [(e["pid"], e["name"]) for e in commands if e["args"].get("failed")]
    assert failed == [(1, "CallFunction meshrt.fail")], f"expected the failed kernel on rank 1 only, found {failed}"
    # Each collective names its peers, the line of its dimension in the 2x2 mesh (rank =
    # 2 * host + gpu), in the line's order, or the whole job for the program's first reduce
    # (over 'w'); the to_mesh from host 0 to host 1, its partner.
    lines = {"gpu": lambda r: [r - r % 2, r - r % 2 + 1], "host": lambda r: [r % 2, r % 2 + 2],
             "w": lambda r: [0, 1, 2, 3]}
    for e in commands:
        kind = e["name"].split(" ")[0]
        if kind == "Reduce":
            dim = e["name"].split("over '")[1].rstrip("'")
            assert e["args"].get("peers") == lines[dim](e["pid"]), f"rank {e['pid']}: {e}"
        elif kind == "SendTensor":
            assert e["args"].get("peers") == [(e["pid"] + 2) % 4], f"rank {e['pid']}: {e}"
    assert {e["name"].split(" ")[0] for e in commands} >= {"Reduce", "SendTensor"}, "no collective or send"
    # The straggler: rank 3 starts the all_reduce after its sleep (the first reduce issued
    # after it) 0.3 s late, its peer at once. Other collectives may have late ranks too (an
    # oversubscribed rank descheduled for as long, seen under MPICH), so this one is looked
    # up by its invocation rather than taken as the worst.
    sleep = next(i for i, c in calls.items() if c["name"] == "test.sleep")
    ident = min(e["args"]["ident"] for e in commands if e["name"].startswith("Reduce ") and e["args"]["ident"] > sleep)
    late = [row for row in mt.stragglers(trace) if row[1] == ident and 3 in row[4]]
    assert len(late) == 1, f"expected one line of invocation {ident} with rank 3, found {late}"
    late_us, _, rank, name, group = late[0]
    assert name == "Reduce reduce sum over 'gpu'", f"invocation {ident} is {name}, expected the reduce after the sleep"
    assert rank == 3 and late_us >= 200e3, f"expected rank 3 late by >= 200 ms, found rank {rank} by {late_us} us"
    assert group == [2, 3], f"expected the straggler among the 'gpu' line of ranks 2 and 3, found {group}"
    waits = mt.waiting(trace)
    assert waits[(2, ident)] >= 200e3, f"rank 2 waited {waits[(2, ident)]} us for rank 3, expected >= 200 ms"
    by_rank = mt.collectives(trace)[ident]
    first = min(e["ts"] for e in by_rank.values())
    for r, e in by_rank.items():
        if r != 3:
            assert e["ts"] - first < 100e3, f"rank {r} also started late: {e['ts'] - first} us"
    # The summary names it among the worst stragglers (5 by default).
    worst = summary.stdout.split("worst stragglers")[1].split("still running")[0].splitlines()[1:]
    assert any(f"late: rank 3 (rank 3 on" in line and f"(invocation {ident})" in line for line in worst), summary.stdout
    print("trace_test: ok")


if __name__ == "__main__":
    main()
