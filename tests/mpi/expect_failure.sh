#!/usr/bin/env bash
# usage: expect_failure.sh <regex>... -- <command...>
# Passes when the command exits non-zero (and not by the outer timeout) and its output
# matches every <regex> (grep -E, each on some line).
set -u
regexes=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do regexes+=("$1"); shift; done
shift
out=$(timeout 60 "$@" 2>&1)
rc=$?
echo "$out"
echo "--- exit code $rc"
if [ $rc -eq 0 ]; then echo "FAIL: expected a non-zero exit"; exit 1; fi
if [ $rc -eq 124 ]; then echo "FAIL: the command hung"; exit 1; fi
for regex in "${regexes[@]}"; do
  if ! grep -qE -- "$regex" <<<"$out"; then echo "FAIL: the output does not match: $regex"; exit 1; fi
done
echo "ok: failed as expected"
