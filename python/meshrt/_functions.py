"""Python remote functions: ``@meshrt.function(name, shape=...)`` (docs/python.md).

Every rank imports the same modules, so the decorator registers the function on every
rank, before ``meshrt.run`` starts the runtime (whose handshake compares the ranks'
function tables). Registering after the start is refused.
"""

import builtins as _builtins
import inspect as _inspect
import struct as _struct
import sys as _sys
from typing import Any, Callable, Optional, TypeVar

from . import _core

_Kernel = TypeVar("_Kernel", bound=Callable[..., Any])


def _kind(annotation):
    if annotation is _inspect.Parameter.empty:
        return "any"
    if isinstance(annotation, str):
        return annotation
    return getattr(annotation, "__name__", str(annotation))


def function(
    name: str, *, shape: Optional[Callable[..., Any]] = None, torch: bool = False
) -> Callable[[_Kernel], _Kernel]:
    """Registers the decorated kernel as the remote function ``name``.

    Without ``shape`` it is an object constructor only: ``mesh.call_object(kernel, ...)``
    runs it on every rank and keeps what it returns there (a ``meshrt.WorkerObject``
    handle on the controller); ``mesh.call`` refuses it. Any function can be called with
    ``call_object``.

    ``shape(*args)`` runs at the controller's call site with a ``meshrt.TensorMeta`` for
    each tensor argument and the Python values of the others (lists as tuples, dtypes as
    their names); it returns a ``TensorMeta``, a list of them, ``None`` (no outputs) or a
    ``meshrt.Signature(outputs=[...], mutates=[i])`` for a kernel that writes tensor
    argument i in place (``views={k: j}``: output k is a view of tensor argument j, which
    the kernel then gets writable and returns a view of). Raising there (``meshrt.UsageError`` or any exception) makes the
    call raise ``meshrt.UsageError`` carrying the exception's type and message.

    ``kernel(ctx, *args)`` runs on every rank of the mesh with ``ctx`` a
    ``meshrt.CallContext`` and each tensor argument a numpy view of the rank's local
    tensor (read-only unless the shape function declares it mutated), or a torch tensor
    over it with ``torch=True``. Only torch kernels run on CUDA meshes: there their
    tensors are torch CUDA tensors over meshrt's device memory, and their torch work runs
    on the call's stream (torch's current stream while the kernel runs); the same kernel
    runs unchanged on cpu, emulated and cuda meshes (``ctx.torch_device`` names where its
    new tensors go). It returns a tensor (anything that speaks DLPack or the
    buffer protocol), a tuple or list of them, or ``None``; the outputs must match the
    shape function's metas. An exception there is a ``meshrt.RemoteError`` at the
    values that depend on the call, with the exception and its last frames.

    Returns the kernel unchanged.
    """

    def register(kernel: _Kernel) -> _Kernel:
        code = getattr(kernel, "__code__", None)
        if code is not None:
            file, line = code.co_filename, code.co_firstlineno
        else:
            caller = _sys._getframe(1)
            file, line = caller.f_code.co_filename, caller.f_lineno
        params, returns = [], ""
        try:
            sig = _inspect.signature(kernel)
            params = [(p.name, _kind(p.annotation)) for p in list(sig.parameters.values())[1:]]
            if sig.return_annotation is not _inspect.Signature.empty:
                returns = _kind(sig.return_annotation)
        except (TypeError, ValueError):
            pass  # a builtin or C callable: no signature to describe
        doc = (_inspect.getdoc(kernel) or "").strip().split("\n")[0]
        _core._register_function(name, kernel, shape, bool(torch), file, line, params, returns, doc)
        _kernels[name] = kernel
        try:
            kernel.__meshrt_function__ = name  # calls take the function for its name
        except (AttributeError, TypeError):
            pass  # a builtin or C callable: call it by name
        return kernel

    return register


def _cuda_stream(stream_ptr: int, device_index: int) -> Any:
    """The context a torch kernel on a CUDA mesh runs in (python_kernels.cpp): meshrt's
    CUDA stream of the call, wrapped as a ``torch.cuda.ExternalStream``, as torch's current
    stream (and its device as torch's current device)."""
    import torch as _torch

    return _torch.cuda.stream(_torch.cuda.ExternalStream(stream_ptr, device=device_index))


# Every Python remote function by name, for ctl.fetch on the workers.
_kernels: "dict[str, Callable[..., Any]]" = {}

# The framing of a fetched value: the codec's bytes and out-of-band buffers, each after its
# length (little-endian uint64s: the bytes' length, the number of buffers, each buffer's).
_WORD = _struct.Struct("<Q")
_EXCEPTION = "__meshrt_returned_exception__"


def _fetch_value_shape(name: str, *args: Any) -> Any:
    # A fetch's output is not checked against its meta: its size is the value's.
    return _core.TensorMeta((0,), "uint8")


def _fetch_value(ctx: Any, name: str, *args: Any) -> bytes:
    kernel = _kernels.get(name)
    if kernel is None:
        raise _core.UsageError(f"ctl.fetch: expected a Python remote function, found {name!r}, which is not one "
                               "(a C++ function's tensor is fetched with fetch_shard, or with Controller::fetch_call)")
    value = kernel(ctx, *args)
    if isinstance(value, BaseException):
        # An exception returned (not raised) is a value: its type's name and its arguments.
        carried = value.args
        try:
            _core._codec_encode(carried)
        except Exception:
            carried = (str(value),)
        value = {_EXCEPTION: (type(value).__module__, type(value).__qualname__, carried)}
    try:
        data, buffers = _core._codec_encode(value)
    except Exception as e:
        raise _core.UsageError(f"ctl.fetch of {name} on rank {ctx.rank}: expected a value the safe codec carries "
                               f"(docs/python.md, \"What travels\"), found {str(e).split(';')[0]}") from None
    parts = [_WORD.pack(len(data)), _WORD.pack(len(buffers))]
    parts += [_WORD.pack(len(b)) for b in buffers]
    return b"".join(parts + [data] + list(buffers))


def _fetched(tensor: Any) -> Any:
    """The value a fetch's bytes frame (on the controller, at result())."""
    raw = tensor.numpy().tobytes()
    size, count = _WORD.unpack_from(raw, 0)[0], _WORD.unpack_from(raw, 8)[0]
    at = 16 + 8 * count
    lengths = [_WORD.unpack_from(raw, 16 + 8 * i)[0] for i in range(count)]
    data, at = raw[at:at + size], at + size
    buffers = []
    for n in lengths:
        buffers.append(raw[at:at + n])
        at += n
    value = _core._codec_decode(data, buffers)
    if isinstance(value, dict) and len(value) == 1 and _EXCEPTION in value:
        module, qualname, args = value[_EXCEPTION]
        kind = getattr(_builtins, qualname, None) if module == "builtins" else None
        if not (isinstance(kind, type) and issubclass(kind, BaseException)):
            # Only builtin exception types are made again: a name never imports code.
            return RuntimeError(f"{module}.{qualname}: {', '.join(map(str, args))}")
        return kind(*args)
    return value


function("meshrt.fetch_value", shape=_fetch_value_shape)(_fetch_value)
