"""Futures that compose (docs/python.md, "Futures"): done callbacks, ``await``,
``meshrt.wait`` and ``meshrt.as_completed``.

A meshrt future completes when the workers' replies say so, and replies are read only by
a thread that asks the controller (docs/ARCHITECTURE.md section 3.3: the completion rule;
a wait polls the replies). The completion thread here is that asker for futures with
callbacks: it polls ``done()`` of each (through the binding, so under the controller lock
with the GIL released), backing off while nothing completes, and runs the callbacks with
no lock held. It idles, polling nothing, while no callback is pending.
"""

import concurrent.futures as _cf
import logging as _logging
import queue as _queue
import threading as _threading
import time as _time
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Set

from . import _core

ALL_COMPLETED: str = _cf.ALL_COMPLETED
FIRST_COMPLETED: str = _cf.FIRST_COMPLETED
FIRST_EXCEPTION: str = _cf.FIRST_EXCEPTION

_log = _logging.getLogger("meshrt")

# The polling interval grows from the first to the last while nothing completes: a reply
# that arrives is seen soon, and an idle wait costs little.
_FIRST_POLL = 0.0002
_LAST_POLL = 0.02

_lock = _threading.Lock()
_wake = _threading.Condition(_lock)
# id(future) -> [future, callbacks]; the entry keeps the future alive until it completes.
_pending: "dict[int, list[Any]]" = {}
_thread: "_threading.Thread | None" = None


def _run_callback(fn: Callable[[Any], Any], future: Any) -> None:
    try:
        fn(future)
    except Exception:  # logged, never lost and never the end of the completion thread
        _log.exception("meshrt: exception in the done callback %r of %r", fn, future)


def _is_done(future: Any) -> bool:
    try:
        return bool(future.done())
    except Exception:
        return True  # its callbacks see the error through result() or exception()


def _completion_loop() -> None:
    delay = _FIRST_POLL
    while True:
        with _lock:
            while not _pending:
                _wake.wait()
                delay = _FIRST_POLL
            futures = [entry[0] for entry in _pending.values()]
        finished = [f for f in futures if _is_done(f)]
        if not finished:
            with _lock:
                _wake.wait(delay)
            delay = min(delay * 2, _LAST_POLL)
            continue
        delay = _FIRST_POLL
        for f in finished:
            with _lock:
                entry = _pending.pop(id(f), None)
            for fn in entry[1] if entry else ():
                _run_callback(fn, f)


def add_done_callback(future: Any, fn: Callable[[Any], Any]) -> None:
    if _is_done(future):
        _run_callback(fn, future)
        return
    global _thread
    with _lock:
        entry = _pending.setdefault(id(future), [future, []])
        entry[1].append(fn)
        if _thread is None:
            _thread = _threading.Thread(target=_completion_loop, name="meshrt completion", daemon=True)
            _thread.start()
        _wake.notify()


def remove_done_callback(future: Any, fn: Callable[[Any], Any]) -> None:
    with _lock:
        entry = _pending.get(id(future))
        if entry is None:
            return
        entry[1] = [f for f in entry[1] if f != fn]  # bound methods are equal, not identical
        if not entry[1]:
            del _pending[id(future)]


def await_future(future: Any) -> Any:
    """The iterator ``await future`` drives: an asyncio future of the loop, settled from
    the completion thread through ``loop.call_soon_threadsafe``."""
    import asyncio

    async def waiting() -> Any:
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()

        def settle(f: Any) -> None:
            try:
                error = f.exception()
                value = None if error is not None else f.result()
            except BaseException as e:  # noqa: B036 - handed to the awaiting task
                error, value = e, None

            def apply() -> None:
                if waiter.done():
                    return  # the awaiting task was cancelled meanwhile
                if error is not None:
                    waiter.set_exception(error)
                else:
                    waiter.set_result(value)

            loop.call_soon_threadsafe(apply)

        add_done_callback(future, settle)
        return await waiter

    return waiting().__await__()


class DoneAndNotDoneFutures(NamedTuple):
    done: Set[Any]
    not_done: Set[Any]


def wait(futures: Iterable[Any], timeout: "float | None" = None,
         return_when: str = ALL_COMPLETED) -> DoneAndNotDoneFutures:
    """Waits for meshrt futures as ``concurrent.futures.wait`` does: returns the sets
    ``(done, not_done)`` once all are done (``ALL_COMPLETED``), one is
    (``FIRST_COMPLETED``), one has failed or all are done (``FIRST_EXCEPTION``), or
    ``timeout`` seconds have passed (then ``not_done`` holds the rest; nothing raises).
    The constants are ``concurrent.futures``' (also ``meshrt.ALL_COMPLETED`` ...)."""
    if return_when not in (ALL_COMPLETED, FIRST_COMPLETED, FIRST_EXCEPTION):
        raise _core.UsageError(
            f"meshrt.wait: expected return_when ALL_COMPLETED, FIRST_COMPLETED or FIRST_EXCEPTION, found {return_when!r}")
    fs = set(futures)
    done: Set[Any] = set()
    failed = [False]
    ready = _threading.Condition()

    def note(f: Any) -> None:
        bad = f.exception() is not None
        with ready:
            done.add(f)
            failed[0] = failed[0] or bad
            ready.notify_all()

    def satisfied() -> bool:
        if len(done) == len(fs):
            return True
        if return_when == FIRST_COMPLETED:
            return bool(done)
        return return_when == FIRST_EXCEPTION and failed[0]

    try:
        for f in fs:
            add_done_callback(f, note)
        with ready:
            ready.wait_for(satisfied, timeout)
            finished = set(done)
    finally:
        for f in fs:
            remove_done_callback(f, note)
    return DoneAndNotDoneFutures(finished, fs - finished)


def as_completed(futures: Iterable[Any], timeout: "float | None" = None) -> Iterator[Any]:
    """Yields meshrt futures as they complete (those already done first), as
    ``concurrent.futures.as_completed`` does; ``meshrt.TimeoutError`` (a builtin
    ``TimeoutError``) once ``timeout`` seconds pass with some unfinished."""
    fs = list(dict.fromkeys(futures))
    arrived: "_queue.SimpleQueue[Any]" = _queue.SimpleQueue()
    deadline = None if timeout is None else _time.monotonic() + timeout
    for f in fs:
        add_done_callback(f, arrived.put)
    try:
        for left in range(len(fs), 0, -1):
            wait_for = None if deadline is None else max(0.0, deadline - _time.monotonic())
            try:
                yield arrived.get(timeout=wait_for)
            except _queue.Empty:
                raise _core.TimeoutError(
                    f"meshrt.as_completed: {left} of {len(fs)} futures unfinished after {timeout} s; wait longer, "
                    "or see what the workers are doing with ctl.dump_flight_recorder()") from None
    finally:
        for f in fs:
            remove_done_callback(f, arrived.put)


def flatten(tree: Any) -> "tuple[list[Any], Callable[[list[Any]], Any]]":
    """The DTensors of a pytree (tuples, named tuples, lists and dicts of them, nested),
    and the function that rebuilds the structure around values in their place."""
    leaves: "list[Any]" = []

    def spec(node: Any, where: str) -> Any:
        if isinstance(node, _core.DTensor):
            leaves.append(node)
            return None
        if isinstance(node, dict):
            return (dict, list(node), [spec(v, f"{where}[{k!r}]") for k, v in node.items()])
        if isinstance(node, (tuple, list)):
            return (type(node), None, [spec(v, f"{where}[{i}]") for i, v in enumerate(node)])
        raise _core.UsageError(
            f"fetch_shard: expected a DTensor, or a tuple, list or dict of them, found a {type(node).__qualname__} "
            f"at {where}; fetch values other than tensors with ctl.fetch")

    structure = spec(tree, "the argument")

    def rebuild(values: "list[Any]") -> Any:
        it = iter(values)

        def build(node: Any) -> Any:
            if node is None:
                return next(it)
            kind, keys, children = node
            items = [build(c) for c in children]
            if kind is dict:
                return dict(zip(keys, items))
            if hasattr(kind, "_fields"):  # a named tuple
                return kind(*items)
            return kind(items)

        return build(structure)

    return leaves, rebuild
