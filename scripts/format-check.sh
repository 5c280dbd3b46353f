#!/usr/bin/env bash
# CI: every tracked C/C++ file follows the repository's .clang-format. Fails, listing
# the files and the first differences, on any formatting slip; `clang-format -i FILE`
# fixes one. Runs in a second, before anything is built (scripts/test.sh runs it first).
#
# The tree is formatted with clang-format 14 (Debian 12's); other major versions place a
# few constructs differently, so another version is refused rather than trusted.
# Settings (environment):
#   MESHRT_CLANG_FORMAT   the clang-format binary (default: clang-format-14, else clang-format)
source "$(dirname "$0")/common.sh"
cd "$MESHRT_ROOT"

if [ -z "${MESHRT_CLANG_FORMAT:-}" ]; then
  if command -v clang-format-14 >/dev/null; then
    MESHRT_CLANG_FORMAT=clang-format-14
  else
    command -v clang-format >/dev/null || ensure_packages clang-format
    MESHRT_CLANG_FORMAT=clang-format
  fi
fi
version=$("$MESHRT_CLANG_FORMAT" --version)
if ! grep -q "version 14\." <<<"$version"; then
  echo "format-check: expected clang-format 14 (the version the tree is formatted with), found: $version" >&2
  echo "  install clang-format-14, or point MESHRT_CLANG_FORMAT at it" >&2
  exit 1
fi
if ! git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  echo "format-check: expected a git checkout (the check covers tracked files), found none at $MESHRT_ROOT" >&2
  exit 1
fi

mapfile -t files < <(git ls-files -- '*.cpp' '*.hpp' '*.h' '*.cc' '*.cu' '*.cuh')
if [ ${#files[@]} -eq 0 ]; then
  echo "format-check: expected tracked C/C++ files, found none" >&2
  exit 1
fi
present=()
for f in "${files[@]}"; do
  [ -f "$f" ] && present+=("$f")  # a file deleted in the work tree, not yet committed, is skipped
done
# One run over every file (fast); its diagnostics name each file that differs.
bad=()
if ! report=$("$MESHRT_CLANG_FORMAT" --dry-run --Werror "${present[@]}" 2>&1); then
  mapfile -t bad < <(sed -n 's/^\([^:]*\):[0-9]*:[0-9]*: error: .*/\1/p' <<<"$report" | sort -u)
  [ ${#bad[@]} -gt 0 ] || { echo "$report" >&2; exit 1; }  # failed for another reason: show it
fi
if [ ${#bad[@]} -gt 0 ]; then
  echo "format-check: ${#bad[@]} of ${#present[@]} files do not follow .clang-format:" >&2
  for f in "${bad[@]}"; do
    echo "== $f" >&2
    grep -A2 "^$f:" <<<"$report" | head -n 12 >&2
  done
  echo "format-check: fix with: $MESHRT_CLANG_FORMAT -i ${bad[*]}" >&2
  exit 1
fi
echo "format-check: ${#present[@]} files follow .clang-format ($MESHRT_CLANG_FORMAT)"
