#!/usr/bin/env bash
# Builds meshrt against MPICH (Debian's mpich) in build-mpich/ and runs the MPI tests
# there. Open MPI stays the default MPI of the machine; MPICH is chosen by its wrappers:
#   cmake -DMPI_C_COMPILER=mpicc.mpich -DMPI_CXX_COMPILER=mpicxx.mpich \
#         -DMPIEXEC_EXECUTABLE=/usr/bin/mpiexec.mpich ...
# Extra arguments go to ctest.
source "$(dirname "$0")/common.sh"
ensure_packages "${MESHRT_PACKAGES[@]}" mpich libmpich-dev
MESHRT_BUILD_DIR=${MESHRT_MPICH_BUILD_DIR:-$MESHRT_ROOT/build-mpich}
configure_and_build -DMESHRT_WERROR=ON -DMESHRT_WITH_CUDA=OFF \
  -DMPI_C_COMPILER=/usr/bin/mpicc.mpich -DMPI_CXX_COMPILER=/usr/bin/mpicxx.mpich \
  -DMPIEXEC_EXECUTABLE=/usr/bin/mpiexec.mpich
echo "== ctest (MPICH)"
# Tests labelled openmpi use Open MPI's own tools (ompi-server for the cross-job group);
# the nightly ones run with Open MPI only (scripts/test.sh, MESHRT_TEST_NIGHTLY=1).
ctest --test-dir "$MESHRT_BUILD_DIR" --output-on-failure -j "$MESHRT_JOBS" -LE "large|openmpi|nightly" "$@"
