#!/bin/sh
# usage: repeat.sh <runs> <command...>
# Runs the command <runs> times in a row, each run a fresh job, and stops at the first
# failure with its output; says how long each run took.
runs=$1
shift
i=1
while [ "$i" -le "$runs" ]; do
  start=$(date +%s.%N)
  if ! out=$("$@" 2>&1); then
    printf '%s\n' "$out"
    echo "repeat.sh: run $i of $runs failed (the runs before it passed)"
    exit 1
  fi
  awk -v i="$i" -v n="$runs" -v s="$start" -v e="$(date +%s.%N)" 'BEGIN { printf "repeat.sh: run %d of %d passed in %.1f s\n", i, n, e - s }'
  i=$((i + 1))
done
echo "repeat.sh: $runs runs in a row passed"
