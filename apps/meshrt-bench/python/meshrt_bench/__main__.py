"""meshrt's Python benchmarks, each side by side with its baseline in one run (built
beside the package in the build folder, not installed: PYTHONPATH=build/python):

    mpiexec -n 2 python3 -m meshrt_bench calls [...]   # Python controller vs C++ controller
    mpiexec -n 2 python3 -m meshrt_bench group [...]   # the Python group vs mpi4py

`python3 -m meshrt_bench SUITE --help` lists a suite's options.
"""

import sys

SUITES = {"calls": "meshrt_bench.calls", "group": "meshrt_bench.group"}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in SUITES:
        found = repr(argv[0]) if argv else "nothing"
        print(f"python3 -m meshrt_bench: expected a suite, one of {', '.join(SUITES)}, found {found}\n\n{__doc__}",
              file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(SUITES[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
