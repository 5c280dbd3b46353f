#!/usr/bin/env bash
# The main job: sets up, builds, and runs meshrt on 4 local ranks.
#   scripts/run.sh
source "$(dirname "$0")/common.sh"
ensure_packages "${MESHRT_PACKAGES[@]}"
configure_and_build
mpi_local_environment
echo "== mpiexec -n 4 meshrt-info"
exec mpiexec -n 4 "$MESHRT_BUILD_DIR/apps/meshrt-info" "$@"
