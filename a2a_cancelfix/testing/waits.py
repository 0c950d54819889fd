"""Bounded waits: gates that hold the code under test at a known point, and waits that fail fast."""

from __future__ import annotations

import asyncio
import inspect
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from a2a_cancelfix.testing._clock import VirtualTimeLoop

T = TypeVar("T")

BOUND = 2.5
"""The default bound of every wait, in seconds; a scenario still running after it is reported as HANG."""


class Gate:
    """Park the code under test at a known point until the test opens it.

    Await the gate where the code should stop; ``reached`` is set once it is there.
    """

    def __init__(self) -> None:
        self.reached = asyncio.Event()
        self._open = asyncio.Event()

    async def __call__(self) -> None:
        self.reached.set()
        await self._open.wait()

    def open(self) -> None:
        """Let whoever waits at the gate, and whoever comes to it later, go on."""
        self._open.set()


async def within(awaitable: Awaitable[Any], seconds: float = BOUND) -> Any:
    """Fail fast instead of hanging when a bug keeps something waiting forever."""
    # wait_for, not _aio.bounded: the sweeps' rows are timed in loop turns taken with its task.
    return await asyncio.wait_for(awaitable, seconds)


class Changes:
    """Wakes whoever waits for a condition on something each time that something changes.

    The code that changes it calls ``notify()``; a waiter re-checks its condition then, and
    only then, instead of polling it.
    """

    def __init__(self) -> None:
        self._changed: asyncio.Event | None = None  # Made by the first waiter: notify() is free.

    def notify(self) -> None:
        """Say that something changed: every waiter re-checks its condition."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def until(self, condition: Callable[[], object], seconds: float = BOUND) -> None:
        """Wait until ``condition()`` (a value or an awaitable) holds, checked at once and at
        each change; fail fast after ``seconds``."""

        async def waiting() -> None:
            while True:
                changed = self._changed = self._changed or asyncio.Event()
                if await _holds(condition):
                    return
                await changed.wait()

        await within(waiting(), seconds)


async def wait_all_tasks_blocked(seconds: float = BOUND) -> None:
    """Wait until every other task waits on something not yet done and no callback is due.

    Then everything the code under test can do on its own has been done: what is left waits
    for a timer, a thread or the network. For checking that something did *not* happen, and
    for what the code does asynchronously that no event announces. Fails fast after
    ``seconds`` if the loop never gets there (a task that never blocks).
    """
    await within(_all_tasks_blocked(), seconds)


async def eventually(condition: Callable[[], object], seconds: float = BOUND) -> None:
    """Wait until ``condition()`` (a value or an awaitable) holds, when no event announces it.

    For the SDK's own state, such as its registry of runs. The condition is checked at once,
    then each time every other task has blocked (`wait_all_tasks_blocked`), and then not
    again until one of them is woken or a timer of the loop is due. Fails fast after
    ``seconds``.
    """

    async def waiting() -> None:
        while not await _holds(condition):
            await wait_all_tasks_blocked(seconds)
            if await _holds(condition):
                return
            await _one_wakes()

    await within(waiting(), seconds)


async def _one_wakes() -> None:
    """Wait until a future another task awaits is done, or the loop's next timer is due."""
    loop = asyncio.get_running_loop()
    this = asyncio.current_task()
    waiters: list[asyncio.Future[Any] | None] = [
        getattr(task, "_fut_waiter", None) for task in asyncio.all_tasks(loop) if task is not this
    ]
    if any(waiter is None or waiter.done() for waiter in waiters):
        return  # One is runnable already.
    waiting = [waiter for waiter in waiters if waiter is not None]
    woken = loop.create_future()

    def wake(_: object = None) -> None:
        if not woken.done():
            woken.set_result(None)

    for waiter in waiting:
        waiter.add_done_callback(wake)
    timers = [timer.when() for timer in getattr(loop, "_scheduled", ()) if not timer.cancelled()]
    timer = loop.call_at(min(timers), wake) if timers else None
    try:
        await woken
    finally:
        for waiter in waiting:
            waiter.remove_done_callback(wake)
        if timer is not None:
            timer.cancel()


async def _holds(condition: Callable[[], object]) -> bool:
    value = condition()
    return bool(await value) if inspect.isawaitable(value) else bool(value)


# The task of each loop that looks for everyone blocked. Two looking at once would each see
# the other run, for ever: a second one waits for the first, then looks itself.
_looking: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Task[Any]] = (
    weakref.WeakKeyDictionary()
)


async def _all_tasks_blocked() -> None:
    loop = asyncio.get_running_loop()
    while (other := _looking.get(loop)) is not None and not other.done():
        await asyncio.wait({other})
    this = _looking[loop] = asyncio.current_task()  # type: ignore[assignment]
    try:
        while True:
            # One turn of the loop, which also polls for I/O: the other tasks run until they block.
            await asyncio.sleep(0)
            if _others_blocked():
                return
    finally:
        if _looking.get(loop) is this:
            del _looking[loop]


def _others_blocked() -> bool:
    """Whether no callback is due and every other task waits on a future not yet done."""
    loop = asyncio.get_running_loop()
    if getattr(loop, "_ready", None):  # asyncio's own loop: callbacks due this turn or the next.
        return False
    this = asyncio.current_task()
    for task in asyncio.all_tasks(loop):
        waiter = getattr(task, "_fut_waiter", None)  # What the task awaits (None: runnable).
        if task is not this and (waiter is None or waiter.done()):
            return False
    return True


async def answer_or_hang(call: Awaitable[str], seconds: float) -> str:
    """What ``call`` answers, or ``HANG`` when it has not answered within ``seconds``."""
    try:
        return await asyncio.wait_for(call, seconds)
    except TimeoutError:
        return "HANG"


def in_own_loop(main: Callable[..., Awaitable[T]], *args: Any, real_time: bool = False) -> T:
    """Run ``main(*args)`` in an event loop of its own, then cancel what it left running.

    What one run leaves behind (a stock handler's hung request, an executor's stray task)
    stays in its loop and cannot block the next; the clean-up waits on nothing forever. The
    loop's clock skips the waits only its timers could end (see `VirtualTimeLoop`), unless
    ``real_time``.
    """
    loop = asyncio.new_event_loop() if real_time else VirtualTimeLoop()
    try:
        return loop.run_until_complete(main(*args))
    finally:
        pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.wait(pending, timeout=1.0))
        for task in pending:
            if task.done() and not task.cancelled():
                task.exception()
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
