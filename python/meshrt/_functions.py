"""Python remote functions: ``@meshrt.function(name, shape=...)`` (docs/python.md).

Every rank imports the same modules, so the decorator registers the function on every
rank, before ``meshrt.run`` starts the runtime (whose handshake compares the ranks'
function tables). Registering after the start is refused.
"""

import inspect as _inspect
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
