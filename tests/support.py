"""Bounded waits the tests share beyond those of a2a_cancelfix.check (Gate, within, eventually)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import uvicorn

from a2a_cancelfix.check import BOUND, within


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


class _Server(uvicorn.Server):
    """A uvicorn server that says when it is up: an event rather than a flag to poll."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.up = asyncio.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        self.up.set()


@contextlib.asynccontextmanager
async def uvicorn_serving(
    app: Any, listener: socket.socket, *, shutdown_seconds: float = BOUND, **options: Any
) -> AsyncIterator[uvicorn.Server]:
    """Serve ``app`` on ``listener`` (a bound socket) until the block exits.

    Yields once the server is up; a startup that fails raises here, and one that takes longer
    than ``BOUND`` fails. So does a shutdown that takes longer than ``shutdown_seconds``.
    """
    server = _Server(uvicorn.Config(app, lifespan="off", **options))
    serving = asyncio.ensure_future(server.serve(sockets=[listener]))
    up = asyncio.ensure_future(server.up.wait())
    try:
        await within(asyncio.wait({up, serving}, return_when=asyncio.FIRST_COMPLETED))
        if serving.done():
            serving.result()  # Startup failed: raise its error here.
            raise RuntimeError("the server stopped before it was up")
        yield server
    finally:
        up.cancel()
        server.should_exit = True
        await within(serving, shutdown_seconds)
