"""What users of the single-controller model write, each checked against numpy.

    mpiexec -n 4 python3 apps/examples/python/seed_patterns.py
    MESHRT_ACCELERATOR=emulated mpiexec -n 4 python3 apps/examples/python/seed_patterns.py --kind cpu,emulated

On a 2x2 mesh ("host" x "gpu"): rooted collectives and a barrier over one dimension, a
reduction over several dimensions at once, a rooted result broadcast back onto the whole
mesh, an object kept on every worker and passed to kernels, an output declared a view of
its input, a kernel's Python value and a pytree of tensors fetched in one round trip, and
futures that compose with asyncio and concurrent.futures. docs/python.md, "Patterns of
the single-controller model", walks through it. Exits non-zero if any value is wrong.
"""

import argparse
import sys

import numpy as np

import meshrt

HOSTS, GPUS = 2, 2


def x_at(h, g):
    """The local tensor of x on (host=h, gpu=g): [1 + 10 h + g, 2 + 10 h + g]."""
    return np.array([1 + 10 * h + g, 2 + 10 * h + g], dtype=np.float32)


def check(ok, what):
    if not ok:
        print(f"seed_patterns: FAILED: {what}", file=sys.stderr, flush=True)
        sys.exit(1)


def equal(actual, expected, what):
    check(np.array_equal(np.asarray(actual), np.asarray(expected)), f"{what}: expected {expected}, found {actual}")


def local(ctl, t, **coords):
    return ctl.fetch_shard(t, **coords).result(timeout=60).numpy()


def patterns(ctl, kind):
    mesh = ctl.world_mesh({"host": HOSTS, "gpu": GPUS}, kind=kind)
    # x[h, g] = x_at(h, g): a part that varies along gpu plus one that varies along host.
    x = mesh.call("meshrt.add", mesh.scatter("gpu", np.array([1, 2, 2, 3], np.float32)),
                  mesh.scatter("host", np.array([0, 0, 10, 10], np.float32)))

    # Rooted collectives over one dimension, and a barrier (a future).
    to0 = x.reduce("gpu", "sum", dst=0)  # lives on mesh.slice("gpu", 0)
    check(to0.mesh == mesh.slice("gpu", 0), "a rooted reduce's result lives on the root's sub-mesh")
    for h in range(HOSTS):
        equal(local(ctl, to0, host=h), x_at(h, 0) + x_at(h, 1), f"reduce to gpu=0 on host {h}")
    back = to0.to_mesh(mesh)  # the rooted result broadcast back onto the whole mesh
    for g in range(GPUS):
        equal(local(ctl, back, host=1, gpu=g), x_at(1, 0) + x_at(1, 1), f"to_mesh from gpu=0 onto gpu {g}")
    equal(local(ctl, x.gather("host", dst=1), gpu=0), [x_at(0, 0), x_at(1, 0)], "gather to host=1")
    equal(local(ctl, x.broadcast("gpu", src=1), host=0, gpu=0), x_at(0, 1), "broadcast from gpu=1")
    mesh.barrier("gpu").result(timeout=60)

    # Several dimensions at once: one all_reduce over all four ranks.
    total = sum(x_at(h, g) for h in range(HOSTS) for g in range(GPUS))
    equal(local(ctl, x.reduce(("host", "gpu"), "sum"), host=1, gpu=1), total, "reduce over (host, gpu)")
    equal(local(ctl, x.reduce((), "mean"), host=0, gpu=1), total / 4, "mean over every dimension")
    out = mesh.call("meshrt.zeros", [2], "float32")
    x.reduce("gpu", "sum", out=out)
    equal(local(ctl, out, host=1, gpu=0), x_at(1, 0) + x_at(1, 1), "reduce(out=)")
    check(mesh.size(("host", "gpu")) == 4 and x.shape == (2,), "Mesh.size of several, DTensor.shape")

    print(f"seed patterns: all checks passed on {kind}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kind", default="cpu", help="cpu, emulated or cuda; several comma-separated")
    args = parser.parse_args()

    def controller(ctl):
        for kind in args.kind.split(","):
            patterns(ctl, kind)

    meshrt.run(controller)


if __name__ == "__main__":
    main()
