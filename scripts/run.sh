#!/usr/bin/env bash
# The main job: sets up, builds, and runs meshrt-demo on 4 local ranks as a 2x2 mesh
# (data parallel x tensor parallel). It trains a small MLP for 300 steps and ends by
# checking the weights against the same training in one process; the exit code is that
# check's verdict. Extra arguments go to meshrt-demo (scripts/run.sh --steps 1000).
source "$(dirname "$0")/common.sh"
ensure_packages "${MESHRT_PACKAGES[@]}"
configure_and_build
mpi_local_environment
echo "== mpiexec -n 4 meshrt-demo --mesh 2x2"
exec mpiexec -n 4 "$MESHRT_BUILD_DIR/apps/meshrt-demo" --mesh 2x2 "$@"
