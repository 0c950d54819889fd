"""Waiting on the cancel path: one wake-up per wait, and no task of its own."""

from __future__ import annotations

import asyncio

try:
    from asyncio import timeout_at as _timeout_at  # Python 3.11+
except ImportError:  # pragma: no cover - Python 3.10: a task per wait, as wait_for does.
    _timeout_at = None


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
