"""Python remote functions (4 ranks, a 2 x 2 mesh): kernels registered with
@meshrt.function run on every rank with numpy views (or torch tensors) of their inputs,
shape functions check calls at the call site, and every unhappy path (a kernel that
raises, returns the wrong shape or hangs; a shape function that raises; a registration
after the start) raises the Python exception it should, with nothing left hanging."""
import re
import sys
import threading
import time

import numpy as np
import pytest
import torch

import meshrt

# ---------------------------------------------------------------- the functions


def scale_shape(x, a):
    if x.dtype != meshrt.float32:
        raise meshrt.UsageError(f"expected a float32 tensor, found {x}")
    if not isinstance(a, float):
        raise TypeError(f"expected a float factor, found {type(a).__name__}")
    return x


@meshrt.function("test.py_scale", shape=scale_shape)
def scale(ctx, x, a):
    """x times a."""
    assert isinstance(x, np.ndarray) and x.dtype == np.float32, type(x)
    assert not x.flags.writeable, "an input the shape function does not mutate must be read-only"
    return x * np.float32(a)


def where_shape():
    return meshrt.TensorMeta((6,), meshrt.int64)


@meshrt.function("test.py_where", shape=where_shape)
def where(ctx):
    assert ctx.dim_names == ("dp", "tp"), ctx.dim_names
    assert ctx.sizes == (2, 2) and ctx.coordinates == (ctx.coordinate("dp"), ctx.coordinate("tp"))
    assert str(ctx.device) == "cpu", ctx.device
    return np.array([ctx.rank, ctx.coordinate("dp"), ctx.coordinate("tp"), ctx.size("dp"), ctx.size("tp"),
                     ctx.stream_id], np.int64)


def add_shape(x, y):
    if x.shape != y.shape:
        raise meshrt.UsageError(f"expected tensors of one shape, found {x} and {y}")
    return meshrt.Signature(mutates=[0])


@meshrt.function("test.py_add_", shape=add_shape)
def add_(ctx, x, y):
    assert x.flags.writeable and not y.flags.writeable
    x += y  # in place, through the view of the rank's tensor


def split_shape(x):
    return [x, meshrt.TensorMeta((), x.dtype)]


@meshrt.function("test.py_split", shape=split_shape)
def split(ctx, x):
    return (x + 1, x.sum(dtype=np.float32))


@meshrt.function("test.py_torch_scale", shape=scale_shape, torch=True)
def torch_scale(ctx, x, a):
    assert isinstance(x, torch.Tensor) and x.dtype == torch.float32, type(x)
    return x * a


def _fail_deep(n):
    if n == 0:
        raise ValueError("bad input 42")
    _fail_deep(n - 1)


@meshrt.function("test.py_raise", shape=lambda x: x)
def raises(ctx, x):
    if ctx.rank == 2:
        _fail_deep(8)  # a deep stack: the report keeps the last frames
    return x


@meshrt.function("test.py_wrong_shape", shape=lambda x: x)
def wrong_shape(ctx, x):
    return x[:-1].copy()


@meshrt.function("test.py_not_a_tensor", shape=lambda x: x)
def not_a_tensor(ctx, x):
    return "text"


@meshrt.function("test.py_sleep", shape=lambda x, seconds: x)
def sleeps(ctx, x, seconds):
    time.sleep(seconds)
    return x


ran_on_rank0 = threading.Event()


@meshrt.function("test.py_flag", shape=lambda x: x)
def flag(ctx, x):
    if ctx.rank == 0:
        ran_on_rank0.set()
    return x


@meshrt.function("test.py_bad_shape_result", shape=lambda x: 42)
def bad_shape_result(ctx, x):
    return x


# (rank, tag) -> the address of the array or tensor a kernel on that rank returned.
made = {}


def made_shape(tag):
    return meshrt.TensorMeta((1024,), meshrt.float32)


@meshrt.function("test.py_make", shape=made_shape)
def make(ctx, tag):
    out = np.arange(1024, dtype=np.float32)
    made[(ctx.rank, tag)] = out.__array_interface__["data"][0]
    return out


@meshrt.function("test.py_make_torch", shape=made_shape, torch=True)
def make_torch(ctx, tag):
    out = torch.arange(1024, dtype=torch.float32)
    made[(ctx.rank, tag)] = out.data_ptr()
    return out


@meshrt.function("test.py_same_memory", shape=lambda x, tag: meshrt.TensorMeta((), meshrt.int64))
def same_memory(ctx, x, tag):
    """1 where x (a view of this rank's value) is the memory the kernel of `tag` returned."""
    return np.array(int(x.__array_interface__["data"][0] == made[(ctx.rank, tag)]), np.int64)


@meshrt.function("test.py_rows", shape=lambda: meshrt.TensorMeta((4, 2), meshrt.float32))
def rows(ctx):
    return np.arange(8, dtype=np.float32).reshape(4, 2) + np.float32(100 * ctx.rank)


def chunks_shape(x):
    half = meshrt.TensorMeta((x.shape[0] // 2,) + tuple(x.shape[1:]), x.dtype)
    return meshrt.Signature(outputs=[half, half], views={0: 0, 1: 0})


@meshrt.function("test.py_chunks", shape=chunks_shape)
def chunks(ctx, x):
    assert x.flags.writeable, "an argument with declared views is writable"
    h = x.shape[0] // 2
    return x[:h], x[h:]


@meshrt.function("test.py_chunk_copies", shape=lambda x: meshrt.Signature(
    outputs=[meshrt.TensorMeta((x.shape[0] // 2,) + tuple(x.shape[1:]), x.dtype)], views={0: 0}))
def chunk_copies(ctx, x):
    return x[: x.shape[0] // 2].copy()  # declared a view, but a copy


@meshrt.function("test.py_undeclared_view", shape=lambda x: meshrt.TensorMeta((x.shape[0] // 2,) + tuple(
    x.shape[1:]), x.dtype), torch=True)
def undeclared_view(ctx, x):
    return x[: x.shape[0] // 2]  # torch views are writable: this is x's memory


# ---------------------------------------------------------------- helpers


def fetch(ctl, t, **coords):
    return ctl.fetch_shard(t, **coords).result(timeout=30).numpy()


def raises_remote(ctl, t, **coords):
    with pytest.raises(meshrt.RemoteError) as info:
        ctl.fetch_shard(t, **coords).result(timeout=30)
    return info.value


def ones(mesh, value=1.0, shape=(3, 4)):
    return mesh.call("meshrt.full", shape, meshrt.float32, value)


# ---------------------------------------------------------------- the tests


def test_registration_errors():
    # Before the first meshrt.run (a registration after it is refused first).
    with pytest.raises(meshrt.UsageError, match=r"remote function 'test.py_scale' registered twice"):
        meshrt.function("test.py_scale", shape=scale_shape)(scale)
    with pytest.raises(meshrt.UsageError, match=r"expected a callable shape function"):
        meshrt.function("test.py_bad", shape=3)(scale)
    with pytest.raises(meshrt.UsageError, match=r"expected a non-empty name"):
        meshrt.function("", shape=scale_shape)(scale)


def test_kernels_run_on_every_rank_with_views_of_their_inputs():
    def main(ctl):
        mesh = ctl.world_mesh({"dp": 2, "tp": 2})
        x = ones(mesh)
        y = mesh.call("test.py_scale", x, 2.0).reduce("tp", "sum")
        for dp in range(2):
            for tp in range(2):
                np.testing.assert_array_equal(fetch(ctl, y, dp=dp, tp=tp), np.full((3, 4), 4, np.float32))
        w = mesh.call("test.py_where")
        for dp in range(2):
            for tp in range(2):
                got = fetch(ctl, w, dp=dp, tp=tp)
                assert list(got[:5]) == [2 * dp + tp, dp, tp, 2, 2], got
        ctl.synchronize()

    meshrt.run(main)


def test_in_place_multiple_outputs_and_torch():
    def main(ctl):
        mesh = ctl.world_mesh({"dp": 2, "tp": 2})
        x = ones(mesh)
        out = mesh.call("test.py_add_", x, ones(mesh, 5.0))
        assert out is None or out == [] or out == (), out  # no outputs
        np.testing.assert_array_equal(fetch(ctl, x, dp=1, tp=0), np.full((3, 4), 6, np.float32))
        a, s = mesh.call_n("test.py_split", x)
        np.testing.assert_array_equal(fetch(ctl, a, dp=0, tp=1), np.full((3, 4), 7, np.float32))
        assert fetch(ctl, s, dp=0, tp=1) == 72.0
        t = mesh.call("test.py_torch_scale", x, 0.5)
        np.testing.assert_array_equal(fetch(ctl, t, dp=1, tp=1), np.full((3, 4), 3, np.float32))
        ctl.synchronize()

    meshrt.run(main)


def test_a_kernels_array_becomes_the_workers_value_and_a_fetch_is_viewed_without_a_copy():
    def main(ctl):
        mesh = ctl.world_mesh({"dp": 2, "tp": 2})
        for fn, tag in (("test.py_make", "numpy"), ("test.py_make_torch", "torch")):
            x = mesh.call(fn, tag)
            same = mesh.call("test.py_same_memory", x, tag)
            for dp in range(2):
                for tp in range(2):
                    assert fetch(ctl, same, dp=dp, tp=tp) == 1, f"{fn}'s result was copied on dp={dp}, tp={tp}"
            # A fetched tensor: numpy and torch view its memory.
            t = ctl.fetch_shard(x, dp=1, tp=1).result(timeout=30)
            assert isinstance(t, meshrt.Tensor), type(t)
            assert np.from_dlpack(t).__array_interface__["data"][0] == t.data_ptr
            assert torch.from_dlpack(t).data_ptr() == t.data_ptr
            np.testing.assert_array_equal(np.from_dlpack(t), np.arange(1024, dtype=np.float32))
        ctl.synchronize()

    meshrt.run(main)


def test_declared_views_share_their_arguments_storage():
    def main(ctl):
        mesh = ctl.world_mesh({"dp": 2, "tp": 2})

        def local(dp, tp):  # test.py_rows on the rank at (dp, tp)
            return np.arange(8, dtype=np.float32).reshape(4, 2) + np.float32(100 * (2 * dp + tp))

        base = mesh.call("test.py_rows")
        top, bottom = mesh.call_n("test.py_chunks", base)
        assert top.meta.shape == (2, 2), top.meta
        top.reduce_("tp", "sum")  # reaches rows 0 and 1 of the base
        mesh.call("test.py_add_", bottom, bottom)  # a mutating call on a view: rows 2 and 3
        mesh.call("test.py_add_", base, base)  # and one on the base, seen through both views
        for dp in range(2):
            for tp in range(2):
                want = local(dp, tp)
                want[:2] = local(dp, 0)[:2] + local(dp, 1)[:2]
                want[2:] *= 2
                want *= 2
                np.testing.assert_array_equal(fetch(ctl, base, dp=dp, tp=tp), want)
                np.testing.assert_array_equal(fetch(ctl, top, dp=dp, tp=tp), want[:2])
                np.testing.assert_array_equal(fetch(ctl, bottom, dp=dp, tp=tp), want[2:])
        # A borrow of a view covers its base.
        lent = ctl.stream("side").borrow(top, mutable=True)
        with pytest.raises(meshrt.UsageError, match=r"borrowed mutably by stream 'side'"):
            base.reduce_("tp", "sum")
        lent.drop()
        # A view declared but returned outside its argument's storage fails the call (and
        # poisons the argument, whose storage it was declared to share).
        x = mesh.call("test.py_rows")
        outside = mesh.call("test.py_chunk_copies", x)
        for t in (outside, x):
            e = raises_remote(ctl, t, dp=0, tp=1)
            assert "memory outside its argument 0" in e.worker_message, e.worker_message
        # An undeclared view is refused as before, saying how to declare one.
        undeclared = mesh.call("test.py_undeclared_view", mesh.call("test.py_rows"))
        e = raises_remote(ctl, undeclared, dp=1, tp=0)
        assert "not an undeclared view of an input" in e.worker_message, e.worker_message
        assert "views= in Python" in e.worker_message, e.worker_message
        ctl.synchronize()  # the failures were observed above

    meshrt.run(main)


def test_a_shape_function_error_raises_usage_error_at_the_call():
    def main(ctl):
        mesh = ctl.world_mesh({"dp": 2, "tp": 2})
        ints = mesh.call("meshrt.full", (3,), meshrt.int64, 1)
        with pytest.raises(meshrt.UsageError) as info:
            mesh.call("test.py_scale", ints, 2.0)
        message = str(info.value)
        assert "test.py_scale" in message and "meshrt.UsageError: expected a float32 tensor" in message, message
        assert "scale_shape" in message and "test_functions.py" in message, message
        with pytest.raises(meshrt.UsageError, match=r"test.py_scale: its shape function raised TypeError: expected a "
                                                    r"float factor, found int"):
            mesh.call("test.py_scale", ones(mesh), 2)
        with pytest.raises(meshrt.UsageError, match=r"test.py_bad_shape_result: its shape function returned a int; "
                                                    r"expected a meshrt.TensorMeta"):
            mesh.call("test.py_bad_shape_result", ones(mesh))
        # The session goes on: a good call after the refused ones.
        np.testing.assert_array_equal(fetch(ctl, mesh.call("test.py_scale", ones(mesh), 3.0), dp=1, tp=1),
                                      np.full((3, 4), 3, np.float32))
        ctl.synchronize()

    meshrt.run(main)


def test_a_kernel_that_raises_is_a_remote_error_with_its_traceback():
    def main(ctl):
        mesh = ctl.world_mesh({"dp": 2, "tp": 2})
        x = ones(mesh)
        y = mesh.call("test.py_raise", x)
        z = y.reduce("tp", "sum")  # a dependent: rank 2's failure reaches it on rank 3 too
        e = raises_remote(ctl, y, dp=1, tp=0)
        message = str(e)
        assert "test.py_raise on rank 2 raised ValueError: bad input 42" in message, message
        assert e.function == "test.py_raise" and 2 in e.ranks, (e.function, e.ranks)
        worker = e.worker_message
        # The last 5 frames of 10: the kernel's own frame, the outermost, is left out.
        assert "Traceback (the last 5 of 10 frames)" in worker and "in _fail_deep" in worker, worker
        assert 'raise ValueError("bad input 42")' in worker and "in raises" not in worker, worker
        assert "bad input 42" in str(raises_remote(ctl, z, dp=1, tp=1))
        # Work that does not depend on it computes as usual.
        np.testing.assert_array_equal(fetch(ctl, mesh.call("test.py_scale", x, 2.0), dp=1, tp=0),
                                      np.full((3, 4), 2, np.float32))
        try:
            ctl.synchronize()
        except meshrt.Error:
            pass  # the failure may be raised again here: the point is that it comes back

    meshrt.run(main)


def test_a_kernel_that_returns_the_wrong_shape_or_no_tensor_fails_its_call():
    def main(ctl):
        mesh = ctl.world_mesh({"dp": 2, "tp": 2})
        y = mesh.call("test.py_wrong_shape", ones(mesh))
        message = str(raises_remote(ctl, y, dp=0, tp=1))
        assert re.search(r"test.py_wrong_shape returned on rank \d as output 0: expected float32\[3, 4\] on cpu \(its "
                         r"shape function\), found float32\[2, 4\] on cpu", message), message
        z = mesh.call("test.py_not_a_tensor", ones(mesh))
        message = str(raises_remote(ctl, z, dp=1, tp=1))
        assert re.search(r"test.py_not_a_tensor on rank \d: its kernel's output 0: expected a tensor", message), message
        assert "found str" in message, message
        try:
            ctl.synchronize()
        except meshrt.Error:
            pass  # the failure may be raised again here: the point is that it comes back

    meshrt.run(main)


def test_the_worker_runs_a_kernel_while_the_controller_busy_loops_in_python():
    def main(ctl):
        mesh = ctl.world_mesh({"dp": 2, "tp": 2})
        y = mesh.call("test.py_flag", ones(mesh))
        deadline = time.monotonic() + 30
        spins = 0
        # No blocking call: rank 0's worker thread takes the GIL between bytecodes.
        while not ran_on_rank0.is_set() and time.monotonic() < deadline:
            spins += 1
        assert ran_on_rank0.is_set(), f"rank 0's kernel did not run while the controller spun {spins} times"
        np.testing.assert_array_equal(fetch(ctl, y, dp=0, tp=0), np.ones((3, 4), np.float32))
        ctl.synchronize()

    meshrt.run(main)


def test_a_kernel_that_hangs_times_out_and_the_report_names_it():
    def main(ctl):
        mesh = ctl.world_mesh({"dp": 2, "tp": 2})
        y = mesh.call("test.py_sleep", ones(mesh), 3.0)
        future = ctl.fetch_shard(y, dp=1, tp=1)
        with pytest.raises(meshrt.TimeoutError) as info:
            future.result(timeout=0.5)
        assert isinstance(info.value, TimeoutError)
        # The desync report names the function every rank is running.
        assert "running test.py_sleep" in str(info.value), str(info.value)
        assert str(info.value).count("CallFunction test.py_sleep") == 4, str(info.value)
        np.testing.assert_array_equal(future.result(timeout=30).numpy(), np.ones((3, 4), np.float32))
        ctl.synchronize()

    meshrt.run(main)


def test_registration_after_the_start_is_refused():
    def main(ctl):
        with pytest.raises(meshrt.UsageError, match=r"meshrt.function\('test.py_late'\) at .*test_functions.py:\d+: "
                                                    r"expected registration before meshrt.run"):
            @meshrt.function("test.py_late", shape=lambda: None)
            def late(ctx):
                pass
        with pytest.raises(meshrt.UsageError, match="test.py_late"):
            ctl.world_mesh({"dp": 2, "tp": 2}).call("test.py_late")

    meshrt.run(main)


# ---------------------------------------------------------------- worker objects

freed = [0]  # Counters this process has let go (each worker's own count)


class Counter:
    def __init__(self, rank, start):
        self.rank, self.count = rank, start

    def __del__(self):
        freed[0] += 1


@meshrt.function("test.py_counter")  # no shape: an object constructor only
def make_counter(ctx, start):
    assert not start.flags.writeable, "a constructor's tensor argument is read-only"
    if ctx.rank == 2 and int(start.sum()) < 0:
        raise ValueError("no counter below zero on rank 2")
    return Counter(ctx.rank, int(start.sum()))


@meshrt.function("test.py_bump", shape=lambda c: meshrt.TensorMeta((3,), meshrt.int64))
def bump(ctx, c):
    """Counts one more in this rank's counter: [its rank, its count, its id]."""
    c.count += 1
    return np.array([c.rank, c.count, id(c)], np.int64)


@meshrt.function("test.py_freed", shape=lambda: meshrt.TensorMeta((), meshrt.int64))
def freed_count(ctx):
    return np.array(freed[0], np.int64)


def every_rank(ctl, t):
    return [fetch(ctl, t, dp=dp, tp=tp) for dp in range(2) for tp in range(2)]


def test_a_worker_object_is_each_ranks_own_kept_between_calls_and_freed_with_its_handle():
    def main(ctl):
        mesh = ctl.world_mesh({"dp": 2, "tp": 2})
        base = every_rank(ctl, mesh.call("test.py_freed"))
        c = mesh.call_object(make_counter, mesh.call("meshrt.full", (3,), meshrt.int64, 0))
        assert isinstance(c, meshrt.WorkerObject) and c.mesh == mesh and not c.dropped, c
        first, second = mesh.call("test.py_bump", c), mesh.call("test.py_bump", c)
        for rank, (a, b) in enumerate(zip(every_rank(ctl, first), every_rank(ctl, second))):
            # The rank's own object, the same one both times: the second call sees the first's count.
            assert (a[0], a[1], b[0], b[1]) == (rank, 1, rank, 2) and a[2] == b[2], (rank, a, b)
        # A recorded step takes it as a captured argument: each replay bumps the same counter.
        x = mesh.call("meshrt.full", (2,), meshrt.float32, 0.0)
        rec = ctl.record([x], lambda x: mesh.call("test.py_bump", c))
        rec(x)
        assert [int(v[1]) for v in every_rank(ctl, rec(x))] == [4] * 4
        del rec
        # The last handle frees it on every rank: by drop() and by the collector.
        c.drop()
        assert c.dropped
        with pytest.raises(meshrt.UsageError, match=r"test.py_bump: argument 0: the WorkerObject was dropped"):
            mesh.call("test.py_bump", c)
        assert [int(n) for n in every_rank(ctl, mesh.call("test.py_freed"))] == [int(n) + 1 for n in base]
        d = mesh.call_object("test.py_counter", np.array([2, 3]))  # a host array: a host tensor on every rank
        assert [int(v[1]) for v in every_rank(ctl, mesh.call("test.py_bump", d))] == [6] * 4
        del d
        assert [int(n) for n in every_rank(ctl, mesh.call("test.py_freed"))] == [int(n) + 2 for n in base]
        ctl.synchronize()

    meshrt.run(main)


def test_a_failed_constructor_poisons_its_object_and_wrong_uses_are_refused():
    def main(ctl):
        mesh = ctl.world_mesh({"dp": 2, "tp": 2})
        made_at = sys._getframe().f_lineno + 1
        bad = mesh.call_object(make_counter, mesh.call("meshrt.full", (2,), meshrt.int64, -1))
        y = mesh.call("test.py_bump", bad)
        e = raises_remote(ctl, y, dp=1, tp=0)
        assert "test.py_counter on rank 2 raised ValueError: no counter below zero on rank 2" in str(e), str(e)
        assert e.function == "test.py_counter" and e.ranks == [2], (e.function, e.ranks)
        assert e.issued_at == f"test_functions.py:{made_at} (main)", (e.issued_at, made_at)
        # The job goes on: a good object on the same mesh.
        good = mesh.call_object(make_counter, mesh.call("meshrt.full", (2,), meshrt.int64, 1))
        assert [int(v[1]) for v in every_rank(ctl, mesh.call("test.py_bump", good))] == [1 + 1 + 1] * 4  # sum, +1
        # An object belongs to its mesh.
        with pytest.raises(meshrt.UsageError) as info:
            mesh.slice("dp", 1).call("test.py_bump", good)
        assert ("test.py_bump: a worker object made on mesh [dp=2, tp=2] on ranks [0, 1, 2, 3] was passed to a call "
                "on mesh [tp=2] on ranks [2, 3]") in str(info.value), str(info.value)
        with pytest.raises(meshrt.UsageError, match=r"test.py_counter: it was registered without shape= and returns "
                                                    r"no tensors: call it with mesh.call_object"):
            mesh.call("test.py_counter", [1])
        with pytest.raises(meshrt.UsageError, match=r"call_object of test.py_counter"):
            ctl.record([mesh.call("meshrt.full", (2,), meshrt.int64, 1)],
                       lambda x: mesh.call_object(make_counter, x))
        try:
            ctl.synchronize()
        except meshrt.RemoteError:
            pass  # the constructor's failure may be raised again here

    meshrt.run(main)
