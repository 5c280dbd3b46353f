#!/usr/bin/env bash
# Fuzzes the protocol decoder with libFuzzer for a bounded time and fails on any crash,
# leak or sanitizer report. Builds only the fuzzer, in its own folder, with clang.
# Settings (environment):
#   MESHRT_FUZZ_SECONDS     how long to fuzz (default 30)
#   MESHRT_FUZZ_BUILD_DIR   build folder (default build-fuzz)
#   MESHRT_JOBS             parallel build jobs (default: the number of cores)
# Extra arguments go to the fuzzer (e.g. -jobs=2, -max_len=65536).
source "$(dirname "$0")/common.sh"
ensure_packages "${MESHRT_PACKAGES[@]}" "${MESHRT_FUZZ_PACKAGES[@]}"
root=$MESHRT_ROOT
build=${MESHRT_FUZZ_BUILD_DIR:-$root/build-fuzz}
seconds=${MESHRT_FUZZ_SECONDS:-30}
jobs=$MESHRT_JOBS

for tool in clang clang++; do
  command -v "$tool" >/dev/null || { echo "fuzz.sh: $tool not found (Debian: apt-get install clang libclang-rt-dev)" >&2; exit 1; }
done

start=$(date +%s)
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
echo "== configuring $build"
CC=clang CXX=clang++ cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DMESHRT_FUZZ=ON -DMESHRT_WITH_CUDA=OFF -DMESHRT_BUILD_TESTS=OFF -DMESHRT_BUILD_APPS=OFF -DMESHRT_WERROR=ON >/dev/null
echo "== building protocol_fuzzer"
cmake --build "$build" -j "$jobs" --target protocol_fuzzer protocol_fuzz_corpus
built=$(date +%s)

seeds=$build/fuzz-seeds
corpus=$build/fuzz-corpus
artifacts=$build/fuzz-artifacts
rm -rf "$seeds"
mkdir -p "$seeds" "$corpus" "$artifacts"
"$build/tests/fuzz/protocol_fuzz_corpus" "$seeds" 20

echo "== fuzzing for ${seconds}s"
# New inputs go to $corpus (kept between runs); $seeds is read only. libFuzzer exits
# non-zero on a crash, a leak, a sanitizer report or a timeout, and set -e passes it on.
"$build/tests/fuzz/protocol_fuzzer" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
  -artifact_prefix="$artifacts/" -print_final_stats=1 "$@" "$corpus" "$seeds"
end=$(date +%s)
echo "== fuzz.sh: build $((built - start))s, fuzz $((end - built))s, no crash"
