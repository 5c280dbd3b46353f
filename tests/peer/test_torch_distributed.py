"""PyTorch's object-collective and DeviceMesh tests, ported to meshrt (8 ranks).

Follows, written afresh (the same properties and closed-form results, not the text):
- pytorch/pytorch test/distributed/test_c10d_object_collectives.py
  (commit 9c491bc34c6ab131b18cf51db02636d65ffd3472): all_gather_object, gather_object,
  send/recv_object_list, broadcast_object_list and scatter_object_list over the world and
  over pair sub-groups [r - r % 2, r - r % 2 + 1], made by the pairs at the same time;
- pytorch/pytorch test/distributed/test_device_mesh.py
  (commit 4c0ad729d146eb59483f8be24e6c5a0d4616f6a3): DeviceMeshTest, DeviceMeshTestNDim
  and DeviceMeshCollectiveTest: the groups of each dimension of a 2x2x2 mesh are the rows
  of mesh.swapdims(-1, dim).reshape(-1, size), the local rank per dimension, broadcast and
  scatter along each dimension, reduce_scatter of a sliced tensor (res = sum of ranks
  times the element), and the uneven all_gather, scatter and reduce_scatter;
- pytorch/pytorch test/distributed/_tensor/test_device_mesh.py
  (commit 0757c55c827ecb4c333c972f9408dc87e022d1da), the same file before it moved, for
  its all_gather_nd, all_reduce_nd, reduce_scatter_nd and all_to_all_1d/_nd (rank r sends
  chunk i = i + r * n; it receives the transpose, coordinate + sender * n).

torch's calls map to meshrt's so (docs/guide.md, "Reductions" and "Rooted collectives"):
mesh_broadcast -> DTensor.broadcast(dim, src=), mesh_scatter -> DTensor.scatter(dim,
src=) and Mesh.scatter(dim, host array), all_gather -> reduce(dim, "stack"),
reduce_scatter -> reduce(dim, "sum", scatter=True), all_to_all -> reduce(dim, "stack",
scatter=True), get_local_rank(dim) -> Mesh.rank(dim) and CallContext.coordinate(dim),
a dimension's group -> the line of ranks along it (Mesh.slice of the other dimensions).

Where meshrt differs from torch, on purpose:
- A group's src and dst are group ranks (torch's object collectives take a global rank).
- Collectives split and stack along the first axis only: torch's scatter_dim/shard_dim
  loops (which test its handling of non-contiguous chunks) have one case here.
- Uneven sizes are refused, not padded: a scatter or reduce_scatter whose first axis does
  not split into the dimension's size raises meshrt.UsageError at the call, naming what
  it needs and what it found (torch pads the last chunks and unpads after). An uneven
  all_gather cannot be expressed: a DTensor has one shape on every rank (a kernel whose
  output differs from its shape function fails its call).
- all_to_all is one tensor of size(0) == n in and out (torch: lists of n tensors).
"""
import os

# Before meshrt starts: the emulated accelerator, so that both kinds of mesh are tested.
os.environ.setdefault("MESHRT_ACCELERATOR", "emulated")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import meshrt  # noqa: E402
import meshrt.testing  # noqa: E402

ME = meshrt.rank()
WORLD = 8
T = 30  # seconds: every call here completes long before
SHAPE = (3, 3)
KINDS = ["cpu", "emulated"]

pytestmark = meshrt.testing.ranks(WORLD)


def _full_shape(shape):
    return meshrt.TensorMeta(tuple(shape), meshrt.float32)


@meshrt.function("peer.torch_rank_full", shape=_full_shape)
def _rank_full(ctx, shape):
    """torch.ones(shape) * rank."""
    return np.full(shape, ctx.rank, np.float32)


def _a2a_shape(n, shape):
    return meshrt.TensorMeta((n, *shape), meshrt.float32)


@meshrt.function("peer.torch_a2a_input", shape=_a2a_shape)
def _a2a_input(ctx, n, shape):
    """all_to_all's input: chunk i is i + rank * n."""
    return np.stack([np.full(shape, i + ctx.rank * n, np.float32) for i in range(n)])


def _stride(ctx, dim):
    """The world-rank distance between neighbours along dim (a world mesh is row-major)."""
    i = ctx.dim_names.index(dim)
    return int(np.prod(ctx.sizes[i + 1:], dtype=np.int64))


def _scatter_src_shape(dim_size, dim, shape):
    return meshrt.TensorMeta((dim_size * shape[0], *shape[1:]), meshrt.float32)


@meshrt.function("peer.torch_scatter_src", shape=_scatter_src_shape)
def _scatter_src(ctx, dim_size, dim, shape):
    """mesh_scatter's list on the line along dim, stacked: part i is ones * (the world rank
    at coordinate i of this rank's line)."""
    mine = ctx.coordinate(dim)
    parts = [np.full(shape, ctx.rank + (i - mine) * _stride(ctx, dim), np.float32) for i in range(dim_size)]
    return np.concatenate(parts)


def _sliced_shape(step):
    return meshrt.TensorMeta((step // 2, 2), meshrt.float32)


@meshrt.function("peer.torch_sliced", shape=_sliced_shape)
def _sliced(ctx, step):
    """test_reduce_scatter_contiguous's input: arange(step**2).view(step, step) * (rank + 1),
    rows 0, 2, 4, ... and the first two columns: a non-contiguous view."""
    t = np.arange(step * step, dtype=np.float32).reshape(step, step) * (ctx.rank + 1)
    return t[::2, :2]


# ---- object collectives ---------------------------------------------------------------


def pair():
    base = ME - ME % 2
    return [base, base + 1]


def test_object_collectives_over_the_world():
    with meshrt.StatelessGroup.create(list(range(WORLD)), timeout=T) as w:
        assert w.all_gather_obj(ME) == list(range(WORLD))
        assert w.gather_obj(ME, 0) == (list(range(WORLD)) if ME == 0 else None)
        sent = [99 if ME == 0 else None] * WORLD
        if ME == 0:
            w.send_obj(sent, 1)
        got = w.recv_obj(0) if ME == 1 else sent
        assert got[0] == (99 if ME < 2 else None)
        assert w.broadcast_obj([99] * WORLD if ME == 0 else None, 0)[0] == 99
        assert w.scatter_obj(list(range(WORLD)) if ME == 0 else None, 0) == ME
        w.barrier()


def test_object_collectives_over_pairs_made_at_once():
    # Four disjoint groups made at the same time on one parent tag: only members talk.
    ranks = pair()
    with meshrt.StatelessGroup.create(ranks, timeout=T) as g:
        assert g.members == ranks and g.rank == ME % 2
        # torch passes the global rank ranks[0] as the root; meshrt, the group rank 0.
        assert g.scatter_obj(ranks if g.rank == 0 else None, 0) == ME
        assert g.all_gather_obj(ME) == ranks
        assert g.gather_obj(ME, 0) == (ranks if g.rank == 0 else None)
        assert g.broadcast_obj(ME if g.rank == 0 else None, 0) == ranks[0]
        g.barrier()


# ---- DeviceMesh ------------------------------------------------------------------------


def shards(ctl, t):
    """Every shard of t by world rank, as numpy arrays (fetched at once, then waited on)."""
    mesh = t.mesh
    futures = {}
    for flat, index in enumerate(np.ndindex(*mesh.sizes)):
        futures[mesh.ranks[flat]] = ctl.fetch_shard(t, **{n: int(c) for n, c in zip(mesh.names, index)})
    return {r: f.result(timeout=T).numpy() for r, f in futures.items()}


def swapdims_rule(sizes, dim):
    """torch's dimension groups: the rows of arange.reshape(sizes).swapdims(-1, dim), in
    numpy (importing torch on 8 ranks would cost seconds)."""
    return np.swapaxes(np.arange(int(np.prod(sizes))).reshape(sizes), -1, dim).reshape(-1, sizes[dim]).tolist()


def line_of(rank, sizes, dim):
    return next(row for row in swapdims_rule(sizes, dim) if rank in row)


def run(main):
    meshrt.run(main)


@pytest.mark.parametrize("sizes", [(2, 2, 2), (4, 2)])
def test_dimension_groups_follow_the_swapdims_rule(sizes):
    names = ["dp", "pp", "tp"][-len(sizes):]

    def main(ctl):
        mesh = ctl.world_mesh(dict(zip(names, sizes)))
        assert mesh.ranks == list(range(WORLD))
        for d, name in enumerate(names):
            # The line through each rank as the mesh names it: the other dimensions fixed.
            for rank in range(WORLD):
                coords = np.unravel_index(rank, sizes)
                line = mesh
                for other, c in zip(names, coords):
                    if other != name:
                        line = line.slice(other, int(c))
                assert line.names == [name] and line.ranks == line_of(rank, sizes, d), (name, rank)
            # The line as the collective sees it: each rank's all_gather of the ranks.
            got = shards(ctl, mesh.call("peer.torch_rank_full", (1,)).reduce(name, "stack"))
            for rank, a in got.items():
                assert a.ravel().tolist() == line_of(rank, sizes, d), (name, rank, a)

    run(main)


def test_local_rank_per_dimension():
    def main(ctl):
        mesh = ctl.world_mesh({"dp": 2, "pp": 2, "tp": 2})
        expected = {"tp": lambda r: r % 2, "pp": lambda r: 0 if r % 4 <= 1 else 1, "dp": lambda r: r // 4}
        for name, rule in expected.items():
            got = shards(ctl, mesh.rank(name))
            assert {r: int(a) for r, a in got.items()} == {r: rule(r) for r in range(WORLD)}, name
        flat = ctl.world_mesh({"x": WORLD})
        assert {r: int(a) for r, a in shards(ctl, flat.rank("x")).items()} == {r: r for r in range(WORLD)}

    run(main)


def test_meshes_torch_rejects_are_refused():
    def main(ctl):
        with pytest.raises(meshrt.UsageError, match="dp"):
            ctl.world_mesh([("dp", 2), ("dp", 2), ("tp", 2)])
        with pytest.raises(meshrt.UsageError, match="8"):
            ctl.world_mesh({"dp": 3, "tp": 2})

    run(main)


@pytest.mark.parametrize("kind", KINDS)
def test_collectives_along_each_dimension(kind):
    sizes = (2, 2, 2)
    names = ["dp", "pp", "tp"]

    def main(ctl):
        mesh = ctl.world_mesh(dict(zip(names, sizes)), kind=kind)
        x = mesh.call("peer.torch_rank_full", SHAPE)
        for d, name in enumerate(names):
            n = sizes[d]
            line = {r: line_of(r, sizes, d) for r in range(WORLD)}
            coord = {r: line[r].index(r) for r in range(WORLD)}
            # broadcast_nd: the line's rank at src.
            for src in range(n):
                got = shards(ctl, x.broadcast(name, src=src))
                for r, a in got.items():
                    np.testing.assert_array_equal(a, np.full(SHAPE, line[r][src]), err_msg=f"{name} src={src} rank {r}")
            # scatter_nd: the root's parts are the line's ranks; each gets its own rank.
            src_parts = mesh.call("peer.torch_scatter_src", n, name, SHAPE)
            for src in range(n):
                got = shards(ctl, src_parts.scatter(name, src=src))
                for r, a in got.items():
                    np.testing.assert_array_equal(a, np.full(SHAPE, r), err_msg=f"{name} src={src} rank {r}")
            # all_gather_nd: the line's ranks, stacked.
            for r, a in shards(ctl, x.reduce(name, "stack")).items():
                np.testing.assert_array_equal(a, np.stack([np.full(SHAPE, q) for q in line[r]]))
            # all_reduce_nd: the sum of the line's ranks.
            for r, a in shards(ctl, x.reduce(name, "sum")).items():
                np.testing.assert_array_equal(a, np.full(SHAPE, sum(line[r])))
            # reduce_scatter_nd: ones * rank, n rows of SHAPE, summed: the line's sum.
            stacked = mesh.call("peer.torch_rank_full", (n, *SHAPE))
            for r, a in shards(ctl, stacked.reduce(name, "sum", scatter=True)).items():
                np.testing.assert_array_equal(a, np.full(SHAPE, sum(line[r])))
            # all_to_all_nd: chunk i = i + rank * n in; chunk j = coordinate + line[j] * n out.
            a2a = mesh.call("peer.torch_a2a_input", n, SHAPE).reduce(name, "stack", scatter=True)
            for r, a in shards(ctl, a2a).items():
                np.testing.assert_array_equal(a, np.stack([np.full(SHAPE, coord[r] + q * n) for q in line[r]]))
            # gather to each root, the rooted all_gather: only the root's slice holds it.
            for dst in range(n):
                g = x.gather(name, dst=dst)
                assert g.mesh == mesh.slice(name, dst)
                for r, a in shards(ctl, g).items():
                    assert coord[r] == dst
                    np.testing.assert_array_equal(a, np.stack([np.full(SHAPE, q) for q in line[r]]))

    run(main)


@pytest.mark.parametrize("kind", KINDS)
def test_collectives_over_a_flat_mesh(kind):
    def main(ctl):
        mesh = ctl.world_mesh({"x": WORLD}, kind=kind)
        # broadcast_1d: rank 0's ones * 0 everywhere.
        got = shards(ctl, mesh.call("peer.torch_rank_full", SHAPE).broadcast("x", src=0))
        assert all(np.array_equal(a, np.zeros(SHAPE)) for a in got.values())
        # scatter_1d from the controller: part r of a [WORLD * 3, 3] host tensor to rank r.
        whole = np.random.default_rng(0).standard_normal((WORLD * 3, 3)).astype(np.float32)
        for r, a in shards(ctl, mesh.scatter("x", whole)).items():
            np.testing.assert_array_equal(a, whole[3 * r:3 * r + 3])
        # all_to_all_1d: the transpose of i + rank * WORLD.
        a2a = mesh.call("peer.torch_a2a_input", WORLD, SHAPE).reduce("x", "stack", scatter=True)
        for r, a in shards(ctl, a2a).items():
            np.testing.assert_array_equal(a, np.stack([np.full(SHAPE, r + j * WORLD) for j in range(WORLD)]))
        # reduce_scatter_contiguous: a non-contiguous view, reduce-scattered; rank r gets row r
        # of (2 r step + [0, 1]) * sum(rank + 1).
        step = 2 * WORLD
        sum_base = WORLD * (WORLD + 1) // 2
        for r, a in shards(ctl, mesh.call("peer.torch_sliced", step).reduce("x", "sum", scatter=True)).items():
            first = r * sum_base * step * 2
            np.testing.assert_array_equal(a, [first, first + sum_base])

    run(main)


@pytest.mark.parametrize("kind", KINDS)
def test_uneven_sizes_are_refused(kind):
    # torch pads the last chunks of a [size + 3, size + 1] tensor; meshrt refuses it at the call.
    def main(ctl):
        mesh = ctl.world_mesh({"x": WORLD}, kind=kind)
        uneven = (WORLD + 3, WORLD + 1)
        x = mesh.call("peer.torch_rank_full", uneven)
        found = f"found float32[{WORLD + 3}, {WORLD + 1}]"
        with pytest.raises(meshrt.UsageError) as e:
            x.reduce("x", "sum", scatter=True)
        assert f"size(0) == {WORLD}" in str(e.value) and found in str(e.value), str(e.value)
        with pytest.raises(meshrt.UsageError) as e:
            x.reduce("x", "stack", scatter=True)
        assert f"size(0) == {WORLD}" in str(e.value) and found in str(e.value), str(e.value)
        with pytest.raises(meshrt.UsageError) as e:
            x.scatter("x", src=0)
        assert f"splits into {WORLD} equal parts" in str(e.value) and found in str(e.value), str(e.value)
        with pytest.raises(meshrt.UsageError) as e:
            mesh.scatter("x", np.ones(uneven, np.float32))
        assert f"expected a tensor whose first axis splits into {WORLD} equal shards" in str(e.value), str(e.value)
        assert found in str(e.value), str(e.value)
        # The mesh works on after the refusals.
        assert int(shards(ctl, mesh.rank("x").reduce("x", "sum"))[3]) == sum(range(WORLD))

    run(main)
