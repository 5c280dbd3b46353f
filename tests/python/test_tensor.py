"""meshrt.Tensor and DLPack: numpy and torch view meshrt tensors and meshrt views theirs
without a copy (asserted by address) for every dtype; the buffer protocol; the refusals
and their messages; lifetimes when the producer goes first. No MPI needed."""
import array
import ctypes
import gc
import sys
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


# ---------------------------------------------------------------- copies where a view cannot be


STRIDED = {
    "transpose": lambda a: a.T,
    "stepped": lambda a: a[:, ::2],
    "reversed": lambda a: a[::-1],
    "column": lambda a: a[:, 1],
}


@pytest.mark.parametrize("make", list(STRIDED.values()), ids=list(STRIDED))
def test_strided_memory_is_copied_unless_copy_false(make):
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    view = make(a)
    for convert in (meshrt.from_dlpack, meshrt.Tensor, meshrt.Tensor.from_dlpack):
        t = convert(view)
        assert t.shape == view.shape
        np.testing.assert_array_equal(t.numpy(), np.ascontiguousarray(view))
        a += 1  # the copy has memory of its own
        assert not np.array_equal(t.numpy(), np.ascontiguousarray(view))
    with pytest.raises(BufferError, match=r"meshrt.from_dlpack: expected memory meshrt can view \(contiguous, row-major, "
                                          r"writable: kernels may write a tensor\) with copy=False, found strided memory "
                                          r"\(not contiguous and row-major\) from ndarray; pass copy=None"):
        meshrt.from_dlpack(view, copy=False)
    with pytest.raises(BufferError, match=r"meshrt.Tensor\(obj\): .*found strided memory"):
        meshrt.Tensor(view, copy=False)


def test_strided_torch_tensors_and_buffers_are_copied():
    tt = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    for view in (tt.t(), tt[:, ::2], tt[:, 1]):
        t = meshrt.from_dlpack(view)
        assert t.data_ptr != tt.data_ptr()
        assert torch.equal(torch.from_dlpack(t), view.contiguous())
        with pytest.raises(BufferError, match="found strided memory"):
            meshrt.from_dlpack(view, copy=False)
    buf = memoryview(np.arange(6, dtype=np.float32))[::2]  # the buffer protocol's way in
    assert not hasattr(buf, "__dlpack__")
    np.testing.assert_array_equal(meshrt.from_dlpack(buf).numpy(), [0, 2, 4])
    with pytest.raises(BufferError, match=r"found strided memory \(not contiguous and row-major\) in a memoryview of "
                                          r"float32\[3\] on cpu"):
        meshrt.from_dlpack(buf, copy=False)


def test_copy_true_always_copies_and_copy_false_views():
    a = sample(np.int32)
    c = meshrt.from_dlpack(a, copy=True)
    assert c.data_ptr != address(a) and np.array_equal(c.numpy(), a)
    assert meshrt.from_dlpack(a, copy=False).data_ptr == address(a)
    assert meshrt.Tensor(a, copy=True).data_ptr != address(a)
    ba = bytearray(b"\x01\x02")
    assert meshrt.from_dlpack(ba, copy=True).numpy().tolist() == [1, 2]
    m = meshrt.from_dlpack(a)
    assert meshrt.from_dlpack(m).same_storage(m)
    assert not meshrt.from_dlpack(m, copy=True).same_storage(m)
    ro = np.arange(4.0)
    ro.setflags(write=False)
    with pytest.raises(BufferError, match="copy=False, found read-only memory in a ndarray of float64"):
        meshrt.from_dlpack(ro, copy=False)
    with pytest.raises(TypeError, match="expected copy=None, True or False, found 'yes'"):
        meshrt.from_dlpack(a, copy="yes")


def test_device_argument_copies_to_that_device():
    host = meshrt.from_dlpack(sample(np.float32))
    dev = meshrt.from_dlpack(host, device="emulated:1")
    assert dev.device == meshrt.Device("emulated:1")
    back = meshrt.from_dlpack(dev, device=meshrt.Device("cpu"))
    np.testing.assert_array_equal(back.numpy(), sample(np.float32))
    assert meshrt.from_dlpack(np.asarray(host), device="emulated:0").device == meshrt.Device("emulated:0")
    assert meshrt.from_dlpack(host, device="cpu").same_storage(host)
    with pytest.raises(BufferError, match="expected a tensor on emulated:0 without a copy .copy=False., found float32"):
        meshrt.from_dlpack(host, device="emulated:0", copy=False)


# ---------------------------------------------------------------- DLPack 1.0, read through ctypes


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", _DLPackVersion), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER),
                ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]


READ_ONLY, IS_COPIED = 1, 2
_api = ctypes.pythonapi
_api.PyCapsule_GetName.restype = ctypes.c_char_p
_api.PyCapsule_GetName.argtypes = [ctypes.py_object]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
# A capsule keeps the pointer to its name: these stay alive with the module.
_NAMES = {n: ctypes.c_char_p(n) for n in (b"dltensor", b"used_dltensor", b"dltensor_versioned",
                                          b"used_dltensor_versioned")}


def capsule_name(capsule):
    return _api.PyCapsule_GetName(capsule).decode()


def versioned_struct(capsule):
    assert capsule_name(capsule) == "dltensor_versioned"
    return _DLManagedTensorVersioned.from_address(_api.PyCapsule_GetPointer(capsule, _NAMES[b"dltensor_versioned"]))


def consume(capsule):
    """What a DLPack 1.0 consumer does: rename the capsule, then call the deleter, once."""
    m = versioned_struct(capsule)
    _api.PyCapsule_SetName(capsule, _NAMES[b"used_dltensor_versioned"])
    m.deleter(ctypes.addressof(m))


def test_max_version_picks_the_capsule():
    t = meshrt.from_dlpack(sample(np.float32))
    assert capsule_name(t.__dlpack__()) == "dltensor"
    assert capsule_name(t.__dlpack__(max_version=None)) == "dltensor"
    assert capsule_name(t.__dlpack__(max_version=(0, 8))) == "dltensor"
    for asked in ((1, 0), (1, 3), (2, 0)):
        capsule = t.__dlpack__(max_version=asked)  # alive while its struct is read
        m = versioned_struct(capsule)
        assert (m.version.major, m.version.minor) == (1, 0), asked
    with pytest.raises(TypeError, match=r"expected max_version as a \(major, minor\) pair of ints or None, found '1.0'"):
        t.__dlpack__(max_version="1.0")
    # A bare number is meshrt's TypeError too, not Python's about iterating it.
    for bad in (1, 1.0, (1, 0, 0), (1.0, 0), (True, 0)):
        with pytest.raises(TypeError, match=r"expected max_version as a \(major, minor\) pair of ints"):
            t.__dlpack__(max_version=bad)
        with pytest.raises(TypeError, match=r"expected dl_device as a \(device type, device id\) pair of ints"):
            t.__dlpack__(dl_device=bad)
    # The keywords are the array API's: stream may come by position, the others by name.
    assert capsule_name(t.__dlpack__(None)) == "dltensor"
    with pytest.raises(TypeError):
        t.__dlpack__(None, (1, 0))


@pytest.mark.parametrize("dtype,code,bits", [(meshrt.float32, 2, 32), (meshrt.bool_, 6, 8), (meshrt.bfloat16, 4, 16),
                                             (meshrt.int64, 0, 64), (meshrt.uint8, 1, 8)],
                         ids=["float32", "bool", "bfloat16", "int64", "uint8"])
def test_versioned_capsule_describes_the_tensor(dtype, code, bits):
    t = meshrt_owned(dtype, (2, 3))
    capsule = t.__dlpack__(max_version=(1, 0))
    m = versioned_struct(capsule)
    d = m.dl_tensor
    assert m.flags == 0, "a view, writable"
    assert (d.device.device_type, d.device.device_id) == (1, 0)
    assert d.data == t.data_ptr and d.byte_offset == 0
    assert (d.dtype.code, d.dtype.bits, d.dtype.lanes) == (code, bits, 1)
    assert d.ndim == 2 and [d.shape[i] for i in range(2)] == [2, 3] and [d.strides[i] for i in range(2)] == [3, 1]
    # The unversioned capsule keeps bool as uint8 (numpy 1.24 and torch 1.13 take no kDLBool).
    unversioned = t.__dlpack__()
    legacy = _DLManagedTensor.from_address(_api.PyCapsule_GetPointer(unversioned, _NAMES[b"dltensor"]))
    assert legacy.dl_tensor.dtype.code == (1 if dtype == meshrt.bool_ else code)


def test_versioned_zero_dim_and_empty():
    for shape in ((), (0, 4)):
        t = meshrt.TensorMeta(shape, meshrt.float64).zeros()
        capsule = t.__dlpack__(max_version=(1, 0))
        d = versioned_struct(capsule).dl_tensor
        assert d.ndim == len(shape) and [d.shape[i] for i in range(d.ndim)] == list(shape)


def test_copy_and_dl_device_in_export():
    t = meshrt.from_dlpack(sample(np.float32))
    capsules = [t.__dlpack__(max_version=(1, 0), copy=c) for c in (True, False)]
    copied, viewed = (versioned_struct(c) for c in capsules)
    assert copied.flags == IS_COPIED and copied.dl_tensor.data != t.data_ptr
    assert viewed.flags == 0 and viewed.dl_tensor.data == t.data_ptr
    capsules.append(t.__dlpack__(max_version=(1, 0), dl_device=(1, 0), copy=False))
    same = versioned_struct(capsules[-1])
    assert same.flags == 0 and same.dl_tensor.data == t.data_ptr
    e = meshrt.from_dlpack(t, device="emulated:2")
    assert e.__dlpack_device__() == (12, 2)
    capsules.append(e.__dlpack__(max_version=(1, 0), dl_device=(1, 0)))
    host = versioned_struct(capsules[-1])
    assert host.flags == IS_COPIED and (host.dl_tensor.device.device_type, host.dl_tensor.device.device_id) == (1, 0)
    values = np.ctypeslib.as_array(ctypes.cast(host.dl_tensor.data, ctypes.POINTER(ctypes.c_float)), shape=(3, 4))
    np.testing.assert_array_equal(values, sample(np.float32))
    # An unversioned capsule takes the same requests (it has no flags to say so).
    assert capsule_name(e.__dlpack__(dl_device=(1, 0))) == "dltensor"
    with pytest.raises(BufferError, match=r"of float32\[3, 4\] on emulated:2: dl_device \(1, 0\) needs a copy to cpu, "
                                          r"and copy=False forbids one"):
        e.__dlpack__(dl_device=(1, 0), copy=False)
    with pytest.raises(BufferError, match="expected dl_device on kDLCPU .1., kDLCUDA .2. or kDLExtDev .12, meshrt's "
                                          "emulated accelerator., found device type 10"):
        t.__dlpack__(dl_device=(10, 0))
    with pytest.raises(TypeError, match="expected dl_device as a .device type, device id. pair of ints, found 'cpu'"):
        t.__dlpack__(dl_device="cpu")
    with pytest.raises(ValueError, match=r"expected stream=None \(DLPack's streams are CUDA's\), found stream=7"):
        t.__dlpack__(stream=7)
    assert capsule_name(t.__dlpack__(stream=-1)) == "dltensor"
    np.testing.assert_array_equal(np.from_dlpack(e.to("cpu")), sample(np.float32))


def test_versioned_deleter_runs_exactly_once():
    # Not consumed: the capsule's destructor releases the storage (the numpy producer).
    a = sample(np.float32)
    before = sys.getrefcount(a)
    t = meshrt.from_dlpack(a)
    assert sys.getrefcount(a) == before + 1, "the view holds the array"
    capsule = t.__dlpack__(max_version=(1, 0))
    del t
    gc.collect()
    assert sys.getrefcount(a) == before + 1, "the capsule holds the storage"
    del capsule
    gc.collect()
    assert sys.getrefcount(a) == before, "the capsule's destructor ran the deleter"
    # Consumed: the consumer renames it and calls the deleter; the capsule's destructor
    # then leaves it alone (a second run would free the export twice).
    t = meshrt.from_dlpack(a)
    capsule = t.__dlpack__(max_version=(1, 0))
    del t
    consume(capsule)
    assert capsule_name(capsule) == "used_dltensor_versioned"
    gc.collect()
    assert sys.getrefcount(a) == before, "the consumer's deleter released the storage"
    del capsule
    gc.collect()
    assert sys.getrefcount(a) == before


class _Producer:
    """A DLPack producer of any capsule, recording how it was asked."""

    def __init__(self, capsule, versioned=True):
        self.capsule, self.versioned, self.calls = capsule, versioned, []

    def __dlpack__(self, **kwargs):
        self.calls.append(kwargs)
        if not self.versioned and "max_version" in kwargs:
            raise TypeError("__dlpack__() got an unexpected keyword argument 'max_version'")
        return self.capsule

    def __dlpack_device__(self):
        return (1, 0)


class _Versioned:
    """A DLPack 1.0 producer in ctypes: a float64 array, flags and version of our choosing,
    a deleter that counts its runs."""

    def __init__(self, flags=0, major=1, shape=(2, 3)):
        self.array = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape)
        self.shape = (ctypes.c_int64 * len(shape))(*shape)
        self.deleted = 0
        self.deleter = _DELETER(self._delete)
        m = self.managed = _DLManagedTensorVersioned()
        m.version = _DLPackVersion(major, 0)
        m.deleter = self.deleter
        m.flags = flags
        m.dl_tensor = _DLTensor(self.array.ctypes.data, _DLDevice(1, 0), len(shape), _DLDataType(2, 64, 1),
                                self.shape, None, 0)

    def _delete(self, _):
        self.deleted += 1

    def capsule(self):
        return _api.PyCapsule_New(ctypes.addressof(self.managed), _NAMES[b"dltensor_versioned"], None)


def test_versioned_import_views_and_runs_the_deleter_once():
    p = _Versioned()
    producer = _Producer(p.capsule())
    t = meshrt.from_dlpack(producer)
    assert producer.calls == [{"max_version": (1, 0)}]
    assert capsule_name(producer.capsule) == "used_dltensor_versioned"
    assert t.data_ptr == p.array.ctypes.data and t.meta == meshrt.TensorMeta((2, 3), meshrt.float64)
    t.numpy()[1, 2] = 42
    assert p.array[1, 2] == 42
    assert p.deleted == 0
    view = t.reshape((6,))
    del t
    gc.collect()
    assert p.deleted == 0, "a handle is left"
    del view
    gc.collect()
    assert p.deleted == 1


def test_versioned_read_only_is_copied_and_released_at_once():
    p = _Versioned(flags=READ_ONLY)
    t = meshrt.from_dlpack(_Producer(p.capsule()))
    assert t.data_ptr != p.array.ctypes.data
    np.testing.assert_array_equal(t.numpy(), p.array)
    assert p.deleted == 1, "copied: the producer's tensor is released at once"
    p = _Versioned(flags=READ_ONLY)
    producer = _Producer(p.capsule())
    with pytest.raises(BufferError, match=r"copy=False, found read-only memory \(DLPack's read-only flag\) from "
                                          "_Producer"):
        meshrt.from_dlpack(producer, copy=False)
    assert capsule_name(producer.capsule) == "dltensor_versioned", "refused: not consumed"
    assert p.deleted == 0


def test_versioned_import_of_another_major_version_is_refused():
    p = _Versioned(major=2)
    producer = _Producer(p.capsule())
    with pytest.raises(meshrt.UsageError, match=r"expected a DLPack 1.x tensor \(meshrt asked for max_version \(1, "
                                                r"0\)\), found DLPack 2.0 from _Producer"):
        meshrt.from_dlpack(producer)
    assert capsule_name(producer.capsule) == "dltensor_versioned" and p.deleted == 0


def test_a_producer_from_before_dlpack_1_is_asked_again_and_its_capsule_renamed():
    a = sample(np.int64)
    producer = _Producer(a.__dlpack__(), versioned=False)
    t = meshrt.from_dlpack(producer)
    assert producer.calls == [{"max_version": (1, 0)}, {}]
    assert capsule_name(producer.capsule) == "used_dltensor"
    assert t.data_ptr == address(a)
    # numpy 1.24 and torch 1.13 are such producers: they take no max_version.
    with pytest.raises(TypeError):
        a.__dlpack__(max_version=(1, 0))
    with pytest.raises(TypeError):
        torch.zeros(2).__dlpack__(max_version=(1, 0))
    assert meshrt.from_dlpack(torch.arange(3)).numpy().tolist() == [0, 1, 2]
