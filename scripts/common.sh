# Shared by run.sh and test.sh: install what is missing, configure, build.
# Sourced, not run. Settings (environment):
#   MESHRT_BUILD_DIR    build folder (default: build)
#   MESHRT_CMAKE_ARGS   extra arguments for the configure step
#   MESHRT_JOBS         parallel build jobs (default: the number of cores)
set -euo pipefail

MESHRT_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MESHRT_BUILD_DIR=${MESHRT_BUILD_DIR:-$MESHRT_ROOT/build}
MESHRT_JOBS=${MESHRT_JOBS:-$(nproc)}

# The Debian 12 packages a build needs.
MESHRT_PACKAGES=(build-essential cmake ninja-build pkg-config
  openmpi-bin libopenmpi-dev
  libboost-serialization-dev libboost-log-dev libboost-stacktrace-dev
  libgtest-dev libgmock-dev libbenchmark-dev libcli11-dev nlohmann-json3-dev libfmt-dev
  libopenblas-dev
  python3-dev pybind11-dev libdlpack-dev python3-numpy python3-pytest python3-torch python3-mpi4py
  python3-venv python3-pip python3-setuptools python3-wheel)
# Only scripts/fuzz.sh needs these (clang with libFuzzer and the sanitizer runtimes).
MESHRT_FUZZ_PACKAGES=(clang libclang-rt-14-dev)

# ensure_packages PKG... : installs the missing ones as root; otherwise prints the line.
ensure_packages() {
  local missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" -ne 0 ]; then
    echo "meshrt needs these Debian packages, and installing them needs root:" >&2
    echo "  sudo apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
  echo "== installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# The MPI settings every local run needs on a small machine, as root.
mpi_local_environment() {
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  export OMPI_MCA_rmaps_base_oversubscribe=1
  # Without it oversubscribed ranks busy-poll and run about 1000x slower.
  export OMPI_MCA_mpi_yield_when_idle=1
  # Shared memory's single copy through the kernel (CMA) is ~5x faster at 1 MiB, but
  # needs ptrace rights that containers often withhold. Configure probes it once per build
  # folder (cmake/MeshrtTesting.cmake, cached as MESHRT_MPI_SINGLE_COPY): turn it off only
  # where the probe failed.
  if grep -qx 'MESHRT_MPI_SINGLE_COPY:BOOL=OFF' "$MESHRT_BUILD_DIR/CMakeCache.txt" 2>/dev/null; then
    export OMPI_MCA_btl_vader_single_copy_mechanism=none
    echo "== MPI shared-memory single copy does not work here (configure's probe): off, large messages ~5x slower" >&2
  fi
}

configure_and_build() {
  # The CUDA toolkit installs nvcc off the default PATH.
  if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
    export CUDACXX=/usr/local/cuda/bin/nvcc
  fi
  local generator=()
  command -v ninja >/dev/null && generator=(-G Ninja)
  if [ ! -f "$MESHRT_BUILD_DIR/CMakeCache.txt" ]; then
    echo "== configuring $MESHRT_BUILD_DIR"
    # shellcheck disable=SC2086
    cmake -S "$MESHRT_ROOT" -B "$MESHRT_BUILD_DIR" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" ${MESHRT_CMAKE_ARGS:-}
  else
    # shellcheck disable=SC2086
    cmake -S "$MESHRT_ROOT" -B "$MESHRT_BUILD_DIR" "$@" ${MESHRT_CMAKE_ARGS:-} >/dev/null
  fi
  echo "== building ($MESHRT_JOBS jobs)"
  cmake --build "$MESHRT_BUILD_DIR" -j "$MESHRT_JOBS"
}
