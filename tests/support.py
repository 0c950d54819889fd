"""Bounded waits the tests share, beyond a2a_cancelfix.testing's (Gate, within, Changes,
wait_all_tasks_blocked)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any

from a2a_cancelfix.testing import BOUND, wait_all_tasks_blocked, within


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


async def _holds(condition: Callable[[], object]) -> bool:
    value = condition()
    return bool(await value) if inspect.isawaitable(value) else bool(value)


async def _one_wakes() -> None:
    """Wait until a future another task awaits is done, or the loop's next timer is due."""
    loop = asyncio.get_running_loop()
    this = asyncio.current_task()
    waiters = [getattr(task, "_fut_waiter", None) for task in asyncio.all_tasks(loop) if task is not this]
    if any(waiter is None or waiter.done() for waiter in waiters):
        return  # One is runnable already.
    woken = loop.create_future()

    def wake(_: object = None) -> None:
        if not woken.done():
            woken.set_result(None)

    for waiter in waiters:
        waiter.add_done_callback(wake)
    timers = [timer.when() for timer in getattr(loop, "_scheduled", ()) if not timer.cancelled()]
    timer = loop.call_at(min(timers), wake) if timers else None
    try:
        await woken
    finally:
        for waiter in waiters:
            waiter.remove_done_callback(wake)
        if timer is not None:
            timer.cancel()


def tasks_since(before: set[asyncio.Task[Any]]) -> set[asyncio.Task[Any]]:
    """The tasks started since ``before`` was taken that have not ended, but the caller's own."""
    return asyncio.all_tasks() - before - {asyncio.current_task()}


async def set_within(event: asyncio.Event, seconds: float) -> bool:
    """Whether ``event`` is set within ``seconds``: for an event that a timer may cause."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(event.wait(), seconds)
    return event.is_set()


@contextlib.contextmanager
def logged(text: str, logger: str = "a2a_cancelfix") -> Iterator[asyncio.Event]:
    """An event, set once ``logger`` emits a record whose message contains ``text``.

    The logger's level must let the record through (``caplog.at_level``).
    """
    loop = asyncio.get_running_loop()
    event = asyncio.Event()

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if text in record.getMessage():
                loop.call_soon_threadsafe(event.set)

    handler = Seen()
    logging.getLogger(logger).addHandler(handler)
    try:
        yield event
    finally:
        logging.getLogger(logger).removeHandler(handler)


