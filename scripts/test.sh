#!/usr/bin/env bash
# The whole test suite: sets up, builds with warnings as errors, runs every test through
# ctest. Extra arguments go to ctest (e.g. -R ndslice). Settings (environment):
#   MESHRT_TEST_LARGE=1   also run the tests labelled "large" (over 2 GiB of data)
#   MESHRT_TEST_SCALE64=1 also run the tests labelled "scale64" (64 ranks, oversubscribed)
#   MESHRT_TEST_NIGHTLY=1 also run the tests labelled "nightly" (a peer test in 100 fresh
#                         jobs in a row: about 15 minutes on 2 cores)
#   MESHRT_TEST_FUZZ=0    skip the fuzzer run (MESHRT_FUZZ_SECONDS sets its length)
#   MESHRT_TEST_SLURM=0   skip the Slurm templates (and the two-node cluster)
#   MESHRT_TEST_MULTINODE=0  skip the two-node cluster only
#   MESHRT_TEST_SANITIZERS=1  also run the suite under ASan+UBSan (scripts/test-sanitizers.sh;
#                         a second full build in build-asan: off by default, see its timing)
#   MESHRT_TEST_GPU_BUNDLE=0  skip the GPU machine's bundle and its rehearsal
#   MESHRT_TEST_INSTALL=0 skip installing (cmake --install, the module file, pip install .
#                         into a venv and the Python tests against it)
source "$(dirname "$0")/common.sh"
# The source checks first: a second each, so a formatting slip, an include across the
# module lines or a comment or doc naming a missing path fails before the build
# (scripts/format-check.sh, scripts/include-check.sh, scripts/docs-check.sh).
echo "== format check"
"$MESHRT_ROOT/scripts/format-check.sh"
echo "== include check"
"$MESHRT_ROOT/scripts/include-check.sh"
echo "== docs check"
"$MESHRT_ROOT/scripts/docs-check.sh"
ensure_packages "${MESHRT_PACKAGES[@]}"
configure_and_build -DMESHRT_WERROR=ON
echo "== settings check"
"$MESHRT_ROOT/scripts/settings-check.sh" "$MESHRT_BUILD_DIR"
mpi_local_environment
# The built-in functions' reference against the registry it is generated from.
echo "== builtins check"
"$MESHRT_ROOT/scripts/builtins-check.sh" "$MESHRT_BUILD_DIR"

skip=()
[ "${MESHRT_TEST_LARGE:-0}" = 1 ] || skip+=(large)
[ "${MESHRT_TEST_SCALE64:-0}" = 1 ] || skip+=(scale64)
[ "${MESHRT_TEST_NIGHTLY:-0}" = 1 ] || skip+=(nightly)
exclude=()
[ ${#skip[@]} -eq 0 ] || exclude=(-LE "$(IFS='|'; echo "${skip[*]}")")
echo "== ctest"
ctest --test-dir "$MESHRT_BUILD_DIR" --output-on-failure -j "$MESHRT_JOBS" "${exclude[@]}" "$@"

# The protocol decoder under libFuzzer with ASan+UBSan, for a bounded time (~70 s).
if [ "${MESHRT_TEST_FUZZ:-1}" = 1 ]; then
  echo "== fuzzing the protocol decoder for ${MESHRT_FUZZ_SECONDS:-30} s"
  "$MESHRT_ROOT/scripts/fuzz.sh"
fi

if [ "${MESHRT_TEST_SANITIZERS:-0}" = 1 ]; then
  echo "== sanitizers (ASan + UBSan)"
  "$MESHRT_ROOT/scripts/test-sanitizers.sh" asan
fi

# Installing as an admin and as a Python user do (scripts/test-install.sh; pip's fresh
# build of the package is most of its time).
if [ "${MESHRT_TEST_INSTALL:-1}" = 1 ]; then
  echo "== installing: cmake --install, module load, pip install ."
  "$MESHRT_ROOT/scripts/test-install.sh" "$MESHRT_BUILD_DIR"
fi

# The Slurm templates on a throw-away one-node cluster (needs root; about 12 s).
if [ "${MESHRT_TEST_SLURM:-1}" = 1 ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "== slurm templates"
    "$MESHRT_ROOT/tests/slurm/run_slurm_tests.sh" "$MESHRT_BUILD_DIR"
    # Two nodes on this host, each a network namespace with its own address and
    # hostname: the multinode template at 2 x 2 ranks, bytes over TCP (about 30 s).
    if [ "${MESHRT_TEST_MULTINODE:-1}" = 1 ]; then
      if ip netns add meshrt-probe-$$ 2>/dev/null && ip netns del meshrt-probe-$$; then
        echo "== slurm: two nodes"
        "$MESHRT_ROOT/tests/slurm/run_multinode_tests.sh" "$MESHRT_BUILD_DIR"
      else
        echo "== slurm: two nodes: skipped (needs network namespaces; MESHRT_TEST_MULTINODE=0 hides this)"
      fi
    fi
  else
    echo "== slurm templates: skipped (needs root; MESHRT_TEST_SLURM=0 hides this)"
  fi
fi

# The GPU machine's bundle packed from this build and rehearsed with only glibc beside its
# programs (scripts/gpu-bundle.sh, scripts/gpu-bundle-rehearse.sh; docs/gpu.md; needs root).
if [ "${MESHRT_TEST_GPU_BUNDLE:-1}" = 1 ]; then
  if [ "$(id -u)" = 0 ] && unshare -m true 2>/dev/null; then
    echo "== GPU bundle rehearsal"
    "$MESHRT_ROOT/scripts/gpu-bundle.sh" --from "$MESHRT_BUILD_DIR" --out "$MESHRT_BUILD_DIR/gpu-bundle"
    "$MESHRT_ROOT/scripts/gpu-bundle-rehearse.sh" "$MESHRT_BUILD_DIR/gpu-bundle/meshrt-gpu-bundle.tar.gz"
  else
    echo "== GPU bundle rehearsal: skipped (needs root and mount namespaces; MESHRT_TEST_GPU_BUNDLE=0 hides this)"
  fi
fi
