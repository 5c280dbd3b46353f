#!/usr/bin/env bash
# Makes the bundle that scripts/gpu-check.sh runs from on a GPU machine that has a driver
# but no build tools, no Open MPI and no network (the lent H200 machine, docs/gpu.md):
#   scripts/gpu-bundle.sh                  a CUDA build into build-bundle, then the bundle
#   scripts/gpu-bundle.sh --from build     the bundle from an existing build (CI's rehearsal)
#   scripts/gpu-bundle.sh --out DIR        where the bundle goes (default: gpu-bundle)
# The bundle is one file, DIR/meshrt-gpu-bundle.tar.gz, beside DIR/MANIFEST.txt (what is in
# it and what it needs from the machine). It holds the check's programs (the device test
# suites, meshrt-info, meshrt-bench, meshrt-demo), Open MPI's launcher, daemon, components
# and help files, PMIx's, and every shared library they load that is not glibc: Boost,
# fmt, OpenBLAS, hwloc, libevent, libstdc++, CUDA's runtime (libcudart) and so on, all
# stripped. Not in it, taken from the machine: the driver (libcuda.so.1) and NCCL
# (libnccl.so.2, 218 MB: the machine's pip nvidia-nccl-cu13, found by gpu-check.sh).
# env.sh at the bundle's root sets the environment its programs need (library path, Open
# MPI's and PMIx's relocation) from wherever it was unpacked. Nothing is installed here.
# With the Python package in the build, python-kit/ holds what gpu-check.sh needs to build the
# extension there for the machine's own python3: its sources, a CMake project for it alone
# (scripts/gpu-python/CMakeLists.txt), and the headers it includes that are not Python's,
# pybind11's or the compiler's (meshrt's under include/; Boost's, fmt's, DLPack's and
# MPI's under python-kit/sysroot/, where they lie here); the libraries it links come along.
# scripts/gpu-bundle-rehearse.sh runs the bundle with only glibc beside it.
# Settings: MESHRT_JOBS (build jobs), MESHRT_BUNDLE_BUILD_DIR (default build-bundle),
# MESHRT_BUNDLE_CUDA_ARCHITECTURES (default 90: the H100 and H200), MESHRT_BUNDLE_LIMIT_MIB
# (the largest bundle accepted, default 56: the device tool carries 64 MiB in all).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
FROM=""
DEST=$ROOT/gpu-bundle
while [ $# -gt 0 ]; do
  case $1 in
  --from) FROM=$(cd "$2" && pwd); shift 2 ;;
  --out) mkdir -p "$2"; DEST=$(cd "$2" && pwd); shift 2 ;;
  *) echo "gpu-bundle: expected --from BUILD_DIR or --out DIR, found '$1'" >&2; exit 2 ;;
  esac
done
LIMIT_MIB=${MESHRT_BUNDLE_LIMIT_MIB:-56}

# The programs gpu-check.sh runs (tests, then apps).
TESTS=(unit_functions unit_tensor unit_device device_comm device_data_plane runtime_cuda mpi_group_nccl runtime_overlap
  peer_nccl_exact)
APPS=(meshrt-info meshrt-bench meshrt-demo)
# glibc: the one part of the base system the bundle relies on (its programs are built
# against this machine's glibc; MANIFEST.txt says which version they need).
BASE_RE='^(linux-vdso\.so\.1|ld-linux-x86-64\.so\.2|libc\.so\.6|libm\.so\.6|libmvec\.so\.1|libpthread\.so\.0|libdl\.so\.2|librt\.so\.1|libutil\.so\.1|libresolv\.so\.2|libanl\.so\.1|libnss_[a-z]+\.so\.2|libthread_db\.so\.1)$'
# Taken from the GPU machine: its driver, and its NCCL.
EXTERNAL_RE='^(libcuda\.so\.1|libnccl\.so\.2)$'

say() { echo "== gpu-bundle: $*"; }
die() { echo "gpu-bundle: $*" >&2; exit 1; }

# 1. The build.
if [ -z "$FROM" ]; then
  BUILD=${MESHRT_BUNDLE_BUILD_DIR:-$ROOT/build-bundle}
  if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDACXX=/usr/local/cuda/bin/nvcc; fi
  command -v nvcc >/dev/null || [ -n "${CUDACXX:-}" ] ||
    die "expected CUDA's compiler (nvcc on PATH or /usr/local/cuda/bin/nvcc) for the GPU machine's build, found none"
  launcher=()
  if command -v ccache >/dev/null; then
    launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  fi
  generator=()
  [ -f "$BUILD/CMakeCache.txt" ] || ! command -v ninja >/dev/null || generator=(-G Ninja)
  # Release at -O2: GCC 12 at -O3 warns falsely (-Wrestrict) in the group module (src/group/), and
  # -O2 is what CI's RelWithDebInfo build tests.
  say "configuring $BUILD (Release, CUDA architectures ${MESHRT_BUNDLE_CUDA_ARCHITECTURES:-90})"
  cmake -S "$ROOT" -B "$BUILD" "${generator[@]}" "${launcher[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CXX_FLAGS_RELEASE="-O2 -DNDEBUG" -DCMAKE_C_FLAGS_RELEASE="-O2 -DNDEBUG" -DMESHRT_WERROR=ON \
    -DMESHRT_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="${MESHRT_BUNDLE_CUDA_ARCHITECTURES:-90}" >/dev/null
  # The Python extension (where this machine has Python's headers and pybind11): what it
  # links and how it was compiled is what the machine's build of it repeats.
  py_target=()
  grep -q '^MESHRT_PYTHON_BUILD_DIR:' "$BUILD/CMakeCache.txt" && py_target=(meshrt_python)
  say "building ${TESTS[*]} ${APPS[*]} ${py_target[*]}"
  cmake --build "$BUILD" -j "${MESHRT_JOBS:-$(nproc)}" --target "${TESTS[@]}" "${APPS[@]}" "${py_target[@]}"
else
  BUILD=$FROM
fi
[ -f "$BUILD/CMakeCache.txt" ] || die "expected a build folder with CMakeCache.txt, found none at $BUILD"
CUDA_ON=$(sed -n 's/^CMAKE_CUDA_COMPILER:[A-Z]*=//p' "$BUILD/CMakeCache.txt")
NCCL_H=$(sed -n 's/^NCCL_INCLUDE_DIR:[A-Z]*=//p' "$BUILD/CMakeCache.txt")
if [ -z "$CUDA_ON" ]; then
  # A CPU build (CI without a toolkit): no NCCL test; the rest rehearses all the same.
  TESTS=("${TESTS[@]/mpi_group_nccl/}")
fi

# 2. The staging tree: bin/ (programs, Open MPI's launcher), lib/ (libraries by soname),
# lib/openmpi and lib/pmix (components), share/ (help files), etc/ (Open MPI's settings).
STAGE_PARENT=$(mktemp -d "${TMPDIR:-/tmp}/meshrt-gpu-bundle.XXXXXX")
trap 'rm -rf "$STAGE_PARENT"' EXIT
STAGE=$STAGE_PARENT/bundle
mkdir -p "$STAGE"/{bin,lib/openmpi,lib/pmix,lib/hwloc,share/openmpi,share/pmix,etc}

programs=()
for t in "${TESTS[@]}" "${APPS[@]}"; do
  [ -n "$t" ] || continue
  f=$(find "$BUILD/tests" "$BUILD/apps" -type f -name "$t" -perm -u+x -print -quit 2>/dev/null)
  [ -n "$f" ] || die "expected the program $t in $BUILD (tests/ or apps/), found none: build it first"
  cp "$f" "$STAGE/bin/$t"
  programs+=("$f")
done

# Open MPI: where Debian (or any install) keeps it, from ompi_info.
command -v ompi_info >/dev/null || die "expected Open MPI's ompi_info on PATH, found none"
ompi_path() { ompi_info --parsable --path "$1" | sed -n "s/^path:$1://p"; }
OMPI_BIN=$(ompi_path bindir)
OMPI_PKGLIB=$(ompi_path pkglibdir)
OMPI_PKGDATA=$(ompi_path pkgdatadir)
OMPI_SYSCONF=$(ompi_path sysconfdir)
for p in orterun orted ompi_info; do
  [ -x "$OMPI_BIN/$p" ] || die "expected $OMPI_BIN/$p (Open MPI 4's launcher and daemon), found none"
  cp "$(readlink -f "$OMPI_BIN/$p")" "$STAGE/bin/$p"
  programs+=("$OMPI_BIN/$p")
done
ln -s orterun "$STAGE/bin/mpiexec"
ln -s orterun "$STAGE/bin/mpirun"
cp -r "$OMPI_PKGDATA"/. "$STAGE/share/openmpi/"
[ -f "$OMPI_SYSCONF/openmpi-mca-params.conf" ] && cp "$OMPI_SYSCONF/openmpi-mca-params.conf" "$STAGE/etc/"

# What each file loads, as "soname path" lines (not found: path "-"), from ldd; asked once
# per file, many files per ldd call (ldd is the slow part of bundling).
declare -A ldd_of=()
load_needs() {  # load_needs FILE...: fills ldd_of for the files not asked yet
  local todo=() f out
  for f in "$@"; do [ -n "${ldd_of[$f]+x}" ] || todo+=("$f"); done
  [ ${#todo[@]} -gt 0 ] || return 0
  for f in "${todo[@]}"; do ldd_of[$f]=""; done
  out=$(ldd "${todo[@]}" 2>/dev/null | awk -v one="${todo[0]}" -v n="${#todo[@]}" '
    n == 1 && NR == 1 { file = one }
    n > 1 && /^[^ \t].*:$/ { file = substr($0, 1, length($0) - 1); next }
    $2 == "=>" { print file "\t" $1 " " ($3 == "not" ? "-" : $3) }')
  while IFS=$'\t' read -r f line; do
    [ -n "$f" ] && ldd_of[$f]+="$line"$'\n'
  done <<<"$out"
}
declare -A lib_path=()  # soname -> the file it resolves to here
add_closure() {         # add_closure FILE: every library FILE loads, except glibc and the machine's
  local so p
  load_needs "$1"
  while read -r so p; do
    [ -n "$so" ] || continue
    [[ $so =~ $BASE_RE || $so =~ $EXTERNAL_RE ]] && continue
    [ "$p" != - ] || die "$1 needs $so, which is not found here: expected every library to resolve before bundling"
    lib_path[$so]=$(readlink -f "$p")
  done <<<"${ldd_of[$1]}"
}
for p in "${programs[@]}"; do add_closure "$p"; done

# PMIx (Open MPI 4 on Debian uses the system's, through its pmix components): its
# library, components and help files.
for c in "$OMPI_PKGLIB"/mca_pmix_*.so; do [ -e "$c" ] && add_closure "$c"; done
pmix_lib=${lib_path[libpmix.so.2]:-}
if [ -n "$pmix_lib" ] && [ -d "$(dirname "$pmix_lib")/pmix" ]; then
  for c in "$(dirname "$pmix_lib")"/pmix/*.so; do cp "$c" "$STAGE/lib/pmix/"; add_closure "$c"; done
  [ -d "$(dirname "$pmix_lib")/../share/pmix" ] && cp -r "$(dirname "$pmix_lib")/../share/pmix"/. "$STAGE/share/pmix/"
fi

# Open MPI's components: each one whose libraries are all in the bundle already (or in
# glibc) comes along; one that needs more (UCX, libfabric, PSM, verbs, OpenSHMEM: network
# fabrics a one-node check never uses) stays behind, named in MANIFEST.txt. Its common
# libraries (libmca_common_*) count as in the bundle if their own needs are.
load_needs "$OMPI_PKGLIB"/mca_*.so
in_bundle() { [[ $1 =~ $BASE_RE || $1 =~ $EXTERNAL_RE || -n ${lib_path[$1]:-} ]]; }
dropped=()
for c in "$OMPI_PKGLIB"/mca_*.so; do
  missing=()
  while read -r so p; do
    [ -n "$so" ] || continue
    in_bundle "$so" && continue
    if [[ $so == libmca_common_* && $p != - ]]; then
      load_needs "$p"
      ok=1
      while read -r so2 _; do
        [ -z "$so2" ] || in_bundle "$so2" || [[ $so2 == libmca_common_* ]] || ok=0
      done <<<"${ldd_of[$p]}"
      [ $ok = 1 ] && continue
    fi
    missing+=("$so")
  done <<<"${ldd_of[$c]}"
  if [ ${#missing[@]} -eq 0 ]; then
    cp "$c" "$STAGE/lib/openmpi/"
  else
    dropped+=("$(basename "$c" .so) (needs ${missing[*]})")
  fi
done
for c in "$STAGE"/lib/openmpi/*.so; do add_closure "$OMPI_PKGLIB/$(basename "$c")"; done

# The Python extension's kit (python-kit/): built on the GPU machine by gpu-check.sh for its
# python3, from the build's flags (compile_commands.json) over the bundle's files.
PY_CORE=$(find "$BUILD/python/meshrt" -maxdepth 1 -name '_core*.so' -print -quit 2>/dev/null)
PY_NOTE="none (a build without the Python package)"
if [ -n "$PY_CORE" ]; then
  add_closure "$PY_CORE"
  mkdir -p "$STAGE/python-kit/source" "$STAGE/python-kit/sysroot" "$STAGE/include"
  cp "$ROOT/scripts/gpu-python/CMakeLists.txt" "$STAGE/python-kit/CMakeLists.txt"
  cp "$ROOT/python/CMakeLists.txt" "$STAGE/python-kit/source/"
  (cd "$ROOT/python" && find src meshrt -type f \( -name '*.cpp' -o -name '*.hpp' -o -name '*.py' -o -name '*.pyi' -o -name py.typed \) \
    -not -path '*/__pycache__/*' -print0 | xargs -0 cp --parents -t "$STAGE/python-kit/source")
  cp -r "$ROOT/include/meshrt" "$STAGE/include/"
  cp -r "$BUILD/include/meshrt"/. "$STAGE/include/meshrt/"
  # How the build compiled one of the extension's files: its definitions and include folders.
  py_flags=$(python3 - "$BUILD/compile_commands.json" "$ROOT/python/src/module.cpp" <<'PYEOF'
import json, shlex, sys
entry = next(e for e in json.load(open(sys.argv[1])) if e["file"] == sys.argv[2])
args = shlex.split(entry["command"]) if "command" in entry else entry["arguments"]
i = 0
while i < len(args):
    a = args[i]
    for flag in ("-D", "-I", "-isystem"):
        if a == flag:
            print(flag, args[i + 1]); i += 1; break
        if a.startswith(flag) and flag != "-isystem":
            print(flag, a[len(flag):]); break
    i += 1
PYEOF
  ) || die "expected $ROOT/python/src/module.cpp in $BUILD/compile_commands.json (CMAKE_EXPORT_COMPILE_COMMANDS), found none"
  defs=() third=() flags=()
  while read -r flag val; do
    case $flag in
    -D) [[ $val == *_EXPORTS ]] || defs+=("$val"); flags+=("-D$val") ;;
    -I | -isystem)
      flags+=("$flag" "$val")
      # Left out: the extension's own sources, meshrt's headers (include/), Python's.
      [ "$val" = "$ROOT/python/src" ] || [ "$val" = "$ROOT/include" ] || [ "$val" = "$BUILD/include" ] ||
        [ -f "$val/Python.h" ] || third+=("$val") ;;
    esac
  done <<<"$py_flags"
  # The third-party headers named in /usr/include by meshrt's own #include lines (Boost,
  # fmt, DLPack: not Python's or pybind11's, which are the machine's).
  tops=$(grep -rhoE '^#include <[a-z0-9_]+/' "$ROOT/include/meshrt" "$ROOT/python/src" | sed 's/#include <//; s/\/$//' |
    sort -u | grep -vx pybind11)
  # Every header the extension's files reach through meshrt's headers and those lines (a
  # compiler's dependency list of one file that includes them all), mirrored under
  # sysroot/; and Boost's configuration whole (another compiler takes other files of it).
  tu=$STAGE_PARENT/python-headers.cpp
  { find "$ROOT/include/meshrt" -name '*.hpp' | sort | sed 's/.*/#include "&"/'
    grep -rhoE "^#include <($(echo "$tops" | paste -sd'|'))/[^>]*>" "$ROOT/include/meshrt" "$ROOT/python/src" | sort -u
  } >"$tu"
  cxx=$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$BUILD/CMakeCache.txt")
  deps=$("${cxx:-c++}" -std=c++20 "${flags[@]}" -M "$tu" | tr -d '\\' | tr ' ' '\n' | grep '^/' | sort -u) ||
    die "could not list the headers of the Python extension (${cxx:-c++} -M $tu)"
  dlpack=$(sed -n 's/^DLPACK_INCLUDE_DIR:[A-Z]*=//p' "$BUILD/CMakeCache.txt")
  sys_dirs=("${third[@]}" "${dlpack:-/usr/include}")
  mirrored=0
  while read -r h; do
    [ -n "$h" ] || continue
    keep=0
    for d in "${third[@]}"; do [[ $h == "$d"/* ]] && keep=1; done
    for t in $tops; do [[ $h == /usr/include/$t/* ]] && keep=1; done
    [ $keep = 1 ] || continue
    mkdir -p "$STAGE/python-kit/sysroot$(dirname "$h")"
    cp "$h" "$STAGE/python-kit/sysroot$h"
    mirrored=$((mirrored + 1))
  done <<<"$deps"
  [ -d /usr/include/boost/config ] && cp -r /usr/include/boost/config "$STAGE/python-kit/sysroot/usr/include/boost/"
  # The libraries it links, as the build's extension names them (libmeshrt's first).
  py_libs=(libmeshrt.so.0)
  while read -r so; do
    [[ $so =~ $BASE_RE || $so =~ ^(libstdc\+\+\.so\.6|libgcc_s\.so\.1|libmeshrt\.so\.0)$ ]] || py_libs+=("$so")
  done < <(readelf -d "$PY_CORE" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
  {
    echo "# Written by scripts/gpu-bundle.sh from $BUILD: how it compiled meshrt's Python extension."
    echo "set(MESHRT_KIT_DEFINITIONS \"$(IFS=';'; echo "${defs[*]}")\")"
    echo "set(MESHRT_KIT_SYSTEM_INCLUDE_DIRS \"$(IFS=';'; echo "${sys_dirs[*]}")\")"
    echo "set(MESHRT_KIT_DLPACK_INCLUDE_DIR \"${dlpack:-/usr/include}\")"
    echo "set(MESHRT_KIT_LIBRARIES \"$(IFS=';'; echo "${py_libs[*]}")\")"
  } >"$STAGE/python-kit/kit.cmake"
  PY_NOTE="the extension's sources and $mirrored headers (python-kit/), for $(basename "$PY_CORE" | sed 's/^_core\.//; s/\.so$//') here: gpu-check.sh builds it for the machine's python3"
fi

for so in "${!lib_path[@]}"; do cp "${lib_path[$so]}" "$STAGE/lib/$so"; done

# 3. Strip, and point every run path at the bundle ($ORIGIN-relative): the build's own
# (build folders, /usr/local/cuda/lib) and Debian's (/usr/lib/.../openmpi/lib) must not
# reach the GPU machine's files. env.sh's LD_LIBRARY_PATH covers the libraries with none.
is_elf() { [ "$(head -c 4 "$1" | tr -d '\0')" = $'\x7fELF' ]; }
elfs=()
while read -r f; do is_elf "$f" && elfs+=("$f"); done < <(find "$STAGE" -type f | sort)
rp_script=$STAGE_PARENT/rpath.cmake
: >"$rp_script"
for f in "${elfs[@]}"; do
  chmod u+w "$f"
  strip --strip-unneeded "$f" 2>/dev/null || die "could not strip $f"
  # (grep reads all of readelf's output: with -q, pipefail could fail the test at random)
  if readelf -d "$f" | grep -E '\((RPATH|RUNPATH)\)' >/dev/null; then
    rel=$(realpath --relative-to="$(dirname "$f")" "$STAGE/lib")
    # shellcheck disable=SC2016
    printf 'file(RPATH_SET FILE "%s" NEW_RPATH "$ORIGIN/%s")\n' "$f" "$rel" >>"$rp_script"
  fi
done
cmake -P "$rp_script" >/dev/null
rm -f "$rp_script"

# 4. env.sh, sourced by gpu-check.sh: the bundle's environment from where it lies.
cat >"$STAGE/env.sh" <<'EOF'
# Sourced (bash): the environment the bundle's programs need, from the bundle's own folder.
# MESHRT_NCCL_LIB_DIR, if set, is the folder of the libnccl.so.2 to load (the machine's).
_mb=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export MESHRT_BUNDLE=$_mb
export PATH="$_mb/bin:$PATH"
export LD_LIBRARY_PATH="$_mb/lib${MESHRT_NCCL_LIB_DIR:+:$MESHRT_NCCL_LIB_DIR}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# Open MPI and PMIx look for their components, help files and settings here, not where
# they were installed on the build machine.
export OPAL_PREFIX="$_mb" OPAL_EXEC_PREFIX="$_mb" OPAL_BINDIR="$_mb/bin" OPAL_SBINDIR="$_mb/bin"
export OPAL_LIBEXECDIR="$_mb/bin" OPAL_LIBDIR="$_mb/lib" OPAL_PKGLIBDIR="$_mb/lib/openmpi"
export OPAL_DATAROOTDIR="$_mb/share" OPAL_DATADIR="$_mb/share" OPAL_PKGDATADIR="$_mb/share/openmpi"
export OPAL_SYSCONFDIR="$_mb/etc"
export PMIX_PREFIX="$_mb" PMIX_EXEC_PREFIX="$_mb" PMIX_BINDIR="$_mb/bin" PMIX_LIBDIR="$_mb/lib"
export PMIX_PKGLIBDIR="$_mb/lib/pmix" PMIX_DATADIR="$_mb/share" PMIX_DATAROOTDIR="$_mb/share"
export PMIX_PKGDATADIR="$_mb/share/pmix" PMIX_SYSCONFDIR="$_mb/etc"
export PMIX_MCA_mca_base_component_path="$_mb/lib/pmix"
# hwloc's plugins (none bundled): never the machine's, which may be another version.
export HWLOC_PLUGINS_PATH="$_mb/lib/hwloc"
# One node: ranks start as local processes (plm isolated), never through ssh or rsh,
# which the GPU machine need not have (Open MPI's rsh launcher fails without them).
export OMPI_MCA_plm=isolated
# Shared memory without the kernel's single copy (CMA): a sandboxed machine may refuse
# process_vm_readv, and the check moves no large host messages over MPI.
export OMPI_MCA_btl_vader_single_copy_mechanism=none
# As root, oversubscribed, yielding when idle (scripts/common.sh's mpi_local_environment).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_mpi_yield_when_idle=1
unset _mb
EOF

# 5. MANIFEST.txt: what the bundle holds and needs.
glibc_needed=$(for f in "${elfs[@]}"; do objdump -T "$f" 2>/dev/null; done |
  grep -o 'GLIBC_2\.[0-9]*' | sort -uV | tail -1 | sed 's/GLIBC_//')
nccl_built=""
if [ -n "$NCCL_H" ] && [ -f "$NCCL_H/nccl.h" ]; then
  nccl_built=$(awk '/^#define NCCL_(MAJOR|MINOR|PATCH) /{v[$2]=$3} END{print v["NCCL_MAJOR"]"."v["NCCL_MINOR"]"."v["NCCL_PATCH"]}' "$NCCL_H/nccl.h")
fi
cudart=$(basename "$(readlink -f "${lib_path[libcudart.so.13]:-${lib_path[libcudart.so.12]:-none}}")")
{
  echo "meshrt GPU bundle (scripts/gpu-bundle.sh); unpack and source env.sh"
  # shellcheck disable=SC1091
  echo "made:        $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(. /etc/os-release && echo "$PRETTY_NAME")"
  echo "source:      $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$ROOT" diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "build:       $BUILD ($(sed -n 's/^CMAKE_BUILD_TYPE:[A-Z]*=//p' "$BUILD/CMakeCache.txt"))"
  if [ -n "$CUDA_ON" ]; then
    # The build's CUDA architectures (cached since the default went into the cache).
    archs=$(sed -n 's/^CMAKE_CUDA_ARCHITECTURES:[A-Z]*=//p' "$BUILD/CMakeCache.txt" | tr ';' ' ')
    echo "cuda:        $("$CUDA_ON" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'), architectures ${archs:-unknown (not in CMakeCache.txt)}, runtime $cudart (bundled)"
    echo "nccl-built:  ${nccl_built:-unknown} (libnccl.so.2 is the machine's: NCCL 2.14 or later)"
  else
    echo "cuda:        none (a CPU build: the emulated accelerator only)"
  fi
  echo "glibc:       ${glibc_needed:-unknown} or later (the machine's)"
  echo "open-mpi:    $(ompi_info --parsable 2>/dev/null | sed -n 's/^ompi:version:full://p')"
  echo "python:      $PY_NOTE"
  echo "from the machine: libcuda.so.1 (its driver), libnccl.so.2, glibc; for Python: python3 with Python.h, pybind11, torch, pytest, a C++ compiler, CMake"
  for d in "${dropped[@]}"; do echo "left out:    $d"; done
  echo "files:"
  (cd "$STAGE" && find . -type f -printf '  %8s  %P\n' | sort -k2)
} >"$STAGE/MANIFEST.txt"

# 6. Pack: one file (its modes and links survive any copy), checked against the limit.
mkdir -p "$DEST"
tar -C "$STAGE" -czf "$DEST/meshrt-gpu-bundle.tar.gz.part" .
mv "$DEST/meshrt-gpu-bundle.tar.gz.part" "$DEST/meshrt-gpu-bundle.tar.gz"
cp "$STAGE/MANIFEST.txt" "$DEST/MANIFEST.txt"
size=$(stat -c %s "$DEST/meshrt-gpu-bundle.tar.gz")
unpacked=$(du -sb "$STAGE" | cut -f1)
say "$DEST/meshrt-gpu-bundle.tar.gz: $((size >> 20)) MiB ($((unpacked >> 20)) MiB unpacked, ${#lib_path[@]} libraries, ${#dropped[@]} Open MPI components left out)"
if [ "$size" -gt $((LIMIT_MIB << 20)) ]; then
  die "expected a bundle of at most $LIMIT_MIB MiB (MESHRT_BUNDLE_LIMIT_MIB), found $((size >> 20)) MiB: see $DEST/MANIFEST.txt"
fi
