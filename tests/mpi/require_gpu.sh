#!/usr/bin/env bash
# usage: require_gpu.sh <test binary> [args...]
# Runs one GPU test with MESHRT_REQUIRE_GPU=1. Decided at run time, not at configure
# time: where nvidia-smi lists a GPU the test must pass; elsewhere it must fail, and say
# that MESHRT_REQUIRE_GPU turned its skip into a failure (a skip that stays green would let
# a GPU node with a broken driver look verified).
set -u
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  echo "nvidia-smi lists a GPU: the test must pass"
  MESHRT_REQUIRE_GPU=1 timeout 120 "$@"
  exit $?
fi
echo "no GPU listed by nvidia-smi: the test must fail under MESHRT_REQUIRE_GPU=1"
out=$(MESHRT_REQUIRE_GPU=1 timeout 120 "$@" 2>&1)
rc=$?
echo "$out"
echo "--- exit code $rc"
if [ $rc -eq 0 ]; then echo "FAIL: expected a failure with MESHRT_REQUIRE_GPU=1 and no GPU"; exit 1; fi
if [ $rc -eq 124 ]; then echo "FAIL: the test hung"; exit 1; fi
if ! grep -q "MESHRT_REQUIRE_GPU=1 but this test cannot run" <<<"$out"; then
  echo "FAIL: the failure does not name MESHRT_REQUIRE_GPU"; exit 1
fi
# Without the setting the same test skips and passes: the failure comes from the setting.
if ! MESHRT_REQUIRE_GPU=0 timeout 120 "$@" >/dev/null 2>&1; then
  echo "FAIL: without MESHRT_REQUIRE_GPU the test should skip and pass"; exit 1
fi
echo "ok: the GPU skip fails under MESHRT_REQUIRE_GPU=1 and passes without it"
