"""Python kernels on the emulated accelerator (4 ranks, MESHRT_ACCELERATOR=emulated with a
delay on every stream operation): a Python kernel runs as a host task on the call's
device stream, so it reads its inputs after the work that wrote them and later work
reads its outputs after it; its numpy views of device memory are valid inside the task
only, and a kernel that keeps one fails its call, as an error in a kernel faults the
stream of its rank."""
import numpy as np

import meshrt


@meshrt.function("test.emu_scale", shape=lambda x, a: x)
def scale(ctx, x, a):
    assert ctx.device.type == "emulated", ctx.device
    return x * np.float32(a)


@meshrt.function("test.emu_add_", shape=lambda x, y: meshrt.Signature(mutates=[0]))
def add_(ctx, x, y):
    x += y


# A cpu meta on an emulated mesh: the output is on the rank's device.
@meshrt.function("test.emu_arange", shape=lambda n: meshrt.TensorMeta((n,), meshrt.float32))
def arange(ctx, n):
    return np.arange(n, dtype=np.float32) + ctx.rank


kept = []


@meshrt.function("test.emu_misbehave", shape=lambda x: x)
def misbehave(ctx, x):
    if ctx.rank == 1:
        raise RuntimeError("an error in a Python kernel on the emulated accelerator")
    if ctx.rank == 2:
        kept.append(x)  # a view of device memory, past the task
    return x


@meshrt.function("test.emu_forget", shape=lambda: None)
def forget(ctx):
    kept.clear()


def fetch(ctl, t, **coords):
    return ctl.fetch_shard(t, **coords).result(timeout=30).numpy()


def test_python_kernels_run_in_stream_order_on_the_device():
    def main(ctl):
        mesh = ctl.world_mesh({"dp": 2, "tp": 2}, kind="emulated")
        x = mesh.call("meshrt.full", (3, 4), meshrt.float32, 1.0)
        assert x.meta.device.type == "emulated", x.meta
        y = mesh.call("test.emu_scale", x, 2.0).reduce("tp", "sum")
        mesh.call("test.emu_add_", y, x)  # 4 + 1 on every rank
        for dp in range(2):
            for tp in range(2):
                np.testing.assert_array_equal(fetch(ctl, y, dp=dp, tp=tp), np.full((3, 4), 5, np.float32))
        a = mesh.call("test.emu_arange", 5)
        assert a.meta.device.type == "emulated", a.meta
        np.testing.assert_array_equal(fetch(ctl, a, dp=1, tp=1), np.arange(5, dtype=np.float32) + 3)
        ctl.synchronize()

    meshrt.run(main)


def test_an_error_or_a_kept_view_faults_the_ranks_stream():
    def main(ctl):
        mesh = ctl.world_mesh({"dp": 2, "tp": 2}, kind="emulated")
        x = mesh.call("meshrt.full", (2,), meshrt.float32, 3.0)
        y = mesh.call("test.emu_misbehave", x)
        np.testing.assert_array_equal(fetch(ctl, y, dp=0, tp=0), np.full((2,), 3, np.float32))
        for coords, text in (({"dp": 0, "tp": 1}, "test.emu_misbehave on rank 1 raised RuntimeError: an error in a "
                                                  "Python kernel on the emulated accelerator"),
                             ({"dp": 1, "tp": 0}, "test.emu_misbehave on rank 2: the kernel kept its view of "
                                                  "argument 0 (float32[2] on emulated")):
            try:
                ctl.fetch_shard(y, **coords).result(timeout=30)
                raise AssertionError(f"expected a RemoteError from {coords}")
            except meshrt.RemoteError as e:
                assert text in str(e), str(e)
                assert "device error" in str(e), str(e)
        ctl.world_mesh({"dp": 2, "tp": 2}).call("test.emu_forget")
        try:
            ctl.synchronize()
        except meshrt.Error:
            pass  # the faults may be raised again here: the point is that it comes back

    meshrt.run(main)
