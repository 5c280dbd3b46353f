"""meshrt.Tensor and DLPack: numpy and torch view meshrt tensors and meshrt views theirs
without a copy (asserted by address) for every dtype; the buffer protocol; the refusals
and their messages; lifetimes when the producer goes first. No MPI needed."""
import array
import ctypes
import gc
import weakref

import numpy as np
import pytest
import torch

import meshrt

# numpy has no bfloat16: it is covered with torch only.
NUMPY = [
    (np.bool_, meshrt.bool_),
    (np.uint8, meshrt.uint8),
    (np.int32, meshrt.int32),
    (np.int64, meshrt.int64),
    (np.float16, meshrt.float16),
    (np.float32, meshrt.float32),
    (np.float64, meshrt.float64),
]
TORCH = [
    (torch.bool, meshrt.bool_),
    (torch.uint8, meshrt.uint8),
    (torch.int32, meshrt.int32),
    (torch.int64, meshrt.int64),
    (torch.float16, meshrt.float16),
    (torch.bfloat16, meshrt.bfloat16),
    (torch.float32, meshrt.float32),
    (torch.float64, meshrt.float64),
]
ALL_DTYPES = [m for _, m in TORCH]


def address(a):
    return a.__array_interface__["data"][0]


def sample(dtype, shape=(3, 4)):
    n = int(np.prod(shape))
    if dtype == np.bool_:
        return (np.arange(n) % 3 == 0).reshape(shape)
    return np.arange(1, n + 1).astype(dtype).reshape(shape)


def torch_sample(dtype, shape=(3, 4)):
    n = int(np.prod(shape))
    if dtype == torch.bool:
        return (torch.arange(n) % 3 == 0).reshape(shape)
    return torch.arange(1, n + 1).to(dtype).reshape(shape)


def meshrt_owned(dtype, shape=(3, 4)):
    """A tensor in meshrt's own storage, filled 1, 2, 3, ... (bool: every third true)."""
    t = meshrt.TensorMeta(shape, dtype).zeros()
    view = torch.from_dlpack(t)  # uint8 for bool (torch 1.13 takes no kDLBool)
    n = view.numel()
    values = (torch.arange(n) % 3 == 0) if dtype == meshrt.bool_ else torch.arange(1, n + 1)
    view.copy_(values.to(view.dtype).reshape(view.shape))
    return t


def numpy_dtype(dtype):
    return np.dtype("bool" if dtype == meshrt.bool_ else str(dtype))


# ---------------------------------------------------------------- numpy


@pytest.mark.parametrize("np_dtype,dtype", NUMPY, ids=[str(m) for _, m in NUMPY])
def test_numpy_array_becomes_a_tensor_without_a_copy(np_dtype, dtype):
    a = sample(np_dtype)
    t = meshrt.from_dlpack(a)
    assert t.data_ptr == address(a)
    assert (t.dtype, t.shape, t.device) == (dtype, (3, 4), meshrt.Device("cpu"))
    assert t.meta == meshrt.TensorMeta((3, 4), dtype)
    assert t.nbytes == a.nbytes
    a[0, 0] = a[1, 1]  # the tensor sees the array's writes
    view = t.numpy()
    assert address(view) == t.data_ptr
    assert view.dtype == a.dtype
    np.testing.assert_array_equal(view, a)
    assert meshrt.Tensor(a).data_ptr == address(a)
    assert meshrt.Tensor.from_dlpack(a).data_ptr == address(a)


@pytest.mark.parametrize("dtype", [m for _, m in NUMPY], ids=[str(m) for _, m in NUMPY])
def test_numpy_views_a_tensor_without_a_copy(dtype):
    t = meshrt_owned(dtype)
    a = t.numpy()
    assert address(a) == t.data_ptr
    assert a.dtype == numpy_dtype(dtype)
    assert address(np.asarray(t)) == t.data_ptr
    d = np.from_dlpack(t)
    assert address(d) == t.data_ptr
    # bool leaves DLPack as uint8 (numpy 1.24 takes no kDLBool); .numpy() keeps it bool.
    assert d.dtype == (np.uint8 if dtype == meshrt.bool_ else numpy_dtype(dtype))
    np.testing.assert_array_equal(d, a.astype(d.dtype))
    a[2, 3] = a[0, 0]
    assert d[2, 3] == d[0, 0]


def test_numpy_memory_at_element_alignment():
    base = np.arange(17, dtype=np.float64)
    a = base[1:]  # 8 bytes past numpy's 16-byte aligned block
    t = meshrt.from_dlpack(a)
    assert t.data_ptr == address(a)
    assert t.data_ptr % 16 == 8
    assert t.clone().equals(t)
    assert t.clone().data_ptr != t.data_ptr
    np.testing.assert_array_equal(t.numpy(), np.arange(1, 17))


def test_numpy_zero_dim_and_empty():
    t = meshrt.from_dlpack(np.array(3.5, np.float32))
    assert t.shape == () and t.item() == 3.5
    with pytest.raises(TypeError, match="0-d"):
        len(t)
    e = meshrt.from_dlpack(np.zeros((0, 3), np.int32))
    assert e.shape == (0, 3) and e.nbytes == 0 and len(e) == 0
    assert np.from_dlpack(e).shape == (0, 3)


# ---------------------------------------------------------------- torch


@pytest.mark.parametrize("torch_dtype,dtype", TORCH, ids=[str(m) for _, m in TORCH])
def test_torch_tensor_becomes_a_tensor_without_a_copy(torch_dtype, dtype):
    tt = torch_sample(torch_dtype)
    t = meshrt.from_dlpack(tt)
    assert t.data_ptr == tt.data_ptr()
    assert (t.dtype, t.shape) == (dtype, (3, 4))
    tt[0, 0] = tt[1, 1]
    back = torch.from_dlpack(t)
    assert back.data_ptr() == tt.data_ptr()
    if torch_dtype == torch.bool:
        assert back.dtype == torch.uint8  # bool leaves DLPack as uint8
        back = back.bool()
    assert back.dtype == torch_dtype
    assert torch.equal(back, tt)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=[str(m) for m in ALL_DTYPES])
def test_torch_views_a_tensor_without_a_copy(dtype):
    t = meshrt_owned(dtype)
    tt = torch.from_dlpack(t)
    assert tt.data_ptr() == t.data_ptr
    assert tuple(tt.shape) == t.shape
    tt[2, 3] = tt[0, 0]
    assert torch.equal(torch.from_dlpack(t)[2, 3], tt[0, 0])
    if dtype == meshrt.bfloat16:
        assert tt.dtype == torch.bfloat16


def test_meshrt_round_trip_keeps_the_storage_and_bool():
    t = meshrt_owned(meshrt.bool_)
    back = meshrt.from_dlpack(t)
    assert back.same_storage(t) and back.dtype == meshrt.bool_
    assert meshrt.Tensor(t).same_storage(t)


def test_torch_empty_tensor_has_no_address():
    tt = torch.empty((0, 3), dtype=torch.float32)
    assert tt.data_ptr() == 0
    t = meshrt.from_dlpack(tt)
    assert t.shape == (0, 3) and t.nbytes == 0
    assert t.clone().equals(t)


# ---------------------------------------------------------------- the buffer protocol


def test_writable_buffers_are_viewed():
    ba = bytearray(b"\x01\x02\x03\x04")
    t = meshrt.from_dlpack(ba)
    assert t.data_ptr == ctypes.addressof((ctypes.c_char * len(ba)).from_buffer(ba))
    assert (t.dtype, t.shape) == (meshrt.uint8, (4,))
    ba[0] = 9
    assert t.numpy()[0] == 9
    arr = array.array("d", [1.0, 2.0, 3.0])
    t = meshrt.Tensor(arr)
    assert t.data_ptr == arr.buffer_info()[0]
    assert (t.dtype, t.shape) == (meshrt.float64, (3,))
    m = memoryview(bytearray(8)).cast("i")
    assert meshrt.Tensor(m).dtype == meshrt.int32


def test_read_only_memory_is_copied():
    data = b"\x01\x02\x03"
    t = meshrt.from_dlpack(data)
    assert (t.dtype, t.shape) == (meshrt.uint8, (3,))
    np.testing.assert_array_equal(t.numpy(), [1, 2, 3])
    a = np.arange(4, dtype=np.int64)
    a.setflags(write=False)
    t = meshrt.from_dlpack(a)
    assert t.data_ptr != address(a)
    np.testing.assert_array_equal(t.numpy(), a)


# ---------------------------------------------------------------- refusals


def test_refusals_name_what_was_found():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    with pytest.raises(meshrt.UsageError, match=r"found strides \[1, 4\]; make it contiguous first \(numpy\.ascontiguousarray"):
        meshrt.from_dlpack(a.T)
    with pytest.raises(meshrt.UsageError, match=r"numpy\.ascontiguousarray"):
        meshrt.from_dlpack(a[:, ::2])
    assert meshrt.from_dlpack(np.ascontiguousarray(a[:, ::2])).shape == (3, 2)
    with pytest.raises(meshrt.UsageError, match="found complex64"):
        meshrt.from_dlpack(np.zeros(2, np.complex64))
    with pytest.raises(meshrt.UsageError, match="found int8"):
        meshrt.from_dlpack(np.zeros(2, np.int8))
    with pytest.raises(meshrt.UsageError, match="found int16"):
        meshrt.from_dlpack(torch.zeros(2, dtype=torch.int16))
    with pytest.raises(meshrt.UsageError, match="found format 'b'"):
        meshrt.from_dlpack(array.array("b", [1, 2]))
    with pytest.raises(meshrt.UsageError, match="detach"):
        meshrt.from_dlpack(torch.zeros(2, requires_grad=True))
    with pytest.raises(meshrt.UsageError, match="expected a tensor .* found str"):
        meshrt.from_dlpack("not a tensor")


def test_bfloat16_has_no_numpy_view():
    t = meshrt_owned(meshrt.bfloat16)
    with pytest.raises(meshrt.UsageError, match="numpy has no bfloat16: torch.from_dlpack"):
        t.numpy()


def test_emulated_memory_is_not_host_readable():
    t = meshrt.TensorMeta((2, 3), meshrt.float32, "emulated:1").zeros()
    assert t.__dlpack_device__() == (12, 1)  # kDLExtDev
    with pytest.raises(RuntimeError, match="device"):
        np.from_dlpack(t)
    with pytest.raises(RuntimeError, match="device"):
        torch.from_dlpack(t)
    with pytest.raises(meshrt.UsageError, match="cannot read an accelerator's memory"):
        t.numpy()
    with pytest.raises(meshrt.UsageError, match="cannot read an accelerator's memory"):
        np.asarray(t)
    assert "values in device memory" in repr(t)
    assert meshrt.from_dlpack(t).same_storage(t)
    host = t.to("cpu")
    np.testing.assert_array_equal(host.numpy(), np.zeros((2, 3), np.float32))


# ---------------------------------------------------------------- lifetimes


def test_numpy_producer_goes_first():
    a = sample(np.int64)
    expected = a.copy()
    ref = weakref.ref(a)
    t = meshrt.from_dlpack(a)
    del a
    gc.collect()
    assert ref() is not None, "the tensor keeps the array alive"
    np.testing.assert_array_equal(t.numpy(), expected)
    del t
    gc.collect()
    assert ref() is None, "the last handle released the array"


def test_torch_producer_goes_first():
    tt = torch_sample(torch.float32)
    expected = tt.clone()
    t = meshrt.from_dlpack(tt)
    del tt
    gc.collect()
    assert torch.equal(torch.from_dlpack(t), expected)


def test_meshrt_producer_goes_first():
    t = meshrt_owned(meshrt.float64)
    ref = weakref.ref(t)
    a, tt, view = np.from_dlpack(t), torch.from_dlpack(t), t.numpy()
    del t
    gc.collect()
    assert ref() is None
    expected = np.arange(1, 13, dtype=np.float64).reshape(3, 4)
    np.testing.assert_array_equal(a, expected)
    np.testing.assert_array_equal(view, expected)
    assert torch.equal(tt, torch.from_numpy(expected))


def test_capsule_deleter_runs_only_when_not_consumed():
    a = sample(np.float32)
    ref = weakref.ref(a)
    t = meshrt.from_dlpack(a)
    del a
    capsule = t.__dlpack__()
    del t
    gc.collect()
    assert ref() is not None, "the unconsumed capsule holds the storage"
    del capsule  # never consumed: its destructor calls the deleter
    gc.collect()
    assert ref() is None

    a = sample(np.float32)
    ref = weakref.ref(a)
    t = meshrt.from_dlpack(a)
    del a
    capsule = t.__dlpack__()
    del t
    tt = torch.utils.dlpack.from_dlpack(capsule)  # consumes it: renamed used_dltensor
    del capsule
    gc.collect()
    assert ref() is not None, "torch owns the DLManagedTensor now"
    assert float(tt[2, 3]) == 12.0
    del tt
    gc.collect()
    assert ref() is None


# ---------------------------------------------------------------- properties


def test_properties_item_clone_repr():
    t = meshrt.from_dlpack(np.arange(12, dtype=np.float32).reshape(3, 4))
    assert (t.ndim, t.numel, len(t)) == (2, 12, 3)
    assert t.__dlpack_device__() == (1, 0)
    assert repr(t).startswith("Tensor(float32[3, 4] on cpu:")
    c = t.clone()
    assert c.equals(t) and not c.same_storage(t) and c.data_ptr != t.data_ptr
    assert meshrt.from_dlpack(np.array(2**53 + 1, np.int64)).item() == 2**53 + 1
    assert meshrt.from_dlpack(np.array(True)).item() is True
    assert meshrt.from_dlpack(torch.tensor(1.5, dtype=torch.bfloat16)).item() == 1.5
    with pytest.raises(meshrt.UsageError, match="expected one element"):
        t.item()
    r = t.reshape((4, 3))
    assert r.same_storage(t) and r.shape == (4, 3)
