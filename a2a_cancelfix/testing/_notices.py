"""Notices between handlers of one process, as PostgreSQL's NOTIFY or Redis carry them between
replicas: the sweep's two replicas hear each other's cancels as a deployment with notices does."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from a2a_cancelfix.notices import CancelNotices


class LocalNotices(CancelNotices):
    """Every announcement reaches every listener of this object, at once."""

    def __init__(self) -> None:
        super().__init__()
        self._listeners: set[asyncio.Queue[str]] = set()

    async def announce(self, task_id: str) -> None:
        await self._send(task_id)

    async def _send(self, notice: str) -> None:
        for listener in self._listeners:
            listener.put_nowait(notice)

    @contextlib.asynccontextmanager
    async def listen(self) -> AsyncIterator[AsyncIterator[str | None]]:
        heard: asyncio.Queue[str] = asyncio.Queue()
        self._listeners.add(heard)
        try:
            yield _ids(heard)
        finally:
            self._listeners.discard(heard)


async def _ids(heard: asyncio.Queue[str]) -> AsyncIterator[str | None]:
    yield None  # Listening from now on.
    while True:
        yield await heard.get()
