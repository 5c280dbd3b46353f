#!/usr/bin/env bash
# The test suite under sanitizers, with Open MPI (CMakePresets.json):
#   asan  AddressSanitizer + UndefinedBehaviorSanitizer (and LeakSanitizer): builds the
#         whole tree in build-asan and runs every test except the large, package and
#         Slurm ones;
#   tsan  ThreadSanitizer: builds and runs the tests that drive rank 0's controller and
#         worker threads together (runtime_basic, runtime_2x2) in build-tsan.
# Usage: scripts/test-sanitizers.sh [asan|tsan|all] [extra ctest arguments]
# Suppressions (Open MPI and the libraries under it only) are in tests/sanitizers/ and
# reach the tests through their CTest environment. Settings (environment):
#   MESHRT_JOBS   parallel build jobs (default: the number of cores)
source "$(dirname "$0")/common.sh"
ensure_packages "${MESHRT_PACKAGES[@]}"
mpi_local_environment
cd "$MESHRT_ROOT"

which=${1:-asan}
[ $# -gt 0 ] && shift
case "$which" in asan|tsan|all) ;; *) echo "test-sanitizers.sh: expected asan, tsan or all, found '$which'" >&2; exit 2;; esac

run_preset() {
  local preset=$1
  shift
  local start built end
  start=$(date +%s)
  echo "== $preset: configuring build-$preset"
  cmake --preset "$preset" >/dev/null
  if [ "$preset" = tsan ]; then
    cmake --build --preset tsan -j "$MESHRT_JOBS" --target runtime_basic runtime_2x2
  else
    cmake --build --preset "$preset" -j "$MESHRT_JOBS"
  fi
  built=$(date +%s)
  echo "== $preset: ctest"
  if [ "$preset" = tsan ]; then
    # 10^5 calls under TSan outlive runtime_2x2's timeout; the other tests drive the
    # same controller and worker threads. The ranks inherit GTEST_FILTER from mpiexec.
    GTEST_FILTER=-Runtime.ShortLivedTensorsLeaveNothingBehind ctest --preset "$preset" "$@"
  else
    ctest --preset "$preset" "$@"
  fi
  end=$(date +%s)
  echo "== $preset: build $((built - start))s, tests $((end - built))s"
}

[ "$which" = tsan ] || run_preset asan "$@"
[ "$which" = asan ] || run_preset tsan "$@"
