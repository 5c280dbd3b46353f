#!/usr/bin/env bash
# Installing meshrt the ways an admin and a Python user do, each checked (docs/building.md,
# "Installing"):
#   - cmake --install: meshrt-info, meshrt-trace and meshrt-bench run from the prefix's bin/
#     without LD_LIBRARY_PATH, and the module file loads with Debian's Lmod and puts them
#     and the Python package on the paths;
#   - pip install --no-build-isolation . into a venv over Debian's python3: a fresh build
#     (no tests, apps or GoogleTest: the runtime builds without it), imported from outside
#     the tree, then the Python tests run against that install.
# Usage: scripts/test-install.sh [build folder]; MESHRT_PIP_BUILD_DIR=<folder> reuses a
# configured build for the pip step instead of a fresh one (quicker, proves less).
source "$(dirname "$0")/common.sh"
MESHRT_BUILD_DIR=${1:-$MESHRT_BUILD_DIR}
ensure_packages python3-venv python3-pip python3-setuptools python3-wheel lmod
mpi_local_environment
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "== cmake --install, then the programs from the prefix"
cmake --install "$MESHRT_BUILD_DIR" --prefix "$work/prefix" >/dev/null
for program in meshrt-info meshrt-trace meshrt-bench; do
  if ! env -u LD_LIBRARY_PATH "$work/prefix/bin/$program" --help >"$work/$program.out" 2>&1; then
    cat "$work/$program.out" >&2
    echo "test-install: expected $work/prefix/bin/$program --help to run, found it failing (above)" >&2
    exit 1
  fi
done
# Read whole, then matched: `grep -q` in the pipe would exit at the first line and, under
# pipefail, fail the check when meshrt-info's next write meets the closed pipe.
info_out=$(env -u LD_LIBRARY_PATH "$work/prefix/bin/meshrt-info")
grep -q "meshrt " <<<"$info_out" ||
  { echo "test-install: expected meshrt-info to print meshrt's version" >&2; exit 1; }

echo "== module load meshrt (Lmod)"
module_check=$(env -u LD_LIBRARY_PATH -u PYTHONPATH bash -c '
  source /usr/share/lmod/lmod/init/bash
  module use "$1/share/modulefiles"
  module load meshrt
  command -v meshrt-info meshrt-trace
  /usr/bin/python3 -c "import meshrt, sys; sys.stdout.write(meshrt.__file__ + \"\n\")"' _ "$work/prefix")
echo "$module_check"
for want in "$work/prefix/bin/meshrt-info" "$work/prefix/bin/meshrt-trace" "$work/prefix/lib/"; do
  grep -q "$want" <<<"$module_check" ||
    { echo "test-install: expected 'module load meshrt' to put $want on the paths, found the lines above" >&2; exit 1; }
done

echo "== pip install --no-build-isolation . into a venv over Debian's python3"
/usr/bin/python3 -m venv --system-site-packages "$work/venv"
(cd "$MESHRT_ROOT" && "$work/venv/bin/pip" install -q --no-build-isolation .)
(cd "$work" && env -u PYTHONPATH VENV_DIR="$work/venv" "$work/venv/bin/python" -c \
  'import meshrt, os; assert meshrt.__file__.startswith(os.environ["VENV_DIR"]), meshrt.__file__; print("imported", meshrt.__file__)') ||
  { echo "test-install: expected the venv to import its own meshrt" >&2; exit 1; }

echo "== the Python tests against the installed package"
MESHRT_TEST_PYTHON="$work/venv/bin/python" ctest --test-dir "$MESHRT_BUILD_DIR" --output-on-failure -L python -LE "build-tree|large|nightly"
