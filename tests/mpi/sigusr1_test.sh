#!/usr/bin/env bash
# usage: sigusr1_test.sh <log dir> <command...>: the command's rank 1 gets SIGUSR1 and must
# write its flight recorder to <log dir>/meshrt.rank1.<host>.log.
set -u
logdir=$1
shift
rm -rf "$logdir"
MESHRT_LOG_DIR=$logdir timeout 60 "$@" || { echo "FAIL: the program exited $?"; exit 1; }
log="$logdir/meshrt.rank1.$(hostname -s).log"
if grep -q "SIGUSR1: flight recorder of rank 1" "$log"; then
  grep -A3 "SIGUSR1" "$log"
  echo "ok: rank 1 wrote its flight recorder on SIGUSR1"
else
  echo "FAIL: no flight recorder in $log:"; ls "$logdir"; cat "$log"; exit 1
fi
