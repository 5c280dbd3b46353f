"""Python kernels on the emulated accelerator (4 ranks, MESHRT_ACCELERATOR=emulated with a
delay on every stream operation): a Python kernel runs as a host task on the call's
device stream, so it reads its inputs after the work that wrote them and later work
reads its outputs after it; its numpy views of device memory are valid inside the task
only. A kernel that raises (or keeps a view) fails its call, found when the stream runs
the task: what depends on it fails, on every rank, and nothing else does."""
import time

import numpy as np
import pytest

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


@meshrt.function("test.emu_misbehave", shape=lambda x, how: x)
def misbehave(ctx, x, how):
    if ctx.rank == 1 and how == "raise":
        raise RuntimeError("an error in a Python kernel on the emulated accelerator")
    if ctx.rank == 2 and how == "keep":
        kept.append(x)  # a view of device memory, past the task
    return x


@meshrt.function("test.emu_raise_everywhere", shape=lambda: None)
def raise_everywhere(ctx):
    raise ValueError(f"nothing to return, and rank {ctx.rank} raised")


@meshrt.function("test.emu_plus_one", shape=lambda x: x)
def plus_one(ctx, x):
    return x + 1


@meshrt.function("test.emu_sleep", shape=lambda s: None)
def sleep(ctx, s):
    time.sleep(s)


@meshrt.function("test.emu_forget", shape=lambda: None)
def forget(ctx):
    kept.clear()


def fetch(ctl, t, **coords):
    return ctl.fetch_shard(t, **coords).result(timeout=30).numpy()


@meshrt.function("test.emu_rows", shape=lambda x: meshrt.Signature(outputs=[x], views={0: 0}))
def emu_rows(ctx, x):
    return x


def test_a_call_declaring_views_is_refused_on_the_emulated_accelerator():
    def main(ctl):
        mesh = ctl.world_mesh({"dp": 2, "tp": 2}, kind="emulated")
        x = mesh.call("meshrt.full", (2, 2), meshrt.float32, 1.0)
        with pytest.raises(meshrt.UsageError, match=r"test.emu_rows: its shape function declares views, which a "
                                                    r"Python kernel on emulated:0 cannot return"):
            mesh.call("test.emu_rows", x)
        np.testing.assert_array_equal(fetch(ctl, x, dp=1, tp=1), np.ones((2, 2), np.float32))
        ctl.synchronize()

    meshrt.run(main)


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


@pytest.mark.parametrize("how, text", [
    ("raise", "test.emu_misbehave on rank 1 raised RuntimeError: an error in a Python kernel on the emulated "
              "accelerator"),
    ("keep", "test.emu_misbehave on rank 2: the kernel kept its view of argument 0 (float32[2] on emulated"),
])
def test_a_failed_kernel_fails_its_call_on_every_rank_and_nothing_else(how, text):
    def main(ctl):
        mesh = ctl.world_mesh({"dp": 2, "tp": 2}, kind="emulated")
        x = mesh.call("meshrt.full", (2,), meshrt.float32, 3.0)
        y = mesh.call("test.emu_misbehave", x, how)
        for dp in range(2):
            for tp in range(2):  # from the rank that failed and from the others alike
                with pytest.raises(meshrt.RemoteError) as e:
                    ctl.fetch_shard(y, dp=dp, tp=tp).result(timeout=30)
                assert text in str(e.value), str(e.value)
        # The stream goes on: unrelated work on it, on the failed rank too, computes right.
        z = mesh.call("meshrt.full", (2,), meshrt.float32, 2.0)
        np.testing.assert_array_equal(fetch(ctl, z, dp=0, tp=1), np.full((2,), 2, np.float32))
        s = z.reduce("tp", "sum")
        np.testing.assert_array_equal(fetch(ctl, s, dp=1, tp=0), np.full((2,), 4, np.float32))
        ctl.world_mesh({"dp": 2, "tp": 2}).call("test.emu_forget")
        ctl.synchronize(timeout=30)

    meshrt.run(main)


def test_a_failed_kernel_without_outputs_is_raised_by_synchronize():
    def main(ctl):
        mesh = ctl.world_mesh({"dp": 2, "tp": 2}, kind="emulated")
        mesh.call("test.emu_raise_everywhere")
        with pytest.raises(meshrt.RemoteError, match=r"nothing to return, and rank \d raised"):
            ctl.synchronize(timeout=30)

    meshrt.run(main)


def test_a_failed_value_borrowed_onto_another_stream_fails_what_uses_it():
    def main(ctl):
        mesh = ctl.world_mesh({"dp": 2, "tp": 2}, kind="emulated")
        side = ctl.stream("side")
        x = mesh.call("meshrt.full", (4,), meshrt.float32, 0.0)
        failed = mesh.call("test.emu_misbehave", x, "raise")
        borrowed = side.borrow(failed)
        used = mesh.call_on(side, "test.emu_plus_one", borrowed)[0]
        with pytest.raises(meshrt.RemoteError, match="an error in a Python kernel"):
            ctl.fetch_shard(used, dp=0, tp=0).result(timeout=30)  # never [1, 1, 1, 1]
        borrowed.drop()
        ctl.synchronize(timeout=30)

    meshrt.run(main)


def test_a_timeout_names_every_rank_still_running_its_kernel():
    def main(ctl):
        mesh = ctl.world_mesh({"dp": 2, "tp": 2}, kind="emulated").slice("dp", 0)  # ranks 0 and 1
        mesh.call("test.emu_sleep", 3.0)
        x = mesh.call("meshrt.full", (2,), meshrt.float32, 1.0)
        with pytest.raises(meshrt.TimeoutError) as e:
            ctl.fetch_shard(x, tp=0).result(timeout=1)
        assert e.value.missing_ranks == [0, 1], str(e.value)
        assert "running test.emu_sleep" in str(e.value) and "has finished it" not in str(e.value), str(e.value)
        ctl.synchronize(timeout=30)

    meshrt.run(main)


# ---------------------------------------------------------------- worker objects

freed = [0]  # Rngs this process has let go


class Rng:
    def __init__(self, rank, seed):
        self.rank, self.draws, self.gen = rank, 0, np.random.default_rng(seed + rank)

    def __del__(self):
        freed[0] += 1


@meshrt.function("test.emu_rng")  # an object constructor only
def make_rng(ctx, seed):
    return Rng(ctx.rank, seed)


@meshrt.function("test.emu_draw", shape=lambda rng, x: x)
def draw(ctx, rng, x):
    """x plus this rank's next draw; the object counts its draws."""
    assert ctx.device.type == "emulated", ctx.device
    rng.draws += 1
    return x + np.float32(rng.gen.integers(0, 100)) + 1000 * rng.draws


@meshrt.function("test.emu_freed", shape=lambda: meshrt.TensorMeta((), meshrt.int64))
def freed_count(ctx):
    return np.array(freed[0], np.int64)


def test_a_worker_object_on_the_emulated_accelerator_is_kept_and_freed():
    def main(ctl):
        mesh = ctl.world_mesh({"dp": 2, "tp": 2}, kind="emulated")
        coords = [(dp, tp) for dp in range(2) for tp in range(2)]
        base = [int(ctl.fetch_shard(mesh.call("test.emu_freed"), dp=dp, tp=tp).result(timeout=30).numpy())
                for dp, tp in coords]
        rng = mesh.call_object("test.emu_rng", 7)
        x = mesh.call("meshrt.zeros", [2], "float32")
        a = mesh.call("test.emu_draw", rng, x)
        b = mesh.call("test.emu_draw", rng, x)
        for rank, (dp, tp) in enumerate(coords):
            want = np.random.default_rng(7 + rank).integers(0, 100, 2)  # the rank's own generator, drawn twice
            got_a = ctl.fetch_shard(a, dp=dp, tp=tp).result(timeout=30).numpy()
            got_b = ctl.fetch_shard(b, dp=dp, tp=tp).result(timeout=30).numpy()
            np.testing.assert_array_equal(got_a, np.full(2, want[0] + 1000, np.float32))
            np.testing.assert_array_equal(got_b, np.full(2, want[1] + 2000, np.float32))
        with pytest.raises(meshrt.UsageError, match=r"an object constructor takes tensors on a cpu mesh only"):
            mesh.call_object("test.emu_rng", x)
        del rng
        after = [int(ctl.fetch_shard(mesh.call("test.emu_freed"), dp=dp, tp=tp).result(timeout=30).numpy())
                 for dp, tp in coords]
        assert after == [n + 1 for n in base], (base, after)
        ctl.synchronize()

    meshrt.run(main)
