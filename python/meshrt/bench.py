"""meshrt's Python benchmarks, each side by side with its baseline in one run:

    mpiexec -n 2 python3 -m meshrt.bench calls [...]   # Python controller vs C++ controller
    mpiexec -n 2 python3 -m meshrt.bench group [...]   # the Python group vs mpi4py

`python3 -m meshrt.bench SUITE --help` lists a suite's options.
"""

import json
import sys

SUITES = {"calls": "meshrt._bench_calls", "group": "meshrt._bench_group"}


def write_json_lines(suite, ranks, rows, path=""):
    """Prints one JSON line per row, led by the suite and the job's ranks, and appends the
    lines to `path` when one is given: the form every suite's --json writes."""
    lines = [json.dumps({"suite": suite, "ranks": ranks, **row}) for row in rows]
    for line in lines:
        print(line)
    if path:
        with open(path, "a") as f:
            f.write("".join(line + "\n" for line in lines))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in SUITES:
        found = repr(argv[0]) if argv else "nothing"
        print(f"python3 -m meshrt.bench: expected a suite, one of {', '.join(SUITES)}, found {found}\n\n{__doc__}",
              file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(SUITES[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
