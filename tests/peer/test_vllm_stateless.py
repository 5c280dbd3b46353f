"""vLLM's test of its StatelessProcessGroup, ported to meshrt.StatelessGroup (4 ranks).

Follows test_stateless_process_group and its workers in vLLM's
https://github.com/vllm-project/vllm/blob/bf0f082be1d1224f6646d5d191431cd157b19850/tests/distributed/test_utils.py
(repository vllm-project/vllm, commit bf0f082): the same groups, calls and closed-form
results, written afresh. vLLM forks 4 processes that meet over TCP ports;
here the 4 ranks of the job are the processes and the groups need no ports. vLLM skips
its own copy as "flaky and prone to hang"; this one runs every time, and 100 times in a
row in the nightly run (tests/peer/CMakeLists.txt).

The GPU worker (PyNccl all_reduce over both groups: 6 on rank 3, 18 on the others) needs
an NCCL communicator from Python; its sums are checked here over the groups themselves
(test_sum_over_both_groups_as_the_gpu_worker_does).

Each scenario runs REPEATS times in one job (PEER_REPEATS, default 3), each time on
groups made afresh.
"""
import os

import pytest
import torch

import meshrt
import meshrt.testing

ME = meshrt.rank()
WORLD_SIZE = 4
REPEATS = int(os.environ.get("PEER_REPEATS", "3"))
T = 30  # seconds: every call here completes long before

pytestmark = [meshrt.testing.ranks(WORLD_SIZE), pytest.mark.parametrize("repeat", range(REPEATS))]


def groups():
    """vLLM's two groups: pg1 over all four, and pg2 over ranks 0..2, made by them while
    pg1 exists (rank 3 goes on without it)."""
    pg1 = meshrt.StatelessGroup.create(list(range(WORLD_SIZE)), timeout=T)
    pg2 = meshrt.StatelessGroup.create([0, 1, 2], timeout=T) if ME <= 2 else None
    return pg1, pg2


def test_cpu_worker(repeat):
    pg1, pg2 = groups()
    data = pg1.broadcast_obj(torch.tensor([ME]), src=2)
    assert isinstance(data, torch.Tensor) and data.item() == 2
    if ME <= 2:
        data = pg2.broadcast_obj(torch.tensor([ME + 1]), src=2)
        assert data.item() == 3
        pg2.barrier()
    pg1.barrier()


def test_broadcast_worker(repeat):
    pg1, _ = groups()
    if ME == 2:
        assert pg1.broadcast_obj("secret", src=2) == "secret"
    else:
        assert pg1.broadcast_obj(None, src=2) == "secret"
    pg1.barrier()


def test_allgather_worker(repeat):
    pg1, _ = groups()
    assert pg1.all_gather_obj(ME) == list(range(WORLD_SIZE))
    pg1.barrier()


def test_sum_over_both_groups_as_the_gpu_worker_does(repeat):
    # vLLM's gpu_worker all-reduces [rank] over pg1 (0+1+2+3 = 6 everywhere), then the
    # result over pg2 (6 * 3 = 18 on ranks 0..2; rank 3 keeps 6).
    pg1, pg2 = groups()
    data = torch.tensor([ME])
    data = sum(pg1.all_gather_obj(data))
    pg1.barrier()
    if ME <= 2:
        data = sum(pg2.all_gather_obj(data))
        pg2.barrier()
    assert data.item() == (6 if ME == 3 else 18)
