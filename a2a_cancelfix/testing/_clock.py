"""Virtual time for the sweep's runs: waits on the loop's own timers cost no real time.

The loop's clock is the real clock plus every wait it skipped. When nothing is ready to run and
nothing outside the loop works for it (no thread started since the loop began, nor any pool's
worker, no socket or pipe of anyone's registered), only a timer can wake it: the clock jumps to
that timer at once.
Otherwise it waits as any loop does. A row sees the same order of events either way; an
executor's ``asyncio.sleep(0.1)`` standing in for a model call just takes no real time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import selectors
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

_T = TypeVar("_T")


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock skips the waits that only its own timers could end."""

    def __init__(self) -> None:
        self._clock = _SkippingSelector(self._outside_works)
        super().__init__(self._clock)
        self._own_files = len(self._clock.get_map())  # The loop's wake-up pipe.
        self._threads = set(threading.enumerate())
        self._handed: list[asyncio.Future[Any]] = []  # Work it handed to threads.

    def time(self) -> float:
        return time.monotonic() + self._clock.skipped

    def run_in_executor(self, executor: Any, func: Callable[..., _T], *args: Any) -> asyncio.Future[_T]:  # type: ignore[override]
        work = super().run_in_executor(executor, func, *args)
        self._handed = [each for each in self._handed if not each.done()] + [work]
        return work

    def _outside_works(self) -> bool:
        """Whether something outside the loop may still wake it: a thread, a socket, a pipe.

        The threads judged are those started since the loop began and every pool's workers
        (a process-wide pool's outlive the loops, and the work for them comes from anywhere,
        ``asyncio.wrap_future(pool.submit(...))`` too); not the thread running this loop.
        """
        if any(not work.done() for work in self._handed):
            return True
        if len(self._clock.get_map()) > self._own_files:
            return True
        here = threading.current_thread()
        return any(
            working(thread)
            for thread in threading.enumerate()
            if thread is not here and (thread not in self._threads or _work_queue(thread) is not None)
        )


class _SkippingSelector(selectors.DefaultSelector):
    def __init__(self, outside_works: Callable[[], bool]) -> None:
        super().__init__()
        self._outside_works = outside_works
        self.skipped = 0.0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if not timeout or timeout <= 0 or self._outside_works():
            return super().select(timeout)
        ready: list[tuple[selectors.SelectorKey, int]] = super().select(0)
        if not ready:
            self.skipped += timeout  # Only a timer can wake the loop: it is due now.
        return ready


def started_here(thread: threading.Thread) -> bool:
    """Whether ``thread`` runs and was started through `threading`, as an executor's are.

    Not a thread started below it (pytest-xdist's I/O thread, a C library's), which `threading`
    lists as a dummy from the moment it first asks for ``current_thread()``: a log call, or a
    finalizer the collector happens to run in it, mid-run. Nobody can join it.
    """
    return thread.is_alive() and not isinstance(thread, threading._DummyThread)


# Where a pool's worker thread waits for its next work item: concurrent.futures' (and so
# asyncio's) on a SimpleQueue, in C, inside _worker; another pool's in queue.Queue.get (anyio's
# are judged by their queue, in `working`).
_POOLS_IDLE_AT = ("concurrent.futures.thread", "_worker")
_IDLE_AT = {_POOLS_IDLE_AT, ("queue", "get")}


def _work_queue(thread: threading.Thread) -> queue.SimpleQueue[Any] | None:
    """The queue a concurrent.futures pool's worker takes its work from; None for another thread."""
    if getattr(thread, "_target", None) is not concurrent.futures.thread._worker:
        return None
    # Its arguments (the pool, its queue, ...) are in another order from one Python to another.
    return next((each for each in getattr(thread, "_args", ()) if isinstance(each, queue.SimpleQueue)), None)


def frame_of(thread: threading.Thread) -> Any:
    return sys._current_frames().get(thread.ident or 0) if thread.is_alive() else None


def working(thread: threading.Thread) -> bool:
    """Whether ``thread`` still runs something: alive, and not a pool worker waiting for work."""
    if not started_here(thread):
        return False
    items = getattr(thread, "queue", None)
    if type(thread).__module__.startswith("anyio.") and isinstance(items, queue.Queue):
        # anyio's worker marks the item it took done once it has handed the result back: past
        # that it runs no work of anyone's, whatever its frames show (it may be running a
        # finalizer the collector put there).
        return items.unfinished_tasks > 0
    frame = frame_of(thread)
    while frame is not None and frame.f_globals.get("__name__") == "threading":
        frame = frame.f_back  # A lock or condition it waits on: what waits there tells.
    if frame is None:
        return thread.is_alive()
    where = (frame.f_globals.get("__name__"), frame.f_code.co_name)
    if where == _POOLS_IDLE_AT:
        # Between two items, unless one is queued for it and it has not woken to take it, or it
        # has taken one and not yet begun it (_worker holds it in a local until it is done).
        queued = _work_queue(thread)
        if (queued is not None and not queued.empty()) or "work_item" in frame.f_locals:
            return True
        return _handed_work(thread)
    return where not in _IDLE_AT


def _handed_work(thread: threading.Thread) -> bool:
    """Whether work was handed to one of the idle-looking workers of ``thread``'s pool.

    From Python 3.13 a SimpleQueue hands an item straight to a worker waiting in its ``get``:
    the queue shows nothing and the worker has not yet named it. ``submit`` takes one of the
    pool's idle counts (``_idle_semaphore``) as it gives work to a waiting worker: more workers
    waiting than idle counts left means one of them has work."""
    pool = thread._args[0]() if getattr(thread, "_args", None) else None  # type: ignore[attr-defined]
    idle = getattr(getattr(pool, "_idle_semaphore", None), "_value", None)
    if idle is None:
        return False
    waiting = 0
    for worker in list(getattr(pool, "_threads", ())):
        frame = frame_of(worker)
        while frame is not None and frame.f_globals.get("__name__") == "threading":
            frame = frame.f_back
        at = None if frame is None else (frame.f_globals.get("__name__"), frame.f_code.co_name)
        waiting += at == _POOLS_IDLE_AT and "work_item" not in frame.f_locals
    return waiting > idle


def join(
    works: list[concurrent.futures.Future[Any]], threads: list[threading.Thread], seconds: float
) -> None:
    """Wait up to ``seconds`` for ``works`` to be done and ``threads`` to stop working."""
    deadline = time.monotonic() + seconds
    concurrent.futures.wait(works, timeout=seconds)
    for thread in threads:
        # A pool's worker lives on, idle, after its work: waiting for that is all a join can do.
        # Nothing announces a worker going idle, so it is looked at every few milliseconds.
        while working(thread) and time.monotonic() < deadline:
            thread.join(0.005)
