"""What users of the single-controller model write, each checked against numpy.

    mpiexec -n 4 python3 apps/examples/python/seed_patterns.py
    MESHRT_ACCELERATOR=emulated mpiexec -n 4 python3 apps/examples/python/seed_patterns.py --kind cpu,emulated

On a 2x2 mesh ("host" x "gpu"): rooted collectives and a barrier over one dimension, a
reduction over several dimensions at once, a rooted result broadcast back onto the whole
mesh, an object kept on every worker and passed to kernels, an output declared a view of
its input, a kernel's Python value and a pytree of tensors fetched, and
futures that compose with asyncio and concurrent.futures; docs/python.md, "The
controller", documents each. Exits non-zero if any value is wrong.
"""

import argparse
import asyncio
import sys
import threading

import numpy as np

import meshrt

HOSTS, GPUS = 2, 2


def x_at(h, g):
    """The local tensor of x on (host=h, gpu=g): [1 + 10 h + g, 2 + 10 h + g]."""
    return np.array([1 + 10 * h + g, 2 + 10 * h + g], dtype=np.float32)


class Generator:
    """A worker's own random generator: built once on every rank, never sent anywhere."""

    def __init__(self, seed, rank):
        self.gen, self.draws = np.random.default_rng(seed + rank), 0


@meshrt.function("patterns.generator")  # no shape=: an object constructor only
def make_generator(ctx, seed):
    return Generator(seed, ctx.rank)


@meshrt.function("patterns.draw", shape=lambda g, x: x)
def draw(ctx, g, x):
    g.draws += 1
    return x + np.float32(g.gen.integers(0, 100)) + 1000 * g.draws


def halves_shape(x):
    half = meshrt.TensorMeta((x.shape[0] // 2,) + tuple(x.shape[1:]), x.dtype)
    return meshrt.Signature(outputs=[half, half], views={0: 0, 1: 0})


@meshrt.function("patterns.halves", shape=halves_shape)
def halves(ctx, x):
    return x[: x.shape[0] // 2], x[x.shape[0] // 2:]


@meshrt.function("patterns.summary")  # a Python value, brought back by ctl.fetch
def summary(ctx, x, label):
    return {"label": label, "rank": ctx.rank, "total": float(x.sum())}


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

    # An object on every worker: each rank's generator, kept between calls.
    g = mesh.call_object(make_generator, 7)
    zero = mesh.call("meshrt.zeros", [2], "float32")
    mesh.call("patterns.draw", g, zero)
    second = mesh.call("patterns.draw", g, zero)
    for rank, (h, gpu) in enumerate((h, gpu) for h in range(HOSTS) for gpu in range(GPUS)):
        want = np.random.default_rng(7 + mesh.ranks[rank]).integers(0, 100, 2)[1] + 2000
        equal(local(ctl, second, host=h, gpu=gpu), [want, want], f"rank {rank}'s generator, drawn twice")
    g.drop()

    # Outputs declared views of their input: an in-place reduction of one half reaches the
    # base. (A Python kernel on an accelerator mesh returns copies: cpu meshes only.)
    if kind == "cpu":
        w = mesh.call("meshrt.add", x, mesh.call("meshrt.zeros", [2], "float32"))
        top, bottom = mesh.call_n("patterns.halves", w)
        top.reduce_("gpu", "sum")
        equal(local(ctl, w, host=0, gpu=1), [x_at(0, 0)[0] + x_at(0, 1)[0], x_at(0, 1)[1]], "a view reduced in place")
        equal(local(ctl, bottom, host=0, gpu=1), [x_at(0, 1)[1]], "the other view")

    # A kernel's Python value from one rank (tensor arguments on cpu meshes).
    if kind == "cpu":
        got = ctl.fetch(summary, x, "x", host=1, gpu=1).result(timeout=60)
        check(got == {"label": "x", "rank": mesh.ranks[3], "total": float(x_at(1, 1).sum())}, f"ctl.fetch: {got}")

    # A pytree of tensors in one fetch, and futures that compose.
    tree = ctl.fetch_shard({"x": x, "pair": (to0, back)}, host=1).result(timeout=60)  # gpu defaults to 0
    equal(tree["x"].numpy(), x_at(1, 0), "pytree fetch: x")
    equal(tree["pair"][1].numpy(), x_at(1, 0) + x_at(1, 1), "pytree fetch: the pair")
    futures = [ctl.fetch_shard(x, host=h, gpu=g) for h in range(HOSTS) for g in range(GPUS)]
    seen, called = [], threading.Event()
    futures[0].add_done_callback(lambda f: (seen.append(f), called.set()))
    done, not_done = meshrt.wait(futures, timeout=60)
    check(len(done) == 4 and not not_done, "meshrt.wait: all four done")

    async def both():
        return await asyncio.gather(futures[1], futures[2])

    b, c = asyncio.run(both())
    equal(b.numpy(), x_at(0, 1), "await")
    equal(c.numpy(), x_at(1, 0), "await")
    check(called.wait(60) and seen == [futures[0]], "add_done_callback ran once with the future")

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
