"""The controller API from Python (4 ranks): meshes, calls and their arguments, reductions,
sends, streams and borrows, fetches and futures, the controller's own methods, on the CPU
and on the emulated accelerator; and the unhappy paths: call sites named by the Python
line, timeouts, remote failures, dropped and stale handles, Ctrl-C during a wait.

Every test calls meshrt.run once on every rank; the assertions about the run are made in
main, on rank 0 (an assertion error there is re-raised by run on rank 0)."""
import ctypes
import json
import os
import pathlib
import re
import signal
import sys
import tempfile
import threading
import time
import uuid

# Before meshrt starts: the emulated accelerator, so that both kinds of mesh are tested.
os.environ.setdefault("MESHRT_ACCELERATOR", "emulated")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import meshrt  # noqa: E402

# test.block and test.sigint (tests/python/blocking_functions.cpp), registered on every rank
# before the start-up handshake compares the function tables.
_FUNCTIONS = os.environ.get("MESHRT_PYTHON_TEST_FUNCTIONS") or str(
    pathlib.Path(meshrt._core.__file__).parents[2] / "tests" / "python" / "libmeshrt_python_test_functions.so")
ctypes.CDLL(_FUNCTIONS)

KINDS = ["cpu", "emulated"]
HERE = os.path.basename(__file__)


# ctl.fetch's functions: a Python value made on one rank.
@meshrt.function("test.fetch_stats", shape=lambda x: x)
def fetch_stats(ctx, x, label):
    return {"label": label, "rank": ctx.rank, "sum": float(x.sum()), "max": float(x.max()), "rows": x.copy()}


@meshrt.function("test.fetch_rank")  # no shape: ctl.fetch takes any Python remote function
def fetch_rank(ctx):
    return f"rank {ctx.rank}"


@meshrt.function("test.fetch_exception")
def fetch_exception(ctx):
    return ValueError("returned, not raised", ctx.rank)


@meshrt.function("test.fetch_raises")
def fetch_raises(ctx):
    raise RuntimeError("raised on purpose")


@meshrt.function("test.fetch_uncarried")
def fetch_uncarried(ctx):
    return threading.Lock()


def here():
    """The caller's line number."""
    return sys._getframe(1).f_lineno


def site(line, function="main"):
    return f"{HERE}:{line} ({function})"


def value(ctl, t, **coords):
    return ctl.fetch_shard(t, **coords).result(timeout=60).numpy()


def release_path():
    return os.path.join(tempfile.gettempdir(), f"meshrt-pytest-{uuid.uuid4().hex}")


def interrupt_when_on(line):
    """Ctrl-C (SIGINT to this process) once the main thread is on `line`."""
    main_thread = threading.main_thread().ident

    def interrupt():
        while sys._current_frames()[main_thread].f_lineno != line:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()


def test_caller_site_is_the_python_line():
    line = here() + 1
    file, function, at = meshrt._core._caller_site()
    assert (os.path.basename(file), function, at) == (HERE, "test_caller_site_is_the_python_line",
                                                       line)
    # The same line again is the same interned site.
    sites = [meshrt._core._caller_site() for _ in range(3)]
    assert sites[0] == sites[1] == sites[2]
    # Two lines of one loop are two sites, the second time round (from the cache) as the first.
    for _ in range(2):
        first, first_line = meshrt._core._caller_site(), here()
        second, second_line = meshrt._core._caller_site(), here()
        assert (first[2], second[2]) == (first_line, second_line)


def test_rank_and_world_size():
    assert meshrt.world_size() == 4
    rank = meshrt.rank()

    def main(ctl):
        assert ctl.world_size == 4
        assert ctl.worker_ranks == [0, 1, 2, 3]
        assert ctl.accelerator == meshrt.DeviceKind.EMULATED
        assert str(ctl.accelerator) == "emulated"
        return rank

    assert meshrt.run(main) == (0 if rank == 0 else None)


@pytest.mark.parametrize("kind", KINDS)
def test_mesh(kind):
    def main(ctl):
        mesh = ctl.world_mesh({"dp": 2, "tp": 2}, kind=kind)
        assert mesh == ctl.world_mesh([("dp", 2), ("tp", 2)], kind=kind)
        assert mesh.names == ["dp", "tp"]
        assert mesh.sizes == [2, 2]
        assert mesh.ranks == [0, 1, 2, 3]
        assert mesh.size("tp") == 2
        assert repr(mesh) == "meshrt.Mesh({'dp': 2, 'tp': 2}, ranks [0, 1, 2, 3])"
        row = mesh.slice("dp", 1)
        assert (row.names, row.ranks) == (["tp"], [2, 3])
        col = mesh.slice("tp", 1, 2)
        assert (col.names, col.sizes, col.ranks) == (["dp", "tp"], [2, 1], [1, 3])
        every_other = ctl.world_mesh({"x": 4}, kind=kind).slice("x", 0, 4, 2)
        assert every_other.ranks == [0, 2]
        renamed = mesh.rename("tp", "model")
        assert renamed.names == ["dp", "model"]
        assert mesh.flatten("all").names == ["all"]
        assert mesh.flatten("all").ranks == [0, 1, 2, 3]
        split = ctl.world_mesh({"x": 4}, kind=kind).split("x", {"a": 2, "b": 2})
        assert (split.names, split.sizes) == (["a", "b"], [2, 2])
        assert ctl.world_mesh({"x": 4}, kind=kind).split("x", [("a", 2), ("b", 2)]) == split
        # rank(dim): each rank's coordinate, as an int64 0-d tensor.
        r = mesh.rank("tp")
        assert r.meta.shape == () and r.meta.dtype == meshrt.int64
        assert r.meta.device.type == kind
        assert r.mesh == mesh
        assert [int(value(ctl, r, dp=d, tp=t)) for d in range(2) for t in range(2)] == [0, 1, 0, 1]

    meshrt.run(main)


@pytest.mark.parametrize("kind", KINDS)
def test_call_arguments(kind):
    def main(ctl):
        mesh = ctl.world_mesh({"x": 4}, kind=kind)
        # Shapes as tuples or lists; dtypes of meshrt, numpy and torch, or names.
        for dtype, expected in [(meshrt.float32, meshrt.float32), (np.float64, meshrt.float64),
                                (np.dtype("int32"), meshrt.int32), (torch.int64, meshrt.int64),
                                ("float16", meshrt.float16)]:
            t = mesh.call("meshrt.full", (2, 3), dtype, 1)
            assert t.meta.shape == (2, 3) and t.meta.dtype == expected
        t = mesh.call("meshrt.full", [4], meshrt.float32, np.float32(2.5))  # a numpy scalar is a number
        np.testing.assert_array_equal(value(ctl, t, x=1), np.full(4, 2.5, np.float32))
        assert mesh.call("meshrt.full", (), meshrt.bool_, True).meta.dtype == meshrt.bool_
        # Host tensors as arguments: numpy, torch, meshrt.Tensor, sent to every rank.
        a = np.arange(6, dtype=np.float32).reshape(2, 3)
        np.testing.assert_array_equal(value(ctl, mesh.call("meshrt.from_host", a), x=3), a)
        np.testing.assert_array_equal(value(ctl, mesh.call("meshrt.from_host", torch.arange(4.0)), x=2),
                                      np.arange(4, dtype=np.float32))
        fetched = ctl.fetch_shard(mesh.call("meshrt.arange", 5, meshrt.int64), x=0).result(timeout=60)
        np.testing.assert_array_equal(value(ctl, mesh.call("meshrt.from_host", fetched), x=1), np.arange(5))
        np.testing.assert_array_equal(value(ctl, mesh.from_host(a), x=2), a)
        np.testing.assert_array_equal(value(ctl, mesh.scatter("x", np.arange(8).reshape(4, 2)), x=3), [[6, 7]])
        # A DTensor inside a list reaches the shape function as its meta.
        x = mesh.call("meshrt.full", (3,), meshrt.float32, 1.0)
        with pytest.raises(meshrt.UsageError, match="float32"):
            mesh.call("meshrt.fail", "never runs", [x])
        # One output, several (call_n), none (a function that only mutates).
        assert mesh.call("meshrt.fill_", x, 7.0) is None
        np.testing.assert_array_equal(value(ctl, x, x=0), [7, 7, 7])
        outs = mesh.call_n("meshrt.add", x, x)
        assert isinstance(outs, list) and len(outs) == 1
        np.testing.assert_array_equal(value(ctl, outs[0], x=2), [14, 14, 14])
        # A fetch through a function on the worker.
        assert float(ctl.fetch_shard(x, preprocess="meshrt.sum", x=1).result(timeout=60).numpy()) == 21.0

    meshrt.run(main)


@pytest.mark.parametrize("kind", KINDS)
def test_rooted_and_several_dimension_collectives(kind):
    def main(ctl):
        mesh = ctl.world_mesh({"dp": 2, "tp": 2}, kind=kind)
        dp, tp = mesh.rank("dp"), mesh.rank("tp")
        x = mesh.call("meshrt.add", mesh.call("meshrt.add", dp, dp), tp)  # 2 * dp + tp
        to1 = x.reduce("tp", "sum", dst=1)  # on the sub-mesh tp=1
        assert to1.mesh == mesh.slice("tp", 1)
        assert [int(value(ctl, to1, dp=d)) for d in range(2)] == [1, 5]
        np.testing.assert_array_equal(value(ctl, x.gather("dp", dst=0), tp=1), [1, 3])
        b = x.broadcast("tp", src=1)
        assert [int(value(ctl, b, dp=d, tp=t)) for d in range(2) for t in range(2)] == [1, 1, 3, 3]
        rows = x.reduce(("tp", "dp"), "stack")  # ranked dp-major, the mesh's order: [0, 1, 2, 3]
        np.testing.assert_array_equal(value(ctl, rows, dp=1, tp=0), [0, 1, 2, 3])
        np.testing.assert_array_equal(value(ctl, rows.scatter("dp", src=1), dp=1, tp=0), [2, 3])
        assert int(value(ctl, x.reduce((), "sum"), dp=0, tp=1)) == 6
        assert x.reduce_(["tp", "dp"], "max") is x
        assert int(value(ctl, x, dp=0, tp=0)) == 3
        with pytest.raises(meshrt.UsageError, match=r"expected one dimension \(a str\) with dst=, found a tuple"):
            x.reduce(("dp",), "sum", dst=0)
        with pytest.raises(meshrt.UsageError, match=r"reduce: expected each dimension a str, found int"):
            x.reduce(("dp", 1), "sum")
        with pytest.raises(meshrt.UsageError, match=r"broadcast over 'tp': expected a coordinate in 0..1"):
            x.broadcast("tp", src=2)

    meshrt.run(main)


@pytest.mark.parametrize("kind", KINDS)
def test_small_forms_reduce_out_mean_shape_size_split_and_drop(kind):
    def main(ctl):
        mesh = ctl.world_mesh({"dp": 2, "tp": 2}, kind=kind)
        assert mesh.size(("dp", "tp")) == 4 and mesh.size() == 4 and mesh.size("tp") == 2
        assert ctl.world_mesh({"all": 4}).split("all", {"a": -1, "b": 2}).sizes == [2, 2]
        with pytest.raises(meshrt.UsageError, match=r"part 'b' \(-1\) cannot be inferred"):
            ctl.world_mesh({"all": 4}).split("all", {"a": 3, "b": -1})
        x = mesh.scatter("tp", np.array([[1.0, 2.0], [11.0, 12.0]], dtype=np.float32))  # [[1, 2]] or [[11, 12]]
        assert x.shape == (1, 2) and x.dtype == meshrt.float32
        assert meshrt.Reduction.MEAN == meshrt.Reduction.AVG
        np.testing.assert_array_equal(value(ctl, x.reduce("tp", "mean"), dp=1, tp=0), [[6.0, 7.0]])
        out = mesh.call("meshrt.zeros", [1, 2], "float32")
        same = out
        assert x.reduce("tp", "sum", out=out) is out
        np.testing.assert_array_equal(value(ctl, same, dp=0, tp=1), [[12.0, 14.0]])
        x.reduce(("dp", "tp"), meshrt.Reduction.MEAN, out=out)
        np.testing.assert_array_equal(value(ctl, out, dp=1, tp=1), [[6.0, 7.0]])
        with pytest.raises(meshrt.UsageError, match=r"expected out of the result's meta float32\[1, 2\]"):
            x.reduce("tp", "sum", out=mesh.call("meshrt.zeros", [3], "float32"))
        with pytest.raises(meshrt.UsageError, match=r"expected dst= or out=, found both"):
            x.reduce("tp", "sum", dst=0, out=out)
        gone = mesh.call("meshrt.zeros", [1, 2], "float32")
        other = gone
        gone.drop()
        with pytest.raises(meshrt.UsageError, match=r"the tensor was dropped at .*test_controller.py"):
            other.reduce("tp", "sum")
        ctl.synchronize()
        np.testing.assert_array_equal(value(ctl, x, dp=0, tp=1), [[11.0, 12.0]])

    meshrt.run(main)


@pytest.mark.parametrize("kind", KINDS)
def test_to_mesh_from_a_slice_broadcasts(kind):
    def main(ctl):
        mesh = ctl.world_mesh({"dp": 2, "tp": 2}, kind=kind)
        dp, tp = mesh.rank("dp"), mesh.rank("tp")
        x = mesh.call("meshrt.add", mesh.call("meshrt.add", dp, dp), tp)  # 2 * dp + tp
        rooted = x.reduce("tp", "sum", dst=0).to_mesh(mesh)  # x.reduce("tp", "sum"): 4 * dp + 1
        assert rooted.mesh == mesh
        assert [int(value(ctl, rooted, dp=d, tp=t)) for d in range(2) for t in range(2)] == [1, 1, 5, 5]
        down = x.slice_mesh("dp", 1).to_mesh(mesh)  # every dp gets dp=1's: 2 + tp
        assert [int(value(ctl, down, dp=d, tp=t)) for d in range(2) for t in range(2)] == [2, 3, 2, 3]
        one = x.slice_mesh("dp", 0).slice_mesh("tp", 1).to_mesh(mesh)
        assert [int(value(ctl, one, dp=d, tp=t)) for d in range(2) for t in range(2)] == [1, 1, 1, 1]
        row = x.slice_mesh("dp", 0)
        with pytest.raises(meshrt.UsageError,
                           match=r"to_mesh: expected a target mesh of the same sizes as the source \[tp=2\], or one "
                           r"the source is a slice of .*found the target \[x=4\]"):
            row.to_mesh(ctl.world_mesh({"x": 4}, kind=kind))
        line = here() + 2
        with pytest.raises(meshrt.UsageError, match=r"a permutation does not combine with a broadcast") as e:
            row.to_mesh(mesh, meshrt.MeshPermutation.rotate("tp", 1))
        assert site(line) in str(e.value)
        with pytest.raises(meshrt.UsageError, match=r"is no slice"):
            row.to_mesh(ctl.world_mesh({"tp": 2, "dp": 2}, kind=kind))

    meshrt.run(main)


@pytest.mark.parametrize("kind", KINDS)
def test_fetch_brings_back_a_python_value_from_one_rank(kind):
    def main(ctl):
        mesh = ctl.world_mesh({"dp": 2, "tp": 2}, kind=kind)
        # World rank = 2 dp + tp; dimensions not named are 0.
        assert ctl.fetch(fetch_rank, mesh=mesh, dp=1).result(timeout=60) == "rank 2"
        assert ctl.fetch("test.fetch_rank", mesh=mesh, tp=1).result(timeout=60) == "rank 1"
        e = ctl.fetch(fetch_exception, mesh=mesh, dp=1, tp=1).result(timeout=60)
        assert isinstance(e, ValueError) and e.args == ("returned, not raised", 3)
        with pytest.raises(meshrt.RemoteError, match=r"(?s)fetch of test.fetch_raises.*raised on purpose") as info:
            ctl.fetch(fetch_raises, mesh=mesh, tp=1).result(timeout=60)
        assert info.value.ranks == [1]
        with pytest.raises(meshrt.RemoteError, match=r"ctl.fetch of test.fetch_uncarried on rank 0: expected a "
                                                     r"value the safe codec carries"):
            ctl.fetch(fetch_uncarried, mesh=mesh).result(timeout=60)
        rows = np.arange(8, dtype=np.float32).reshape(4, 2)
        x = mesh.scatter("tp", rows)
        if kind == "cpu":
            got = ctl.fetch(fetch_stats, x, "x", dp=1, tp=1).result(timeout=60)
            assert {k: got[k] for k in ("label", "rank", "sum", "max")} == {
                "label": "x", "rank": 3, "sum": float(rows[2:].sum()), "max": 7.0}
            np.testing.assert_array_equal(got["rows"], rows[2:])
        else:
            with pytest.raises(meshrt.UsageError, match=r"fetch of test.fetch_stats: expected tensor arguments on a "
                                                         r"cpu mesh, found float32\[2, 2\] on emulated"):
                ctl.fetch(fetch_stats, x, "x")
        with pytest.raises(meshrt.UsageError, match=r"fetch of test.fetch_rank: expected a DTensor argument or mesh="):
            ctl.fetch(fetch_rank)
        assert float(value(ctl, x.reduce("tp", "sum"), dp=0, tp=0).sum()) == float(rows.sum())  # the session goes on

    meshrt.run(main)


@pytest.mark.parametrize("kind", KINDS)
def test_barrier_is_a_future_of_its_lines(kind):
    def main(ctl):
        mesh = ctl.world_mesh({"dp": 2, "tp": 2}, kind=kind)
        release = release_path()
        try:
            mesh.call("test.block", release, [1])  # world rank 1 (dp=0, tp=1) waits for the file
            f = mesh.barrier("tp")
            assert isinstance(f, meshrt.Future)
            # Rank 1 has not entered: the future cannot be done, whenever it is asked.
            assert not f.done()
            with pytest.raises(meshrt.TimeoutError, match=r"barrier over 'tp' \(invocation \d+\) did not complete"):
                f.result(timeout=0.2)
        finally:
            pathlib.Path(release).touch()
        assert f.result(timeout=60) is None
        assert f.done() and f.exception() is None
        assert mesh.barrier(("tp", "dp")).result(timeout=60) is None
        assert mesh.barrier().result(timeout=60) is None
        assert mesh.slice("dp", 1).barrier(()).result(timeout=60) is None
        with pytest.raises(meshrt.UsageError, match=r"barrier: expected each dimension a str, found int"):
            mesh.barrier(("tp", 1))
        with pytest.raises(meshrt.UsageError, match=r"rack"):
            mesh.barrier("rack")
        x = mesh.rank("tp")
        with pytest.raises(meshrt.UsageError, match=r"barrier over 'tp' inside a recording"):
            ctl.record(x, lambda t: (mesh.barrier("tp"), t)[1])

    meshrt.run(main)


@pytest.mark.parametrize("kind", KINDS)
def test_futures_compose_with_callbacks_wait_and_asyncio(kind):
    import asyncio
    import logging
    import queue

    def main(ctl):
        mesh = ctl.world_mesh({"dp": 2, "tp": 2}, kind=kind)
        tp, dp = mesh.rank("tp"), mesh.rank("dp")
        # A future completes once every rank has reported past it, and a rank busy in a
        # kernel reports nothing: `fast` is done first, then rank 1 holds what follows.
        fast = ctl.fetch_shard(tp, dp=1, tp=1)
        assert int(fast.result(timeout=60).numpy()) == 1
        release = release_path()
        calls = []
        called = threading.Event()

        def on_done(f):
            calls.append((f, threading.current_thread().name))
            called.set()

        try:
            blocked = mesh.call("test.block", release, [1])
            slow = ctl.fetch_shard(blocked, dp=0, tp=1)
            slow.add_done_callback(on_done)
            done, not_done = meshrt.wait([slow, fast], return_when=meshrt.FIRST_COMPLETED)
            assert (done, not_done) == ({fast}, {slow})
            done, not_done = meshrt.wait([slow, fast], timeout=0.2)  # ALL_COMPLETED, cut short
            assert (done, not_done) == ({fast}, {slow})
            with pytest.raises(meshrt.TimeoutError):
                slow.exception(timeout=0.1)
            assert calls == [] and slow.running() and not fast.running()
            assert slow.cancel() is False and not slow.cancelled()
            # Released while the wait runs: it returns once `slow` completes.
            threading.Thread(target=pathlib.Path(release).touch).start()
            done, not_done = meshrt.wait([slow], return_when=meshrt.FIRST_COMPLETED)
            assert (done, not_done) == ({slow}, set())
        finally:
            pathlib.Path(release).touch()
        assert called.wait(60)
        done, not_done = meshrt.wait([slow, fast], timeout=60)
        assert (done, not_done) == ({slow, fast}, set())
        assert float(slow.result().numpy()) == 1.0 and int(fast.result().numpy()) == 1
        # Added after completion: called at once, on the caller's thread.
        late = []
        slow.add_done_callback(late.append)
        assert late == [slow]
        os.unlink(release)

        # A failed future: its callback sees the exception; FIRST_EXCEPTION stops at it.
        bad = ctl.fetch_shard(mesh.call("meshrt.fail", "seen by the callback", [2]), dp=1, tp=0)
        errors = queue.SimpleQueue()
        bad.add_done_callback(lambda f: errors.put(f.exception()))
        err = errors.get(timeout=60)
        assert isinstance(err, meshrt.RemoteError) and "seen by the callback" in err.worker_message
        done, _ = meshrt.wait([bad], return_when=meshrt.FIRST_EXCEPTION)
        assert done == {bad}

        # A callback that raises is logged; the completion thread goes on.
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger("meshrt").addHandler(handler)
        try:
            after = queue.SimpleQueue()
            f1, f2 = ctl.fetch_shard(dp, dp=1, tp=0), ctl.fetch_shard(tp, dp=0, tp=1)
            f1.add_done_callback(lambda f: 1 / 0)
            f2.add_done_callback(after.put)
            assert after.get(timeout=60) is f2
            meshrt.wait([f1], timeout=60)
        finally:
            logging.getLogger("meshrt").removeHandler(handler)
        assert any(r.exc_info and r.exc_info[0] is ZeroDivisionError for r in records), records

        # asyncio: two futures awaited together, and a failure raised at the await.
        async def both():
            return await asyncio.gather(ctl.fetch_shard(dp, dp=1, tp=1), ctl.fetch_shard(tp, dp=1, tp=1))

        a, b = asyncio.run(both())
        assert (int(a.numpy()), int(b.numpy())) == (1, 1)

        async def failing():
            await bad

        with pytest.raises(meshrt.RemoteError, match="seen by the callback"):
            asyncio.run(failing())
        coords = [(0, 0), (0, 1), (1, 0), (1, 1)]
        fs = {ctl.fetch_shard(tp, dp=d, tp=t): t for d, t in coords}
        assert sorted(fs[f] for f in meshrt.as_completed(fs, timeout=60)) == [0, 0, 1, 1]
        assert len(calls) == 1 and calls[0][0] is slow and calls[0][1] == "meshrt completion"

    meshrt.run(main)


@pytest.mark.parametrize("kind", KINDS)
def test_fetch_shard_of_a_pytree_is_one_round_trip_and_defaults_to_coordinate_0(kind):
    import collections

    Pair = collections.namedtuple("Pair", "first second")

    def main(ctl):
        mesh = ctl.world_mesh({"dp": 2, "tp": 2}, kind=kind)
        host = np.arange(8, dtype=np.float32).reshape(4, 2)
        a = mesh.scatter("tp", host)  # tp shard t: rows 2t, 2t+1
        b = mesh.rank("dp")
        c = a.reduce("dp", "sum")
        on_tp = mesh.slice("dp", 1)  # a mesh without 'dp': the coordinate does not apply there
        d = on_tp.scatter("tp", host * 10)
        want = {(dp, tp): (host[2 * tp:2 * tp + 2], dp, 2 * host[2 * tp:2 * tp + 2], 10 * host[2 * tp:2 * tp + 2])
                for dp in (0, 1) for tp in (0, 1)}
        ctl.synchronize()
        for (dp, tp), (wa, wb, wc, wd) in want.items():
            before = ctl.control_traffic()["sent"]["Command"]["messages"]
            f = ctl.fetch_shard((a, [b, {"c": c, "p": Pair(d, a)}]), dp=dp, tp=tp)
            sent = ctl.control_traffic()["sent"]["Command"]["messages"] - before
            # One command per rank: a, b, c at (dp, tp), d at world rank 2 + tp.
            assert sent == (1 if dp == 1 else 2), sent
            got = f.result(timeout=60)
            assert isinstance(got, tuple) and isinstance(got[1], list) and isinstance(got[1][1]["p"], Pair)
            ga, (gb, rest) = got
            np.testing.assert_array_equal(ga.numpy(), wa)
            assert int(gb.numpy()) == wb
            np.testing.assert_array_equal(rest["c"].numpy(), wc)
            np.testing.assert_array_equal(rest["p"].first.numpy(), wd)
            np.testing.assert_array_equal(rest["p"].second.numpy(), wa)
            # The same as fetching each leaf on its own.
            for leaf, tensor in ((a, ga), (b, gb), (c, rest["c"])):
                np.testing.assert_array_equal(value(ctl, leaf, dp=dp, tp=tp), tensor.numpy())
        # Coordinate 0 along the dimensions not named.
        np.testing.assert_array_equal(value(ctl, a, tp=1), value(ctl, a, dp=0, tp=1))
        np.testing.assert_array_equal(value(ctl, b, dp=1), value(ctl, b, dp=1, tp=0))
        assert int(value(ctl, b)) == 0 and int(ctl.fetch_shard([b], dp=1).result(timeout=60)[0].numpy()) == 1
        assert ctl.fetch_shard({}).result(timeout=60) == {}
        with pytest.raises(meshrt.UsageError, match=r"found a str at the argument\[1\]\['x'\]"):
            ctl.fetch_shard((a, {"x": "not a tensor"}))
        with pytest.raises(meshrt.UsageError, match="unknown mesh dimension 'rack'"):
            ctl.fetch_shard([a, b], rack=0)
        with pytest.raises(meshrt.UsageError, match="coordinate 2 of dimension 'tp' is outside the mesh"):
            ctl.fetch_shard([a, b], tp=2)
        # A failed leaf fails the whole fetch, naming the rank.
        bad = mesh.call("meshrt.fail", "a broken leaf", [3])
        with pytest.raises(meshrt.RemoteError, match="a broken leaf"):
            ctl.fetch_shard([a, bad], dp=1, tp=1).result(timeout=60)

    meshrt.run(main)


@pytest.mark.parametrize("kind", KINDS)
def test_reductions_and_sends(kind):
    def main(ctl):
        mesh = ctl.world_mesh({"dp": 2, "tp": 2}, kind=kind)
        x = mesh.call("meshrt.full", (4,), meshrt.float32, 1.0)
        np.testing.assert_array_equal(value(ctl, x.reduce("tp", "sum"), dp=1, tp=0), [2, 2, 2, 2])
        np.testing.assert_array_equal(value(ctl, x.reduce("dp", meshrt.Reduction.AVG), dp=0, tp=1), [1, 1, 1, 1])
        rows = mesh.call("meshrt.full", (2, 3), meshrt.float32, 1.0)
        scattered = rows.reduce("tp", "SUM", scatter=True)  # reduce_scatter: one row each
        assert scattered.meta.shape == (3,)
        np.testing.assert_array_equal(value(ctl, scattered, dp=0, tp=1), [2, 2, 2])
        r = mesh.rank("tp")
        g = r.reduce("tp", meshrt.Reduction.STACK)
        assert g.meta.shape == (2,)
        np.testing.assert_array_equal(value(ctl, g, dp=0, tp=0), [0, 1])
        # In place: the same handle, its value changed.
        y = mesh.call("meshrt.full", (2,), meshrt.float32, 3.0)
        assert y.reduce_("tp", "sum") is y
        np.testing.assert_array_equal(value(ctl, y, dp=0, tp=0), [6, 6])
        # Sends: positional, to a slice, and in a permutation's order.
        z = y.slice_mesh("dp", 0).to_mesh(mesh.slice("dp", 1))
        assert z.mesh == mesh.slice("dp", 1)
        np.testing.assert_array_equal(value(ctl, z, tp=1), [6, 6])
        ring = ctl.world_mesh({"x": 4}, kind=kind)
        c = ring.rank("x")
        assert [int(value(ctl, c.rotate("x", 1), x=i)) for i in range(4)] == [3, 0, 1, 2]
        rotated = c.to_mesh(ring, meshrt.MeshPermutation.rotate("x", -1))
        assert [int(value(ctl, rotated, x=i)) for i in range(4)] == [1, 2, 3, 0]
        mapped = c.to_mesh(ring, permutation=meshrt.MeshPermutation.mapping([1, 0, 3, 2]))
        assert [int(value(ctl, mapped, x=i)) for i in range(4)] == [1, 0, 3, 2]
        grid = ctl.world_mesh({"row": 2, "col": 2}, kind=kind)
        rows = grid.rank("row")
        flat = grid.call("meshrt.add", grid.call("meshrt.add", rows, rows), grid.rank("col"))  # 2 * row + col
        t = flat.to_mesh(grid, meshrt.MeshPermutation.transpose("row", "col"))
        assert [int(value(ctl, t, row=i, col=j)) for i in range(2) for j in range(2)] == [0, 2, 1, 3]
        p = meshrt.MeshPermutation.transpose("row", "col")
        assert str(p) == "transpose 'row' and 'col'"
        assert p.resolve(["row", "col"], [2, 2]) == [0, 2, 1, 3]

    meshrt.run(main)


@pytest.mark.parametrize("kind", KINDS)
def test_streams_and_borrows(kind):
    def main(ctl):
        mesh = ctl.world_mesh({"dp": 2, "tp": 2}, kind=kind)
        comms = ctl.stream("comms")
        assert comms.name == "comms" and ctl.stream("comms") == comms
        assert ctl.default_stream.name == "default" and ctl.default_stream != comms
        y = mesh.call("meshrt.full", (4,), meshrt.float32, 1.0)
        assert y.stream == ctl.default_stream
        b = comms.borrow(y, mutable=True)
        assert b.stream == comms and repr(comms) == "meshrt.Stream('comms')"
        b.reduce_("tp", "sum")
        with pytest.raises(meshrt.UsageError, match="borrowed mutably by stream 'comms'"):
            y.reduce("tp", "sum")
        b.drop()
        with pytest.raises(meshrt.UsageError, match="was dropped"):
            b.reduce("tp", "sum")
        with pytest.raises(meshrt.UsageError, match="already dropped"):
            b.drop()
        np.testing.assert_array_equal(value(ctl, y, dp=0, tp=1), [2, 2, 2, 2])  # what the borrower wrote
        on_comms = mesh.call_on(comms, "meshrt.full", (4,), meshrt.float32, 5.0)
        assert len(on_comms) == 1 and on_comms[0].stream == comms
        with pytest.raises(meshrt.UsageError, match="borrow them onto one stream"):
            mesh.call("meshrt.add", on_comms[0], y)
        ro = comms.borrow(y)
        np.testing.assert_array_equal(value(ctl, mesh.call("meshrt.add", ro, on_comms[0]), dp=1, tp=1), [7, 7, 7, 7])
        ro.drop()

    meshrt.run(main)


def test_controller_methods():
    def main(ctl):
        mesh = ctl.world_mesh({"x": 4})
        x = mesh.call("meshrt.full", (1024,), meshrt.float32, 1.0).reduce("x", "sum")
        f = ctl.fetch_shard(x, x=0)
        ctl.synchronize(timeout=60)
        assert f.done()
        assert f.exception() is None
        ctl.synchronize()
        assert ctl.live_values(0) >= 1
        assert isinstance(ctl.release_cached_memory(), int)
        dump = ctl.dump_flight_recorder()
        assert isinstance(dump, str) and "meshrt.full" in dump
        traffic = ctl.control_traffic()
        assert traffic["sent"]["Command"]["messages"] > 0
        assert "DTensor(float32[1024]" in repr(x)

    meshrt.run(main)


def test_controller_busy_in_python_while_work_runs():
    def main(ctl):
        mesh = ctl.world_mesh({"x": 4})
        x = mesh.call("meshrt.rand", (128, 128), meshrt.float32, 7)
        for _ in range(8):
            x = mesh.call("meshrt.scale", mesh.call("meshrt.matmul", x, x), 1.0 / 128)
        f = ctl.fetch_shard(x.reduce("x", "sum"), x=0)
        # The controller holds the GIL in pure Python: the workers, rank 0's included,
        # go on without it.
        end = time.monotonic() + 1.0
        spins = 0
        while time.monotonic() < end:
            spins += 1
        assert f.result(timeout=60).shape == (128, 128)

    meshrt.run(main)


def test_handles_dropped_by_another_thread_while_the_controller_waits():
    def main(ctl):
        mesh = ctl.world_mesh({"x": 4})
        mesh.call("meshrt.full", (), meshrt.float32, 0.0)  # the mesh and the stream, made on the workers
        ctl.synchronize()
        before = ctl.live_values(1)
        doomed = [mesh.call("meshrt.full", (1 << 15,), meshrt.float32, 1.0) for _ in range(4)]
        release = release_path()
        f = ctl.fetch_shard(mesh.call("test.block", release, [1]), x=1)
        main_thread = threading.main_thread().ident

        def drop():
            # While the main thread waits in result() (holding the controller): the
            # handles are destroyed later, by the next call, and nothing deadlocks.
            while sys._current_frames()[main_thread].f_lineno != line:
                time.sleep(0.01)
            time.sleep(0.1)
            doomed.clear()
            pathlib.Path(release).touch()

        dropper = threading.Thread(target=drop)
        line = here() + 2
        dropper.start()
        assert float(f.result(timeout=60).numpy()) == 1.0
        dropper.join()
        os.unlink(release)
        ctl.synchronize()
        assert ctl.live_values(1) == before

    meshrt.run(main)


# ---------------------------------------------------------------- unhappy paths


def test_usage_errors_name_the_python_line():
    def main(ctl):
        mesh = ctl.world_mesh({"x": 4})
        x = mesh.call("meshrt.full", (4,), meshrt.float32, 1.0)
        line = here() + 2
        with pytest.raises(meshrt.UsageError) as e:
            x.reduce("nope", "sum")
        assert "unknown mesh dimension 'nope'" in str(e.value)
        assert f"(at {site(line)})" in str(e.value)
        line = here() + 2
        with pytest.raises(meshrt.UsageError, match=r"unknown mesh dimension 'y'.*\(at " + re.escape(site(line))):
            mesh.size("y")
        line = here() + 3
        with pytest.raises(meshrt.UsageError,
                           match=r"expected sizes that hold the 4 worker ranks.*" + re.escape(site(line))):
            ctl.world_mesh({"x": 3})
        with pytest.raises(meshrt.UsageError, match="world_mesh: the size of 'x': expected an int, found str '4'"):
            ctl.world_mesh({"x": "4"})
        with pytest.raises(meshrt.UsageError, match="expected kind .* found str 'tpu'"):
            ctl.world_mesh({"x": 4}, kind="tpu")
        line = here() + 2
        with pytest.raises(meshrt.UsageError) as e:
            mesh.call("meshrt.full", (3, 4), meshrt.float32, {1})
        assert "meshrt.full: argument 2: expected a DTensor" in str(e.value)
        assert "found set {1}" in str(e.value) and site(line) in str(e.value)
        with pytest.raises(meshrt.UsageError, match=r"argument 0\[1\]: .*found object"):
            mesh.call("meshrt.full", (3, object()), meshrt.float32, 1.0)
        with pytest.raises(meshrt.UsageError, match="expected a meshrt.Reduction or its name"):
            x.reduce("x", 3)
        with pytest.raises(meshrt.UsageError, match="stack"):  # the names it takes
            x.reduce("x", "total")
        line = here() + 2
        with pytest.raises(meshrt.UsageError, match=r"meshrt.full.*" + re.escape(site(line))):
            mesh.call("meshrt.full", (3, 4), "not-a-dtype", 1.0)
        with pytest.raises(meshrt.UsageError, match="registered function's name"):
            mesh.call(42)
        with pytest.raises(TypeError, match="keyword"):  # a call's arguments are positional
            mesh.call("meshrt.full", (3, 4), meshrt.float32, value=1.0)
        with pytest.raises(TypeError, match="Mesh"):
            meshrt.Mesh.call_n(ctl, "meshrt.full", (3, 4), meshrt.float32, 1.0)
        line = here() + 2
        with pytest.raises(meshrt.UsageError, match=r"call_on: expected a Stream.*found str.*" + re.escape(site(line))):
            mesh.call_on("comms", "meshrt.full", (3, 4), meshrt.float32, 1.0)
        with pytest.raises(meshrt.UsageError, match="unknown mesh dimension 'rack'"):
            ctl.fetch_shard(x, rack=0)

    meshrt.run(main)


def test_remote_error_names_the_python_line():
    def main(ctl):
        mesh = ctl.world_mesh({"x": 4})
        line = here() + 1
        bad = mesh.call("meshrt.fail", "broken on purpose", [2])
        f = ctl.fetch_shard(bad, x=2)
        err = f.exception()
        assert isinstance(err, meshrt.RemoteError) and f.done()
        assert err.function == "meshrt.fail" and err.ranks == [2]
        assert "broken on purpose" in err.worker_message
        assert err.issued_at == site(line)
        with pytest.raises(meshrt.RemoteError) as e:
            f.result()
        assert e.value.issued_at == site(line)
        assert site(line) in str(e.value)
        # A failure nobody fetched: synchronize raises it.
        line = here() + 1
        mesh.call("meshrt.fail", "unobserved", [1])
        with pytest.raises(meshrt.RemoteError) as e:
            ctl.synchronize()
        assert e.value.issued_at == site(line) and "unobserved" in e.value.worker_message
        ctl.synchronize()  # reported once

    meshrt.run(main)


def test_timeout_names_the_missing_rank():
    def main(ctl):
        release = release_path()
        try:
            mesh = ctl.world_mesh({"x": 4})
            line = here() + 1
            blocked = mesh.call("test.block", release, [3])
            f = ctl.fetch_shard(blocked, x=3)
            with pytest.raises(meshrt.TimeoutError) as e:
                f.result(timeout=0.5)
            assert isinstance(e.value, TimeoutError)
            assert e.value.missing_ranks == [3]
            assert "test.block" in str(e.value) and "within 0.5 s" in str(e.value)
            assert site(line) in str(e.value)
            assert not f.done()
        finally:
            pathlib.Path(release).touch()
        assert float(f.result(timeout=60).numpy()) == 1.0
        os.unlink(release)

    meshrt.run(main)


def test_dropped_and_stale_handles():
    saved = []

    def main(ctl):
        saved.append(ctl)
        mesh = ctl.world_mesh({"x": 4})
        x = mesh.call("meshrt.full", (2,), meshrt.float32, 1.0)
        b = ctl.stream("side").borrow(x)
        b.drop()
        with pytest.raises(meshrt.UsageError, match="dropped; it cannot be used any more"):
            ctl.fetch_shard(b, x=0)
        f = ctl.fetch_shard(x, x=0)
        ctl.restart_workers()
        for stale in (lambda: x.reduce("x", "sum"), lambda: mesh.slice("x", 0), lambda: mesh.call("meshrt.copy", x),
                      lambda: ctl.stream("side").borrow(x)):
            with pytest.raises(meshrt.UsageError, match=r"made before restart_workers\(\)"):
                stale()
        del f  # a future from before the restart may be dropped unread
        fresh = ctl.world_mesh({"x": 4})
        np.testing.assert_array_equal(value(ctl, fresh.call("meshrt.full", (2,), meshrt.float32, 4.0), x=3), [4, 4])
        return "ok"

    result = meshrt.run(main)
    if meshrt.rank() == 0:
        assert result == "ok"
        with pytest.raises(meshrt.UsageError, match="session has ended"):
            saved[0].world_mesh({"x": 4})


def test_main_exception_is_reraised_unchanged():
    class Boom(Exception):
        pass

    raised = []

    def main(ctl):
        ctl.world_mesh({"x": 4}).call("meshrt.full", (2,), meshrt.float32, 1.0)
        raised.append(Boom("from main"))
        raise raised[0]

    if meshrt.rank() == 0:
        with pytest.raises(Boom) as e:
            meshrt.run(main)
        assert e.value is raised[0]
        codes = []
        tb = e.value.__traceback__
        while tb is not None:
            codes.append(tb.tb_frame.f_code)
            tb = tb.tb_next
        assert codes[-1] is main.__code__
    else:
        assert meshrt.run(main) is None


def test_runtime_options_are_the_first_runs():
    with pytest.raises(meshrt.UsageError, match="expected dedicated_controller=False"):
        meshrt.run(lambda ctl: None, dedicated_controller=True)


def test_ctrl_c_interrupts_a_wait_on_rank_0():
    def main(ctl):
        release = release_path()
        try:
            mesh = ctl.world_mesh({"x": 4})
            f = ctl.fetch_shard(mesh.call("test.block", release, [1]), x=1)
            # The kernel blocks until the file exists: result() can end only by the interrupt.
            line = here() + 3
            interrupt_when_on(line)
            with pytest.raises(KeyboardInterrupt) as e:
                f.result()
            assert e.traceback[-1].lineno + 1 == line
            assert not f.done()
        finally:
            pathlib.Path(release).touch()
        # The session goes on: the same future, waited on again.
        assert float(f.result(timeout=60).numpy()) == 1.0
        os.unlink(release)
        return "ok"

    assert meshrt.run(main) == ("ok" if meshrt.rank() == 0 else None)


def test_ctrl_c_on_a_worker_rank_is_raised_when_the_session_ends():
    def main(ctl):
        mesh = ctl.world_mesh({"x": 4})
        mesh.call("test.sigint", [1, 2, 3])
        # The interrupted workers serve on until the controller ends the session.
        s = mesh.call("meshrt.full", (2,), meshrt.float32, 1.0).reduce("x", "sum")
        np.testing.assert_array_equal(value(ctl, s, x=3), [4, 4])
        return "ok"

    if meshrt.rank() == 0:
        assert meshrt.run(main) == "ok"
    else:
        with pytest.raises(KeyboardInterrupt):
            meshrt.run(main)


def test_record_replays_a_step_and_names_both_lines():
    def main(ctl):
        for kind in KINDS:
            mesh = ctl.world_mesh({"x": 2, "y": 2}, kind)
            acc = mesh.call("meshrt.zeros", [2], "float32")
            x = mesh.call("meshrt.full", [2], "float32", 1.0)

            def step(v):
                y = mesh.call("meshrt.scale", v, 2.0).reduce("y", "sum")
                mesh.call("meshrt.add_", acc, y)  # the captured acc changes at every replay
                return y

            rec = ctl.record([x], step)
            assert (rec.num_inputs, rec.num_outputs) == (1, 1) and rec.num_commands == 3
            v = x
            for _ in range(3):
                v = rec(v)
            assert value(ctl, v, x=1, y=0).tolist() == [64.0, 64.0]  # times 2, summed over 2 ranks: 4^3
            assert value(ctl, acc, x=0, y=1).tolist() == [4.0 + 16.0 + 64.0] * 2
            # The forms: None and tuples come back as recorded.
            pair = ctl.record([x], lambda v: (v, mesh.call("meshrt.copy", v)))
            a, b = pair(x)
            assert value(ctl, b, x=0, y=0).tolist() == [1.0, 1.0]
            assert ctl.record([], lambda: None)() is None

        mesh = ctl.world_mesh({"x": 4})
        x = mesh.call("meshrt.full", [2], "float32", 1.0)
        # Refused inside: a fetch, named by its line.
        line = here() + 2
        with pytest.raises(meshrt.UsageError, match=r"fetch_shard inside a recording") as e:
            ctl.record([x], lambda v: ctl.fetch_shard(v, x=0))
        assert site(line) in str(e.value)
        # A failure inside a replay names the recorded line and the replay's.
        def failing(v):
            return mesh.call("meshrt.fail", "inside the replay", [2])
        recorded = failing.__code__.co_firstlineno + 1
        rec = ctl.record([x], failing)
        line = here() + 1
        out = rec(x)
        with pytest.raises(meshrt.RemoteError) as e:
            ctl.fetch_shard(out, x=2).result(timeout=60)
        assert e.value.issued_at == f"{site(recorded, 'failing')}, replayed at {site(line)}"
        assert e.value.ranks == [2]
        ctl.synchronize()
        with pytest.raises(meshrt.UsageError, match=r"expected float32\[2\] on cpu as recorded"):
            rec(mesh.call("meshrt.full", [3], "float32", 1.0))

    meshrt.run(main)


def test_part_of_a_run_traced_with_python_lines():
    path = pathlib.Path(release_path() + ".json")

    def main(ctl):
        mesh = ctl.world_mesh({"x": 4})
        ctl.start_trace()
        line = here() + 1
        y = mesh.call("meshrt.full", [2], "float32", 1.0).reduce("x", "sum")
        ctl.stop_trace()
        mesh.call("meshrt.scale", y, 2.0)
        ctl.synchronize()
        try:
            assert ctl.write_trace(path) > 0
            trace = json.loads(path.read_text())
        finally:
            path.unlink(missing_ok=True)
        spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
        calls = {e["name"]: e for e in spans if e["cat"] == "call"}
        assert calls["meshrt.full"]["args"]["site"] == site(line), calls
        assert "meshrt.scale" not in calls, "a call after stop_trace was recorded"
        assert {e["pid"] for e in spans if e["name"] == "CallFunction meshrt.full"} == {0, 1, 2, 3}
        with pytest.raises(meshrt.UsageError, match=r"write_trace inside a recording"):
            ctl.record([y], lambda v: ctl.write_trace(path))

    meshrt.run(main)
