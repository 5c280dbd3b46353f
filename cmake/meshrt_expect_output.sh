#!/usr/bin/env bash
# usage: meshrt_expect_output.sh <regex>... -- <command...>
# Passes when the command exits 0 and its output matches every <regex> (grep -E).
# (CTest's PASS_REGULAR_EXPRESSION alone would ignore the exit code.)
set -u
regexes=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do regexes+=("$1"); shift; done
shift
out=$("$@" 2>&1)
rc=$?
printf '%s\n' "$out"
if [ $rc -ne 0 ]; then echo "FAIL: exit code $rc"; exit 1; fi
for regex in "${regexes[@]}"; do
  if ! grep -qaE -- "$regex" <<<"$out"; then echo "FAIL: the output does not match: $regex"; exit 1; fi
done
