#!/usr/bin/env bash
# Checks meshrt's MPI test main: usage: harness_selftest.sh <mpiexec> <harness_fixture>
set -u
mpiexec=$1
fixture=$2
fail=0
out=$(mktemp)
trap 'rm -f "$out"' EXIT

# 1. A failing assertion on rank 2 of 4 fails the run and its text shows in the output.
MESHRT_FIXTURE=fail "$mpiexec" -n 4 "$fixture" >"$out" 2>&1
rc=$?
if [ $rc -eq 0 ]; then echo "FAIL: a failure on rank 2 did not fail the run"; fail=1; fi
grep -q "Fixture.FailsOnRankTwo on rank 2" "$out" || { echo "FAIL: rank 2 is not named"; fail=1; }
grep -q "deliberate failure placed on rank 2" "$out" || { echo "FAIL: rank 2's failure text is missing"; fail=1; }
grep -q "Fixture.FailsOnRankTwo (rank 2)" "$out" || { echo "FAIL: no summary line naming rank 2"; fail=1; }
echo "--- failing run (exit $rc) ---"; cat "$out"

# 2. A hung rank: the watchdog names it and the whole job ends well within the timeout.
start=$(date +%s)
MESHRT_FIXTURE=hang MESHRT_TEST_WATCHDOG=3 timeout 40 "$mpiexec" -n 4 "$fixture" >"$out" 2>&1
rc=$?
elapsed=$(( $(date +%s) - start ))
echo "--- hanging run (exit $rc after ${elapsed}s) ---"; cat "$out"
if [ $rc -eq 0 ] || [ $rc -eq 124 ]; then echo "FAIL: the hung run exited $rc (0 = passed, 124 = outer timeout)"; fail=1; fi
grep -q "rank 1 .*Fixture.HangsOnRankOne" "$out" || { echo "FAIL: the hung rank 1 is not named"; fail=1; }
if [ $elapsed -gt 30 ]; then echo "FAIL: the hung run took ${elapsed}s"; fail=1; fi
sleep 1
if pgrep -f "^$fixture" >/dev/null; then
  echo "FAIL: processes left behind:"; pgrep -af "^$fixture"; pkill -9 -f "^$fixture"; fail=1
fi
[ $fail -eq 0 ] && echo "harness self-test passed"
exit $fail
