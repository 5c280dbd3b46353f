"""Builds the meshrt package with the project's CMake (pyproject.toml says how to call it).

The wheel holds python/meshrt/ (the .py files, the generated stub, py.typed), the
extension module meshrt._core and libmeshrt beside it (the module finds it there first,
its RPATH being $ORIGIN). A fresh build configures without tests, apps or GoogleTest;
MESHRT_PIP_BUILD_DIR reuses a configured build folder instead.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def version():
    text = (ROOT / "CMakeLists.txt").read_text()
    return re.search(r"project\(meshrt VERSION (\d+\.\d+\.\d+)", text).group(1)


def run(cmd):
    print("meshrt setup.py:", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True)


class BuildWithCMake(build_py):
    """Copies the package's Python files, then builds meshrt._core and libmeshrt with CMake and
    puts both into the package."""

    def run(self):
        super().run()
        build = os.environ.get("MESHRT_PIP_BUILD_DIR")
        if build:
            build = Path(build).resolve()
        else:
            build = ROOT / "build-pip"
            if not (build / "CMakeCache.txt").exists():
                generator = ["-G", "Ninja"] if shutil.which("ninja") else []
                run(["cmake", "-S", ROOT, "-B", build, *generator, "-DCMAKE_BUILD_TYPE=Release",
                     "-DMESHRT_BUILD_TESTS=OFF", "-DMESHRT_BUILD_APPS=OFF", "-DMESHRT_PYTHON=ON",
                     "-DCMAKE_DISABLE_FIND_PACKAGE_GTest=ON", f"-DPython3_EXECUTABLE={sys.executable}",
                     *os.environ.get("MESHRT_PIP_CMAKE_ARGS", "").split()])
        jobs = os.environ.get("MESHRT_JOBS") or str(os.cpu_count() or 1)
        run(["cmake", "--build", build, "--target", "meshrt_python", "-j", jobs])
        package = Path(self.build_lib) / "meshrt"
        package.mkdir(parents=True, exist_ok=True)
        built = build / "python" / "meshrt"
        for module in built.glob("_core*.so"):
            shutil.copy2(module, package / module.name)
        # The library under its soname (what the module's NEEDED entry names).
        for lib in (build / "src").glob("libmeshrt.so.*"):
            if not lib.is_symlink() and lib.name.count(".") == 4:
                soname = subprocess.run(["objdump", "-p", lib], capture_output=True, text=True).stdout
                m = re.search(r"SONAME\s+(\S+)", soname)
                shutil.copy2(lib, package / (m.group(1) if m else lib.name))
        for extra in ("_core.pyi", "py.typed"):
            shutil.copy2(ROOT / "python" / "meshrt" / extra, package / extra)


class BinaryDistribution(Distribution):
    """A wheel for this platform and Python: the package carries compiled code."""

    def has_ext_modules(self):
        return True


setup(
    version=version(),
    package_dir={"meshrt": "python/meshrt"},
    cmdclass={"build_py": BuildWithCMake},
    distclass=BinaryDistribution,
)
