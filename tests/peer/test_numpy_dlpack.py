"""numpy's DLPack properties, pointed at meshrt.Tensor.__dlpack__ and meshrt.from_dlpack.

Follows numpy/numpy, numpy/_core/tests/test_dlpack.py at commit
6c8e62419edc6e2b39f10142a2aa8d685c92bafe (the properties, not the text): capsule reference
counts for every max_version, the stream, copy and dl_device arguments, strides that are
not a multiple of the item size, every dtype, 0 to 32 dimensions, __dlpack_device__,
read-only arrays, and the deleter when a consumer raises. The other side is Debian's
numpy 1.24 and torch 1.13, which predate DLPack 1.0. One process; no MPI.

Where meshrt answers differently from numpy, by design (docs/python.md, "DLPack
answers"), the test asserts meshrt's answer and says why:

- A capsule of meshrt.Tensor holds the tensor's storage, not the Python Tensor object, so
  its reference count is taken on the memory's owner (the numpy array a tensor views).
- stream on the CPU: None and -1 are taken; any other int is a ValueError (numpy 1.24
  raises RuntimeError): the array API asks for ValueError on a stream the device lacks.
- copy that is not None/True/False is a TypeError (numpy: ValueError).
- dl_device of a device meshrt has not is a BufferError ("cannot be exported as
  asked", the array API's exception for export); numpy raises ValueError.
- Memory meshrt cannot view (strides that are not a multiple of the item size, other
  strides, read-only) is copied unless copy=False, which is a BufferError; numpy's
  from_dlpack refuses such strides outright.
- Dtypes beyond meshrt's eight (int8, uint16, complex, ...) and the other byte order are
  a meshrt.UsageError that names what was found and what meshrt takes (numpy:
  BufferError); so is from_dlpack(device="gpu") (numpy: ValueError).
- An unversioned capsule carries bool as uint8: numpy 1.24 and torch 1.13 take no
  kDLBool. The versioned capsule says kDLBool.
"""
import ctypes
import gc
import sys

import numpy as np
import pytest
import torch
import torch.utils.dlpack

import meshrt

KDL_CPU, KDL_EXT_DEV = 1, 12

# numpy dtypes meshrt takes (numpy has no bfloat16: torch covers it).
NUMPY = [np.bool_, np.uint8, np.int32, np.int64, np.float16, np.float32, np.float64]
TORCH = [torch.bool, torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32,
         torch.float64]
# numpy dtypes meshrt has not.
NOT_MESHRT = [np.int8, np.int16, np.uint16, np.uint32, np.uint64, np.complex64, np.complex128]

_capsule_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_valid.restype = ctypes.c_int
_capsule_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]


def capsule_named(capsule, name):
    return _capsule_valid(capsule, name.encode()) == 1


def values(dtype, shape=(6,)):
    n = int(np.prod(shape))
    if dtype == np.bool_:
        return (np.arange(n) % 3 == 1).reshape(shape)
    return (np.arange(n) * 3 + 1).astype(dtype).reshape(shape)


class OldDLPack(np.ndarray):
    """A producer from before DLPack 1.0 that takes stream only (numpy 1.24 takes no
    max_version either; this one has its own signature)."""

    def __dlpack__(self, stream=None):
        return super().__dlpack__(stream=stream)


def producers():
    return [np.arange(5), np.arange(5).view(OldDLPack)]


# ---------------------------------------------------------------- reference counts


@pytest.mark.parametrize("max_version", [(0, 0), None, (1, 0), (100, 3)])
def test_export_capsule_holds_the_memory_and_drops_it(max_version):
    a = np.arange(5)
    base = sys.getrefcount(a)
    t = meshrt.from_dlpack(a, copy=False)  # a view: holds a through numpy's capsule
    assert sys.getrefcount(a) == base + 1
    capsule = t.__dlpack__(max_version=max_version)
    versioned = max_version is not None and max_version[0] >= 1
    assert capsule_named(capsule, "dltensor_versioned" if versioned else "dltensor")
    del t
    assert sys.getrefcount(a) == base + 1  # the capsule keeps the memory alive
    del capsule
    assert sys.getrefcount(a) == base


@pytest.mark.parametrize("producer", producers(), ids=["numpy", "old_dlpack"])
def test_import_refcount(producer):
    arr = producer.copy()
    y = meshrt.from_dlpack(arr)
    count = sys.getrefcount(arr)
    del y
    assert count - sys.getrefcount(arr) == 1
    # A copy releases the producer's capsule before it returns.
    count = sys.getrefcount(arr)
    y = meshrt.Tensor(arr, copy=True)
    assert sys.getrefcount(arr) == count
    assert np.array_equal(np.from_dlpack(y), arr)


def test_torch_consumer_drops_what_it_took():
    a = np.arange(6.0)
    base = sys.getrefcount(a)
    t = meshrt.from_dlpack(a)
    u = torch.utils.dlpack.from_dlpack(t.__dlpack__())
    del t
    assert sys.getrefcount(a) == base + 1  # torch's tensor holds meshrt's storage, which holds a
    assert u.data_ptr() == a.ctypes.data
    del u
    gc.collect()
    assert sys.getrefcount(a) == base


# ---------------------------------------------------------------- arguments


def test_stream_on_cpu():
    t = meshrt.from_dlpack(np.arange(5))
    assert capsule_named(t.__dlpack__(stream=None), "dltensor")
    assert capsule_named(t.__dlpack__(stream=-1), "dltensor")
    for stream in (0, 1, 2, 12345):
        with pytest.raises(ValueError, match=r"expected stream=None .* found stream="):
            t.__dlpack__(stream=stream)
    with pytest.raises(TypeError, match="expected stream as an int or None"):
        t.__dlpack__(stream="default")


def test_max_version_must_be_a_pair():
    t = meshrt.from_dlpack(np.arange(5))
    for bad in [(1,), "1.0", (1, "a"), 1, 1.0]:
        with pytest.raises(TypeError, match=r"expected max_version as a \(major, minor\) pair"):
            t.__dlpack__(max_version=bad)


def test_copy_argument():
    a = np.arange(5)
    t = meshrt.from_dlpack(a)
    assert torch.utils.dlpack.from_dlpack(t.__dlpack__(copy=None)).data_ptr() == a.ctypes.data
    assert torch.utils.dlpack.from_dlpack(t.__dlpack__(copy=False)).data_ptr() == a.ctypes.data
    copied = torch.utils.dlpack.from_dlpack(t.__dlpack__(copy=True))
    assert copied.data_ptr() != a.ctypes.data and copied.tolist() == a.tolist()
    for bad in [np.array([1, 2, 3]), 1, "yes"]:
        with pytest.raises(TypeError, match="expected copy=None, True or False"):
            t.__dlpack__(copy=bad)

    # The consumer side: numpy's from_dlpack(copy=) as meshrt.from_dlpack and meshrt.Tensor.
    for make in (meshrt.from_dlpack, meshrt.Tensor):
        assert np.from_dlpack(make(a)).ctypes.data == a.ctypes.data
        assert np.from_dlpack(make(a, copy=False)).ctypes.data == a.ctypes.data
        y = np.from_dlpack(make(a, copy=True))
        assert y.ctypes.data != a.ctypes.data and np.array_equal(y, a)
        with pytest.raises(TypeError, match="expected copy=None, True or False"):
            make(a, copy=1)


def test_dl_device_argument():
    a = np.arange(5)
    t = meshrt.from_dlpack(a)
    same = torch.utils.dlpack.from_dlpack(t.__dlpack__(dl_device=(KDL_CPU, 0)))
    assert same.data_ptr() == a.ctypes.data
    # Another device meshrt has: a copy there unless copy=False.
    assert capsule_named(t.__dlpack__(dl_device=(KDL_EXT_DEV, 0)), "dltensor")
    with pytest.raises(BufferError, match="needs a copy to emulated:0, and copy=False forbids one"):
        t.__dlpack__(dl_device=(KDL_EXT_DEV, 0), copy=False)
    with pytest.raises(BufferError, match="found device type 10"):
        t.__dlpack__(dl_device=(10, 0))
    with pytest.raises(BufferError, match="expected a device id >= 0"):
        t.__dlpack__(dl_device=(KDL_CPU, -1))
    for bad in ["cpu", 1, (1, 0, 0), (1.0, 0)]:
        with pytest.raises(TypeError, match="expected dl_device as a"):
            t.__dlpack__(dl_device=bad)
    # Back from meshrt's emulated accelerator: a copy to the CPU, or a BufferError.
    e = meshrt.from_dlpack(a, device="emulated")
    back = torch.utils.dlpack.from_dlpack(e.__dlpack__(dl_device=(KDL_CPU, 0)))
    assert back.tolist() == a.tolist()
    with pytest.raises(BufferError, match="needs a copy to cpu, and copy=False forbids one"):
        e.__dlpack__(dl_device=(KDL_CPU, 0), copy=False)
    with pytest.raises(BufferError, match="expected a tensor on cpu without a copy"):
        meshrt.from_dlpack(e, device="cpu", copy=False)
    # from_dlpack's device=.
    assert np.from_dlpack(meshrt.from_dlpack(a, device="cpu")).ctypes.data == a.ctypes.data
    assert np.from_dlpack(meshrt.from_dlpack(a, device=None)).ctypes.data == a.ctypes.data
    with pytest.raises(meshrt.UsageError, match="found 'gpu'"):
        meshrt.from_dlpack(a, device="gpu")


def test_dlpack_device():
    a = np.arange(5)
    assert meshrt.from_dlpack(a).__dlpack_device__() == (KDL_CPU, 0)
    assert meshrt.from_dlpack(a[::2]).__dlpack_device__() == (KDL_CPU, 0)
    assert meshrt.from_dlpack(a, device="emulated:1").__dlpack_device__() == (KDL_EXT_DEV, 1)


# ---------------------------------------------------------------- memory layouts


def test_strides_not_a_multiple_of_the_item_size():
    record = np.zeros(5, dtype=[("int", np.int32), ("char", np.int8)])
    record["int"] = np.arange(5) * 7
    record["char"] = -1
    field = record["int"]  # 5-byte strides over int32
    with pytest.raises(BufferError):
        field.__dlpack__()  # numpy refuses to export it
    for make in (meshrt.from_dlpack, meshrt.Tensor):
        with pytest.raises(BufferError, match=r"with copy=False, found strided memory .* ndarray of int32\[5\]"):
            make(field, copy=False)
        copied = make(field)
        assert copied.dtype == meshrt.int32
        assert np.from_dlpack(copied).tolist() == [0, 7, 14, 21, 28]


def test_non_contiguous_views_are_copied_with_their_values():
    x = np.arange(25).reshape(5, 5)
    for view, viewed in [(x[0], True), (x[1, :], True), (x[:, 0], False), (x[::2, 1::2], False),
                         (x[::-1, ::-2], False), (np.diagonal(x).copy(), True)]:
        t = meshrt.from_dlpack(view)
        y = np.from_dlpack(t)
        assert np.array_equal(y, view)
        assert (y.ctypes.data == view.ctypes.data) == viewed
    transposed = torch.arange(6).reshape(2, 3).t()
    assert np.asarray(meshrt.from_dlpack(transposed)).tolist() == transposed.tolist()


def test_size_one_dimensions_take_any_stride():
    # A size-1 dimension's stride addresses nothing: C order otherwise, so a view.
    buf = np.arange(15.0)
    x = np.ndarray(shape=(5, 1, 3), dtype=np.float64, strides=(24, 1000, 8), buffer=buf)
    y = np.from_dlpack(meshrt.from_dlpack(x, copy=False))
    assert y.ctypes.data == buf.ctypes.data and np.array_equal(y, x)
    # numpy's own case: Fortran order with an odd size-1 stride, copied.
    f = np.ndarray(dtype="f8", shape=(10, 5, 1), strides=(8, 80, 4), buffer=np.ones(1000, dtype=np.uint8),
                   order="F")
    assert np.array_equal(np.from_dlpack(meshrt.from_dlpack(f)), f)


@pytest.mark.parametrize("ndim", range(33))
def test_zero_to_32_dimensions(ndim):
    shape = (1,) * ndim
    x = np.full(shape, 2.5)
    t = meshrt.from_dlpack(x, copy=False)
    assert t.shape == shape
    assert np.from_dlpack(t).shape == shape and np.from_dlpack(t).ctypes.data == x.ctypes.data
    assert tuple(torch.from_dlpack(t).shape) == shape
    assert meshrt.from_dlpack(torch.from_dlpack(t)).shape == shape


# ---------------------------------------------------------------- dtypes


@pytest.mark.parametrize("dtype", NUMPY, ids=[np.dtype(d).name for d in NUMPY])
@pytest.mark.parametrize("producer", producers(), ids=["numpy", "old_dlpack"])
def test_numpy_dtype_passthrough(producer, dtype):
    x = values(dtype).view(type(producer))
    t = meshrt.from_dlpack(x)
    assert str(t.dtype) == np.dtype(dtype).name
    back = np.asarray(t)  # the buffer protocol keeps bool
    assert back.dtype == np.dtype(dtype) and np.array_equal(back, x)
    via_dlpack = np.from_dlpack(t)  # an unversioned capsule: bool travels as uint8
    assert via_dlpack.dtype == (np.uint8 if dtype == np.bool_ else np.dtype(dtype))
    assert np.array_equal(via_dlpack.astype(dtype), x)


@pytest.mark.parametrize("dtype", TORCH, ids=[str(d) for d in TORCH])
def test_torch_dtype_passthrough(dtype):
    x = (torch.arange(6) % 3 == 1) if dtype == torch.bool else (torch.arange(6) * 3 + 1).to(dtype)
    t = meshrt.from_dlpack(x)
    assert str(t.dtype) == ("bool" if dtype == torch.bool else str(dtype).removeprefix("torch."))
    back = torch.from_dlpack(t)
    assert back.dtype == (torch.uint8 if dtype == torch.bool else dtype)
    assert torch.equal(back.to(dtype), x)
    assert back.data_ptr() == x.data_ptr()


@pytest.mark.parametrize("dtype", NOT_MESHRT, ids=[np.dtype(d).name for d in NOT_MESHRT])
def test_dtypes_meshrt_has_not_are_refused_and_released(dtype):
    x = np.arange(3).astype(dtype)
    base = sys.getrefcount(x)
    with pytest.raises(meshrt.UsageError, match=f"expected one lane of bool8, .* found {np.dtype(dtype).name}"):
        meshrt.from_dlpack(x)
    gc.collect()
    assert sys.getrefcount(x) == base  # numpy's capsule, left unconsumed, released x


def test_other_byte_order_and_datetime_are_refused():
    with pytest.raises(meshrt.UsageError, match="found format '>q'"):
        meshrt.from_dlpack(np.arange(5, dtype=">i8"))
    with pytest.raises(meshrt.UsageError, match="datetime|dtype 'M'"):
        meshrt.from_dlpack(np.asarray(np.datetime64("2021-05-27")))


# ---------------------------------------------------------------- read-only


def test_read_only_arrays_are_copied_or_refused():
    x = np.arange(5)
    x.flags.writeable = False
    with pytest.raises(BufferError):
        x.__dlpack__()  # numpy 1.24 exports no read-only array
    for make in (meshrt.from_dlpack, meshrt.Tensor):
        y = np.asarray(make(x))
        assert y.ctypes.data != x.ctypes.data and np.array_equal(y, x)
        y[0] = 99  # meshrt's copy is its own, and writable (numpy 1.24's from_dlpack is read-only)
        assert x[0] == 0
        with pytest.raises(BufferError, match="with copy=False, found read-only memory"):
            make(x, copy=False)


def test_writable_arrays_are_viewed_from_either_producer():
    for x in producers():
        t = meshrt.from_dlpack(x)
        y = np.asarray(t)  # numpy 1.24's from_dlpack makes every array read-only: torch's does not
        assert y.flags.writeable
        y[0] = 42
        assert x[0] == 42
        torch.from_dlpack(t)[1] = 43
        assert x[1] == 43


# ---------------------------------------------------------------- deleters under exceptions


def _raise_holding_a_capsule(t, max_version):
    _capsule = t.__dlpack__(max_version=max_version)  # noqa: F841 (dropped by the raise)
    raise RuntimeError("consumer failed")


@pytest.mark.parametrize("max_version", [None, (1, 0)])
def test_capsule_dropped_by_an_exception_releases_the_memory(max_version):
    a = np.arange(5)
    base = sys.getrefcount(a)
    t = meshrt.from_dlpack(a)
    with pytest.raises(RuntimeError, match="consumer failed"):
        _raise_holding_a_capsule(t, max_version)
    del t
    gc.collect()
    assert sys.getrefcount(a) == base


def test_a_consumer_that_refuses_the_capsule_leaves_it_to_its_destructor():
    a = np.arange(5.0)
    base = sys.getrefcount(a)
    t = meshrt.from_dlpack(a)
    capsule = t.__dlpack__(max_version=(1, 0))
    with pytest.raises(RuntimeError):
        torch.utils.dlpack.from_dlpack(capsule)  # torch 1.13 takes no versioned capsule
    assert capsule_named(capsule, "dltensor_versioned")  # not consumed
    del t, capsule
    gc.collect()
    assert sys.getrefcount(a) == base
    # numpy refuses a device it has not; the capsule it asked for goes the same way.
    e = meshrt.from_dlpack(a, device="emulated")
    with pytest.raises((BufferError, RuntimeError)):
        np.from_dlpack(e)
    del e
    gc.collect()
    assert sys.getrefcount(a) == base


class Stash:
    """A producer that keeps the capsule it hands out, to look at it afterwards."""

    def __init__(self, array, fail=False):
        self.array, self.fail, self.capsule = array, fail, None

    def __dlpack__(self, stream=None):
        if self.fail:
            raise RuntimeError("producer failed")
        self.capsule = self.array.__dlpack__(stream=stream)
        return self.capsule


def test_meshrt_refusing_a_capsule_leaves_it_unconsumed():
    x = np.arange(3, dtype=np.int16)
    p = Stash(x)
    base = sys.getrefcount(x)
    with pytest.raises(meshrt.UsageError, match="found int16"):
        meshrt.from_dlpack(p)
    assert capsule_named(p.capsule, "dltensor")  # neither renamed nor released by meshrt
    p.capsule = None
    gc.collect()
    assert sys.getrefcount(x) == base
    # Taken: renamed, and released with the tensor.
    p = Stash(np.arange(3))
    t = meshrt.from_dlpack(p)
    assert capsule_named(p.capsule, "used_dltensor")
    del t


def test_a_producer_that_raises_is_named():
    with pytest.raises(meshrt.UsageError, match=r"Stash.__dlpack__\(\) failed: RuntimeError: producer failed"):
        meshrt.from_dlpack(Stash(np.arange(3), fail=True))


def test_meshrt_to_meshrt_goes_through_the_versioned_capsule_and_releases():
    a = np.arange(4.0)
    base = sys.getrefcount(a)
    t = meshrt.from_dlpack(a)
    seen = []

    class Spy:
        def __dlpack__(self, stream=None, max_version=None):
            seen.append(max_version)
            capsule = t.__dlpack__(stream=stream, max_version=max_version)
            seen.append(capsule)
            return capsule

    u = meshrt.from_dlpack(Spy())
    assert seen[0] == (1, 0) and capsule_named(seen[1], "used_dltensor_versioned")
    assert np.from_dlpack(u).ctypes.data == a.ctypes.data
    del t, u, seen
    gc.collect()
    assert sys.getrefcount(a) == base
