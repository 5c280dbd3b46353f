#!/bin/bash
# Runs the sbatch templates in slurm/ on a throw-away one-node Slurm cluster.
#
#   tests/slurm/run_slurm_tests.sh <build-dir>
#
# Everything lives in a temporary folder: slurm.conf, gres.conf, a munge key,
# state/spool/log dirs, and the job output files. The script starts its own
# munged (unless one already runs), slurmctld and slurmd as background
# processes, submits every template with `sbatch --wait`, checks the exit code
# and the output file of each job, and stops every daemon it started (by pid)
# on exit, also when a step fails. It needs root (Slurm's daemons, SlurmUser=root)
# and installs slurm-wlm and munge with apt-get when they are missing.
#
# The node is the machine itself, described with its real CPU/socket/core counts
# from `slurmd -C`, plus 4 fake GPUs (gres.conf pointing at stand-in device
# nodes in the temp folder) so the GPU templates' --gpus-per-node is scheduled
# and Slurm sets CUDA_VISIBLE_DEVICES as on a GPU node. Jobs run 4 ranks; on a
# machine with fewer CPUs they use --overcommit (see submit_job), and all four
# jobs are submitted at once. The whole run takes about 12 s.
#
# Programs under test:
#   <build>/apps/meshrt-info      run by meshrt.sbatch, meshrt-cpu.sbatch and
#                                 meshrt-multinode.sbatch (override: MESHRT_INFO)
#   ctest in <build>              run by meshrt-ctest.sbatch with CTEST_ARGS
#                                 (default "-L slurm-smoke")
# Other knobs (environment):
#   MESHRT_INFO_ARGS   arguments for the program (default: none)
#   EXPECT_PATTERN     extended regexp that at least 4 lines (one per rank) of
#                      the program's output must match in each meshrt-info job
#                      (default: the node's name, which meshrt-info's rank
#                      table prints for every rank)
#   CHECK_PMI=1        also run the program with srun --mpi=pmix and --mpi=pmi2
#                      and report which works (informational, never fails)
#   KEEP_TMP=1         keep the temporary folder (printed at the end)
#   JOB_TIMEOUT        seconds one job may take (default 120)
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_DIR="$(cd "$SCRIPT_DIR/../.." && pwd)"
TEMPLATE_DIR="$REPO_DIR/slurm"

if [[ $# -lt 1 ]]; then
    echo "usage: $0 <build-dir>" >&2
    exit 2
fi
BUILD_DIR="$(cd "$1" && pwd)"
MESHRT_INFO="${MESHRT_INFO:-$BUILD_DIR/apps/meshrt-info}"
MESHRT_INFO_ARGS="${MESHRT_INFO_ARGS:-}"
CTEST_ARGS="${CTEST_ARGS:--L slurm-smoke}"
JOB_TIMEOUT="${JOB_TIMEOUT:-120}"
NTASKS=4

log() { echo "[slurm-test] $*"; }
die() { echo "[slurm-test] FAIL: $*" >&2; exit 1; }
# shellcheck source=tests/slurm/cluster.sh
source "$SCRIPT_DIR/cluster.sh"

# ---------------------------------------------------------------- packages --
APT_LINE="apt-get install -y --no-install-recommends slurm-wlm munge"
missing=()
for cmd in slurmctld slurmd sbatch srun sinfo munged mungekey; do
    command -v "$cmd" >/dev/null 2>&1 || PATH="$PATH:/usr/sbin:/sbin" command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd")
done
export PATH="$PATH:/usr/sbin:/sbin"
if [[ ${#missing[@]} -gt 0 ]]; then
    if [[ $(id -u) -ne 0 ]]; then
        echo "[slurm-test] missing: ${missing[*]}; as root, run:" >&2
        echo "  $APT_LINE" >&2
        exit 1
    fi
    log "installing slurm-wlm and munge: $APT_LINE"
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends slurm-wlm munge
fi
if [[ $(id -u) -ne 0 ]]; then
    echo "[slurm-test] this test starts slurmctld/slurmd (SlurmUser=root) and must run as root" >&2
    echo "  (to install the packages: $APT_LINE)" >&2
    exit 1
fi
[[ -x "$MESHRT_INFO" ]] || die "program not found: $MESHRT_INFO (build meshrt-info, or set MESHRT_INFO)"
command -v ctest >/dev/null || die "ctest not found"

# ------------------------------------------------------------ temp folder --
TMP="$(mktemp -d /tmp/meshrt-slurm.XXXXXX)"
chmod 0755 "$TMP"
PIDS=()          # daemons we started, stopped in reverse order
NAMES=()
STEPDS_BEFORE="$(pgrep -x slurmstepd 2>/dev/null | tr '\n' ' ' || true)"

cleanup() {
    local rc=$?
    set +e
    if [[ -n "${SLURM_CONF:-}" && -f "${SLURM_CONF}" ]] && kill -0 "${CTLD_PID:-0}" 2>/dev/null; then
        # jobs still on our own cluster (SLURM_CONF points at it): cancel, wait a bit
        scancel --quiet --user=root >/dev/null 2>&1
        for _ in $(seq 50); do
            [[ -z "$(squeue -h -o %i 2>/dev/null)" ]] && break; sleep 0.1
        done
    fi
    stop_daemons
    kill_new_stepds
    if [[ $rc -ne 0 ]]; then
        for f in "$TMP"/log/*.log; do
            [[ -f "$f" ]] || continue
            echo "----- tail of $f" >&2
            tail -n 25 "$f" >&2
        done
    fi
    if [[ "${KEEP_TMP:-0}" == 1 || $rc -ne 0 ]]; then
        echo "[slurm-test] files kept in $TMP" >&2
    else
        rm -rf "$TMP"
    fi
    exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

mkdir -p "$TMP"/{state,spool,log,run,munge,jobs}

# ------------------------------------------------------------------ ports --
port_in_use() { ss -Htan "( sport = :$1 )" 2>/dev/null | grep -q .; }
free_port() {
    local p
    for _ in $(seq 200); do
        p=$(( 20000 + RANDOM % 30000 ))
        port_in_use "$p" || port_in_use "$((p + 1))" || { echo "$p"; return; }
    done
    die "no free port found"
}
CTLD_PORT=$(free_port)
SLURMD_PORT=$(( CTLD_PORT + 1 ))

# ------------------------------------------------------------------ munge --
MUNGE_AUTHINFO=""
if pgrep -x munged >/dev/null; then
    log "using the munged that already runs"
else
    start_munge "$TMP/munge" "$TMP/log"
    NAMES+=(munged)
    MUNGE_AUTHINFO="AuthInfo=socket=$MUNGE_SOCKET"
    log "munged started (pid ${PIDS[-1]}, socket $MUNGE_SOCKET)"
fi

# ------------------------------------------------------------- slurm.conf --
NODE_LINE="$(slurmd -C | head -n 1)"          # NodeName=... CPUs=... Sockets... RealMemory=...
NODE_NAME="$(sed -n 's/^NodeName=\([^ ]*\).*/\1/p' <<<"$NODE_LINE")"
[[ -n "$NODE_NAME" ]] || die "could not parse 'slurmd -C': $NODE_LINE"
NODE_HW="$(sed -e 's/^NodeName=[^ ]* //' -e 's/RealMemory=[0-9]*//' <<<"$NODE_LINE")"
HOST="$(hostname -s)"
EXPECT_PATTERN="${EXPECT_PATTERN:-\\b($NODE_NAME|$HOST)\\b}"

export SLURM_CONF="$TMP/slurm.conf"
cat >"$SLURM_CONF" <<EOF
# one-node test cluster written by tests/slurm/run_slurm_tests.sh
ClusterName=meshrt-test
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/munge
CredType=cred/munge
$MUNGE_AUTHINFO
StateSaveLocation=$TMP/state
SlurmdSpoolDir=$TMP/spool/%n
SlurmctldPidFile=$TMP/run/slurmctld.pid
SlurmdPidFile=$TMP/run/slurmd-%n.pid
SlurmctldLogFile=$TMP/log/slurmctld.log
SlurmdLogFile=$TMP/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=${SLURMD_DEBUG:-info}
# no cgroups
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
# schedule a submitted batch job at once (default: may wait up to 3 s)
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
MpiDefault=pmix
GresTypes=gpu
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=2
MinJobAge=60
MessageTimeout=10
NodeName=$NODE_NAME NodeAddr=127.0.0.1 $NODE_HW Gres=gpu:4 State=UNKNOWN
PartitionName=test Nodes=$NODE_NAME Default=YES MaxTime=INFINITE State=UP
EOF
# 4 fake GPUs: empty files stand in for /dev/nvidia0..3 (no cgroups, so Slurm
# never opens them); enough for --gpus-per-node, and Slurm sets
# CUDA_VISIBLE_DEVICES=0,1,2,3 in the job like on a real GPU node
mkdir -p "$TMP/dev"
for i in 0 1 2 3; do mknod "$TMP/dev/nvidia$i" c 1 3 2>/dev/null || touch "$TMP/dev/nvidia$i"; done
cat >"$TMP/gres.conf" <<EOF
AutoDetect=off
NodeName=$NODE_NAME Name=gpu File=$TMP/dev/nvidia[0-3]
EOF
mkdir -p "$TMP/spool/$NODE_NAME"
log "slurm.conf: $SLURM_CONF (node $NODE_NAME: $NODE_HW; ports $CTLD_PORT/$SLURMD_PORT)"

# ---------------------------------------------------------------- daemons --
slurmctld -D -i -f "$SLURM_CONF" >"$TMP/log/slurmctld.out" 2>&1 &
PIDS+=($!); NAMES+=(slurmctld); CTLD_PID=$!
slurmd -D -N "$NODE_NAME" -f "$SLURM_CONF" >"$TMP/log/slurmd.out" 2>&1 &
PIDS+=($!); NAMES+=(slurmd)
log "slurmctld pid ${PIDS[-2]}, slurmd pid ${PIDS[-1]}"

state=""
for _ in $(seq 200); do
    for i in "${!PIDS[@]}"; do
        kill -0 "${PIDS[i]}" 2>/dev/null || die "${NAMES[i]} exited (see $TMP/log)"
    done
    state="$(sinfo -h -n "$NODE_NAME" -o %T 2>/dev/null || true)"
    [[ "$state" == idle ]] && break
    [[ "$state" == inval* || "$state" == drain* ]] && break
    sleep 0.1
done
[[ "$state" == idle ]] || die "node $NODE_NAME not idle (state: '${state}'; $(scontrol show node "$NODE_NAME" 2>/dev/null | grep -o 'Reason=.*'))"
log "node $NODE_NAME is idle"
# A first step on the fresh cluster: checks srun end to end, and gets the
# controller's first scheduling pass (slower) out of the way, so that every
# sbatch --wait below sees its job finished at its first poll (2 s).
timeout 30 srun --mpi=none --ntasks=1 --time=1 true || die "srun --ntasks=1 true failed"

if [[ "${CHECK_PMI:-0}" == 1 ]]; then
    # slurm/README.md: Debian's Open MPI starts under srun --mpi=pmix only
    for mpi in pmix pmi2; do
        log "srun --mpi=$mpi --ntasks=2 --overcommit $MESHRT_INFO"
        if OMPI_MCA_mpi_yield_when_idle=1 timeout 30 srun --mpi=$mpi --ntasks=2 --overcommit \
                --time=1 "$MESHRT_INFO" >"$TMP/jobs/srun-$mpi.out" 2>&1; then
            log "  --mpi=$mpi: works"
        else
            log "  --mpi=$mpi: fails:"; grep -a -m 3 -E 'error|ERROR|not built' "$TMP/jobs/srun-$mpi.out" | sed 's/^/      /'
        fi
    done
fi

# ------------------------------------------------------------------- jobs --
export OMPI_MCA_mpi_yield_when_idle=1      # 4 ranks on this machine's cores
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1   # mpirun in the ctest job
export PROGRAM="$MESHRT_INFO" PROGRAM_ARGS="$MESHRT_INFO_ARGS"
export BUILD_DIR CTEST_ARGS
export MESHRT_LOG_DIR="$TMP/jobs/logs"
FAILED=()

# submit_job NAME TEMPLATE PATTERNS [sbatch options...]
# Starts `sbatch --wait` in the background (the jobs run side by side where the
# node has room; sbatch --wait polls at 2 s, then 8 s later, so waiting for the
# jobs one after the other would take far longer). check_job checks it.
# PATTERNS: newline-separated extended regexps that the output file must match.
declare -A JOB_PID JOB_TEMPLATE JOB_PATTERNS
JOB_NAMES=()
submit_job() {
    local name=$1 template=$2 patterns=$3; shift 3
    local out="$TMP/jobs/$name.out" script="$TEMPLATE_DIR/$template"
    if [[ $STRIP_NTASKS_PER_NODE == 1 ]]; then
        # Slurm refuses --ntasks-per-node above the node's CPU count even with
        # --overcommit, and a command-line option cannot remove an #SBATCH line:
        # submit a copy without that one line, with --ntasks instead.
        script="$TMP/jobs/$template"
        sed 's/^#SBATCH --ntasks-per-node=.*/# (run_slurm_tests.sh: --ntasks-per-node replaced by --ntasks --overcommit)/' \
            "$TEMPLATE_DIR/$template" >"$script"
    fi
    log "sbatch --wait $* $template"
    timeout "$JOB_TIMEOUT" sbatch --wait --quiet --chdir="$TMP/jobs" \
        --job-name="$name" --output="$out" "$@" "$script" >"$TMP/jobs/$name.sbatch.log" 2>&1 &
    JOB_PID[$name]=$!; JOB_TEMPLATE[$name]=$template; JOB_PATTERNS[$name]=$patterns
    JOB_NAMES+=("$name")
}
check_job() {
    local name=$1 rc=0 ok=1 pat out="$TMP/jobs/$1.out"
    wait "${JOB_PID[$name]}" || rc=$?
    if [[ $rc -ne 0 ]]; then
        echo "[slurm-test]   $name: sbatch --wait exit code $rc$([[ $rc == 124 ]] && echo " (timed out after $JOB_TIMEOUT s)")" >&2
        cat "$TMP/jobs/$name.sbatch.log" >&2
        ok=0
    fi
    if [[ ! -s "$out" ]]; then
        echo "[slurm-test]   $name: no output file $out" >&2; ok=0
    else
        grep -aq '^meshrt-job: exit code 0$' "$out" \
            || { echo "[slurm-test]   $name: no 'meshrt-job: exit code 0' line" >&2; ok=0; }
        local min n
        while IFS= read -r pat; do
            [[ -z "$pat" ]] && continue
            min=1
            if [[ "$pat" =~ ^([0-9]+)\*(.*)$ ]]; then min=${BASH_REMATCH[1]}; pat=${BASH_REMATCH[2]}; fi
            # '^meshrt-job:' patterns look at the template's own lines, the
            # others only at what the program printed
            # (-a: a program may print a stray NUL byte; still text to us)
            if [[ "$pat" == '^meshrt-job:'* ]]; then
                n=$(grep -aEc -- "$pat" "$out" || true)
            else
                n=$({ grep -av '^meshrt-job:' "$out" || true; } | grep -aEc -- "$pat" || true)
            fi
            (( n >= min )) \
                || { echo "[slurm-test]   $name: $n line(s) match /$pat/, expected at least $min" >&2; ok=0; }
        done <<<"${JOB_PATTERNS[$name]}"
    fi
    if [[ $ok == 1 ]]; then
        log "  ok: $name (${JOB_TEMPLATE[$name]})"
    else
        echo "----- $out" >&2; tr -d '\000' <"$out" >&2 2>/dev/null || true; echo "-----" >&2
        FAILED+=("$name")
    fi
}

# 4 ranks, one CPU each. This machine may have fewer CPUs than that: then
# --overcommit, and --ntasks instead of --ntasks-per-node (see run_job). With
# GPUs and more tasks than CPUs, cons_tres also refuses an exact --nodes=1
# ("Requested node configuration is not available"), so the node count is a
# range; the cluster has one node, so the job gets that one.
NODE_CPUS="$(sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' <<<"$NODE_LINE")"
if (( NODE_CPUS >= NTASKS )); then
    STRIP_NTASKS_PER_NODE=0
    SMALL=(--nodes=1 "--ntasks-per-node=$NTASKS" --cpus-per-task=1)
    SMALL_GPU=("${SMALL[@]}")
else
    STRIP_NTASKS_PER_NODE=1
    SMALL=(--nodes=1 "--ntasks=$NTASKS" --cpus-per-task=1 --overcommit)
    SMALL_GPU=(--nodes=1-2 "--ntasks=$NTASKS" --cpus-per-task=1 --overcommit)
    log "$NODE_CPUS CPUs < $NTASKS ranks: oversubscribing (--overcommit)"
fi
export SHOW_RANKS=1
RANKS_PATTERN="$NTASKS*$EXPECT_PATTERN"
GPU_PATTERNS="$RANKS_PATTERN
^meshrt-job: rank 0 local 0 host .* CUDA_VISIBLE_DEVICES=0\$
^meshrt-job: rank 3 local 3 host .* CUDA_VISIBLE_DEVICES=3\$"

submit_job gpu       meshrt.sbatch           "$GPU_PATTERNS" "${SMALL_GPU[@]}" --gpus-per-node=4
submit_job multinode meshrt-multinode.sbatch "$GPU_PATTERNS" "${SMALL_GPU[@]}" --gpus-per-node=4
submit_job cpu       meshrt-cpu.sbatch       "$RANKS_PATTERN" "${SMALL[@]}"
submit_job ctest     meshrt-ctest.sbatch     "100% tests passed" "${SMALL[@]}"
for name in "${JOB_NAMES[@]}"; do check_job "$name"; done

if [[ ${#FAILED[@]} -gt 0 ]]; then
    die "${#FAILED[@]} job(s) failed: ${FAILED[*]}"
fi
log "all ${NTASKS}-rank jobs passed in $SECONDS s"
