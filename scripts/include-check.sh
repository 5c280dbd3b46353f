#!/usr/bin/env bash
# CI: the module lines of docs/ARCHITECTURE.md section 2 hold. Fails on an #include (of a
# quoted header, or of <meshrt/...>) that
#   - goes up the module DAG (a module includes one that sits above it, or a peer), or
#   - reaches into another module's private header (src/<module>/*.hpp),
# unless scripts/include-allowlist.txt lists that edge. Reads the sources only (no build):
# it runs in about a second, before anything is compiled (scripts/test.sh runs it first).
#
# The ranks (a module may include only modules of a lower rank, and itself):
#   0 common     error.hpp, config.hpp, version.hpp, src/common/{checks,assert}.hpp: the
#                vocabulary every module needs (exceptions, check macros, build config).
#                Its private headers are shared by design: any module may include them.
#   1 settings   the settings table; it needs only common.
#   2 log        Boost.Log set-up; it reads settings.
#   3 ndslice    4 tensor    5 value, reduction
#                the data types. reduction.hpp (the reduction rules, in src/common/
#                reduction.cpp) needs TensorMeta, so it sits beside value, above tensor.
#   6 device     7 protocol, functions     8 comm     9 control     10 worker
#   11 controller     12 runtime (and the umbrella meshrt.hpp)
# Peers (one rank, two modules) do not include each other.
#   group        StatelessGroup stands beside the chain: it may include common, settings
#                and log, and no library module includes it (only apps, tests and python do).
#   13 python    the Python package's binding (python/src/) is a layer above runtime: it
#                includes headers of include/meshrt/ (installed and internal/) and its own
#                files, never a module's private header under src/.
# include/meshrt/internal/ holds the headers modules share that are not installed (the
# wire protocol, the transport, the worker, the data plane, the device runtime, settings);
# a header there belongs to the module of its name, and no installed header includes one.
# apps/, tests/ and src/testing (the MPI test harness) are no module: they may include any
# public header, and tests/ the private headers of src/common. tests/unit/ holds white-box
# tests of a module's parts (the completion tracker, the dependency graph, the worker's
# loop over the in-memory transport) and may include any private header; any other src/
# header is a private edge to allow-list.
source "$(dirname "$0")/common.sh"
cd "$MESHRT_ROOT"

declare -A rank=([common]=0 [settings]=1 [log]=2 [ndslice]=3 [tensor]=4 [value]=5 [reduction]=5 [device]=6
  [protocol]=7 [functions]=7 [comm]=8 [control]=9 [worker]=10 [controller]=11 [runtime]=12 [group]=3 [python]=13)
# Public headers whose module is not their own name.
declare -A header_module=([error]=common [config]=common [version]=common [stacks]=common [tensor_serialization]=tensor [traffic]=control [mpi_session]=common [call_site]=common
  [meshrt]=runtime)
allowlist="$MESHRT_ROOT/scripts/include-allowlist.txt"

# The module a file belongs to: a module name, or "apps"/"tests"; "" for other files.
module_of() {
  local f=$1 base
  case "$f" in
    include/meshrt/*)
      base=$(basename "$f" .hpp)
      echo "${header_module[$base]:-$base}" ;;
    src/common/reduction.cpp) echo reduction ;;
    src/testing/*) echo tests ;;  # the MPI test harness's main, built for tests only
    src/*/*) f=${f#src/}; echo "${f%%/*}" ;;
    python/*) echo python ;;
    apps/*) echo apps ;;
    tests/*) echo tests ;;
    *) echo "" ;;
  esac
}

if ! git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  echo "include-check: expected a git checkout (the check covers tracked files), found none at $MESHRT_ROOT" >&2
  exit 1
fi
mapfile -t files < <(git ls-files -- 'include/*' 'src/*' 'apps/*' 'tests/*' 'python/*' |
  grep -E '\.(cpp|hpp|h|cc|cu|cuh)$')
declare -A allowed=() used=()
while IFS= read -r line; do
  line=${line%%#*}
  [[ "$line" =~ ^[[:space:]]*([^[:space:]]+)[[:space:]]*-\>[[:space:]]*([^[:space:]]+)[[:space:]]*$ ]] || continue
  allowed["${BASH_REMATCH[1]} -> ${BASH_REMATCH[2]}"]=1
done <"$allowlist"

errors=()
checked=0
for f in "${files[@]}"; do
  [ -f "$f" ] || continue
  from=$(module_of "$f")
  [ -n "$from" ] || continue
  if [ "$from" != apps ] && [ "$from" != tests ] && [ -z "${rank[$from]:-}" ]; then
    errors+=("$f: module '$from' has no rank; add it to the table in scripts/include-check.sh")
    continue
  fi
  while IFS=: read -r lineno target; do
    checked=$((checked + 1))
    edge="$f -> $target"
    # The binding's own files (python/src/support/..., group/...) are local to it.
    if [ "$from" = python ] && [[ "$target" != meshrt/* ]] && [ -f "python/src/$target" ]; then
      continue
    fi
    # What the include names: a public header, a private one under src/, or a local file.
    if [[ "$target" == meshrt/internal/* ]] && [[ "$f" == include/meshrt/* ]] && [[ "$f" != include/meshrt/internal/* ]]; then
      errors+=("$f:$lineno: includes \"$target\": an installed header includes an internal one, expected the installed headers (include/meshrt/*.hpp) to stand alone, as include/meshrt/internal/ is not installed")
      continue
    fi
    if [[ "$target" == meshrt/* ]]; then
      base=$(basename "$target" .hpp)
      to=${header_module[$base]:-$base}
      private=0
      if [ ! -f "include/$target" ] && [ "$target" != meshrt/config.hpp ]; then
        errors+=("$f:$lineno: includes \"$target\": expected a header of include/meshrt/, found none")
        continue
      fi
    elif [[ "$target" == [a-z]*/* ]] && [ -d "src/${target%%/*}" ]; then
      to=${target%%/*}
      private=1
    else
      continue  # a file next to the includer ("bench.hpp", "../support/...")
    fi
    [ -n "${allowed[$edge]:-}" ] && { used[$edge]=1; continue; }
    if [ "$private" = 1 ] && [ "$to" != common ] && [ "$to" != "$from" ] && [[ "$f" != tests/unit/* ]]; then
      errors+=("$f:$lineno: includes \"$target\", a private header of module '$to', from module '$from': expected only its public header (or an allow-listed edge)")
      continue
    fi
    if [ "$from" = python ] && [ "$private" = 1 ]; then
      errors+=("$f:$lineno: includes \"$target\", a private header of module '$to': expected python/ to include headers of include/meshrt/ only (python/ is a layer above runtime; docs/ARCHITECTURE.md section 2)")
      continue
    fi
    [ "$from" = apps ] || [ "$from" = tests ] || [ "$from" = python ] || [ "$to" = "$from" ] && continue
    if [ -z "${rank[$to]:-}" ]; then
      errors+=("$f:$lineno: includes \"$target\" of module '$to', which has no rank in scripts/include-check.sh")
      continue
    fi
    if [ "$to" = group ]; then
      errors+=("$f:$lineno: includes \"$target\": module '$from' includes group, expected group to be included by apps and tests only (it stands beside the module chain)")
    elif [ "${rank[$to]}" -eq "${rank[$from]}" ]; then
      errors+=("$f:$lineno: includes \"$target\": modules '$from' and '$to' are peers (rank ${rank[$from]}), expected neither to include the other")
    elif [ "${rank[$to]}" -gt "${rank[$from]}" ]; then
      errors+=("$f:$lineno: includes \"$target\": an upward edge of the module DAG, expected module '$from' (rank ${rank[$from]}) to include modules below it only, found '$to' (rank ${rank[$to]})")
    fi
  done < <(grep -nE '^[[:space:]]*#[[:space:]]*include[[:space:]]*("|<meshrt/)' "$f" |
    sed -E 's/^([0-9]*):[^"<]*["<]([^">]*)[">].*/\1:\2/')  # "x/y.hpp", and <meshrt/y.hpp> as well
done

for edge in "${!allowed[@]}"; do
  [ -n "${used[$edge]:-}" ] || echo "include-check: note: allow-list entry no longer needed: $edge"
done
if [ ${#errors[@]} -gt 0 ]; then
  printf 'include-check: %s\n' "${errors[@]}" >&2
  echo "include-check: ${#errors[@]} include(s) break the module lines (docs/ARCHITECTURE.md section 2)" >&2
  exit 1
fi
echo "include-check: $checked includes in ${#files[@]} files follow the module DAG (${#allowed[@]} allow-listed)"
