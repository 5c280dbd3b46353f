"""meshrt's Python benchmarks (python3 -m meshrt_bench SUITE); not installed."""

import json


def write_json_lines(suite, ranks, rows, path=""):
    """Prints one JSON line per row, led by the suite and the job's ranks, and appends the
    lines to `path` when one is given: the form every suite's --json writes."""
    lines = [json.dumps({"suite": suite, "ranks": ranks, **row}) for row in rows]
    for line in lines:
        print(line)
    if path:
        with open(path, "a") as f:
            f.write("".join(line + "\n" for line in lines))
