# The daemons of a throw-away Slurm cluster and their removal, shared by
# run_slurm_tests.sh and run_multinode_tests.sh (sourced, not run). The caller defines
# log and die, and sets PIDS=() (the daemons it started, stopped last first) and
# STEPDS_BEFORE (the slurmstepd pids that ran before it started) before using these.

# start_munge DIR LOG_DIR: a munged of its own, with a fresh key under DIR; sets
# MUNGE_SOCKET and adds its pid to PIDS.
start_munge() {
    local dir=$1 logs=$2
    MUNGE_SOCKET="$dir/munge.socket"
    mungekey --create --keyfile="$dir/munge.key" --bits=1024 >/dev/null 2>&1 \
        || dd if=/dev/urandom of="$dir/munge.key" bs=1 count=1024 status=none
    chmod 0400 "$dir/munge.key"
    chmod 0700 "$dir"
    munged --foreground --force --socket="$MUNGE_SOCKET" --key-file="$dir/munge.key" \
        --pid-file="$dir/munged.pid" --log-file="$logs/munged.log" --seed-file="$dir/munged.seed" \
        >/dev/null 2>&1 &
    PIDS+=($!)
    for _ in $(seq 50); do [[ -S "$MUNGE_SOCKET" ]] && break; sleep 0.1; done
    [[ -S "$MUNGE_SOCKET" ]] || die "munged did not start"
}

# stop_daemons: every pid of PIDS, last first: SIGTERM, up to 10 s each, then SIGKILL.
stop_daemons() {
    local i pid
    for (( i=${#PIDS[@]}-1; i>=0; i-- )); do kill -TERM "${PIDS[i]}" 2>/dev/null; done
    for pid in "${PIDS[@]}"; do
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        if kill -0 "$pid" 2>/dev/null; then
            log "pid $pid did not stop; killing it"
            kill -KILL "$pid" 2>/dev/null
        fi
        wait "$pid" 2>/dev/null
    done
}

# kill_new_stepds: a slurmstepd (and its tasks) of a job that still ran when its slurmd
# stopped, among those not running before the caller started; waits 3 s for them first.
kill_new_stepds() {
    local p
    _new_stepds() {
        local q
        for q in $(pgrep -x slurmstepd 2>/dev/null); do
            [[ " $STEPDS_BEFORE " == *" $q "* ]] && continue
            [[ "$(ps -o stat= -p "$q" 2>/dev/null)" == Z* ]] && continue   # exited already
            echo "$q"
        done
    }
    for _ in $(seq 30); do [[ -z "$(_new_stepds)" ]] && break; sleep 0.1; done
    for p in $(_new_stepds); do
        log "killing stray slurmstepd $p and its children"
        pkill -KILL -P "$p" 2>/dev/null; kill -KILL "$p" 2>/dev/null
    done
}
