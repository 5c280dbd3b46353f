#!/usr/bin/env bash
# usage: consumer_test.sh <meshrt build dir> <consumer source> <cmake> <ctest> <generator>
#                         <minimal consumer source> <mpiexec>
set -eu
build=$1 src=$2 cmake=$3 ctest=$4 generator=$5 minimal=$6 mpiexec=$7
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "== from the build tree"
"$cmake" -S "$src" -B "$work/from-build" -G "$generator" -Dmeshrt_DIR="$build" >"$work/from-build.log"
# The testing component takes meshrt's own probe result: it probes nothing either.
if grep -q "single copy" "$work/from-build.log"; then
  echo "expected the testing component to reuse meshrt's MPI probe, found it probing:" >&2
  cat "$work/from-build.log" >&2
  exit 1
fi
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

echo "== a minimal consumer: find_package(meshrt) only, no GTest, CUDAToolkit or fmt to be found"
"$cmake" -S "$minimal" -B "$work/minimal" -G "$generator" -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DCMAKE_DISABLE_FIND_PACKAGE_GTest=ON -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON \
  -DCMAKE_DISABLE_FIND_PACKAGE_fmt=ON >"$work/minimal.log" 2>&1 || {
  cat "$work/minimal.log" >&2
  echo "expected find_package(meshrt) to configure without GTest, CUDAToolkit and fmt, found the errors above" >&2
  exit 1
}
# Nothing runs at configure: no MPI probe (MeshrtTesting.cmake is the testing component's).
if grep -q "single copy" "$work/minimal.log" || [ -e "$work/minimal/meshrt_single_copy_probe" ]; then
  cat "$work/minimal.log" >&2
  echo "expected no MPI probe during a consumer's configure, found one" >&2
  exit 1
fi
"$cmake" --build "$work/minimal"
out=$(LD_LIBRARY_PATH="$work/prefix/lib:${LD_LIBRARY_PATH:-}" "$mpiexec" -n 3 "$work/minimal/minimal_program")
echo "$out"
echo "$out" | grep -q "consumer program: sum 60 over 3 ranks, moved 10"
