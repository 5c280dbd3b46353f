#!/usr/bin/python3
"""The timeline when a job is ended, and for part of a run (runtime_program, 4 ranks):

    trace_end_test.py MESHRT_TRACE_TOOL MPIEXEC -n 4 RUNTIME_PROGRAM

1. SIGTERM (what scancel and a time limit send; here to mpiexec, which passes it to the
   ranks) while rank 2 sleeps in a kernel and rank 3 waits for it in an all_reduce: each
   rank prints its SIGTERM report and names its own timeline file; `meshrt-trace merge`
   joins the four into one file that passes `meshrt-trace check`, with rank 2's kernel and
   rank 3's all_reduce marked unfinished, and `summary` says so.
2. Controller::abort: every rank writes its own file before the job ends; a segfault on
   rank 2: its crash report names its file, and the others' come from the launcher's
   SIGTERM where it sends one (Open MPI's mpiexec; MPICH's hydra kills them outright).
3. start_trace / stop_trace / write_trace without MESHRT_TRACE: write_trace before any
   recording is refused, and the file holds exactly what was issued in between, on every
   rank; nothing is written at the end of the run."""
import glob
import importlib.machinery
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time


def load_tool(tool):
    loader = importlib.machinery.SourceFileLoader("meshrt_trace", tool)
    spec = importlib.util.spec_from_loader("meshrt_trace", loader)
    mt = importlib.util.module_from_spec(spec)
    loader.exec_module(mt)
    return mt


def merged(tool, mt, tmp, stem):
    files = sorted(glob.glob(f"{stem}.rank*.json"))
    assert [os.path.basename(f) for f in files] == [f"{os.path.basename(stem)}.rank{r}.json" for r in range(4)], files
    out = os.path.join(tmp, "merged.json")
    subprocess.run([tool, "merge", out] + files, check=True)
    trace = mt.load(out)
    problems, _ = mt.check(trace, 4)
    assert not problems, "\n".join(problems)
    return out, trace


def sigterm(tool, mt, command, tmp):
    stem = os.path.join(tmp, "term.json")
    env = dict(os.environ, MESHRT_TRACE=stem)
    job = subprocess.Popen(command + ["trace_term"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    line = job.stdout.readline()
    assert "trace_term: waiting for the end" in line, f"the program did not start its long step: {line!r}"
    time.sleep(0.5)  # rank 2 is inside its kernel, rank 3 in the all_reduce after it
    job.send_signal(signal.SIGTERM)
    out, err = job.communicate(timeout=30)
    sys.stdout.write(out)
    sys.stderr.write(err)
    # MPICH's hydra exited 0 in about 2 of 100 such runs here (the ranks' reports below
    # show they were ended): its exit status is checked with Open MPI's mpiexec only.
    if launcher_terminates(command):
        assert job.returncode != 0, "the job was ended, yet it exited 0"
    for r in range(4):
        assert re.search(rf"^meshrt: rank {r} on \S+: SIGTERM \(scancel, a time limit", err, re.M), f"rank {r}"
        assert re.search(rf"^meshrt: rank {r} on \S+: writing its timeline so far to {re.escape(stem)}\.rank{r}\.json"
                         rf" \(MESHRT_TRACE\)", err, re.M), f"rank {r}'s report names its file"
        assert re.search(rf"^meshrt: rank {r} on \S+: its timeline so far \(\d+ events\): {re.escape(stem)}"
                         rf"\.rank{r}\.json \(meshrt-trace merge joins", err, re.M), f"rank {r}'s timeline line"
    path, trace = merged(tool, mt, tmp, stem)
    unfinished = sorted((e["pid"], e["name"]) for e in trace["traceEvents"]
                        if e.get("ph") == "X" and e["args"].get("unfinished"))
    assert unfinished == [(2, "CallFunction test.sleep"), (3, "Reduce reduce sum over 'gpu'")], unfinished
    assert trace["otherData"]["meshrt"]["reasons"] == {str(r): "SIGTERM" for r in range(4)}, trace["otherData"]
    summary = subprocess.run([tool, "summary", path], capture_output=True, text=True, check=True).stdout
    print(summary)
    assert "still running when the job was ended:" in summary, summary
    assert re.search(r"rank 2 \(rank 2 on \S+\): CallFunction test.sleep .*\(SIGTERM\)", summary), summary


def ended(command, tmp, mode):
    """Runs `mode` with MESHRT_TRACE, which must end the job with an error: (the files'
    stem, its stderr)."""
    stem = os.path.join(tmp, f"{mode}.json")
    run = subprocess.run(command + [mode], env=dict(os.environ, MESHRT_TRACE=stem), capture_output=True, text=True,
                         timeout=60)
    sys.stderr.write(run.stderr)
    assert run.returncode != 0, f"the job was ended ({mode}), yet it exited 0"
    return stem, run.stderr


def abort(tool, mt, command, tmp):
    stem, _ = ended(command, tmp, "abort")
    _, trace = merged(tool, mt, tmp, stem)
    assert set(trace["otherData"]["meshrt"]["reasons"].values()) == {"the controller aborted the job"}, trace


def launcher_terminates(command):
    """Whether the launcher sends the other ranks SIGTERM before SIGKILL when one aborts:
    Open MPI's mpiexec does (its version says OpenRTE or Open MPI), MPICH's hydra does not."""
    run = subprocess.run([command[0], "--version"], capture_output=True, text=True, timeout=30)
    return "OpenRTE" in run.stdout + run.stderr or "Open MPI" in run.stdout + run.stderr


def crash(tool, mt, command, tmp):
    stem, err = ended(command, tmp, "crash")
    assert re.search(rf"^meshrt: rank 2: its timeline so far \(\d+ events\): {re.escape(stem)}\.rank2\.json",
                     err, re.M), "the crashed rank's report names no timeline file"
    if launcher_terminates(command):
        _, trace = merged(tool, mt, tmp, stem)
        assert trace["otherData"]["meshrt"]["reasons"]["2"] == "signal 11", trace["otherData"]
    else:
        own = mt.load(f"{stem}.rank2.json")
        assert own["otherData"]["meshrt"]["reason"] == "signal 11", own["otherData"]
        assert any(e.get("ph") == "X" and e["pid"] == 2 for e in own["traceEvents"]), "rank 2's file has no span"


def parts(tool, mt, command, tmp):
    path = os.path.join(tmp, "parts.json")
    env = {k: v for k, v in os.environ.items() if k != "MESHRT_TRACE"}
    env["MESHRT_TEST_TRACE_OUT"] = path
    run = subprocess.run(command + ["trace_parts"], env=env, capture_output=True, text=True, timeout=60)
    sys.stdout.write(run.stdout)
    sys.stderr.write(run.stderr)
    assert run.returncode == 0, f"the program failed ({run.returncode})"
    assert "expected a timeline to write (MESHRT_TRACE=path, or start_trace() before), found none recorded" \
        in run.stdout, run.stdout
    assert "wrote the timeline" not in run.stderr, "a timeline was written at the end without MESHRT_TRACE"
    trace = mt.load(path)
    problems, ran = mt.check(trace, 4)
    assert not problems, "\n".join(problems)
    commands = sorted({(e["pid"], e["name"]) for e in trace["traceEvents"]
                       if e.get("ph") == "X" and e["tid"] == 1 and e["name"] != "RequestStatus"})
    expected = sorted((r, n) for r in range(4) for n in ("CallFunction test.pattern", "Reduce reduce sum over 'gpu'"))
    assert commands == expected, f"expected only the work between start_trace and stop_trace, found {commands}"


def main():
    tool, command = sys.argv[1], sys.argv[2:]
    mt = load_tool(tool)
    with tempfile.TemporaryDirectory() as tmp:
        sigterm(tool, mt, command, tmp)
        abort(tool, mt, command, tmp)
        crash(tool, mt, command, tmp)
        parts(tool, mt, command, tmp)
    print("trace_end_test: ok")


if __name__ == "__main__":
    main()
