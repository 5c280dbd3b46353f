"""What a Python kernel may and may not do (2 ranks), each case a bug a user met: a torch
kernel's inputs are read-only unless declared mutated, bfloat16 reaches torch kernels, a
kernel's output is never its input's memory, a rank-0 kernel cannot drive the controller
nor hold the controller's deadlines hostage, and a stuck Python kernel's stack is in the
desync report."""
import ctypes
import re

import numpy as np
import pytest
import torch

import meshrt


def same(x):
    return x


@meshrt.function("rules.torch_add_100", shape=same, torch=True)
def torch_add_100(ctx, x):
    x.add_(100)  # in place, although the shape function does not declare x mutated
    return x.clone()


@meshrt.function("rules.torch_identity", shape=same, torch=True)
def torch_identity(ctx, x):
    return x  # its input's own memory


@meshrt.function("rules.numpy_view", shape=lambda x: meshrt.TensorMeta((x.numel,), x.dtype))
def numpy_view(ctx, x):
    return x.reshape(-1)  # a view of the input


@meshrt.function("rules.torch_bf16_double", shape=same, torch=True)
def torch_bf16_double(ctx, x):
    assert x.dtype == torch.bfloat16, x.dtype
    return x * 2


def hold_shape(seconds):
    return meshrt.TensorMeta((), meshrt.float32)


@meshrt.function("rules.hold_the_gil", shape=hold_shape)
def hold_the_gil(ctx, seconds):
    # libc's sleep through ctypes.PyDLL keeps the GIL, as a C extension that never lets it
    # go does.
    if ctx.rank == 0:
        ctypes.PyDLL(None).sleep(seconds)
    return np.zeros((), np.float32)


def fetch(ctl, t, **coords):
    return ctl.fetch_shard(t, **coords).result(timeout=30).numpy()


def test_a_torch_kernel_that_writes_an_input_it_did_not_declare_fails_naming_it():
    def main(ctl):
        mesh = ctl.world_mesh({"x": 2})
        x = mesh.call("meshrt.full", (4,), meshrt.float32, 1.0)
        y = mesh.call("rules.torch_add_100", x)
        with pytest.raises(meshrt.RemoteError) as e:
            fetch(ctl, y, x=1)
        text = str(e.value)
        assert "rules.torch_add_100" in text and "argument 0" in text and "in place" in text, text
        ctl.synchronize(timeout=30)  # the failure was reported (by the fetch) and nothing else failed
        # Work that does not depend on it goes on.
        z = mesh.call("meshrt.full", (4,), meshrt.float32, 2.0)
        np.testing.assert_array_equal(fetch(ctl, z, x=0), np.full(4, 2, np.float32))

    meshrt.run(main)


def test_a_kernel_output_that_is_its_inputs_memory_is_refused():
    def main(ctl):
        mesh = ctl.world_mesh({"x": 2})
        x = mesh.call("meshrt.full", (2, 2), meshrt.float32, 1.0)
        y = mesh.call("rules.torch_identity", x)
        with pytest.raises(meshrt.RemoteError) as e:
            fetch(ctl, y, x=0)
        assert "rules.torch_identity" in str(e.value) and "argument 0" in str(e.value), str(e.value)
        # The input is unharmed, and an in-place update of it changes nothing else.
        x.reduce_("x", "sum")
        np.testing.assert_array_equal(fetch(ctl, x, x=1), np.full((2, 2), 2, np.float32))
        ctl.synchronize(timeout=30)

    meshrt.run(main)


def test_a_numpy_view_of_a_read_only_input_becomes_a_value_of_its_own():
    def main(ctl):
        mesh = ctl.world_mesh({"x": 2})
        x = mesh.call("meshrt.full", (2, 2), meshrt.float32, 1.0)
        y = mesh.call("rules.numpy_view", x)  # numpy's input views are read-only: the view is copied
        x.reduce_("x", "sum")
        np.testing.assert_array_equal(fetch(ctl, y, x=0), np.ones(4, np.float32))
        np.testing.assert_array_equal(fetch(ctl, x, x=0), np.full((2, 2), 2, np.float32))
        ctl.synchronize(timeout=30)

    meshrt.run(main)


def test_bfloat16_reaches_a_torch_kernel():
    def main(ctl):
        mesh = ctl.world_mesh({"x": 2})
        x = mesh.call("meshrt.full", (3,), meshrt.bfloat16, 1.5)
        y = mesh.call("rules.torch_bf16_double", x)
        got = torch.from_dlpack(ctl.fetch_shard(y, x=1).result(timeout=30))
        assert got.dtype == torch.bfloat16 and got.tolist() == [3.0, 3.0, 3.0], got
        ctl.synchronize(timeout=30)

    meshrt.run(main)


def test_controller_objects_come_from_run():
    with pytest.raises(meshrt.UsageError, match=r"meshrt.run\(main\) passes one to main"):
        meshrt.Controller()


def test_a_rank0_kernel_holding_the_gil_does_not_hold_the_deadline():
    def main(ctl):
        mesh = ctl.world_mesh({"x": 2})
        y = mesh.call("rules.hold_the_gil", 4)
        with pytest.raises(meshrt.TimeoutError) as e:
            ctl.fetch_shard(y, x=0).result(timeout=1)
        text = str(e.value)
        assert "has finished it" not in text and "rank 0 is behind: running rules.hold_the_gil" in text, text
        # The desync report shows where rank 0's Python kernel is, and the controller: their
        # Python stacks.
        assert re.search(r"Python stack of the kernel:\n.*\n.*line \d+ in hold_the_gil", text), text
        assert re.search(r"Python stack of the controller:\n.*\n.*line \d+ in main", text), text
        ctl.synchronize(timeout=30)

    meshrt.run(main)


CAPTURED = {}


@meshrt.function("rules.call_the_controller", shape=hold_shape)
def call_the_controller(ctx, seconds):
    if ctx.rank == 0:
        CAPTURED["ctl"].synchronize(timeout=seconds)  # a kernel driving the controller
    return np.zeros((), np.float32)


@pytest.mark.parametrize("kind", ["cpu", "emulated"])
def test_a_rank0_kernel_that_calls_the_controller_gets_a_usage_error(kind):
    def main(ctl):
        CAPTURED["ctl"] = ctl
        mesh = ctl.world_mesh({"x": 2}, kind=kind)
        y = mesh.call("rules.call_the_controller", 10)
        with pytest.raises(meshrt.RemoteError) as e:
            ctl.fetch_shard(y, x=0).result(timeout=30)
        assert "a kernel cannot drive the controller" in str(e.value), str(e.value)
        # The controller is not left stuck: later calls and waits work.
        z = mesh.call("meshrt.full", (2,), meshrt.float32, 3.0)
        ctl.synchronize(timeout=10)
        assert ctl.fetch_shard(z, x=1).result(timeout=30).numpy().tolist() == [3.0, 3.0]

    meshrt.run(main)
