#!/usr/bin/python3
"""meshrt.testing's own test: plugin_fixture.py on 4 ranks under the plugin. A test that
fails, errs or skips in setup on one rank does so on every rank, naming it (each rank's
JUnit report says what it saw); ranks() skips at other sizes; and a test that hangs
inside meshrt.run on one rank passes its deadline: every rank prints where it is, its
stacks and its worker's flight recorder, and the job ends.

usage: plugin_selftest.py <mpiexec> <python3 launcher...>
"""
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "plugin_fixture.py")


def run(mpiexec, python, mode, extra):
    # Each rank's own JUnit file: the rank from Open MPI's or MPICH's environment.
    pytest = " ".join([*python, "-m", "pytest", "-p", "meshrt.testing", "-p", "no:cacheprovider", "-q",
                       f"--rootdir={HERE}", FIXTURE, *extra])
    command = [mpiexec, "-n", "4", "sh", "-c", pytest]
    env = dict(os.environ, PLUGIN_FIXTURE_SET=mode)
    start = time.monotonic()
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=90)
    sys.stdout.write(done.stdout)
    return done, time.monotonic() - start


def outcomes(report):
    """{test name: (outcome, message)} from one rank's JUnit report."""
    seen = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        name = case.get("name")
        for kind in ("failure", "error", "skipped"):
            for node in case.findall(kind):
                text = (node.get("message") or "") + "\n" + (node.text or "")
                seen[name] = (kind, text) if name not in seen or kind == "error" else seen[name]
        seen.setdefault(name, ("passed", ""))
    return seen


def check_outcomes(mpiexec, python):
    with tempfile.TemporaryDirectory() as tmp:
        junit = os.path.join(tmp, "rank$" + "{OMPI_COMM_WORLD_RANK:-$PMI_RANK}.xml")
        done, _ = run(mpiexec, python, "outcomes", [f"--junitxml={junit}"])
        assert done.returncode != 0, "the job passed, though tests fail"
        for rank in range(4):
            got = outcomes(os.path.join(tmp, f"rank{rank}.xml"))
            where = f"rank {rank}"

            def expect(test, kind, *texts):
                outcome, text = got[test]
                assert outcome == kind, f"{where}: {test}: expected {kind}, found {outcome}: {text}"
                for t in texts:
                    assert t in text, f"{where}: {test}: expected {t!r} in {text!r}"

            # The rank that failed reports its own error; the others name it and quote it.
            def failed_on(failing, phase):
                return () if rank == failing else (f"the test's {phase} failed on rank(s) [{failing}] of 4",)

            expect("test_fails_on_rank_2", "failure", *failed_on(2, "call"), "rank 2 fails on purpose")
            expect("test_next_test_starts_in_step", "passed")
            expect("test_needs_three_ranks", "skipped", "needs 3 ranks, the job has 4")
            expect("test_runs_at_two_or_four_ranks", "passed")
            expect("test_setup_skipped_on_one_rank_skips_everywhere", "skipped", "rank 1 skips in setup",
                   *(() if rank == 1 else ("skipped on rank(s) [1]",)))
            expect("test_setup_error_on_one_rank", "error", *failed_on(3, "setup"), "rank 3's fixture is broken")
            expect("test_teardown_error_on_one_rank", "error", *failed_on(0, "teardown"), "rank 0's teardown fails")
            expect("test_last_passes", "passed")
    print("plugin_selftest: every rank agrees on every outcome")


def check_deadline(mpiexec, python):
    done, took = run(mpiexec, python, "deadline", [])
    out = done.stdout
    assert done.returncode != 0, "the job passed, though a test hangs"
    for rank in range(4):
        text = (f"meshrt.testing: rank {rank} of 4: plugin_fixture.py::test_hangs_inside_run_on_rank_1 passed its "
                f"deadline of 4 s")
        assert text in out, f"no deadline report from rank {rank}"
    assert "in sleep_on_rank_1" in out, "the stacks do not show the kernel rank 1 is in"
    assert "SIGUSR1: " in out and "flight recorder" in out, "no worker's flight recorder"
    assert "1 passed" not in out.split("test_hangs_inside_run_on_rank_1")[-1], "the job went on after the deadline"
    print(f"plugin_selftest: the deadline ended the job in {took:.1f} s, every rank reporting")


def main():
    mpiexec, python = sys.argv[1], sys.argv[2:]
    check_outcomes(mpiexec, python)
    check_deadline(mpiexec, python)


if __name__ == "__main__":
    main()
