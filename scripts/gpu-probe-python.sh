#!/usr/bin/env bash
# What a GPU machine has for meshrt's Python path (docs/gpu.md), in one short command that
# installs nothing; through the device tool:
#   run(command: "bash scripts/gpu-probe-python.sh", timeout_s: 90)
# Prints, and writes to $OUT/python-probe.txt (default gpu-check-logs/): each python3's
# version and prefix, its Python.h (the one thing the kit's Python step cannot carry),
# its extension suffix, torch (its CUDA, whether it sees a GPU), numpy, pybind11 (and its
# CMake folder), pytest, pip's NCCL and mpi4py; the C++ compilers, nvcc, CMake, ninja;
# glibc, libstdc++ and the system. scripts/gpu-check.sh's Python step needs python3 with
# Python.h, torch, numpy, pytest, pybind11 (or its own CMake folder), a C++ compiler and
# CMake.
set -uo pipefail
OUT_DIR=${OUT:-gpu-check-logs}
mkdir -p "$OUT_DIR"
{
  echo "== python3"
  seen=" "
  for py in python3 /opt/*/.venv/bin/python3 /usr/bin/python3 /usr/bin/python3.[0-9] /usr/bin/python3.[0-9][0-9]; do
    p=$(command -v "$py" 2>/dev/null) || continue
    [[ $seen == *" $p "* ]] && continue
    seen+="$p "
    echo "-- $p"
    (cd / && timeout 60 "$p" -) <<'PY' 2>&1
import importlib, os, sys, sysconfig
print("version", sys.version.split()[0], "prefix", sys.prefix, "base", sys.base_prefix)
inc = sysconfig.get_paths()["include"]
print("include", inc, "Python.h" if os.path.exists(os.path.join(inc, "Python.h")) else "NO Python.h")
print("ext suffix", sysconfig.get_config_var("EXT_SUFFIX"))
for name in ("torch", "numpy", "pybind11", "pytest", "nvidia.nccl", "mpi4py", "cmake", "ninja"):
    try:
        m = importlib.import_module(name)
        extra = ""
        if name == "torch":
            extra = " cuda %s, available %s" % (m.version.cuda, m.cuda.is_available())
        if name == "pybind11":
            extra = " cmake dir %s" % m.get_cmake_dir()
        where = os.path.dirname(m.__file__) if getattr(m, "__file__", None) else list(m.__path__)[0]
        print(name, getattr(m, "__version__", "?"), where + extra)
    except Exception as e:
        print(name, "MISSING", type(e).__name__, e)
PY
  done
  echo "== compilers and tools"
  for c in c++ g++ clang++ nvcc /usr/local/cuda/bin/nvcc cmake ninja make; do
    if command -v "$c" >/dev/null 2>&1; then
      printf '%s: %s (%s)\n' "$c" "$("$c" --version 2>&1 | grep -m1 .)" "$(command -v "$c")"
    else
      echo "$c: missing"
    fi
  done
  echo "== system"
  getconf GNU_LIBC_VERSION
  for so in $(ldconfig -p 2>/dev/null | awk '/libstdc\+\+\.so\.6 /{print $NF}'); do
    echo "libstdc++: $so, newest $(grep -ao 'GLIBCXX_3\.4\.[0-9]*' "$so" | sort -uV | tail -1)"
  done
  grep -E '^(PRETTY_NAME|VERSION_ID)=' /etc/os-release
  nvidia-smi -L 2>&1 | head -4
} 2>&1 | tee "$OUT_DIR/python-probe.txt"
