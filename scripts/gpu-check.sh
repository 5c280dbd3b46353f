#!/usr/bin/env bash
# One command, no questions: checks that meshrt's CUDA backend works on this GPU node.
#   scripts/gpu-check.sh            (from the repository root or anywhere)
# Steps: the driver and GPUs nvidia-smi sees; a build with -DMESHRT_WITH_CUDA=ON into
# build-gpu; the driver against the CUDA runtime the build uses (meshrt-info); the device
# suite on CUDA (MESHRT_ACCELERATOR=cuda MESHRT_REQUIRE_GPU=1, one rank per GPU, so with
# one GPU every NCCL line has one rank); meshrt-bench device-collectives against the same
# NCCL call made by hand. Ends with a one-screen verdict; exits 0 only if every step passed.
# Without a GPU it says "no GPU: nothing verified" and exits 1.
# Settings: MESHRT_JOBS (build jobs, default: cores), MESHRT_GPU_CHECK_DIR (default build-gpu).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${MESHRT_GPU_CHECK_DIR:-$ROOT/build-gpu}
LOG=$BUILD/gpu-check-logs
STEPS=()
FAILED=0
FIGURES=""

step() {  # step NAME PASS|FAIL DETAIL
  STEPS+=("$(printf '%-4s %-22s %s' "$2" "$1" "$3")")
  [ "$2" = PASS ] || FAILED=1
}

verdict() {
  echo
  echo "================ meshrt GPU check: verdict ================"
  for s in "${STEPS[@]}"; do echo "$s"; done
  if [ -n "$FIGURES" ]; then
    echo "-- device collectives vs NCCL by hand (time ratio, 1 MiB and up):"
    echo "$FIGURES"
  fi
  echo "-- $1"
  echo "   logs: $LOG"
}

mkdir -p "$LOG"

# 1. nvidia-smi: is there a GPU and a driver at all?
if ! command -v nvidia-smi >/dev/null 2>&1; then
  step nvidia-smi FAIL "nvidia-smi not found (no NVIDIA driver installed)"
  verdict "no GPU: nothing verified"
  exit 1
fi
if ! nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$LOG/nvidia-smi.txt" 2>&1 ||
  ! grep -q . "$LOG/nvidia-smi.txt"; then
  step nvidia-smi FAIL "nvidia-smi lists no GPU: $(head -c 200 "$LOG/nvidia-smi.txt" | tr '\n' ' ')"
  verdict "no GPU: nothing verified"
  exit 1
fi
NGPU=$(wc -l <"$LOG/nvidia-smi.txt")
GPU_NAME=$(head -1 "$LOG/nvidia-smi.txt" | cut -d, -f1 | sed 's/ *$//')
DRIVER=$(head -1 "$LOG/nvidia-smi.txt" | cut -d, -f2 | tr -d ' ')
step nvidia-smi PASS "$NGPU x $GPU_NAME, driver $DRIVER"

# 2. Build with CUDA.
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDACXX=/usr/local/cuda/bin/nvcc; fi
if (export MESHRT_BUILD_DIR="$BUILD" && cd "$ROOT" &&
  bash -c 'source scripts/common.sh; configure_and_build -DMESHRT_WITH_CUDA=ON') >"$LOG/build.txt" 2>&1; then
  step build PASS "-DMESHRT_WITH_CUDA=ON into $BUILD"
else
  step build FAIL "see $LOG/build.txt: $(grep -m1 -i 'error' "$LOG/build.txt" | head -c 150)"
  verdict "CUDA backend NOT verified on $GPU_NAME: the build failed"
  exit 1
fi

# 3. The driver against the CUDA runtime the build links.
# shellcheck source=/dev/null
source "$ROOT/scripts/common.sh"
set +e
MESHRT_BUILD_DIR=$BUILD
mpi_local_environment
MPIEXEC=$(sed -n 's/^MPIEXEC_EXECUTABLE:[A-Z]*=//p' "$BUILD/CMakeCache.txt")
MPIEXEC=${MPIEXEC:-mpiexec}
"$BUILD/apps/meshrt-info" >"$LOG/meshrt-info.txt" 2>&1
CUDA_LINE=$(grep -m1 '^  CUDA  *runtime' "$LOG/meshrt-info.txt" | sed 's/^  CUDA *//')
if grep -q '^  CUDA .*runtime [0-9.]*, driver [0-9.]*; [0-9]* device' "$LOG/meshrt-info.txt"; then
  step "driver vs runtime" PASS "$CUDA_LINE"
else
  step "driver vs runtime" FAIL "${CUDA_LINE:-meshrt-info printed no CUDA line} (a driver older than the runtime gives cudaErrorInsufficientDriver)"
fi

# 4. The device suite on CUDA, every GPU skip a failure. NCCL refuses two ranks of one
# communicator on one device: runtime_cuda sizes its NCCL lines to the GPU count (one rank
# each with one GPU) and runs at up to 4 ranks; the NCCL bootstrap needs one
# GPU per rank, so it runs at min(GPUs, 8) ranks; runtime_emulated's program on cuda
# needs 4 ranks on 4 GPUs (its 2x2 mesh) and runs only where there are 4; device_comm and
# device_data_plane (written for 2 and 4 ranks) run at 2 or 4 ranks where there are 2 GPUs.
NP=$((NGPU < 8 ? NGPU : 8))
export MESHRT_ACCELERATOR=cuda MESHRT_REQUIRE_GPU=1
suite_failed=()
suite_ran=()
run_test() {  # run_test NAME NP [gtest args]
  local t=$1 np=$2 bin
  shift 2
  bin=$(find "$BUILD/tests" -type f -name "$t" -perm -u+x | head -1)
  if [ -z "$bin" ]; then
    suite_failed+=("$t(not built)")
    return
  fi
  if [ "$np" = 0 ]; then
    timeout 120 "$bin" "$@" >"$LOG/$t.txt" 2>&1 || suite_failed+=("$t")
  else
    timeout 180 "$MPIEXEC" -n "$np" "$bin" "$@" >"$LOG/$t.txt" 2>&1 || suite_failed+=("$t@$np")
  fi
  suite_ran+=("$t")
}
run_test unit_functions 0 --gtest_filter='*Cuda*'
run_test runtime_cuda $((NGPU >= 4 ? 4 : 2))
run_test mpi_group_nccl "$NP"
if [ "$NGPU" -ge 4 ]; then run_test runtime_emulated 4; fi
if [ "$NGPU" -ge 2 ]; then
  run_test device_comm $((NGPU >= 4 ? 4 : 2))
  run_test device_data_plane $((NGPU >= 4 ? 4 : 2))
fi
if [ ${#suite_failed[@]} -eq 0 ]; then
  step "device suite on CUDA" PASS "${suite_ran[*]} (mpi_group_nccl at $NP rank(s), one per GPU)"
else
  step "device suite on CUDA" FAIL "failed: ${suite_failed[*]} (logs in $LOG)"
fi

# 5. Device collectives through meshrt against NCCL by hand.
if timeout 300 "$MPIEXEC" -n "$NP" "$BUILD/apps/meshrt-bench" device-collectives \
  --json "$LOG/device-collectives.json" >"$LOG/device-collectives.txt" 2>&1; then
  step "device collectives" PASS "$NP rank(s) vs NCCL by hand"
  # The table rows (op, bytes, ..., ratio) at 1 MiB and up; ratio = meshrt time / NCCL's.
  FIGURES=$(awk '$1 ~ /^(all_reduce|all_gather|reduce_scatter|all_to_all|send)$/ && $2 >= 1048576 {
    printf "  %-15s %10s B  meshrt %9s us  nccl %9s us  ratio %s\n", $1, $2, $3, $4, $NF }' \
    "$LOG/device-collectives.txt" | head -30)
else
  step "device collectives" FAIL "see $LOG/device-collectives.txt"
fi

if [ $FAILED -eq 0 ]; then
  verdict "CUDA backend verified on $GPU_NAME ($NGPU GPU(s), driver $DRIVER)"
  exit 0
fi
verdict "CUDA backend NOT verified on $GPU_NAME: see the FAIL lines above"
exit 1
