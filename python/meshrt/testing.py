"""meshrt.testing: a pytest plugin for tests that every rank of a job runs (docs/python.md,
"Testing multi-rank code").

    mpiexec -n 4 python3 -m pytest -p meshrt.testing test_mine.py

Every rank runs the same tests in the same order. With the plugin:

- a test that fails on any rank fails on every rank, naming the ranks and their errors,
  and the next test starts once every rank has finished this one (a skip in a test's
  setup, such as a skip mark, skips it on every rank too);
- every test has a deadline (``--meshrt-deadline=SECONDS``, the ini option
  ``meshrt_deadline``, or ``@meshrt.testing.deadline(seconds)``; 300 s otherwise): a rank
  still in the test then prints where it is, every thread's Python stack and, inside
  ``meshrt.run``, its worker's flight recorder, and ends the whole job instead of letting
  it hang;
- ``@meshrt.testing.ranks(4)`` runs a test only in a job of 4 ranks and skips it at
  other sizes.
"""

import faulthandler
import math
import os
import signal
import sys
import threading
import time

import pytest

import meshrt
from meshrt import _core

__all__ = ["ranks", "deadline", "DEFAULT_DEADLINE"]

DEFAULT_DEADLINE = 300.0

# After its deadline a rank waits this long for the others' reports before it ends the
# job (their deadlines pass at about the same time); faulthandler ends a rank whose
# watchdog thread cannot run (C code holding the GIL) this long after that.
_REPORT_GRACE = 1.0
_BACKSTOP_GRACE = 10.0


def ranks(*counts):
    """Runs the test only in a job of one of these sizes: @meshrt.testing.ranks(4) or
    ranks(2, 4); skipped, alike on every rank, at any other size."""
    if not counts or not all(isinstance(n, int) and n >= 1 for n in counts):
        raise meshrt.UsageError(f"meshrt.testing.ranks: expected one or more rank counts >= 1, found {counts!r}")
    size = meshrt.world_size()
    wanted = " or ".join(str(n) for n in counts)
    return pytest.mark.skipif(size not in counts, reason=f"needs {wanted} ranks, the job has {size}")


def deadline(seconds):
    """This test's deadline in seconds, in place of --meshrt-deadline."""
    if not (isinstance(seconds, (int, float)) and seconds > 0 and math.isfinite(seconds)):
        raise meshrt.UsageError(f"meshrt.testing.deadline: expected seconds > 0, found {seconds!r}")
    return pytest.mark.meshrt_deadline(seconds)


def pytest_addoption(parser):
    group = parser.getgroup("meshrt", "meshrt.testing: tests on every rank of a job")
    group.addoption("--meshrt-deadline", type=float, default=None, metavar="SECONDS",
                    help=f"each test's deadline on every rank; past it the rank prints its stacks and ends the job "
                         f"(default: the ini option meshrt_deadline, else {DEFAULT_DEADLINE:g})")
    parser.addini("meshrt_deadline", f"each test's deadline in seconds (default {DEFAULT_DEADLINE:g})", default=None)


def pytest_configure(config):
    config.addinivalue_line("markers", "meshrt_deadline(seconds): this test's deadline (meshrt.testing.deadline)")
    seconds = config.getoption("meshrt_deadline")
    if seconds is None:
        ini = config.getini("meshrt_deadline")
        seconds = float(ini) if ini not in (None, "") else DEFAULT_DEADLINE
    if not (seconds > 0 and math.isfinite(seconds)):
        raise pytest.UsageError(f"--meshrt-deadline: expected seconds > 0, found {seconds}")
    config.stash[_JOB] = _Job(config, seconds)


def pytest_unconfigure(config):
    job = config.stash.get(_JOB, None)
    if job is not None:
        job.close()


def pytest_report_header(config):
    job = config.stash[_JOB]
    return f"meshrt.testing: rank {job.rank} of {job.size}, deadline {job.default_deadline:g} s per test"


def pytest_collection_finish(session):
    """Every rank must run the same tests: a collection error on one rank, or different
    tests, ends the session on every rank before any test runs."""
    job = session.config.stash[_JOB]
    mine = (session.testsfailed, [item.nodeid for item in session.items])
    everyone = job.exchange(mine)
    broken = [r for r, (errors, _) in enumerate(everyone) if errors]
    if broken:
        pytest.exit(f"meshrt.testing: collection failed on rank(s) {broken} (their output says why); "
                    f"no test runs on any rank", returncode=pytest.ExitCode.INTERRUPTED)
    for r, (_, nodeids) in enumerate(everyone):
        if nodeids != mine[1]:
            pytest.exit(f"meshrt.testing: the ranks collected different tests: rank {job.rank} has "
                        f"{_first_difference(mine[1], nodeids)} where rank {r} has "
                        f"{_first_difference(nodeids, mine[1])}; every rank must run the same tests in the same "
                        f"order", returncode=pytest.ExitCode.USAGE_ERROR)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    job = item.config.stash[_JOB]
    marker = item.get_closest_marker("meshrt_deadline")
    job.watchdog.arm(item.nodeid, marker.args[0] if marker else job.default_deadline)
    try:
        yield
    finally:
        job.watchdog.disarm()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    job = item.config.stash[_JOB]
    job.watchdog.phase(f"waiting for the other ranks to finish the test's {rep.when}")
    everyone = job.exchange((item.nodeid, rep.when, rep.outcome, _summary(rep)))
    job.watchdog.phase(_NEXT_PHASE[rep.when])
    for r, (nodeid, when, _, _) in enumerate(everyone):
        if (nodeid, when) != (item.nodeid, rep.when):
            pytest.exit(f"meshrt.testing: the ranks are out of step: rank {job.rank} finished the {rep.when} of "
                        f"{item.nodeid}, rank {r} the {when} of {nodeid}", returncode=pytest.ExitCode.INTERNAL_ERROR)
    failed = [(r, text) for r, (_, _, out, text) in enumerate(everyone) if out == "failed"]
    skipped = [(r, text) for r, (_, _, out, text) in enumerate(everyone) if out == "skipped"]
    if failed:
        listing = "\n".join(f"  rank {r}: {text}" for r, text in failed)
        note = f"the test's {rep.when} failed on rank(s) {[r for r, _ in failed]} of {job.size}:\n{listing}"
        if rep.failed:
            rep.sections.append(("meshrt.testing", note))
        else:
            rep.outcome = "failed"
            rep.longrepr = note
    elif skipped and rep.when == "setup" and rep.passed:
        # The test then runs on no rank: the others would wait for it in its collectives.
        reason = skipped[0][1]
        path, line, _ = item.location
        rep.outcome = "skipped"
        rep.longrepr = (path, line + 1, f"Skipped: skipped on rank(s) {[r for r, _ in skipped]}: {reason}")


# ---------------------------------------------------------------------------------------

_JOB = pytest.StashKey()
_NEXT_PHASE = {"setup": "running the test", "call": "tearing the test down", "teardown": "finishing the test"}


def _summary(rep):
    """One line saying why a phase failed or was skipped."""
    if rep.passed:
        return ""
    if rep.skipped and isinstance(rep.longrepr, tuple):
        return str(rep.longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(getattr(rep, "longrepr", None), "reprcrash", None)
    if crash is not None:
        return crash.message.splitlines()[0] if crash.message else "failed"
    text = str(rep.longrepr).strip().splitlines()
    return text[-1] if text else rep.outcome


def _first_difference(a, b):
    for i, nodeid in enumerate(a):
        if i >= len(b) or b[i] != nodeid:
            return f"test {i + 1} {nodeid}"
    return f"{len(a)} tests"


class _Job:
    """The plugin's world group (its own communicator: the tests' messages never mix with
    it) and this rank's watchdog."""

    def __init__(self, config, default_deadline):
        self.config = config
        self.default_deadline = default_deadline
        self.rank = meshrt.rank()
        self.size = meshrt.world_size()
        self.group = meshrt.StatelessGroup.create(list(range(self.size)), timeout=default_deadline)
        self.watchdog = _Watchdog(self)

    def exchange(self, mine):
        # No limit of its own: a rank waiting here for one still in the test is within the
        # test's deadline.
        return self.group.all_gather_obj(mine, timeout=math.inf)

    def close(self):
        self.watchdog.stop()
        self.group.close()


class _Watchdog(threading.Thread):
    """Ends the job when a test passes its deadline on this rank."""

    def __init__(self, job):
        super().__init__(name="meshrt.testing watchdog", daemon=True)
        self.job = job
        self.cond = threading.Condition()
        self.nodeid = None
        self.seconds = 0.0
        self.started_at = 0.0
        self.where = ""
        self.stopping = False
        # The terminal's stderr, past pytest's capture, for reports from this thread and
        # from faulthandler (which writes without the GIL).
        capman = job.config.pluginmanager.getplugin("capturemanager")
        if capman is None:
            self.stderr = os.dup(2)
        else:
            with capman.global_and_fixture_disabled():
                self.stderr = os.dup(2)
        self.start()

    def arm(self, nodeid, seconds):
        with self.cond:
            self.nodeid, self.seconds, self.started_at = nodeid, float(seconds), time.monotonic()
            self.where = "setting the test up"
            self.cond.notify()
        faulthandler.dump_traceback_later(seconds + _REPORT_GRACE + _BACKSTOP_GRACE, exit=True, file=self.stderr)

    def phase(self, where):
        with self.cond:
            self.where = where

    def disarm(self):
        faulthandler.cancel_dump_traceback_later()
        with self.cond:
            self.nodeid = None
            self.cond.notify()

    def stop(self):
        self.disarm()
        with self.cond:
            self.stopping = True
            self.cond.notify()

    def run(self):
        with self.cond:
            while not self.stopping:
                if self.nodeid is None:
                    self.cond.wait()
                    continue
                left = self.started_at + self.seconds - time.monotonic()
                if left > 0:
                    self.cond.wait(left)
                    continue
                self._expire(self.nodeid, self.seconds, self.where)

    def _write(self, text):
        os.write(self.stderr, text.encode(errors="replace"))

    def _expire(self, nodeid, seconds, where):
        job = self.job
        capman = job.config.pluginmanager.getplugin("capturemanager")
        captured = ("", "")
        try:
            if capman is not None:
                capman.suspend_global_capture(in_=True)
                captured = capman.read_global_capture()
        except Exception:  # noqa: BLE001 - the report goes on without the captured output
            pass
        self._write(f"\nmeshrt.testing: rank {job.rank} of {job.size}: {nodeid} passed its deadline of {seconds:g} s "
                    f"(--meshrt-deadline, or @meshrt.testing.deadline) while {where}; ending the whole job\n")
        for name, text in zip(("stdout", "stderr"), captured):
            if text:
                self._write(f"--- rank {job.rank}: the test's captured {name} ---\n{text}\n")
        self._write(f"--- rank {job.rank}: the Python stacks of its threads ---\n")
        faulthandler.dump_traceback(file=self.stderr, all_threads=True)
        if _core._in_session():
            # The worker's SIGUSR1 handler writes its flight recorder to the log.
            self._write(f"--- rank {job.rank}: its worker's flight recorder (SIGUSR1, in the log) ---\n")
            os.kill(os.getpid(), signal.SIGUSR1)
        sys.stdout.flush()
        time.sleep(_REPORT_GRACE)
        _core._abort_job(1)
