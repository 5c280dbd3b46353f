#!/usr/bin/env bash
# One command, no questions, nothing installed: checks meshrt's CUDA backend on this GPU
# machine from the bundle scripts/gpu-bundle.sh made (docs/gpu.md):
#   bash scripts/gpu-check.sh
# Steps, each under its own timeout and all within MESHRT_GPU_CHECK_BUDGET seconds (450):
# the bundle unpacked; the GPU (nvidia-smi); the libraries (glibc's version, NCCL found,
# every program and component of the bundle resolving its libraries); the driver against
# the bundled CUDA runtime (meshrt-info); Open MPI at 2 ranks; the device suites on CUDA
# with MESHRT_REQUIRE_GPU=1 (one rank per GPU: with one GPU every NCCL line has one rank);
# meshrt-bench device-collectives against the same NCCL calls by hand; meshrt-demo on the
# CPUs; the Python path (the extension built here for this machine's python3 from the
# bundle's python-kit/, then tests/python/test_torch_kernels.py and
# apps/examples/python/train.py on CUDA; a SKIP line names what the machine lacks for it).
# Each step's line is printed as it ends, a failing step's log tail with it, and the
# verdict at the end; exits 0 only if every step passed.
# Everything it writes goes under $OUT (the device tool's folder that comes back; default
# gpu-check-logs): verdict.txt (rewritten after every step), steps.log (each step's log,
# appended as it ends), device-collectives.json, logs.tar.gz (every log, whole).
# Settings: MESHRT_GPU_BUNDLE (the bundle: .tar.gz or an unpacked folder; default
# gpu-bundle/meshrt-gpu-bundle.tar.gz), MESHRT_NCCL_LIB_DIR (the folder holding
# libnccl.so.2; default: looked for, the machine's pip nvidia-nccl-cu13 first),
# MESHRT_GPU_CHECK_PYTHON (the python3 of the Python step; default: the first on PATH),
# MESHRT_GPU_CHECK_BUDGET. scripts/gpu-bundle-rehearse.sh sets MESHRT_GPU_CHECK_REHEARSAL=1
# (no GPU: the suites on the emulated accelerator), MESHRT_GPU_CHECK_WRAP (a command put
# before every bundle program: its chroot), MESHRT_GPU_CHECK_SYSROOT (where NCCL is
# looked for) and MESHRT_GPU_CHECK_PY_OBJECTS (the build whose objects the extension's
# build takes where its preprocessed sources match: scripts/gpu-python/reuse_object.py).
# A new device test program goes into TESTS in scripts/gpu-bundle.sh and a run line below.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUDGET=${MESHRT_GPU_CHECK_BUDGET:-450}
REHEARSAL=${MESHRT_GPU_CHECK_REHEARSAL:-0}
read -r -a WRAP <<<"${MESHRT_GPU_CHECK_WRAP:-}"
SYSROOT=${MESHRT_GPU_CHECK_SYSROOT:-}
OUT_DIR=${OUT:-$ROOT/gpu-check-logs}
mkdir -p "$OUT_DIR"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/meshrt-gpu-check.XXXXXX")
LOG=$WORK/logs
mkdir -p "$LOG"
rm -f "$OUT_DIR/steps.log" "$OUT_DIR/verdict.txt" "$OUT_DIR/logs.tar.gz" "$OUT_DIR/device-collectives.json"

STEPS=()
FAILED=0
FIGURES=""
HEADLINE="not finished: the check stopped before its end"
GPU_NAME="this machine"

elapsed() { echo $((SECONDS)); }

write_verdict() {
  {
    echo "================ meshrt GPU check: verdict ================"
    for s in "${STEPS[@]}"; do echo "$s"; done
    if [ -n "$FIGURES" ]; then
      echo "-- device collectives: meshrt / NCCL by hand, time ratio (1 MiB and up)"
      echo "$FIGURES"
    fi
    echo "-- $HEADLINE ($(elapsed) s)"
    echo "   logs: $OUT_DIR (verdict.txt, steps.log, logs.tar.gz)"
  } >"$OUT_DIR/verdict.txt"
}

finish() {  # finish EXIT_CODE
  write_verdict
  tar -C "$LOG" -czf "$OUT_DIR/logs.tar.gz" . 2>/dev/null
  [ -f "$LOG/device-collectives.json" ] && cp "$LOG/device-collectives.json" "$OUT_DIR/"
  echo
  cat "$OUT_DIR/verdict.txt"
  rm -rf "$WORK"
  exit "$1"
}
trap 'HEADLINE="stopped by a signal: NOT verified"; STEPS+=("FAIL  (the check was stopped by a signal)"); finish 1' INT TERM HUP

# record NAME PASS|FAIL|SKIP SECONDS DETAIL [LOGFILE]: one verdict line, printed now; a
# failure's log tail with it; the log appended to steps.log.
record() {
  local line
  line=$(printf '%-4s  %-28s %4ss  %s' "$2" "$1" "$3" "$4")
  STEPS+=("$line")
  echo "$line"
  [ "$2" = FAIL ] && FAILED=1
  if [ -n "${5:-}" ] && [ -f "$5" ]; then
    if [ "$2" = FAIL ]; then
      echo "      -- last 40 lines of $(basename "$5"):"
      tail -n 40 "$5" | sed 's/^/      | /'
    fi
    {
      echo "######## $1: $2 ($3 s) ########"
      if [ "$(wc -l <"$5")" -gt 3000 ]; then
        head -n 500 "$5"
        echo "[... $(($(wc -l <"$5") - 2500)) lines left out: logs.tar.gz has them ...]"
        tail -n 2000 "$5"
      else
        cat "$5"
      fi
    } >>"$OUT_DIR/steps.log"
  fi
  write_verdict
}

# The seconds a step may take: its own limit, or what is left of the budget.
limit() {
  local left=$((BUDGET - $(elapsed) - 5))
  [ "$left" -lt "$1" ] && echo "$left" || echo "$1"
}

# gtest's counts from a log: "N passed, M skipped, K failed: names".
gtest_counts() {
  local passed skipped failed
  passed=$(grep -oE '^\[  PASSED  \] [0-9]+ test' "$1" | grep -oE '[0-9]+' | sort -n | tail -1)
  skipped=$(grep -oE '^\[  SKIPPED \] [0-9]+ test' "$1" | grep -oE '[0-9]+' | sort -n | tail -1)
  failed=$(grep -oE '^\[  FAILED  \] [A-Za-z0-9_]+\.[A-Za-z0-9_/]+' "$1" | awk '{print $4}' | sort -u |
    awk '{ n++; if (n <= 4) printf "%s ", $0 } END { if (n > 4) printf "and %d more", n - 4 }')
  printf '%s passed, %s skipped' "${passed:-0}" "${skipped:-0}"
  [ -n "$failed" ] && printf ', failed: %s' "$failed"
}

# run NAME LIMIT CHECK COMMAND...: COMMAND (a bundle program, with its arguments) under
# `timeout`, its output in $LOG/NAME.txt. CHECK is gtest (counts in the detail), pytest
# (its summary in the detail), - (the exit code only) or a string the output must hold.
# run_here is the same for a program of the machine's (python3, cmake), never wrapped.
run() { run_step 1 "$@"; }
run_here() { run_step 0 "$@"; }
run_step() {
  local wrapped=$1 name=$2 lim check=$4 t0 rc detail f=$LOG/$2.txt
  lim=$(limit "$3")
  shift 4
  if [ "$lim" -lt 10 ]; then
    record "$name" FAIL 0 "not run: the budget of $BUDGET s is spent"
    return 1
  fi
  local wrap=()
  [ "$wrapped" = 1 ] && wrap=("${WRAP[@]}")
  local program=$1 a
  if [ "$program" = mpiexec ]; then  # the first bundle program among its arguments
    for a in "${@:2}"; do
      if [ -x "$BUNDLE/bin/$a" ]; then
        program=$a
        break
      fi
    done
  fi
  if [ "$wrapped" = 1 ] && [ ! -x "$BUNDLE/bin/$program" ]; then
    if [ "$REHEARSAL" = 1 ]; then
      record "$name" SKIP 0 "$program is not in this bundle (a build without CUDA)"
      return 0
    fi
    record "$name" FAIL 0 "expected $program in the bundle, found none"
    return 1
  fi
  t0=$SECONDS
  echo "\$ $*" >"$f"
  timeout -k 10 "$lim" "${wrap[@]}" "$@" >>"$f" 2>&1
  rc=$?
  detail=""
  [ "$check" = gtest ] && detail=$(gtest_counts "$f")
  [ "$check" = pytest ] && detail=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error|skipped)' "$f" | tail -1 | tr -d '=' | xargs)
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    record "$name" FAIL $((SECONDS - t0)) "timed out after $lim s ${detail:+($detail)}" "$f"
    return 1
  elif [ $rc -ne 0 ]; then
    record "$name" FAIL $((SECONDS - t0)) "exit code $rc ${detail:+($detail)}" "$f"
    return 1
  elif [ "$check" != gtest ] && [ "$check" != pytest ] && [ "$check" != - ] && ! grep -q -- "$check" "$f"; then
    record "$name" FAIL $((SECONDS - t0)) "expected '$check' in its output, found none" "$f"
    return 1
  fi
  record "$name" PASS $((SECONDS - t0)) "${detail:-ok}" "$f"
}

# 1. The bundle: unpacked under $WORK (a tarball keeps its modes through any copy).
BUNDLE_SRC=${MESHRT_GPU_BUNDLE:-$ROOT/gpu-bundle/meshrt-gpu-bundle.tar.gz}
if [ -d "$BUNDLE_SRC" ] && [ -f "$BUNDLE_SRC/env.sh" ]; then
  BUNDLE=$(cd "$BUNDLE_SRC" && pwd)
elif [ -f "$BUNDLE_SRC" ]; then
  BUNDLE=$WORK/bundle
  mkdir -p "$BUNDLE"
  if ! tar -C "$BUNDLE" -xzf "$BUNDLE_SRC" 2>"$LOG/bundle.txt"; then
    record bundle FAIL 0 "could not unpack $BUNDLE_SRC: $(head -c 200 "$LOG/bundle.txt")" "$LOG/bundle.txt"
    HEADLINE="nothing verified: the bundle did not unpack"
    finish 1
  fi
else
  record bundle FAIL 0 "expected the bundle at $BUNDLE_SRC (scripts/gpu-bundle.sh makes it; carry gpu-bundle), found none"
  HEADLINE="nothing verified: no bundle"
  finish 1
fi
cp "$BUNDLE/MANIFEST.txt" "$LOG/MANIFEST.txt" 2>/dev/null
manifest() { sed -n "s/^$1: *//p" "$BUNDLE/MANIFEST.txt" | head -1; }
record bundle PASS "$(elapsed)" "source $(manifest source); cuda $(manifest cuda | cut -d, -f1-2); NCCL built $(manifest nccl-built | cut -d' ' -f1)"

# 2. The GPU.
NGPU=1
if [ "$REHEARSAL" = 1 ]; then
  record gpu SKIP 0 "rehearsal: no GPU, the suites run on the emulated accelerator with one device"
else
  SMI=$(command -v nvidia-smi || ls /usr/local/nvidia/bin/nvidia-smi 2>/dev/null)
  if [ -z "$SMI" ]; then
    record gpu FAIL 0 "nvidia-smi not found (no NVIDIA driver)"
    HEADLINE="no GPU: nothing verified"
    finish 1
  fi
  if ! timeout 30 "$SMI" --query-gpu=name,driver_version,memory.total,compute_mode,compute_cap --format=csv,noheader \
    >"$LOG/gpu.txt" 2>&1 || ! grep -q , "$LOG/gpu.txt"; then
    record gpu FAIL 0 "nvidia-smi lists no GPU: $(head -c 200 "$LOG/gpu.txt" | tr '\n' ' ')" "$LOG/gpu.txt"
    HEADLINE="no GPU: nothing verified"
    finish 1
  fi
  NGPU=$(grep -c , "$LOG/gpu.txt")
  IFS=, read -r GPU_NAME DRIVER MEM MODE CAP <"$LOG/gpu.txt"
  GPU_NAME=$(echo "$GPU_NAME" | xargs)
  MODE=$(echo "$MODE" | xargs)
  CAP=$(echo "${CAP:-}" | xargs | tr -d .)
  # The kernels run on an architecture the bundle has, or a later one (its PTX, compiled
  # by the driver): never below the lowest.
  LOWEST=$(manifest cuda | sed -n 's/.*architectures \([0-9 ]*\).*/\1/p' | tr ' ' '\n' | grep . | sort -n | head -1)
  if [ "$MODE" != Default ]; then
    # Under Exclusive_Process a second process on the GPU fails at its first CUDA call.
    record gpu FAIL 0 "$NGPU x $GPU_NAME, compute mode $MODE: expected Default (several ranks share one GPU)" "$LOG/gpu.txt"
  elif [ -n "$CAP" ] && [ -n "$LOWEST" ] && [ "$CAP" -lt "$LOWEST" ]; then
    record gpu FAIL 0 "$NGPU x $GPU_NAME, compute capability $CAP: expected $LOWEST or later (the bundle's architectures: $(manifest cuda | cut -d, -f2 | xargs))" "$LOG/gpu.txt"
  else
    record gpu PASS 0 "$NGPU x $GPU_NAME,$MEM, driver$DRIVER, sm_$CAP" "$LOG/gpu.txt"
  fi
fi

# 3. The libraries: glibc, NCCL, and every bundle file resolving its libraries.
find_nccl() {
  local d
  if [ -n "${MESHRT_NCCL_LIB_DIR:-}" ]; then echo "$MESHRT_NCCL_LIB_DIR"; return; fi
  if [ -z "$SYSROOT" ] && command -v python3 >/dev/null; then
    d=$(timeout 30 python3 -c 'import os, nvidia.nccl; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
    [ -f "$d/libnccl.so.2" ] && { echo "$d"; return; }
  fi
  for d in "$SYSROOT"/opt/*/.venv/lib/python3*/site-packages/nvidia/nccl/lib \
    "$SYSROOT"/{opt/*,usr/local,usr}/lib/python3*/{site,dist}-packages/nvidia/nccl/lib \
    "$SYSROOT"/usr/local/cuda*/lib{,64} "$SYSROOT"/usr/lib/x86_64-linux-gnu; do
    [ -f "$d/libnccl.so.2" ] && { echo "${d#"$SYSROOT"}"; return; }
  done
  d=$(timeout 30 find "$SYSROOT"/opt "$SYSROOT"/usr "$SYSROOT"/root -name libnccl.so.2 -print -quit 2>/dev/null)
  [ -n "$d" ] && dirname "${d#"$SYSROOT"}"
}
libs_ok=1
libs_detail=""
GLIBC_HERE=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')
GLIBC_NEEDED=$(manifest glibc | cut -d' ' -f1)
if [ -n "$GLIBC_NEEDED" ] && [ -n "$GLIBC_HERE" ] &&
  [ "$(printf '%s\n%s\n' "$GLIBC_NEEDED" "$GLIBC_HERE" | sort -V | head -1)" != "$GLIBC_NEEDED" ]; then
  libs_ok=0
  libs_detail="glibc $GLIBC_HERE here, the bundle needs $GLIBC_NEEDED (make it on an older system); "
fi
if grep -q '^cuda: *[0-9]' "$BUNDLE/MANIFEST.txt"; then
  NCCL_DIR=$(find_nccl)
  if [ -z "$NCCL_DIR" ]; then
    libs_ok=0
    libs_detail+="libnccl.so.2 not found (set MESHRT_NCCL_LIB_DIR to its folder); "
  else
    export MESHRT_NCCL_LIB_DIR=$NCCL_DIR
    libs_detail+="NCCL from $NCCL_DIR; "
  fi
fi
# shellcheck source=/dev/null
source "$BUNDLE/env.sh"
: >"$LOG/libraries.txt"
unresolved=0
traced=0
while read -r f; do
  # (read through SYSROOT: in the rehearsal NCCL's stand-in is inside the chroot only)
  [ "$(head -c 4 "${SYSROOT}$f" | tr -d '\0')" = $'\x7fELF' ] || continue
  traced=$((traced + 1))
  # What ld.so loads for it (ldd's way, which needs no shell inside a chroot): it stops
  # at a missing library with "error while loading shared libraries: NAME: ...".
  if ! timeout 20 "${WRAP[@]}" /lib64/ld-linux-x86-64.so.2 --list "$f" >"$WORK/trace.txt" 2>&1 ||
    grep -q 'not found' "$WORK/trace.txt"; then
    unresolved=$((unresolved + 1))
    echo "${f#"$BUNDLE"/}:" >>"$LOG/libraries.txt"
    grep -v '=> /' "$WORK/trace.txt" | sed 's/^/  /' >>"$LOG/libraries.txt"
  fi
done < <(find "$BUNDLE/bin" "$BUNDLE/lib" -type f | sort
  # the machine's NCCL, with the bundle's libstdc++ before its own
  [ -n "${MESHRT_NCCL_LIB_DIR:-}" ] && echo "$MESHRT_NCCL_LIB_DIR/libnccl.so.2")
if [ "$unresolved" -gt 0 ]; then
  libs_ok=0
  libs_detail+="$unresolved of $traced programs and libraries with a library not found: $(sed -n -e 's/.*[[:space:]]\([^[:space:]]*\) => not found.*/\1/p' \
    -e 's/.*error while loading shared libraries: \([^:]*\):.*/\1/p' "$LOG/libraries.txt" | sort -u | tr '\n' ' ')"
else
  libs_detail+="all $traced programs and libraries resolve theirs"
fi
echo "$libs_detail" >>"$LOG/libraries.txt"
if [ $libs_ok = 1 ]; then record libraries PASS "$(elapsed)" "$libs_detail" "$LOG/libraries.txt"; else
  record libraries FAIL "$(elapsed)" "$libs_detail" "$LOG/libraries.txt"
fi

# 4. The driver against the bundled CUDA runtime, and the NCCL loaded (meshrt-info, one
# process: Open MPI's singleton start, which runs the bundle's orted).
if [ "$REHEARSAL" = 1 ]; then
  run meshrt-info 60 "world size 1" meshrt-info
else
  if run meshrt-info 60 "world size 1" meshrt-info; then
    CUDA_LINE=$(grep -m1 '^  CUDA  *runtime' "$LOG/meshrt-info.txt" | sed 's/^  CUDA *//')
    NCCL_LINE=$(grep -m1 '^  NCCL ' "$LOG/meshrt-info.txt" | sed 's/^  NCCL *//')
    if grep -q '^  CUDA .*runtime [0-9.]*, driver [0-9.]*; [1-9][0-9]* device' "$LOG/meshrt-info.txt"; then
      record "driver vs runtime" PASS 0 "$CUDA_LINE; NCCL $NCCL_LINE loaded"
    else
      record "driver vs runtime" FAIL 0 "${CUDA_LINE:-meshrt-info printed no CUDA line} (a driver older than the runtime gives cudaErrorInsufficientDriver)"
    fi
  fi
fi

# 5. Open MPI from the bundle at 2 ranks.
run mpi@2 60 "world size 2" mpiexec -n 2 meshrt-info

# 6. The device suites. NCCL refuses two ranks of one communicator on one device of one
# host, so the MPI suites run at one rank per GPU, up to 4; runtime_cuda sizes its NCCL
# lines to the GPU count, so it also runs at 2 and 4 ranks on one GPU (lines of one rank).
# A test that needs a second rank or GPU skips, naming what it lacks; runtime_overlap
# (a kernel on one stream while a collective is in flight on another) needs two GPUs. On
# one GPU, device_comm and device_data_plane then run at 2 ranks too, each its own host
# to NCCL (below).
if [ "$REHEARSAL" = 1 ]; then
  export MESHRT_ACCELERATOR=emulated MESHRT_REQUIRE_GPU=0
else
  export MESHRT_ACCELERATOR=cuda MESHRT_REQUIRE_GPU=1
fi
export NCCL_DEBUG=${NCCL_DEBUG:-WARN} MESHRT_TEST_WATCHDOG=${MESHRT_TEST_WATCHDOG:-80} GTEST_COLOR=no
NP=$((NGPU < 4 ? NGPU : 4))
# unit_functions' plugin test loads a library by its path in the build folder.
run unit_functions 60 gtest unit_functions --gtest_filter='-Registry.LoadLibraryAddsItsFunctions'
run unit_tensor 60 gtest unit_tensor
run unit_device 60 gtest unit_device
run "device_comm@$NP" 90 gtest mpiexec -n "$NP" device_comm
run "device_data_plane@$NP" 90 gtest mpiexec -n "$NP" device_data_plane
# (On emulated, as a one-GPU node: one device, so its lines shrink to one rank.)
MESHRT_EMULATED_DEVICES=1 run runtime_cuda@2 90 gtest mpiexec -n 2 runtime_cuda
MESHRT_EMULATED_DEVICES=1 run runtime_cuda@4 90 gtest mpiexec -n 4 runtime_cuda
# The timeline on CUDA: runtime_cuda at 2 ranks with MESHRT_TRACE, then `meshrt-trace
# check --devices` (Python, outside the bundle): on every rank the GPU work of its
# commands, timed by CUDA events, as spans of its streams' tracks, each after its call.
TRACE_FILE=$WORK/cuda-trace.json
if MESHRT_EMULATED_DEVICES=1 MESHRT_TRACE=$TRACE_FILE run timeline@2 90 gtest mpiexec -n 2 runtime_cuda; then
  PY=$(command -v python3 || echo /opt/torch/.venv/bin/python3)
  if [ ! -x "$PY" ]; then
    record "timeline check" SKIP 0 "no python3 here to run meshrt-trace"
  elif out=$("$PY" "$ROOT/apps/meshrt-trace/meshrt-trace" check "$TRACE_FILE" --ranks 2 --devices 2>&1) &&
    tracks=$("$PY" -c 'import json, sys
t = json.load(open(sys.argv[1]))["traceEvents"]
names = sorted({e["args"]["name"] for e in t if e.get("name") == "thread_name" and " stream " in e["args"]["name"]})
spans = [e for e in t if e.get("cat") == "device"]
busy = sum(e["dur"] for e in spans)
print("%d device spans, %.0f us, on %d tracks: %s" % (len(spans), busy, len(names), ", ".join(names)))
sys.exit(0 if spans and all(n.startswith(sys.argv[2]) for n in names) else 1)' "$TRACE_FILE" "$([ "$REHEARSAL" = 1 ] && echo emulated || echo cuda)" 2>&1); then
    record "timeline check" PASS 0 "${out##*: }; $tracks"
  else
    echo "$out $tracks" >"$LOG/timeline-check.txt"
    record "timeline check" FAIL 0 "${out:0:300} ${tracks:-}" "$LOG/timeline-check.txt"
  fi
fi
# The errors that must not stick (docs/gpu.md), by name: a handled out-of-memory is not
# the next kernel's error, and a call that fails inside NCCL's group leaves none open
# (at one rank all_to_all and send_recv go through NCCL's group).
run "errors@1" 60 gtest mpiexec -n 1 device_comm \
  --gtest_filter='DeviceComm.AHandledOutOfMemoryIsNotTheNextKernelsError:DeviceComm.ACallThatFailsInsideAGroupLeavesNoGroupOpen'
# Two ranks on one GPU, so that NCCL moves data between ranks: NCCL refuses two ranks of a
# communicator on one device of one host (2.28: "Duplicate GPU detected", init.cc),
# telling hosts apart by a hash that NCCL_HOSTID overrides (misc/utils.cc). With a host id
# per rank each rank is a host of its own to NCCL, connected through its socket transport
# on the loopback interface (no shared memory, no P2P, no NVLink between them), and to
# meshrt, which tells hosts apart as NCCL does. NCCL 2.30 adds NCCL_MULTI_RANK_GPU_ENABLE
# (experimental) for the same; set too, it is ignored before. With 2 GPUs or more the
# suites above already ran at 2 ranks.
if [ "$NGPU" -lt 2 ]; then
  shared_gpu() {  # shared_gpu NAME PROGRAM [ARGS...]: PROGRAM at 2 ranks on device 0
    local name=$1 prog=$2
    shift 2
    NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1 NCCL_MNNVL_ENABLE=0 NCCL_NVLS_ENABLE=0 NCCL_MULTI_RANK_GPU_ENABLE=1 \
      MESHRT_DEVICE=0 MESHRT_EMULATED_DEVICES=1 run "$name" 120 gtest mpiexec \
      -n 1 -x NCCL_HOSTID=meshrt-gpu-check-rank-0 "$prog" "$@" : -n 1 -x NCCL_HOSTID=meshrt-gpu-check-rank-1 "$prog" "$@"
  }
  shared_gpu "device_comm@2 (1 GPU)" device_comm
  shared_gpu "device_data_plane@2 (1 GPU)" device_data_plane
fi
# nccl-tests' exactness (tests/peer/nccl_exact_test.cpp) to nccl-tests' 2^27 elements per
# rank on the GPU (the largest counts take turns among the combinations; 2^20 rehearsed).
# Its CPU half fills and checks about 5 GB per rank, so its watchdog gets the step's time.
PEER_MAX=$([ "$REHEARSAL" = 1 ] && echo 1048576 || echo 134217728)
PEER_NCCL_MAX_COUNT=$PEER_MAX MESHRT_TEST_WATCHDOG=140 run "peer_nccl_exact@$NP" 150 gtest mpiexec -n "$NP" \
  peer_nccl_exact
[ "$NGPU" -lt 2 ] && PEER_NCCL_MAX_COUNT=$PEER_MAX MESHRT_TEST_WATCHDOG=110 \
  shared_gpu "peer_nccl_exact@2 (1 GPU)" peer_nccl_exact
run "mpi_group_nccl@$NP" 60 gtest mpiexec -n "$NP" mpi_group_nccl
[ "$NP" -ge 2 ] && run runtime_overlap@2 90 gtest mpiexec -n 2 runtime_overlap

# 7. Device collectives through meshrt against NCCL by hand (at one rank a copy: the
# figures are the per-call overhead only; transports need two GPUs or more).
bench_args=(device-collectives --json "$LOG/device-collectives.json" --benchmark_color=false)
[ "$REHEARSAL" = 1 ] && bench_args+=(--quick "--benchmark_filter=/(8|1048576)/")
if run "device-collectives@$NP" 150 "device-collectives on" mpiexec -n "$NP" meshrt-bench "${bench_args[@]}"; then
  FIGURES=$(awk '$1 ~ /^(all_reduce|all_gather|reduce_scatter|all_to_all|send)$/ && $2 >= 1048576 {
    printf "  %-15s %10s B  meshrt %9s us  nccl %9s us  ratio %s\n", $1, $2, $3, $4, $NF }' \
    "$LOG/device-collectives@$NP.txt" | head -24)
  [ "$NP" = 1 ] && [ -n "$FIGURES" ] && FIGURES="  (1 rank: NCCL copies locally, so this is overhead only)
$FIGURES"
fi

# 8. The CPU side on this machine's processor (OpenBLAS picks its kernels at run time):
# the demo on CPU meshes (on one GPU its 2x2 mesh would put two ranks of a line on it).
MESHRT_ACCELERATOR=none run meshrt-demo@4 60 PASS mpiexec -n 4 meshrt-demo --mesh 2x2 --steps 30 --hidden 64 --log-every 10

# 9. The Python path: meshrt's extension built here for this machine's python3 (an
# extension is built for one Python, and this one is not the bundle's build machine's) from
# the bundle's python-kit/, then torch kernels on a mesh of the job's accelerator
# (tests/python/test_torch_kernels.py) and the Python demo (apps/examples/python/train.py),
# one process each (Open MPI's singleton start). Each missing prerequisite is a SKIP line
# that names it; then Python is not verified, and the headline says so.
PY_STATUS="not verified"
python_skip() {
  # In the rehearsal a bundle with the kit has all it needs here: a skip is a broken step.
  if [ "$REHEARSAL" = 1 ] && [ -f "$BUNDLE/python-kit/CMakeLists.txt" ]; then
    record "python" FAIL 0 "python step: skipped: $1 (the rehearsal expects Debian's python3 with all of it)"
  else
    record "python" SKIP 0 "python step: skipped: $1"
  fi
  PY_STATUS="NOT verified ($1)"
}
python_step() {
  local py=${MESHRT_GPU_CHECK_PYTHON:-$(command -v python3)} inc cxx cmake_bin pybind11_dir gen=() launcher=()
  if [ ! -f "$BUNDLE/python-kit/CMakeLists.txt" ]; then
    python_skip "the bundle has no python-kit/ (its build had no Python package)"
    return
  fi
  if [ -z "$py" ] || [ ! -x "$py" ]; then
    python_skip "no python3 on PATH"
    return
  fi
  inc=$(timeout 30 "$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>&1)
  if [ ! -f "$inc/Python.h" ]; then
    python_skip "no Python.h for $py (expected $inc/Python.h: its -dev package)"
    return
  fi
  cxx=${CXX:-$(command -v c++ || command -v g++ || command -v clang++)}
  if [ -z "$cxx" ]; then
    python_skip "no C++ compiler (c++, g++ or clang++) on PATH"
    return
  fi
  cmake_bin=$(command -v cmake || ls "$(dirname "$py")/cmake" 2>/dev/null)
  if [ -z "$cmake_bin" ]; then
    python_skip "no cmake on PATH or beside $py"
    return
  fi
  if ! timeout 60 "$py" -c 'import torch, numpy, pytest' >"$LOG/python-imports.txt" 2>&1; then
    python_skip "$py cannot import torch, numpy and pytest: $(tail -1 "$LOG/python-imports.txt")"
    return
  fi
  pybind11_dir=$(timeout 30 "$py" -c 'import pybind11; print(pybind11.get_cmake_dir())' 2>/dev/null)
  command -v ninja >/dev/null && gen=(-G Ninja)
  # The extension's libraries, where it links them from and finds them at run time: the
  # bundle's, less those this machine has (its python3 and torch load the machine's
  # libstdc++ and the like, never older copies from the bundle); those the extension links
  # always.
  local pylib=$WORK/python-lib so
  mkdir -p "$pylib"
  for so in "$BUNDLE"/lib/*; do
    [ -f "$so" ] || continue
    if ! grep -q "[[:space:]]$(basename "$so") " <(ldconfig -p 2>/dev/null) ||
      grep -q "\"[^\"]*$(basename "$so")[;\"]" "$BUNDLE/python-kit/kit.cmake"; then
      ln -s "$so" "$pylib/"
    fi
  done
  # The rehearsal: objects whose preprocessed source is the build's are taken from it.
  [ -n "${MESHRT_GPU_CHECK_PY_OBJECTS:-}" ] &&
    launcher=("-DCMAKE_CXX_COMPILER_LAUNCHER=$py;$ROOT/scripts/gpu-python/reuse_object.py;$MESHRT_GPU_CHECK_PY_OBJECTS")
  local pybuild=$WORK/python-build
  run_here "python configure" 120 - "$cmake_bin" -S "$BUNDLE/python-kit" -B "$pybuild" "${gen[@]}" "${launcher[@]}" \
    -DCMAKE_BUILD_TYPE=Release "-DCMAKE_CXX_FLAGS_RELEASE=-O2 -DNDEBUG" -DCMAKE_CXX_COMPILER="$cxx" \
    -DPython3_EXECUTABLE="$py" ${pybind11_dir:+-Dpybind11_DIR="$pybind11_dir"} \
    -DMESHRT_KIT_LIBDIR="$pylib" -DMESHRT_KIT_RPATH_LINK="$BUNDLE/lib${MESHRT_NCCL_LIB_DIR:+;$MESHRT_NCCL_LIB_DIR}" || return
  local t0=$SECONDS lim
  lim=$(limit 300)
  if [ "$lim" -lt 10 ]; then
    record "python build" FAIL 0 "not run: the budget of $BUDGET s is spent"
    return
  fi
  echo "\$ $cmake_bin --build $pybuild -j $(nproc)" >"$LOG/python build.txt"
  if ! timeout -k 10 "$lim" "$cmake_bin" --build "$pybuild" -j "$(nproc)" >>"$LOG/python build.txt" 2>&1; then
    record "python build" FAIL $((SECONDS - t0)) "the extension did not build for $py" "$LOG/python build.txt"
    return
  fi
  local core reused
  core=$(find "$pybuild/python/meshrt" -maxdepth 1 -name '_core*.so' -printf '%f\n' | head -1)
  reused=$(grep -c '^reuse_object: reused ' "$LOG/python build.txt")
  record "python build" PASS $((SECONDS - t0)) "$core for $("$py" -c 'import sys; print(sys.version.split()[0])') ($py)${launcher:+, $reused objects taken from the build (same preprocessed source)}" "$LOG/python build.txt"
  local kind=cuda
  [ "$REHEARSAL" = 1 ] && kind=emulated
  # (the last step: what it exports ends with the check)
  export LD_LIBRARY_PATH="$pylib${MESHRT_NCCL_LIB_DIR:+:$MESHRT_NCCL_LIB_DIR}" PYTHONPATH=$pybuild/python
  export PYTHONDONTWRITEBYTECODE=1 MESHRT_ACCELERATOR=$kind
  local failed_before=$FAILED
  FAILED=0
  if run_here "python torch kernels" 150 pytest "$py" -m pytest -q -rs -p no:cacheprovider \
    --rootdir="$ROOT/tests/python" "$ROOT/tests/python/test_torch_kernels.py" &&
    [ "$REHEARSAL" != 1 ] && grep -qE '^(=+ )?[0-9]+ passed.* skipped' "$LOG/python torch kernels.txt"; then
    # MESHRT_REQUIRE_GPU's rule: on a GPU a skipped test is a test that did not run.
    record "python: nothing skipped" FAIL 0 "expected no skipped test on a GPU, found some (-rs lists them)" "$LOG/python torch kernels.txt"
  fi
  run_here "python train.py" 150 "verification passed on $kind" "$py" "$ROOT/apps/examples/python/train.py" \
    --kind "$kind" --mesh 1x1 --steps 15
  [ "$FAILED" = 0 ] && PY_STATUS="verified on $kind"
  [ "$failed_before" = 0 ] || FAILED=1
}
python_step

if [ "$FAILED" = 0 ]; then
  if [ "$REHEARSAL" = 1 ]; then
    HEADLINE="rehearsal passed: the bundle runs with only glibc beside it; Python: $PY_STATUS (CUDA itself NOT verified here)"
  else
    HEADLINE="CUDA backend verified on $GPU_NAME ($NGPU GPU(s)); what needs 2+ GPUs is not; Python: $PY_STATUS"
  fi
  finish 0
fi
HEADLINE="NOT verified on $GPU_NAME: see the FAIL lines"
finish 1
