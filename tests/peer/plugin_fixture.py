"""Tests for meshrt.testing's own test (plugin_selftest.py), run on 4 ranks: some fail,
skip or hang on one rank on purpose. PLUGIN_FIXTURE_SET picks the set: "outcomes" (the
plugin makes every rank agree) or "deadline" (a test hangs inside meshrt.run on rank 1)."""
import os
import time

import numpy as np
import pytest

import meshrt
import meshrt.testing

ME = meshrt.rank()
MODE = os.environ.get("PLUGIN_FIXTURE_SET", "outcomes")
if MODE == "outcomes":
    W = meshrt.StatelessGroup.create(list(range(meshrt.world_size())), timeout=30)
outcomes = pytest.mark.skipif(MODE != "outcomes", reason="the outcomes set")
hang = pytest.mark.skipif(MODE != "deadline", reason="the deadline set")


@outcomes
def test_fails_on_rank_2():
    assert ME != 2, "rank 2 fails on purpose"


@outcomes
def test_next_test_starts_in_step():
    assert W.all_gather_obj(ME) == [0, 1, 2, 3]


@outcomes
@meshrt.testing.ranks(3)
def test_needs_three_ranks():
    assert False, "never runs at 4 ranks"


@outcomes
@meshrt.testing.ranks(2, 4)
def test_runs_at_two_or_four_ranks():
    assert W.broadcast_obj("x" if ME == 3 else None, 3) == "x"


@pytest.fixture
def skip_on_rank_1():
    if ME == 1:
        pytest.skip("rank 1 skips in setup")


@outcomes
def test_setup_skipped_on_one_rank_skips_everywhere(skip_on_rank_1):
    assert False, "runs on no rank"


@pytest.fixture
def broken_on_rank_3():
    if ME == 3:
        raise RuntimeError("rank 3's fixture is broken")


@outcomes
def test_setup_error_on_one_rank(broken_on_rank_3):
    assert False, "runs on no rank"


@pytest.fixture
def teardown_fails_on_rank_0():
    yield
    assert ME != 0, "rank 0's teardown fails"


@outcomes
def test_teardown_error_on_one_rank(teardown_fails_on_rank_0):
    W.barrier()


@outcomes
def test_last_passes():
    W.barrier()


def sleep_shape(x):
    return x


@meshrt.function("test.plugin_sleep", shape=sleep_shape)
def sleep_on_rank_1(ctx, x):
    if ctx.rank == 1:
        time.sleep(600)
    return x.copy()


@hang
def test_passes_before_the_hang():
    pass


@hang
@meshrt.testing.deadline(4)
def test_hangs_inside_run_on_rank_1():
    def main(ctl):
        mesh = ctl.world_mesh({"x": 4})
        ctl.fetch_shard(mesh.call("test.plugin_sleep", mesh.from_host(np.ones(4, np.float32))), x=1).result()

    meshrt.run(main)
