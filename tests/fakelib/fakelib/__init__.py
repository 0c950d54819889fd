"""Calls into a library that suspend several times each, as LLM clients and tool SDKs do."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

LATENCY = 0.001


async def two_sleeps() -> str:
    """One call that suspends twice (a request, then its body)."""
    await asyncio.sleep(LATENCY)
    await asyncio.sleep(LATENCY)
    return "done"


async def chunks(count: int = 2) -> AsyncIterator[str]:
    """A stream whose every item suspends twice."""
    for number in range(count):
        await asyncio.sleep(LATENCY)
        await asyncio.sleep(LATENCY)
        yield f"chunk {number}"
