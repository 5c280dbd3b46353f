#!/bin/sh
# The Python the Python tests run on every rank: Debian's python3 over the build folder's
# package (PYTHONPATH, set by the test), or, with MESHRT_TEST_PYTHON set, that interpreter
# (a venv's python, after `pip install .`) over the meshrt installed there, the build folder
# off the path. usage: python.sh <python3> ARGS...
python=$1
shift
if [ -n "${MESHRT_TEST_PYTHON:-}" ]; then
  unset PYTHONPATH
  exec "$MESHRT_TEST_PYTHON" "$@"
fi
exec "$python" "$@"
