#!/usr/bin/env bash
# CI: docs/builtins.md is what the registry says. Runs `meshrt-info --builtins-markdown`
# from a build folder and fails, with the difference, when the checked-in reference is not
# its output; `--update` writes it instead.
#   scripts/builtins-check.sh [--update] [BUILD_DIR]   (default BUILD_DIR: build)
# scripts/test.sh runs it after the build.
source "$(dirname "$0")/common.sh"

update=0
if [ "${1:-}" = --update ]; then
  update=1
  shift
fi
build=${1:-$MESHRT_BUILD_DIR}
info="$build/apps/meshrt-info"
doc="$MESHRT_ROOT/docs/builtins.md"
if [ ! -x "$info" ]; then
  echo "builtins-check: expected the meshrt-info binary at $info, found none (build the meshrt-info target)" >&2
  exit 1
fi
MESHRT_BUILD_DIR=$build mpi_local_environment
generated=$(mktemp)
trap 'rm -f "$generated"' EXIT
"$info" --builtins-markdown >"$generated"
if [ "$update" = 1 ]; then
  cp "$generated" "$doc"
  echo "builtins-check: wrote $doc"
  exit 0
fi
if ! diff -u "$doc" "$generated"; then
  echo "builtins-check: docs/builtins.md differs from the registry's descriptions (above: - the file, + the" \
    "registry); run scripts/builtins-check.sh --update $build and commit the result" >&2
  exit 1
fi
echo "builtins-check: docs/builtins.md matches the registry"
