"""Asyncio plumbing, once: bounded waits that create no task, and background work kept alive."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

try:
    from asyncio import timeout_at as _timeout_at  # Python 3.11+
except ImportError:  # pragma: no cover - Python 3.10: a task per wait, as wait_for does.
    _timeout_at = None

logger = logging.getLogger("a2a_cancelfix")

T = TypeVar("T")

# The loop keeps only weak references to tasks: a task nobody holds can vanish mid-run.
_background: set[asyncio.Future[Any]] = set()


def keep(work: Awaitable[T]) -> asyncio.Future[T]:
    """Run ``work`` in the background, referenced until it ends; its failure is logged."""
    task = asyncio.ensure_future(work)
    _background.add(task)
    task.add_done_callback(_forget)
    return task


def _forget(task: asyncio.Future[Any]) -> None:
    _background.discard(task)
    if not task.cancelled() and task.exception() is not None:
        logger.error("background work of a2a-cancelfix failed", exc_info=task.exception())


async def wait_set(event: asyncio.Event, deadline: float) -> bool:
    """Wait until ``event`` is set or the loop's clock reaches ``deadline``; whether it is set."""
    if not event.is_set():
        try:
            if _timeout_at is None:
                await asyncio.wait_for(event.wait(), max(deadline - asyncio.get_running_loop().time(), 0))
            else:
                async with _timeout_at(deadline):
                    await event.wait()
        except asyncio.TimeoutError:
            pass
    return event.is_set()


async def wait_done(future: asyncio.Future[Any] | None, deadline: float) -> bool:
    """Wait until ``future`` is done or the loop's clock reaches ``deadline``; whether it is."""
    if future is None:
        return True
    if not future.done():
        await asyncio.wait({future}, timeout=max(deadline - asyncio.get_running_loop().time(), 0))
    return future.done()


def deadline_in(seconds: float) -> float:
    """The loop's clock ``seconds`` from now."""
    return asyncio.get_running_loop().time() + seconds
