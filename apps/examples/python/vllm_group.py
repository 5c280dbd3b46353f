"""vLLM's use of its stateless process group, on meshrt.StatelessGroup.

    mpiexec -n 4 python3 apps/examples/python/vllm_group.py

vLLM forms groups of processes outside torch.distributed's global state: the two
processes of an engine form one, later all four form another (a group that includes
processes already grouped, which torch.distributed cannot do). Over a group it exchanges
metadata (all_gather_obj of small dicts), then broadcasts an NCCL unique id from rank 0
and builds an NCCL communicator from it. Here the id is NCCL's own where torch sees a
GPU for every member, and a stand-in 128-byte id otherwise (the group's part is the
same: 128 bytes from rank 0 to every member). Exits non-zero if anything is wrong.
"""
import os
import socket
import sys

import numpy as np

import meshrt


def check(ok, what):
    if not ok:
        print(f"vllm_group: rank {meshrt.rank()}: FAILED: {what}", file=sys.stderr, flush=True)
        sys.exit(1)


def nccl_unique_id(group):
    """Rank 0 makes the id, the group carries its 128 bytes: vLLM's PyNcclCommunicator."""
    torch = None
    try:
        import torch  # noqa: F811
    except ImportError:
        pass
    real = torch is not None and torch.cuda.is_available() and torch.cuda.device_count() >= group.size
    # Every member must take the same path, so the members agree on it first.
    real = all(group.all_gather_obj(real))
    if group.rank == 0:
        uid = torch.cuda.nccl.unique_id() if real else os.urandom(128)
    else:
        uid = None
    uid = group.broadcast_obj(uid, src=0)
    return uid, real, torch


def main():
    world, me = meshrt.world_size(), meshrt.rank()
    check(world >= 2 and world % 2 == 0, f"expected an even number of ranks, found {world}")

    # Two engines of two processes each, then all of them in one group.
    engine = meshrt.StatelessGroup.create([me - me % 2, me - me % 2 + 1], timeout=30)
    everyone = meshrt.StatelessGroup.create(list(range(world)), timeout=30)

    # Metadata exchange: every member's dict, on every member.
    meta = {
        "rank": everyone.rank,
        "host": socket.gethostname(),
        "engine": me // 2,
        "local_rank": engine.rank,
        "kv_cache_blocks": 1000 + 10 * me,
        "dtype": "bfloat16",
    }
    metas = everyone.all_gather_obj(meta)
    check([m["rank"] for m in metas] == list(range(world)), f"metadata out of order: {metas}")
    check(metas[me] is meta, "the own entry is the object passed in")
    blocks = min(m["kv_cache_blocks"] for m in metas)
    check(blocks == 1000, f"expected the smallest cache of 1000 blocks, found {blocks}")

    # The NCCL bootstrap, per engine and for everyone.
    for group, name in ((engine, "engine"), (everyone, "everyone")):
        uid, real, torch = nccl_unique_id(group)
        check(isinstance(uid, bytes) and len(uid) == 128, f"{name}: expected a 128-byte id, found {uid!r:.40}")
        ids = group.all_gather_obj(uid)
        check(all(i == uid for i in ids), f"{name}: the members hold different ids")
        if real:
            torch.cuda.set_device(group.rank)
            comm = torch.cuda.nccl.init_rank(group.size, uid, group.rank)
            check(comm is not None, f"{name}: ncclCommInitRank returned nothing")
        if everyone.rank == 0:
            kind = "NCCL communicator" if real else "stand-in 128-byte id (no GPU per member)"
            print(f"vllm_group: {name}: {group.size} ranks share one {kind}", flush=True)

    # Weights from the trainer's rank 0 to everyone, received into preallocated memory (no
    # pickle: arrays travel as raw bytes).
    weights = np.arange(1 << 16, dtype=np.float32) if me == 0 else np.empty(1 << 16, np.float32)
    everyone.broadcast_obj(weights, src=0, out=None if me == 0 else weights)
    check(np.array_equal(weights, np.arange(1 << 16, dtype=np.float32)), "weights differ")
    everyone.barrier()
    if me == 0:
        print(f"vllm_group: {world} ranks: metadata, NCCL id and weights exchanged: OK", flush=True)


if __name__ == "__main__":
    main()
