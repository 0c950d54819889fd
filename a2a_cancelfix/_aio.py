"""Asyncio plumbing, once: bounded waits that create no task, and background work kept alive;
the check of the seconds a wait is given."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import heapq
import itertools
import logging
import math
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

logger = logging.getLogger("a2a_cancelfix")

T = TypeVar("T")

# The loop keeps only weak references to tasks: a task nobody holds can vanish mid-run.
_background: set[asyncio.Future[Any]] = set()


def suspended_on(task: asyncio.Task[Any]) -> object | None:
    """The future a suspended task waits for; None while it runs or is about to."""
    # asyncio.Task keeps it as _fut_waiter, in its C and Python versions: CPython 3.10-3.13.
    return getattr(task, "_fut_waiter", None)


def in_background(work: Awaitable[T]) -> asyncio.Future[T]:
    """Run ``work`` in the background, referenced until it ends; its failure is logged."""
    task = asyncio.ensure_future(work)
    _background.add(task)
    task.add_done_callback(_forget)
    return task


async def bounded(awaitable: Awaitable[T], seconds: float) -> T:
    """``await awaitable``, cancelled after ``seconds`` with ``asyncio.TimeoutError``.

    Unlike ``asyncio.wait_for`` up to Python 3.11, a cancel of the caller that comes in the
    loop turn the awaitable finishes in is never swallowed: it is raised, and what the
    awaitable gave is dropped (a loop that swallowed it would go on, cancelled, forever).
    """
    async with asyncio.timeout(seconds):
        return await awaitable


def being_cancelled() -> bool:
    """Whether the running task was cancelled, though something it awaited swallowed the
    cancel (the task keeps the count)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _forget(task: asyncio.Future[Any]) -> None:
    _background.discard(task)
    if not task.cancelled() and task.exception() is not None:
        logger.error("background work of a2a-cancelfix failed", exc_info=task.exception())


class Deadlines:
    """Every deadline of one loop on one loop timer: thousands of cancels, one timer.

    A loop timer per wait costs a handle, a ``Timeout`` and their garbage on each; here a
    deadline is a heap entry, and only the earliest one has a timer. While any entry is
    left, that timer is what holds this (see `deadlines`).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._heap: list[list[Any]] = []  # [when, order, callback or None once dropped]
        self._order = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._dropped = 0

    def at(self, when: float, callback: Callable[[], Any]) -> list[Any]:
        """Call ``callback`` once the loop's clock reaches ``when``; `drop` the entry to not."""
        entry = [when, next(self._order), callback]
        heapq.heappush(self._heap, entry)
        if self._timer is None or when < self._timer.when():
            self._arm(when)
        return entry

    def drop(self, entry: list[Any]) -> None:
        if entry[2] is not None:
            entry[2] = None
            self._dropped += 1
            # Dropped entries wait in the heap for their time; past half of it, sweep them.
            if self._dropped > 64 and self._dropped * 2 > len(self._heap):
                self._heap[:] = [entry for entry in self._heap if entry[2] is not None]
                heapq.heapify(self._heap)
                self._dropped = 0

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        # In a context of its own: the caller's (a run's) must not live as long as the timer.
        self._timer = self.loop.call_at(when, self._fire, context=contextvars.Context())

    def _fire(self) -> None:
        self._timer = None
        heap, now = self._heap, self.loop.time()
        while heap and (heap[0][0] <= now or heap[0][2] is None):
            entry = heapq.heappop(heap)
            callback, entry[2] = entry[2], None  # Out of the heap: a later `drop` is nothing.
            if callback is None:
                self._dropped -= 1
            else:
                try:
                    callback()
                except Exception:
                    logger.exception("a deadline's callback of a2a-cancelfix failed")
        if heap:
            self._arm(heap[0][0])


# Weak both ways: a loop's entries hold its futures, so a strong value would keep the key.
_deadlines: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, weakref.ref[Deadlines]] = (
    weakref.WeakKeyDictionary()
)


# The one found last: a cancel asks five times, nearly always on the same loop.
_recent: weakref.ref[Deadlines] | None = None


def deadlines() -> Deadlines:
    """The running loop's `Deadlines`, made anew once the last had nothing left to time."""
    global _recent
    loop = asyncio.get_running_loop()
    found = None if _recent is None else _recent()
    if found is None or found.loop is not loop:
        held = _deadlines.get(loop)
        found = None if held is None else held()
        if found is None:
            found = Deadlines(loop)
            _deadlines[loop] = weakref.ref(found)
        _recent = weakref.ref(found)
    return found


class Once:
    """A signal given once, waited for until a deadline on the loop's `Deadlines`.

    Like an ``asyncio.Event`` that is never cleared, whose waiters wake in the loop turn it
    is given (a future's done-callbacks would take one more), and whose bounded waits need
    no ``Timeout`` and no timer of their own.
    """

    __slots__ = ("_waiters", "given")

    def __init__(self) -> None:
        self.given = False
        self._waiters: list[asyncio.Future[None]] = []

    def give(self) -> None:
        """Give the signal; the second time is nothing."""
        if not self.given:
            self.given = True
            for waiter in self._waiters:
                _wake(waiter)

    async def wait(self, deadline: float | None = None) -> bool:
        """Wait until given or the loop's clock reaches ``deadline``; whether it was given.

        Even past the deadline the wait takes one loop turn: what was just interrupted may
        end in it. With no deadline, whoever gives the signal bounds the wait.
        """
        if self.given:
            return True
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        timers, entry = None, None
        if deadline is not None:
            timers = deadlines()
            entry = timers.at(deadline, functools.partial(_wake, waiter))
        try:
            await waiter
        finally:
            if timers is not None and entry is not None:
                timers.drop(entry)
            self._waiters.remove(waiter)
        return self.given


def _wake(waiter: asyncio.Future[None], _: object = None) -> None:
    if not waiter.done():
        waiter.set_result(None)


async def wait_done(future: asyncio.Future[Any] | None, deadline: float) -> bool:
    """Wait until ``future`` is done or the loop's clock reaches ``deadline``; whether it is.

    No task and no timer of its own: a waiter future, woken by ``future`` or by `deadlines`.
    """
    if future is None or future.done():
        return True
    waiter = asyncio.get_running_loop().create_future()
    wake = functools.partial(_wake, waiter)
    future.add_done_callback(wake)
    timers = deadlines()
    entry = timers.at(deadline, wake)
    try:
        await waiter
    finally:
        future.remove_done_callback(wake)
        timers.drop(entry)
    return future.done()


async def wait_set(event: asyncio.Event, deadline: float) -> bool:
    """Wait until ``event`` is set or the loop's clock reaches ``deadline``; whether it is set.

    For an event that is set and cleared again (the SDK's, a shield's); a signal given once
    is a `Once`.
    """
    if event.is_set():
        return True
    # asyncio.timeout_at's way (cancel this task at the deadline, then take that cancel back),
    # on the loop's `Deadlines` rather than a loop timer and a Timeout of its own per wait.
    task = asyncio.current_task()
    assert task is not None
    cancelling = task.cancelling()
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        task.cancel()

    timers = deadlines()
    entry = timers.at(deadline, expire)
    try:
        await event.wait()
    except asyncio.CancelledError:
        # Ours, and only ours: the wait is over. Anyone else's cancel goes on up.
        if not expired or task.uncancel() > cancelling:
            raise
    finally:
        timers.drop(entry)
    return event.is_set()


# Past a deadline by this much, the loop itself was late: what it timed says nothing yet.
LATE = 0.1


async def wait_patiently(wait: Callable[[float], Awaitable[bool]], deadline: float, limit: float) -> bool:
    """``wait(deadline)``, not counting the time the loop itself ran late past ``deadline``.

    A loop busy with thousands of cancels runs everything late; a margin that ran out
    while it was that late is extended by the lateness, up to ``limit``.
    """
    loop = asyncio.get_running_loop()
    while not await wait(deadline):
        late = loop.time() - deadline
        if late < LATE or deadline >= limit:
            return False
        deadline = min(loop.time() + late, limit)
    return True


def deadline_in(seconds: float) -> float:
    """The loop's clock ``seconds`` from now."""
    return asyncio.get_running_loop().time() + seconds


def checked_seconds(name: str, value: Any) -> float:
    """``value`` as seconds, where the caller named it ``name``.

    Raises:
        TypeError, ValueError: naming ``name``, for what is not a finite number above 0.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number of seconds greater than 0, not {value!r}")
    return float(value)
