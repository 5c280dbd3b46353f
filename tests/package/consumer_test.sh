#!/usr/bin/env bash
# usage: consumer_test.sh <meshrt build dir> <consumer source> <cmake> <ctest> <generator>
set -eu
build=$1 src=$2 cmake=$3 ctest=$4 generator=$5
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "== from the build tree"
"$cmake" -S "$src" -B "$work/from-build" -G "$generator" -Dmeshrt_DIR="$build" >/dev/null
"$cmake" --build "$work/from-build"
(cd "$work/from-build" && "$ctest" --output-on-failure)

echo "== from an install prefix"
"$cmake" --install "$build" --prefix "$work/prefix" >/dev/null
# The installed headers are the API: none of the library's internal ones.
internal=$(find "$work/prefix/include" \( -path '*/internal*' -o -name 'protocol.hpp' -o -name 'control.hpp' \
  -o -name 'comm.hpp' -o -name 'worker.hpp' -o -name 'settings.hpp' \) -print)
if [ -n "$internal" ]; then
  echo "expected no internal header in the install prefix, found:" >&2
  echo "$internal" >&2
  exit 1
fi
"$cmake" -S "$src" -B "$work/from-install" -G "$generator" -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
grep -q "$work/prefix" "$work/from-install/CMakeCache.txt"
"$cmake" --build "$work/from-install"
(cd "$work/from-install" && LD_LIBRARY_PATH="$work/prefix/lib:${LD_LIBRARY_PATH:-}" "$ctest" --output-on-failure)
