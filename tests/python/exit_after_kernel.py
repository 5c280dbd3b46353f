"""A script as a new user writes it: one Python kernel, one call, one fetch, and the end of
the script. Every rank must exit on its own (issue: the interpreter's exit waited for ever
when numpy was first imported by the kernel on the worker thread).

Run as `exit_after_kernel.py plain` (the script never imports numpy) or `... numpy` (it
does, before meshrt). CTest's timeout catches a hang; the controller prints the value.
"""

import sys

if sys.argv[1:] == ["numpy"]:
    import numpy  # noqa: F401

import meshrt


def same(x):
    return x


@meshrt.function("test.exit_plus_one", shape=same)
def plus_one(ctx, x):
    return x + 1


@meshrt.function("test.exit_identity", shape=same)
def identity(ctx, x):
    return x  # its input's own memory: never the same value as the input


def main(ctl):
    mesh = ctl.world_mesh({"x": meshrt.world_size()})
    y = mesh.call("test.exit_plus_one", mesh.call("meshrt.full", (4,), meshrt.float32, 1.0))
    print("fetched", ctl.fetch_shard(y, x=meshrt.world_size() - 1).result(timeout=30).numpy().tolist())
    # An output that is its input's memory is not one value with it: an in-place update of
    # the input leaves the output as it was (or the call fails, naming the alias).
    z = mesh.call("test.exit_identity", y)
    y.reduce_("x", "sum")
    try:
        print("identity", ctl.fetch_shard(z, x=0).result(timeout=30).numpy().tolist())
    except meshrt.RemoteError as e:
        print("identity refused:", "argument 0" in str(e))


meshrt.run(main)
