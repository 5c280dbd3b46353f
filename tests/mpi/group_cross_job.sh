#!/usr/bin/env bash
# A StatelessGroup across two separately launched MPI jobs (a 2-rank "trainer" that
# accepts and a 1-rank "service" that connects). Open MPI 4.1 needs a rendezvous
# server for two mpiexec jobs to find each other: ompi-server, whose URI both mpiexec
# invocations get with --ompi-server file:<uri>. The port name itself goes through a
# file written atomically by the accepting job.
# usage: group_cross_job.sh <mpiexec> <group_cross_job binary>
set -u
mpiexec=$1
prog=$2
dir=$(mktemp -d)
server_pid=""
cleanup() {
  [ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null
  rm -rf "$dir"
}
trap cleanup EXIT

root=()
[ "$(id -u)" = 0 ] && root=(--allow-run-as-root)

ompi-server --no-daemonize -r "$dir/uri" &
server_pid=$!
for _ in $(seq 100); do [ -s "$dir/uri" ] && break; sleep 0.1; done
[ -s "$dir/uri" ] || { echo "FAIL: ompi-server did not write its URI"; exit 1; }

launch=("$mpiexec" "${root[@]}" --oversubscribe --ompi-server "file:$dir/uri")
"${launch[@]}" -n 2 "$prog" accept "$dir/port" >"$dir/accept.log" 2>&1 &
accept_pid=$!
"${launch[@]}" -n 1 "$prog" connect "$dir/port" >"$dir/connect.log" 2>&1 &
connect_pid=$!
wait "$accept_pid"; accept_rc=$?
wait "$connect_pid"; connect_rc=$?

echo "--- accepting job (exit $accept_rc) ---"; cat "$dir/accept.log"
echo "--- connecting job (exit $connect_rc) ---"; cat "$dir/connect.log"
fail=0
[ "$accept_rc" = 0 ] || { echo "FAIL: accepting job exited $accept_rc"; fail=1; }
[ "$connect_rc" = 0 ] || { echo "FAIL: connecting job exited $connect_rc"; fail=1; }
[ "$(grep -c 'every operation worked' "$dir/accept.log" "$dir/connect.log" | awk -F: '{s+=$2} END {print s}')" = 3 ] ||
  { echo "FAIL: not all 3 group ranks finished every operation"; fail=1; }
if grep -qiE 'broken pipe|ERROR|abort' "$dir/accept.log" "$dir/connect.log"; then
  echo "FAIL: errors in the jobs' output"; fail=1
fi
[ $fail = 0 ] && echo "cross-job group test passed"
exit $fail
