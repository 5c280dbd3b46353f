#!/usr/bin/env bash
# usage: expect_quiet.sh [--fails] [--max-stderr N] [--once REGEX]... [--expect REGEX]...
#                        [--file-has PATH REGEX]... -- <command...>
# Runs the command (stdout and stderr kept apart) and passes when: it exits 0 (non-zero
# with --fails, and not by the outer timeout); stderr has at most N lines; exactly one
# line of stdout and stderr together matches each --once REGEX (grep -E); some line
# matches each --expect REGEX; and file PATH (removed before the run) has a line
# matching REGEX.
set -u
fails=0
max_stderr=-1
once=()
expect=()
files=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  case "$1" in
    --fails) fails=1; shift ;;
    --max-stderr) max_stderr=$2; shift 2 ;;
    --once) once+=("$2"); shift 2 ;;
    --expect) expect+=("$2"); shift 2 ;;
    --file-has) files+=("$2" "$3"); shift 3 ;;
    *) echo "expect_quiet.sh: unknown option $1"; exit 2 ;;
  esac
done
shift
for ((i = 0; i < ${#files[@]}; i += 2)); do rm -f "${files[i]}"; done
err=$(mktemp)
out=$(timeout 60 "$@" 2>"$err")
rc=$?
errtext=$(cat "$err")
rm -f "$err"
echo "--- stdout"
echo "$out"
echo "--- stderr"
echo "$errtext"
echo "--- exit code $rc"
fail() { echo "FAIL: $*"; exit 1; }
if [ $rc -eq 124 ]; then fail "the command hung"; fi
if [ $fails -eq 1 ] && [ $rc -eq 0 ]; then fail "expected a non-zero exit"; fi
if [ $fails -eq 0 ] && [ $rc -ne 0 ]; then fail "expected exit code 0"; fi
lines=0
[ -n "$errtext" ] && lines=$(printf '%s\n' "$errtext" | wc -l)
if [ "$max_stderr" -ge 0 ] && [ "$lines" -gt "$max_stderr" ]; then
  fail "stderr has $lines lines, expected at most $max_stderr"
fi
for regex in "${once[@]}"; do
  n=$(printf '%s\n%s\n' "$out" "$errtext" | grep -cE -- "$regex")
  [ "$n" -eq 1 ] || fail "$n lines match $regex, expected exactly one"
done
for regex in "${expect[@]}"; do
  printf '%s\n%s\n' "$out" "$errtext" | grep -qE -- "$regex" || fail "the output does not match: $regex"
done
for ((i = 0; i < ${#files[@]}; i += 2)); do
  grep -qE -- "${files[i + 1]}" "${files[i]}" 2>/dev/null || fail "${files[i]} has no line matching ${files[i + 1]}"
done
echo "ok"
