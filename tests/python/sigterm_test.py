#!/usr/bin/python3
"""SIGTERM from the launcher (scancel, a time limit, Ctrl-C under Open MPI's mpiexec)
reaches a Python program as meshrt.Terminated in rank 0's main, whose finally: blocks run;
then the job ends as SIGTERM ends it, every rank with its report.

usage: sigterm_test.py <mpiexec> <python3 launcher...>
"""
import signal
import subprocess
import sys
import time


def main():
    mpiexec, python = sys.argv[1], sys.argv[2:]
    program = __file__.replace("sigterm_test.py", "sigterm_program.py")
    job = subprocess.Popen([mpiexec, "-n", "2", *python, program], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    line = job.stdout.readline()
    assert "sigterm_program: waiting" in line, f"the program did not start: {line!r} {job.stderr.read()}"
    time.sleep(0.5)  # rank 0 is inside synchronize()
    job.send_signal(signal.SIGTERM)
    out, err = job.communicate(timeout=30)
    sys.stdout.write(line + out)
    sys.stderr.write(err)
    assert "main raised meshrt.Terminated: SIGTERM: the job is being ended" in out, "no Terminated in main"
    assert "sigterm_program: finally ran on rank 0" in out, "the finally: block did not run"
    for rank in (0, 1):
        assert f"meshrt: rank {rank} on " in err and "SIGTERM (scancel, a time limit" in err, f"no report of rank {rank}"
    print("sigterm_test: main's finally ran, and every rank reported")


if __name__ == "__main__":
    main()
