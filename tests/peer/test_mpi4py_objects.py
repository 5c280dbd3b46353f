"""mpi4py's object-message tests, ported to meshrt.StatelessGroup (any number of ranks;
CTest runs 4).

Follows mpi4py/mpi4py test/test_cco_obj.py, test/test_p2p_obj.py and
test/test_util_pkl5.py (commit 004d8e50ead451de0fe6e753445fb2650f384d42): the same message
list and the same expectations, written afresh. Every message goes through a broadcast
from every root, all_gather, gather to and scatter from every root, a ring of sends, a
send to oneself and the same in a group of one (COMM_SELF) and in a second group over the
world made while the first exists (a Dup); pkl5's testBigMPI sends its numpy messages
under block sizes around powers of two, here the group's chunk size
(MESHRT_GROUP_CHUNK_BYTES), at sizes that travel inside the object's structure and beside
it.

Where meshrt differs from mpi4py, on purpose (docs/python.md, "StatelessGroup"):
- A message travels through the safe codec unless both sides pass allow_pickle=True; every
  message here is one the codec takes (mpi4py pickles all of them).
- A received object has the sent one's type: the checks compare types too (mpi4py's
  compare values).
- A bad root raises meshrt.UsageError on the member that passes it (mpi4py:
  MPI.Exception with ERR_ROOT); a scatter list of the wrong length raises UsageError on
  every member, not ValueError on the root, so that no member is left waiting.
- mpi4py sends to MPI.PROC_NULL; a group has no such rank (a destination out of range is
  a UsageError).
"""
import contextlib
import math
import os

import numpy as np
import pytest

import meshrt
import meshrt.testing

ME = meshrt.rank()
N = meshrt.world_size()
T = 30  # seconds: every call here completes long before
W = meshrt.StatelessGroup.create(list(range(N)), timeout=T)

BASIC = [
    None,
    True,
    False,
    -7,
    0,
    7,
    2**31,
    -(2**63) + 1,
    2**63 - 1,
    2**63,  # beyond int64: the codec's arbitrary-size integers
    -(2**100) - 1,
    -2.17,
    0.0,
    +1.62,
    1 + 2j,
    2 - 3j,
    "mpi4py",
]
MESSAGES = [
    *BASIC,
    list(BASIC),
    tuple(BASIC),
    set(BASIC),
    frozenset(BASIC),
    {f"k{i}": v for i, v in enumerate(BASIC)},
]
A1 = np.arange(1, dtype="i")
A2 = np.arange(1, dtype="f")
ARRAYS = [A1, A2, [A1, A1], [A2, A2], (A1, A2)]
EVERY = MESSAGES + ARRAYS


def same(a, b):
    """Equal values of the same types, arrays by dtype, shape and contents."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


def check(got, sent):
    assert same(got, sent), f"sent {sent!r}, received {got!r}"


def ring(g, send, receive):
    """Sends to the next member and receives from the previous one; even members send
    first (a send may wait for its receiver), and a group of one sends to itself."""
    n, me = g.size, g.rank
    if n == 1:
        send(me)
        return receive(me)
    if me % 2 == 0:
        send((me + 1) % n)
        return receive((me - 1) % n)
    got = receive((me - 1) % n)
    send((me + 1) % n)
    return got


def every_operation(g, messages, allow_pickle=False):
    """mpi4py's per-message checks, on group g."""
    kw = {"allow_pickle": allow_pickle}
    n, me = g.size, g.rank
    for m in messages:
        for root in range(n):
            check(g.broadcast_obj(m if me == root else None, root, **kw), m)
            got = g.gather_obj(m, root, **kw)
            if me == root:
                assert len(got) == n
                for x in got:
                    check(x, m)
            else:
                assert got is None
            check(g.scatter_obj([m] * n if me == root else None, root, **kw), m)
        for x in g.all_gather_obj(m, **kw):
            check(x, m)
        check(ring(g, lambda dst: g.send_obj(m, dst, **kw), lambda src: g.recv_obj(src, **kw)), m)
        g.send_obj(m, me, **kw)
        check(g.recv_obj(me, **kw), m)
    # The whole list as one message (mpi4py's [*messages, messages]).
    check(g.broadcast_obj(messages if me == 0 else None, 0, **kw), messages)
    for x in g.all_gather_obj(messages, **kw):
        check(x, messages)
    for root in range(n):
        got = g.gather_obj(messages, root, **kw)
        assert got is None if me != root else len(got) == n and all(same(x, messages) for x in got)
        check(g.scatter_obj([messages] * n if me == root else None, root, **kw), messages)
    g.barrier()


def test_every_message_through_every_operation():
    every_operation(W, EVERY)


def test_the_same_with_allow_pickle_on_every_side():
    # Nothing here needs pickle: the codec's path is taken, and the results are the same.
    every_operation(W, EVERY, allow_pickle=True)


def test_a_group_of_one():
    with meshrt.StatelessGroup.create([ME], timeout=T) as alone:
        assert (alone.rank, alone.size) == (0, 1)
        every_operation(alone, EVERY)


def test_a_second_world_group_made_while_the_first_exists():
    # mpi4py's Dup: a group of its own over the same ranks, here in reverse order.
    with meshrt.StatelessGroup.create(list(reversed(range(N))), timeout=T) as dup:
        assert dup.rank == N - 1 - ME
        every_operation(dup, MESSAGES[:6] + ARRAYS)
        assert W.all_gather_obj(ME) == list(range(N))


def test_roots_out_of_range_are_usage_errors():
    for root in (-N, -1, N):
        with pytest.raises(meshrt.UsageError, match=f"root rank {root} is not a group rank"):
            W.broadcast_obj(None, root)
        with pytest.raises(meshrt.UsageError, match=f"root rank {root} is not a group rank"):
            W.gather_obj(None, root)
        with pytest.raises(meshrt.UsageError, match=f"root rank {root} is not a group rank"):
            W.scatter_obj([None] * N, root)
    for wrong in (N - 1, N + 1):
        with pytest.raises(meshrt.UsageError, match=f"expected {N} objects, one per member, found {wrong}"):
            W.scatter_obj([None] * wrong if ME == 0 else None, 0)
    assert W.usable


@contextlib.contextmanager
def chunk_bytes(n):
    """Groups made inside move every message in MPI messages of at most n bytes."""
    old = os.environ.get("MESHRT_GROUP_CHUNK_BYTES")
    os.environ["MESHRT_GROUP_CHUNK_BYTES"] = str(n)
    try:
        yield
    finally:
        if old is None:
            del os.environ["MESHRT_GROUP_CHUNK_BYTES"]
        else:
            os.environ["MESHRT_GROUP_CHUNK_BYTES"] = old


# pkl5's block sizes; 1024 int32 (4 KiB) travel inside the object's structure, 4097 (16
# KiB) beside it, each in messages of the chunk size.
@pytest.mark.parametrize("chunk", [63, 64, 65, 4095, 4096, 4097])
@pytest.mark.parametrize("count", [1024, 4097])
def test_numpy_messages_under_chunk_sizes_around_powers_of_two(chunk, count):
    with chunk_bytes(chunk), meshrt.StatelessGroup.create(list(range(N)), timeout=T) as g:
        me, dest, source = g.rank, (g.rank + 1) % N, (g.rank - 1) % N
        a = np.full(count, me, dtype="i")
        b = np.full(count, dest, dtype="i")
        c = np.full(count, 42, dtype="i")
        # pkl5's sendrecv of (a, b) around the ring.
        got = ring(g, lambda dst: g.send_obj((a, b), dst), lambda src: g.recv_obj(src))
        assert type(got) is tuple and len(got) == 2
        assert (got[0] == source).all() and (got[1] == me).all() and got[0].dtype == np.dtype("i")
        for root in range(N):
            for m in ([c, c], (c, c.copy())):
                got = g.broadcast_obj(m if me == root else None, root)
                assert type(got) is type(m) and all((x == 42).all() and x.shape == (count,) for x in got)
        for x in g.all_gather_obj(c):
            assert (x == 42).all()
        g.barrier()
