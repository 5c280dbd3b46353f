"""torch kernels (@meshrt.function(..., torch=True)) on every kind of mesh: the same kernels
run on a cpu mesh and on a mesh of the job's accelerator (MESHRT_ACCELERATOR: emulated in
CTest, cuda in a job on GPUs, which CI does not have). On cuda their tensors are torch
CUDA tensors over meshrt's device memory and their work runs on the call's stream: the
tests marked cuda-only check what only a GPU shows (stream order against a GPU that is
still busy, outputs taken without a copy, torch's allocator and meshrt's pool keeping what
the other uses, the DLPack stream hand-off). No reduction: several ranks may share one GPU
on a GPU machine, where NCCL takes one rank per GPU."""
import numpy as np
import pytest
import torch

import meshrt

# Each kernel records what only its process sees, by rank (rank 0's worker runs in the
# controller's process, so the controller reads rank 0's entries).
made = {}
kept = {}


def same(x, *rest):
    return x


@meshrt.function("torchk.scale", shape=same, torch=True)
def scale(ctx, x, a):
    return x * a


@meshrt.function("torchk.add_", shape=lambda x, y: meshrt.Signature(mutates=[0]), torch=True)
def add_(ctx, x, y):
    x.add_(y)


@meshrt.function("torchk.arange", shape=lambda n: meshrt.TensorMeta((n,), meshrt.float32), torch=True)
def arange(ctx, n):
    assert str(ctx.torch_device) == ("cuda:%d" % ctx.device.index if ctx.device.type == "cuda" else "cpu")
    return torch.arange(n, dtype=torch.float32, device=ctx.torch_device) + ctx.rank


@meshrt.function("torchk.not", shape=same, torch=True)
def logical_not(ctx, x):
    assert x.dtype == torch.bool, x.dtype
    return ~x


@meshrt.function("torchk.bf16_double", shape=same, torch=True)
def bf16_double(ctx, x):
    assert x.dtype == torch.bfloat16, x.dtype
    return x * 2


@meshrt.function("torchk.slow_fill", shape=lambda n, v: meshrt.TensorMeta((n,), meshrt.float32), torch=True)
def slow_fill(ctx, n, v):
    """A GPU still busy when the kernel returns: its output is written by the last of a queue
    of work that a fetch or a later kernel must wait for."""
    out = torch.zeros(n, dtype=torch.float32, device=ctx.torch_device)
    if out.is_cuda:
        torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU clock cycles, then the fill
    out.fill_(v)
    return out


@meshrt.function("torchk.make", shape=lambda n: meshrt.TensorMeta((n,), meshrt.float32), torch=True)
def make(ctx, n):
    out = torch.full((n,), 7.0, device=ctx.torch_device)
    made[ctx.rank] = out.data_ptr()
    return out


@meshrt.function("torchk.address", shape=lambda x: meshrt.TensorMeta((), meshrt.int64), torch=True)
def address(ctx, x):
    return torch.tensor(x.data_ptr(), dtype=torch.int64, device=ctx.torch_device)


@meshrt.function("torchk.keep", shape=lambda x: None, torch=True)
def keep(ctx, x):
    kept[ctx.rank] = x  # a torch view of meshrt's memory, past the call (cuda only)


@meshrt.function("torchk.read_kept", shape=lambda n: meshrt.TensorMeta((n,), meshrt.float32), torch=True)
def read_kept(ctx, n):
    return kept.pop(ctx.rank).clone()


@meshrt.function("torchk.churn", shape=lambda n: None, torch=True)
def churn(ctx, n):
    """Frees torch's cache and fills new memory of the sizes just used: memory either side
    freed too early would be overwritten here."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    junk = [torch.full((n,), -1.0, device=ctx.torch_device) for _ in range(64)]
    del junk


@meshrt.function("torchk.cpu_output", shape=lambda n: meshrt.TensorMeta((n,), meshrt.float32), torch=True)
def cpu_output(ctx, n):
    return torch.zeros(n)  # on the host, whatever the mesh


@meshrt.function("torchk.handoff", shape=lambda x: meshrt.Signature(outputs=[x], mutates=[0]), torch=True)
def handoff(ctx, x):
    """DLPack's stream hand-off both ways, inside a kernel: x is written on the call's stream
    after the GPU sleeps; a meshrt.Tensor of it read on another torch stream must see it."""
    if x.is_cuda:
        torch.cuda._sleep(200_000_000)
    x.fill_(5.0)
    m = meshrt.Tensor(x)  # meshrt imports torch's tensor: hands torch the call's stream
    assert m.data_ptr == x.data_ptr() and m.__dlpack_device__()[0] == (2 if x.is_cuda else 1)
    if not x.is_cuda:
        return torch.from_dlpack(m) * 2
    side = torch.cuda.Stream(device=x.device)
    with torch.cuda.stream(side):
        y = torch.from_dlpack(m)  # calls m.__dlpack__(stream=side): side waits for the call's stream
        z = y * 2
    torch.cuda.current_stream().wait_stream(side)
    z.record_stream(torch.cuda.current_stream())
    return z


@meshrt.function("torchk.numpy_scale", shape=same)
def numpy_scale(ctx, x, a):
    return x * np.float32(a)


def fetch(ctl, t, **coords):
    return ctl.fetch_shard(t, **coords).result(timeout=60)


def kinds(ctl):
    """A cpu mesh, and one of the job's accelerator when it has one."""
    out = ["cpu"]
    if str(ctl.accelerator) != "cpu":
        out.append(str(ctl.accelerator))
    return out


def mesh_of(ctl, kind):
    return ctl.world_mesh({"x": len(ctl.worker_ranks)}, kind=kind)


def each_rank(ctl):
    return range(len(ctl.worker_ranks))


def test_the_same_torch_kernels_run_on_every_kind():
    def main(ctl):
        for kind in kinds(ctl):
            mesh = mesh_of(ctl, kind)
            x = mesh.call("meshrt.full", (3, 4), meshrt.float32, 1.0)
            assert x.meta.device.type == kind, x.meta
            y = mesh.call("torchk.scale", x, 3.0)
            mesh.call("torchk.add_", y, x)  # in place: 3 + 1
            a = mesh.call("torchk.arange", 5)
            flags = mesh.call("torchk.not", mesh.call("meshrt.full", (4,), meshrt.bool_, True))
            b = mesh.call("torchk.bf16_double", mesh.call("meshrt.full", (2,), meshrt.bfloat16, 1.5))
            for r in each_rank(ctl):
                np.testing.assert_array_equal(fetch(ctl, y, x=r).numpy(), np.full((3, 4), 4, np.float32))
                np.testing.assert_array_equal(fetch(ctl, a, x=r).numpy(), np.arange(5, dtype=np.float32) + r)
                assert fetch(ctl, flags, x=r).numpy().tolist() == [False] * 4, kind
                assert torch.equal(torch.from_dlpack(fetch(ctl, b, x=r)), torch.full((2,), 3.0, dtype=torch.bfloat16))
        ctl.synchronize(timeout=60)

    meshrt.run(main)


def test_later_work_waits_for_a_kernels_device_work():
    def main(ctl):
        for kind in kinds(ctl):
            mesh = mesh_of(ctl, kind)
            v = mesh.call("torchk.slow_fill", 1 << 16, 2.5)
            w = mesh.call("torchk.scale", mesh.call("torchk.slow_fill", 1 << 16, 1.5), 2.0)
            for r in each_rank(ctl):
                assert set(fetch(ctl, v, x=r).numpy().tolist()) == {2.5}, kind
                assert set(fetch(ctl, w, x=r).numpy().tolist()) == {3.0}, kind
            h = mesh.call("meshrt.zeros", [1 << 16], meshrt.float32)
            z = mesh.call("torchk.handoff", h)
            for r in each_rank(ctl):
                assert set(fetch(ctl, h, x=r).numpy().tolist()) == {5.0}, kind
                assert set(fetch(ctl, z, x=r).numpy().tolist()) == {10.0}, kind

    meshrt.run(main)


def test_outputs_are_taken_without_a_copy_on_cuda_and_memory_is_kept_both_ways():
    def main(ctl):
        for kind in kinds(ctl):
            mesh = mesh_of(ctl, kind)
            n = 1 << 18
            t = mesh.call("torchk.make", n)
            seen = mesh.call("torchk.address", t)
            # torch's own memory, taken as it is, on cpu and cuda; copied on emulated (a
            # kernel's outputs there are made on the stream and filled from its results).
            assert (int(fetch(ctl, seen, x=0).item()) == made[0]) == (kind != "emulated"), kind
            # Both caches emptied and refilled: the output torch made, which meshrt holds,
            # and (cuda) meshrt's memory that a kernel kept a torch view of, are intact.
            if kind == "cuda":
                src = mesh.call("meshrt.full", [n], meshrt.float32, 4.0)
                mesh.call("torchk.keep", src)
                del src  # meshrt's handle goes: the kept torch view holds the storage
            ctl.release_cached_memory()
            mesh.call("torchk.churn", n)
            fill = [mesh.call("meshrt.full", [n], meshrt.float32, -2.0) for _ in range(8)]
            for r in each_rank(ctl):
                assert set(fetch(ctl, t, x=r).numpy().tolist()) == {7.0}, kind
            if kind == "cuda":
                back = mesh.call("torchk.read_kept", n)
                for r in each_rank(ctl):
                    assert set(fetch(ctl, back, x=r).numpy().tolist()) == {4.0}
            del fill
        ctl.synchronize(timeout=60)

    meshrt.run(main)


def test_what_a_cuda_mesh_refuses():
    def main(ctl):
        if "cuda" not in kinds(ctl):
            pytest.skip("needs a job whose accelerator is cuda (MESHRT_ACCELERATOR=cuda on GPUs)")
        mesh = mesh_of(ctl, "cuda")
        x = mesh.call("meshrt.full", (2,), meshrt.float32, 1.0)
        with pytest.raises(meshrt.UsageError, match="torchk.numpy_scale: expected a mesh on the cpu or the emulated "
                                                    "accelerator for a numpy kernel, found one on cuda:"):
            mesh.call("torchk.numpy_scale", x, 2.0)
        y = mesh.call("torchk.cpu_output", 2)
        with pytest.raises(meshrt.RemoteError, match=r"torchk.cpu_output returned on rank 0 as output 0 float32\[2\] "
                                                     r"on cpu: expected a tensor on the rank's GPU cuda:"):
            fetch(ctl, y, x=0)
        ctl.synchronize(timeout=60)

    meshrt.run(main)


def test_a_cuda_mesh_needs_torch_with_cuda():
    # Asked as the controller and every worker ask it, whatever this job's accelerator.
    cuda = meshrt.TensorMeta((2,), meshrt.float32, "cuda:0")
    if torch.cuda.is_available():
        assert meshrt._core._infer("torchk.scale", "cuda:0", cuda, 2.0).outputs == (cuda,)
    else:
        with pytest.raises(meshrt.UsageError, match=(
                r"torchk.scale on cuda:0: a torch kernel on a CUDA mesh needs torch with CUDA, found torch "
                + torch.__version__.replace(".", r"\.").replace("+", r"\+")
                + r" whose torch.cuda.is_available\(\) is False.*; install a CUDA build of torch, or place the mesh on "
                r"the cpu or the emulated accelerator")):
            meshrt._core._infer("torchk.scale", "cuda:0", cuda, 2.0)
    with pytest.raises(meshrt.UsageError, match="torchk.numpy_scale: expected a mesh on the cpu or the emulated "
                                                r"accelerator for a numpy kernel, found one on cuda:0: .*torch=True"):
        meshrt._core._infer("torchk.numpy_scale", "cuda:0", cuda, 2.0)
    host = meshrt.TensorMeta((2,), meshrt.float32)
    assert meshrt._core._infer("torchk.scale", "cpu", host, 2.0).outputs == (host,)
