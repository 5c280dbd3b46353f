#!/usr/bin/env bash
# Runs `meshrt-bench scale` at N = 2, 4, ..., 64 ranks (or the N given), flat
# (MESHRT_FANOUT=0) and tree (MESHRT_FANOUT=${FANOUT:-8}, threshold 1, so the tree is
# used at every N), and prints one row per run; JSON lines go to ${JSON:-scale.jsonl}.
# On a machine with fewer cores than ranks the ranks are oversubscribed (yield when idle):
# the message counts are exact at any load, the times are the loaded machine's.
#   scripts/bench-scale.sh [N...]
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
mpi_local_environment
BENCH=${BENCH:-$MESHRT_BUILD_DIR/apps/meshrt-bench}
JSON=${JSON:-scale.jsonl}
FANOUT=${FANOUT:-8}
sizes=("$@")
[ ${#sizes[@]} -eq 0 ] && sizes=(2 4 8 16 32 64)
for n in "${sizes[@]}"; do
  for mode in flat tree; do
    if [ "$mode" = flat ]; then f=0; else f=$FANOUT; fi
    MESHRT_FANOUT=$f MESHRT_FANOUT_THRESHOLD=1 timeout "${TIMEOUT:-600}" \
      mpiexec -n "$n" "$BENCH" scale ${QUICK:+--quick} --json "$JSON" | grep -A1 '^ *ranks' | tail -1
  done
done
