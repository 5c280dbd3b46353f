#!/usr/bin/env bash
# Rehearses scripts/gpu-check.sh here, on the emulated accelerator, with the bundle's
# programs seeing only what the GPU machine is sure to have, so that a library missing
# from the bundle shows here and not there:
#   scripts/gpu-bundle-rehearse.sh [BUNDLE]     (default gpu-bundle/meshrt-gpu-bundle.tar.gz)
# In a private mount namespace it builds a root holding glibc alone (its libraries and
# ld.so: no libstdc++, Open MPI, Boost, fmt, OpenBLAS, hwloc, libevent, CUDA), with /dev,
# /proc and /sys, and a stand-in for the machine's pip NCCL (this machine's libnccl.so.2,
# the same nvidia-nccl-cu13 wheel's file, where a venv keeps it). gpu-check.sh runs
# outside it but starts every bundle program inside it (chroot): its library trace covers
# every program and component, its steps run the suites with mpiexec at 1 to 4 ranks.
# The Python step runs outside it, as on the machine: Debian's python3 builds the
# extension from the bundle's kit and runs the torch kernels' tests and train.py on the
# emulated accelerator (MESHRT_GPU_CHECK_PYTHON names another python3).
# Needs root (unshare, mount, chroot); the bundle comes from scripts/gpu-bundle.sh.
# Exits with gpu-check.sh's code; prints its verdict and the time taken, and leaves what
# gpu-check.sh wrote under $OUT in the bundle's folder, under rehearsal/.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUNDLE=$(realpath "${1:-$ROOT/gpu-bundle/meshrt-gpu-bundle.tar.gz}")
[ -f "$BUNDLE" ] || { echo "gpu-bundle-rehearse: expected the bundle at $BUNDLE, found none: run scripts/gpu-bundle.sh" >&2; exit 1; }
if [ "$(id -u)" != 0 ]; then
  echo "gpu-bundle-rehearse: expected root (a private mount namespace and chroot), found uid $(id -u)" >&2
  exit 1
fi

BASE=$(mktemp -d "${TMPDIR:-/tmp}/meshrt-rehearsal.XXXXXX")
trap 'rm -rf --one-file-system "$BASE"' EXIT
SYSROOT=$BASE/root
SHARED=$BASE/work  # the kit's work folder and $OUT: the same path inside and out
mkdir -p "$SYSROOT"/{lib64,lib/x86_64-linux-gnu,etc,tmp,dev,proc,sys} "$SHARED/out" "$SYSROOT$SHARED"
chmod 1777 "$SYSROOT/tmp"

# glibc alone: the libraries of Debian's libc6 package (whatever this glibc names them).
LIBDIR=/lib/x86_64-linux-gnu
glibc=(ld-linux-x86-64.so.2 libc.so.6 libm.so.6 libmvec.so.1 libpthread.so.0 libdl.so.2 librt.so.1
  libutil.so.1 libresolv.so.2 libanl.so.1 libnss_files.so.2 libnss_dns.so.2 libthread_db.so.1)
for so in "${glibc[@]}"; do
  [ -e "$LIBDIR/$so" ] && cp -L "$LIBDIR/$so" "$SYSROOT/lib/x86_64-linux-gnu/$so"
done
ln -s ../lib/x86_64-linux-gnu/ld-linux-x86-64.so.2 "$SYSROOT/lib64/ld-linux-x86-64.so.2"
cp /etc/passwd /etc/group /etc/hosts "$SYSROOT/etc/"
printf 'passwd: files\ngroup: files\nhosts: files dns\n' >"$SYSROOT/etc/nsswitch.conf"
ldconfig -r "$SYSROOT" 2>/dev/null || true

# The stand-in for the machine's pip NCCL (a CUDA bundle's libmeshrt needs libnccl.so.2),
# where the lent machine's torch venv keeps it (docs/gpu.md).
NCCL_HERE=""
tar -xzOf "$BUNDLE" ./MANIFEST.txt >"$BASE/MANIFEST.txt"
if grep -q '^cuda: *[0-9]' "$BASE/MANIFEST.txt"; then
  NCCL_HERE=$(ldconfig -p | awk '/libnccl\.so\.2 / && !p {p = $NF} END {print p}')
  for d in /usr/local/cuda/lib /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu; do
    [ -z "$NCCL_HERE" ] && [ -f "$d/libnccl.so.2" ] && NCCL_HERE=$d/libnccl.so.2
  done
  [ -n "$NCCL_HERE" ] || { echo "gpu-bundle-rehearse: a CUDA bundle needs a libnccl.so.2 here to stand in for the machine's, found none" >&2; exit 1; }
  NCCL_IN=$SYSROOT/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
  mkdir -p "$NCCL_IN"
  touch "$NCCL_IN/libnccl.so.2"
fi

# The Python step: Debian's python3 (torch, numpy, pytest), the kit's extension built with
# the objects of the build the bundle came from where their preprocessed sources match
# (scripts/gpu-python/reuse_object.py: compiling it takes minutes on two cores).
PY_OBJECTS=$(sed -n 's/^build: *\(.*\) (.*)$/\1/p' "$BASE/MANIFEST.txt")
[ -f "$PY_OBJECTS/compile_commands.json" ] || PY_OBJECTS=""
export PY_OBJECTS

start=$(date +%s)
set +e
# shellcheck disable=SC2016
unshare -m bash -euc '
  sysroot=$1 shared=$2 nccl=$3
  mount --rbind /dev "$sysroot/dev"
  mount --rbind /proc "$sysroot/proc"
  mount --rbind -o ro /sys "$sysroot/sys" 2>/dev/null || mount --rbind /sys "$sysroot/sys"
  mount --bind "$shared" "$sysroot$shared"
  if [ -n "$nccl" ]; then
    mount --bind -o ro "$nccl" "$sysroot/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2"
  fi
  shift 3
  exec env TMPDIR="$shared" OUT="$shared/out" MESHRT_GPU_CHECK_REHEARSAL=1 \
    MESHRT_GPU_CHECK_PYTHON="${MESHRT_GPU_CHECK_PYTHON:-/usr/bin/python3}" MESHRT_GPU_CHECK_PY_OBJECTS="$PY_OBJECTS" \
    MESHRT_GPU_CHECK_WRAP="chroot $sysroot" MESHRT_GPU_CHECK_SYSROOT="$sysroot" \
    MESHRT_GPU_CHECK_BUDGET="${MESHRT_GPU_CHECK_BUDGET:-110}" MESHRT_GPU_BUNDLE="$1" bash "$2"
' rehearse "$SYSROOT" "$SHARED" "$NCCL_HERE" "$BUNDLE" "$ROOT/scripts/gpu-check.sh"
rc=$?
KEEP=$(dirname "$BUNDLE")/rehearsal
rm -rf "$KEEP"
cp -r "$SHARED/out" "$KEEP"
echo "== gpu-bundle-rehearse: logs in $KEEP"
echo "== gpu-bundle-rehearse: rc $rc in $(($(date +%s) - start)) s (bundle $(($(stat -c %s "$BUNDLE") >> 20)) MiB, root: glibc only)"
exit $rc
