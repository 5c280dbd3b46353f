#!/usr/bin/env bash
# usage: sigusr1_test.sh <log dir> <command...>: the command's rank 1 gets SIGUSR1 and must
# write its flight recorder to <log dir>/meshrt.rank1.log.
set -u
logdir=$1
shift
rm -rf "$logdir"
MESHRT_LOG_DIR=$logdir timeout 60 "$@" || { echo "FAIL: the program exited $?"; exit 1; }
if grep -q "SIGUSR1: flight recorder of rank 1" "$logdir/meshrt.rank1.log"; then
  grep -A3 "SIGUSR1" "$logdir/meshrt.rank1.log"
  echo "ok: rank 1 wrote its flight recorder on SIGUSR1"
else
  echo "FAIL: no flight recorder in $logdir/meshrt.rank1.log:"; cat "$logdir/meshrt.rank1.log"; exit 1
fi
