#!/usr/bin/python3
"""meshrt-trace summary on a synthetic timeline of two ranks (no MPI): time a command
waits queued while nothing runs is 'queued', not idle, and the time before a rank's
first command arrives (the run's start) is not idle either.

usage: trace_summary_test.py MESHRT_TRACE_TOOL"""
import json
import subprocess
import sys
import tempfile


def command(pid, name, ts, dur, queued, ident):
    return {"ph": "X", "cat": "command", "name": name, "pid": pid, "tid": 1, "ts": ts, "dur": dur,
            "args": {"ident": ident, "queued_us": queued}}


def main():
    tool = sys.argv[1]
    events = [{"ph": "M", "name": "process_name", "pid": p, "args": {"name": f"rank {p} on h"}} for p in (0, 1)]
    # Rank 0: A runs 0..10; B arrives at 5 but starts at 20 (queued 5..20, of which
    # 10..20 with nothing running), runs to 30; then nothing until the run ends at 110.
    events.append(command(0, "CallFunction a", 0.0, 10.0, 0.0, 1))
    events.append(command(0, "CallFunction b", 20.0, 10.0, 15.0, 2))
    # Rank 1: its first command arrives at 100 and runs at once to 110.
    events.append(command(1, "CallFunction a", 100.0, 10.0, 0.0, 1))
    trace = {"traceEvents": events, "otherData": {"meshrt": {"clock_residual_us": 0}}}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(trace, f)
    out = subprocess.run([tool, "summary", f.name], capture_output=True, text=True, check=True).stdout
    print(out)
    header = next(line for line in out.splitlines() if line.startswith("rank "))
    columns = header.split()[1:]
    assert columns[:6] == ["kernels", "waiting", "moving", "other", "queued", "idle"], header
    rows = {line.split(" on ")[0]: line for line in out.splitlines() if line.startswith("rank ") and " on h" in line}

    def shares(row):
        return [float(v.rstrip("%")) for v in row.split()[4:10]]

    # Rank 0 over 0..110: kernels 20, queued 10, idle 80.
    assert shares(rows["rank 0"]) == [18.2, 0.0, 0.0, 0.0, 9.1, 72.7], rows["rank 0"]
    # Rank 1 over 100..110 (its start, 0..100, is not idle): all kernels.
    assert shares(rows["rank 1"]) == [100.0, 0.0, 0.0, 0.0, 0.0, 0.0], rows["rank 1"]
    print("ok")


if __name__ == "__main__":
    main()
