"""Testing multi-rank code with pytest and meshrt.testing (docs/python.md, "Testing
multi-rank code"): every rank runs these tests, in the same order.

    mpiexec -n 2 python3 -m pytest -p meshrt.testing apps/examples/python/test_with_ranks.py
"""
import numpy as np

import meshrt
import meshrt.testing

ME = meshrt.rank()
WORLD = meshrt.StatelessGroup.create(list(range(meshrt.world_size())), timeout=30)


def test_every_rank_is_gathered_in_order():
    assert WORLD.all_gather_obj(ME) == list(range(WORLD.size))


@meshrt.testing.ranks(2)
def test_a_pair_swaps_arrays():
    mine = np.full(1000, ME, np.float32)
    if ME == 0:  # a send returns once it is taken: one side sends first
        WORLD.send_obj(mine, 1)
        theirs = WORLD.recv_obj(1)
    else:
        theirs = WORLD.recv_obj(0)
        WORLD.send_obj(mine, 0)
    assert (theirs == 1 - ME).all()


@meshrt.testing.deadline(20)
def test_the_roots_array_reaches_everyone():
    got = WORLD.broadcast_obj(np.arange(10) if ME == 0 else None, 0)
    assert got.tolist() == list(range(10))
