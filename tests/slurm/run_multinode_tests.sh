#!/bin/bash
# meshrt across nodes, on one host: a throw-away Slurm cluster of two nodes, each a
# network namespace of its own (its own address on a private bridge, its own hostname),
# runs slurm/meshrt-multinode.sbatch at 2 nodes x 2 ranks and checks where every rank
# ran and that the bytes between the nodes went over the network.
#
#   tests/slurm/run_multinode_tests.sh <build-dir>
#
# The cluster (docs/running.md, "Testing the templates"): slurmctld on the host, at the bridge's address;
# per node a namespace with a veth pair into the bridge (10.213.N.11, .12), a UTS
# namespace named n1 / n2 (MPI_Get_processor_name, meshrt-info's host column), an
# /etc/hosts of its own naming both nodes, a /tmp of its own, and a slurmd started inside
# it with -N. Open MPI sees two nodes (PMIx from Slurm), so ranks of
# different nodes talk over its TCP BTL through the veths, never shared memory. No traffic
# leaves the host: the bridge has no uplink. Everything (namespaces, links, daemons,
# files) is removed on exit, whatever happens.
#
# Jobs, each through the multinode template with 2 nodes x 2 tasks:
#   info      meshrt-info: ranks 0,1 on n1 and 2,3 on n2, local ranks 0,1 on each
#             node, the device each chooses (emulated, 2 per node: 0,1 on each node)
#   demo      meshrt-demo on CPU meshes: its verification against one process passes,
#             and the veths carried at least the bytes the demo's cross-node
#             reductions move (counted from their counters before and after)
#   demo-emu  meshrt-demo on the emulated accelerator (MESHRT_EMULATED_DEVICES=2)
#   demo-tree meshrt-demo with the fan-out and status trees on (threshold 0, fan-out 2)
#   killed    a rank of n2 killed mid-job: the job ends, naming the rank and n2
#   scancel   the job cancelled mid-run: every rank reports SIGTERM with its last commands
#             and writes its own timeline file (MESHRT_TRACE); the four merge into one
#   badnic    OMPI_MCA_btl_tcp_if_include naming an interface no node has: the job fails
#             at start, each rank naming the setting, its node and the node's interfaces
#   nodeloss  n2 lost whole (every process of its namespace killed, slurmd included): the
#             heartbeat ring (MESHRT_PEER_TIMEOUT=5) names a rank of n2 and ends the job
# MULTINODE_JOBS="info demo" runs only those; MULTINODE_BENCH=DIR runs the benchmark
# suites at one rank per node instead (docs/benchmarks.md, "Between two nodes").
# Needs root and iproute2; installs slurm-wlm and munge when missing. About 70 s.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_DIR="$(cd "$SCRIPT_DIR/../.." && pwd)"
[[ $# -ge 1 ]] || { echo "usage: $0 <build-dir>" >&2; exit 2; }
BUILD_DIR="$(cd "$1" && pwd)"
JOB_TIMEOUT="${JOB_TIMEOUT:-150}"
export PATH="$PATH:/usr/sbin:/sbin"

log() { echo "[multinode] $*"; }
die() { echo "[multinode] FAIL: $*" >&2; exit 1; }
# shellcheck source=tests/slurm/cluster.sh
source "$SCRIPT_DIR/cluster.sh"

[[ $(id -u) -eq 0 ]] || die "needs root (network namespaces, slurmd as root)"
command -v ip >/dev/null || die "needs iproute2 (ip)"
if ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
    log "installing slurm-wlm and munge"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
fi
for p in meshrt-info meshrt-demo; do [[ -x "$BUILD_DIR/apps/$p" ]] || die "not built: $BUILD_DIR/apps/$p"; done

# Not under /tmp: each node mounts a /tmp of its own over it (PMIx and Open MPI keep
# per-node files there, named the same on every node).
TMP="$(mktemp -d /var/tmp/meshrt-multinode.XXXXXX)"
chmod 0755 "$TMP"
mkdir -p "$TMP"/{state,log,run,munge,jobs,dev,tmp-n1,tmp-n2}
ID=$(( RANDOM % 200 + 20 ))          # the bridge's subnet 10.213.ID.0/24 and names
BR="mrbr$ID"
NODES=(n1 n2)
NS=()
PIDS=()
STEPDS_BEFORE="$(pgrep -x slurmstepd 2>/dev/null | tr '\n' ' ' || true)"

cleanup() {
    local rc=$?
    set +e
    if [[ -n "${CTLD_PID:-}" ]] && kill -0 "$CTLD_PID" 2>/dev/null; then
        scancel --quiet --user=root >/dev/null 2>&1
        for _ in $(seq 50); do [[ -z "$(squeue -h -o %i 2>/dev/null)" ]] && break; sleep 0.1; done
    fi
    stop_daemons
    # Whatever still runs in a node's namespace (a stepd, a rank) goes with it.
    for ns in "${NS[@]}"; do
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null; done
        ip netns del "$ns" 2>/dev/null
        rm -rf "/etc/netns/$ns"
    done
    kill_new_stepds
    ip link del "$BR" 2>/dev/null
    if [[ $rc -ne 0 ]]; then
        for f in "$TMP"/log/*.log; do [[ -f "$f" ]] && { echo "----- tail of $f" >&2; tail -n 20 "$f" >&2; }; done
    fi
    if [[ "${KEEP_TMP:-0}" == 1 || $rc -ne 0 ]]; then echo "[multinode] files kept in $TMP" >&2; else rm -rf "$TMP"; fi
    exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---------------------------------------------------------------- network --
NET="10.213.$ID"
ip link add "$BR" type bridge
ip addr add "$NET.1/24" dev "$BR"
ip link set "$BR" up
HOSTS="$NET.1 meshrt-ctl
$NET.11 n1
$NET.12 n2
127.0.0.1 localhost"
for i in "${!NODES[@]}"; do
    node=${NODES[i]}; ns="mr$ID-$node"; addr="$NET.$((11 + i))"
    ip netns add "$ns"; NS+=("$ns")
    ip link add "mr$ID-h$i" type veth peer name "mr$ID-e$i"
    ip link set "mr$ID-h$i" master "$BR" up
    ip link set "mr$ID-e$i" netns "$ns"
    ip -n "$ns" link set lo up
    ip -n "$ns" link set "mr$ID-e$i" name eth0
    ip -n "$ns" addr add "$addr/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" route add default via "$NET.1"
    mkdir -p "/etc/netns/$ns"
    printf '%s\n' "$HOSTS" >"/etc/netns/$ns/hosts"
done
log "bridge $BR $NET.1/24; nodes n1 $NET.11, n2 $NET.12 (namespaces ${NS[*]})"

# ------------------------------------------------------------------ munge --
start_munge "$TMP/munge" "$TMP/log"

# ------------------------------------------------------------- slurm.conf --
CTLD_PORT=$(( 20000 + RANDOM % 30000 ))
SLURMD_PORT=$(( CTLD_PORT + 1 ))        # one per namespace: the same number on each node
CPUS=2                                   # per node; the host's cores are shared
export SLURM_CONF="$TMP/slurm.conf"
cat >"$SLURM_CONF" <<EOF
# two-node test cluster written by tests/slurm/run_multinode_tests.sh
ClusterName=meshrt-multinode
SlurmctldHost=$(hostname -s)($NET.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET
StateSaveLocation=$TMP/state
SlurmdSpoolDir=$TMP/spool/%n
SlurmctldPidFile=$TMP/run/slurmctld.pid
SlurmdPidFile=$TMP/run/slurmd-%n.pid
SlurmctldLogFile=$TMP/log/slurmctld.log
SlurmdLogFile=$TMP/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
MpiDefault=pmix
GresTypes=gpu
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=2
MinJobAge=60
MessageTimeout=10
NodeName=n1 NodeHostname=n1 NodeAddr=$NET.11 CPUs=$CPUS Gres=gpu:2 State=UNKNOWN
NodeName=n2 NodeHostname=n2 NodeAddr=$NET.12 CPUs=$CPUS Gres=gpu:2 State=UNKNOWN
PartitionName=test Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
EOF
# Two stand-in GPUs per node, so that --gpus-per-node schedules and Slurm sets
# CUDA_VISIBLE_DEVICES per node as on a GPU node.
{
    echo "AutoDetect=off"
    for node in "${NODES[@]}"; do
        for g in 0 1; do touch "$TMP/dev/$node-gpu$g"; done
        echo "NodeName=$node Name=gpu File=$TMP/dev/$node-gpu[0-1]"
        mkdir -p "$TMP/spool/$node"
    done
} >"$TMP/gres.conf"

slurmctld -D -i -f "$SLURM_CONF" >"$TMP/log/slurmctld.out" 2>&1 &
CTLD_PID=$!; PIDS+=($!)
for i in "${!NODES[@]}"; do
    node=${NODES[i]}
    # nsenter, not ip netns exec: that one mounts a fresh /sys without the cgroup tree that
    # slurmd's cgroup plugin reads; the node's /etc/hosts is bind-mounted here instead.
    # A checkout or build under /tmp (a CI clone) stays visible through the node's own /tmp.
    keep=""
    for d in "$REPO_DIR" "$BUILD_DIR"; do
        if [[ "$d" == /tmp/* ]]; then
            mkdir -p "$TMP/tmp-$node/${d#/tmp/}"
            keep+="mount --bind $d $TMP/tmp-$node/${d#/tmp/} && "
        fi
    done
    nsenter --net="/run/netns/${NS[i]}" unshare --uts --mount sh -c \
        "mount --bind /etc/netns/${NS[i]}/hosts /etc/hosts && $keep mount --rbind $TMP/tmp-$node /tmp && hostname $node &&
         exec slurmd -D -N $node -f $SLURM_CONF" \
        >"$TMP/log/slurmd-$node.out" 2>&1 &
    PIDS+=($!)
    disown "$!"   # the node-loss job kills it: no "Killed" notice from bash
done
for _ in $(seq 300); do
    kill -0 "$CTLD_PID" 2>/dev/null || die "slurmctld exited (see $TMP/log)"
    [[ "$(sinfo -h -o '%T' 2>/dev/null | sort -u | tr '\n' ' ')" == "idle " ]] && break
    sleep 0.1
done
[[ "$(sinfo -h -o '%T' 2>/dev/null | sort -u | tr '\n' ' ')" == "idle " ]] ||
    die "the nodes are not idle: $(sinfo -h -o '%N %T %E' 2>/dev/null | tr '\n' ';')"
log "nodes n1, n2 idle (slurmctld $NET.1:$CTLD_PORT)"
timeout 30 srun --mpi=none -N 2 --ntasks-per-node=1 hostname >"$TMP/jobs/hostname.out" 2>&1 ||
    die "srun -N 2 hostname failed: $(cat "$TMP/jobs/hostname.out")"
[[ "$(sort "$TMP/jobs/hostname.out" | tr '\n' ' ')" == "n1 n2 " ]] ||
    die "srun -N 2 hostname: expected n1 and n2, found: $(cat "$TMP/jobs/hostname.out")"

# ------------------------------------------------------------------- jobs --
# Bytes through both nodes' veths (transmitted by n1 plus by n2).
veth_bytes() {
    local total=0 i b
    for i in "${!NODES[@]}"; do
        b=$(ip netns exec "${NS[i]}" cat /sys/class/net/eth0/statistics/tx_bytes)
        total=$(( total + b ))
    done
    echo "$total"
}

export OMPI_MCA_mpi_yield_when_idle=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export SHOW_RANKS=1
FAILED=()
# MULTINODE_JOBS="info demo ...": run only these jobs (default: all).
wanted() { [[ -z "${MULTINODE_JOBS:-}" || " $MULTINODE_JOBS " == *" $1 "* ]]; }

# run_job NAME [VAR=value...] -- PROGRAM ARGS...: the template at 2 nodes x TASKS_PER_NODE
# tasks, waited for; sets JOB_RC and JOB_OUT.
TASKS_PER_NODE=2
run_job() {
    local name=$1; shift
    local env=()
    while [[ $1 != -- ]]; do env+=("$1"); shift; done
    shift
    JOB_OUT="$TMP/jobs/$name.out"
    # The template asks 4 tasks per node on GPU nodes: this cluster has 2 CPUs a node.
    sed -e "s/^#SBATCH --ntasks-per-node=.*/#SBATCH --ntasks-per-node=$TASKS_PER_NODE/" \
        -e 's/^#SBATCH --cpus-per-task=.*/#SBATCH --cpus-per-task=1/' \
        -e 's/^#SBATCH --gpus-per-node=.*/#SBATCH --gpus-per-node=2/' \
        "$REPO_DIR/slurm/meshrt-multinode.sbatch" >"$TMP/jobs/$name.sbatch"
    JOB_RC=0
    env "${env[@]}" PROGRAM="$1" PROGRAM_ARGS="${*:2}" MESHRT_LOG_DIR="$TMP/jobs/$name-logs" \
        timeout "$JOB_TIMEOUT" sbatch --wait --quiet --chdir="$TMP/jobs" --job-name="$name" --output="$JOB_OUT" \
        "$TMP/jobs/$name.sbatch" >"$TMP/jobs/$name.sbatch.log" 2>&1 || JOB_RC=$?
}
fail_job() {
    echo "[multinode]   $1: $2" >&2
    echo "----- $JOB_OUT" >&2; tr -d '\000' <"$JOB_OUT" >&2 2>/dev/null; cat "$TMP/jobs/$1.sbatch.log" >&2; echo "-----" >&2
    FAILED+=("$1")
}
expect_line() {  # NAME REGEX: a line of the job's output matches
    grep -aEq -- "$2" "$JOB_OUT" || { fail_job "$1" "no line matches /$2/"; return 1; }
}

rank_pid() {  # NODE_INDEX RANK: the pid of that rank's program in the node's namespace
    local pid
    for pid in $(ip netns pids "${NS[$1]}" 2>/dev/null); do
        [[ "$(readlink "/proc/$pid/exe" 2>/dev/null)" == "$BUILD_DIR/apps/meshrt-demo" ]] || continue
        tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx "SLURM_PROCID=$2" && { echo "$pid"; return; }
    done
}

# MULTINODE_BENCH=DIR: instead of the tests, the benchmark suites between the two nodes,
# one rank per node, so that every byte crosses the veths; their output goes to DIR.
if [[ -n "${MULTINODE_BENCH:-}" ]]; then
    mkdir -p "$MULTINODE_BENCH"
    TASKS_PER_NODE=1
    JOB_TIMEOUT=900
    bench() {  # NAME [VAR=value...] -- PROGRAM ARGS...
        local name=$1 start=$SECONDS
        run_job "$@"
        tr -d '\000' <"$JOB_OUT" >"$MULTINODE_BENCH/$name.txt"
        [[ $JOB_RC -eq 0 ]] || fail_job "$name" "exit code $JOB_RC"
        log "  $name: $(( SECONDS - start )) s, rc $JOB_RC -> $MULTINODE_BENCH/$name.txt"
    }
    bench bench-collectives -- "$BUILD_DIR/apps/meshrt-bench" collectives
    bench bench-runtime -- "$BUILD_DIR/apps/meshrt-bench" runtime-collectives --reps=3 --max-bytes=16777216
    bench bench-group -- "$BUILD_DIR/apps/meshrt-bench" group
    bench bench-python-group PYTHONPATH="$BUILD_DIR/python" -- /usr/bin/python3 -m meshrt_bench group
    [[ ${#FAILED[@]} -eq 0 ]] || die "${#FAILED[@]} benchmark job(s) failed: ${FAILED[*]}"
    exit 0
fi

# start_long_demo NAME [VAR=value...]: the demo for a million steps at 2 nodes x 2 ranks, in
# the background (job: its pid), once rank 3 runs on n2 (victim: its pid) and a step is
# out. Fails the job and returns 1 if rank 3 never started.
start_long_demo() {
    local name=$1; shift
    run_job "$name" "$@" -- "$BUILD_DIR/apps/meshrt-demo" --mesh 2x2 --steps 1000000 --hidden 64 --log-every 1000 &
    job=$!
    victim=""
    for _ in $(seq 300); do
        victim=$(rank_pid 1 3)
        [[ -n "$victim" ]] && grep -aq "step" "$TMP/jobs/$name.out" 2>/dev/null && break
        sleep 0.1
    done
    if [[ -z "$victim" ]]; then
        wait "$job"; JOB_OUT="$TMP/jobs/$name.out"; fail_job "$name" "rank 3 never started on n2"
        return 1
    fi
    sleep 1
}

# 1. Where each rank runs: node, local rank, and the device chosen from it.
if wanted info; then
run_job info MESHRT_ACCELERATOR=emulated MESHRT_EMULATED_DEVICES=2 -- "$BUILD_DIR/apps/meshrt-info"
if [[ $JOB_RC -ne 0 ]]; then
    fail_job info "exit code $JOB_RC"
else
    ok=1
    for r in 0 1 2 3; do
        node=n$(( r / 2 + 1 )); lr=$(( r % 2 ))
        expect_line info "^meshrt-job: rank $r local $lr host $node " || ok=0
        expect_line info "^ +$r +$node +$lr +2 +emulated:$lr( |$)" || ok=0
    done
    [[ $ok == 1 ]] && log "  ok: info (ranks 0,1 on n1 and 2,3 on n2; local ranks and devices 0,1 on each)"
fi
fi

# 2. The demo on CPU meshes, its verification against one process, bytes on the veths.
if wanted demo; then
before=$(veth_bytes)
run_job demo -- "$BUILD_DIR/apps/meshrt-demo" --mesh 2x2 --steps 30 --hidden 256 --log-every 10
moved=$(( $(veth_bytes) - before ))
if [[ $JOB_RC -ne 0 ]]; then
    fail_job demo "exit code $JOB_RC"
elif expect_line demo "verification passed|PASS"; then
    # dp is the outer dimension (ranks 0,1 | 2,3): its gradient all_reduce crosses the
    # nodes every step. Through shared memory the veths would carry only Slurm's and
    # PMIx's few kilobytes.
    (( moved > 1048576 )) || fail_job demo "the veths carried $moved bytes, expected over 1 MiB"
    log "  ok: demo on CPU across n1, n2 (verification passed; $moved bytes over the veths)"
fi
fi

# 3. The demo on the emulated accelerator: device communicators across nodes.
if wanted demo-emu; then
run_job demo-emu MESHRT_ACCELERATOR=emulated MESHRT_EMULATED_DEVICES=2 -- \
    "$BUILD_DIR/apps/meshrt-demo" --mesh 2x2 --steps 30 --hidden 64 --log-every 10
if [[ $JOB_RC -ne 0 ]]; then
    fail_job demo-emu "exit code $JOB_RC"
elif expect_line demo-emu "verification passed|PASS"; then
    log "  ok: demo on the emulated accelerator across n1, n2"
fi
fi

# 3b. The demo with the fan-out and status trees on (threshold 0, two children a node):
# batches and Status travel rank to rank across the nodes.
if wanted demo-tree; then
run_job demo-tree MESHRT_FANOUT_THRESHOLD=0 MESHRT_FANOUT=2 -- \
    "$BUILD_DIR/apps/meshrt-demo" --mesh 2x2 --steps 30 --hidden 64 --log-every 10
if [[ $JOB_RC -ne 0 ]]; then
    fail_job demo-tree "exit code $JOB_RC"
elif expect_line demo-tree "verification passed|PASS"; then
    log "  ok: demo across n1, n2 with the fan-out and status trees"
fi
fi

# 4. A rank of n2 killed mid-job: the job ends (no rank waits on), and its output names
# the rank and the node. run_job waits, so the job runs in the background here.
if wanted killed && start_long_demo killed; then
    kill -KILL "$victim"
    killed_at=$SECONDS
    wait "$job"; JOB_OUT="$TMP/jobs/killed.out"
    took=$(( SECONDS - killed_at ))
    if ! grep -aq '^meshrt-job: exit code [1-9]' "$JOB_OUT"; then
        fail_job killed "the job did not end with an error after rank 3 was killed"
    elif expect_line killed "^srun: error: n2: task 3: Killed"; then
        log "  ok: killed (rank 3 on n2 killed; the job ended ${took} s later: $(grep -aEm1 "^srun: error: n2: task 3" "$JOB_OUT"))"
    fi
fi

# 4b. scancel mid-job: each rank says it got SIGTERM and shows its last commands, on its
# node, before the job ends (Slurm's KillWait, 2 s here, before SIGKILL). The controller
# runs far ahead of the workers: a recorder of 10^5 commands still holds the ones that
# ran behind the queued ones. With MESHRT_TRACE each rank's report names its timeline
# file, which it writes next (the line it prints once written may be lost: Slurm ends the
# batch script, and srun with it, a moment after the SIGTERM), and meshrt-trace merges
# the four files into one that passes its check (rings of 4096
# events: written well within KillWait; so short that the controller's newest calls, far
# ahead, have not run yet on the workers, whose tails are older: no flows required).
trace_stem="$TMP/jobs/scancel-trace.json"
if wanted scancel && start_long_demo scancel MESHRT_FLIGHT_RECORDER=100000 MESHRT_TRACE="$trace_stem" \
    MESHRT_TRACE_EVENTS=4096; then
    scancel --name=scancel
    wait "$job"; JOB_OUT="$TMP/jobs/scancel.out"
    ok=1
    for r in 0 1 2 3; do
        node=n$(( r / 2 + 1 ))
        expect_line scancel "^meshrt: rank $r on $node: SIGTERM \\(scancel, a time limit or the launcher is ending the job\\); what it did last:" || ok=0
        expect_line scancel "^flight recorder of rank $r on $node \\(the last [0-9]+ commands that ran" || ok=0
        expect_line scancel "^meshrt: rank $r on $node: writing its timeline so far to $trace_stem\\.rank$r\\.json \\(MESHRT_TRACE\\)" || ok=0
        [[ -s "$trace_stem.rank$r.json" ]] || { fail_job scancel "rank $r wrote no $trace_stem.rank$r.json"; ok=0; }
    done
    expect_line scancel "^  #[0-9]+ +(done|running) +(CallFunction|Reduce)" || ok=0
    if [[ $ok == 1 ]] && ! merged=$("$REPO_DIR/apps/meshrt-trace/meshrt-trace" merge "$trace_stem" "$trace_stem".rank*.json 2>&1 &&
        "$REPO_DIR/apps/meshrt-trace/meshrt-trace" check "$trace_stem" --ranks 4 --partial 2>&1); then
        fail_job scancel "the ranks' timeline files did not merge into a valid one: $merged"
        ok=0
    fi
    [[ $ok == 1 ]] && log "  ok: scancel (each rank reported SIGTERM with its last commands and wrote its timeline, named by node)"
fi

# 5. A network interface that n1 and n2 lack, named for Open MPI's TCP transport: the
# job fails at start, each rank naming the setting and its node's interfaces.
if wanted badnic; then
start=$SECONDS
run_job badnic OMPI_MCA_btl_tcp_if_include=eth9 -- "$BUILD_DIR/apps/meshrt-demo" --mesh 2x2 --steps 3
took=$(( SECONDS - start ))
if [[ $JOB_RC -eq 0 ]] || ! grep -aq '^meshrt-job: exit code [1-9]' "$JOB_OUT"; then
    fail_job badnic "expected the job to fail at start"
elif expect_line badnic "^meshrt: rank [0-9] on n2: setting OMPI_MCA_btl_tcp_if_include=eth9: expected an interface of this node .*it has .*eth0 \\(10\\.213\\.$ID\\.12\\)"; then
    log "  ok: badnic (failed at start in ${took} s: $(grep -aEm1 "^meshrt: rank [0-9] on n2" "$JOB_OUT" | cut -c1-150)...)"
fi
fi

# 6. Node n2 lost mid-job: every process of its namespace (its slurmd, the step daemon,
# both ranks) killed at once, as a node that loses power. Nothing closes the connections
# from n1 in an orderly way, and Slurm notices the node only after SlurmdTimeout; meshrt's
# heartbeat ring (MESHRT_PEER_TIMEOUT) names the silent rank and its node and ends the
# job. Last: n2 stays down.
if wanted nodeloss && start_long_demo nodeloss MESHRT_PEER_TIMEOUT=5; then
    ip netns pids "${NS[1]}" | xargs -r kill -KILL
    killed_at=$SECONDS
    wait "$job"; JOB_OUT="$TMP/jobs/nodeloss.out"
    took=$(( SECONDS - killed_at ))
    if ! grep -aq '^meshrt-job: exit code [1-9]' "$JOB_OUT"; then
        fail_job nodeloss "the job did not end with an error after n2 was lost"
    elif (( took > 90 )); then
        fail_job nodeloss "the job ended ${took} s after n2 was lost, expected within 90 s (MESHRT_PEER_TIMEOUT=5; srun itself may wait up to MessageTimeout for the dead node)"
    elif expect_line nodeloss "^meshrt: rank [0-9] on n1: rank [23] on n2 has sent no heartbeat for 5 s"; then
        log "  ok: nodeloss (n2 lost; the job ended ${took} s later: $(grep -aEm1 "^meshrt: rank [0-9] on n1: rank" "$JOB_OUT" | cut -c1-110)...)"
    fi
fi

[[ ${#FAILED[@]} -eq 0 ]] || die "${#FAILED[@]} job(s) failed: ${FAILED[*]}"
log "all multinode jobs passed in $SECONDS s"
