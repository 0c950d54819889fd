"""Recorders of what a task's observers see: the events of a stream, the posts to a push config."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from a2a.types import Task, TaskState, TaskStatusUpdateEvent

from a2a_cancelfix._sdk import state_name
from a2a_cancelfix.testing import _wire
from a2a_cancelfix.testing.waits import BOUND, Changes


class PushReceiver:
    """Record the task state of every push notification posted to it, per URL posted to.

    Receive in process by handing ``client`` (an httpx client whose transport is this
    receiver) to the SDK's push sender; or, from a server's own client or another process,
    over a real socket while ``serving()``.
    """

    def __init__(self) -> None:
        self.received: dict[str, list[str]] = {}
        """The states posted to each URL, in order, without ``TASK_STATE_`` ("?" where none)."""
        self.url = ""
        """While ``serving()``: ``http://127.0.0.1:<port>/``, which a push config's URL extends."""
        self.changes = Changes()  # At each post.
        self.client = httpx.AsyncClient(transport=httpx.MockTransport(self._receive))

    def _receive(self, request: httpx.Request) -> httpx.Response:
        self._record(str(request.url), request.content)
        return httpx.Response(200)

    def _record(self, url: str, content: bytes) -> None:
        state = _find_state(json.loads(content or b"{}"))
        self.received.setdefault(url, []).append(state or "?")
        self.changes.notify()

    async def posted(self, url: str, state: str, seconds: float = BOUND) -> None:
        """Wait until a notification of ``state`` has been posted to ``url``; fail fast after
        ``seconds``."""
        await self.changes.until(lambda: state in self.received.get(url, ()), seconds)

    @contextlib.asynccontextmanager
    async def serving(self, **options: Any) -> AsyncIterator[PushReceiver]:
        """Receive posts to ``url`` and any path below it on 127.0.0.1 until the block exits.

        ``options`` go to ``_wire.uvicorn_serving``.
        """
        # As in _wire, the HTTP server's packages are needed only once something is served.
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import Response
        from starlette.routing import Route

        async def receive(request: Request) -> Response:
            self._record(str(request.url), await request.body())
            return Response(status_code=200)

        listener = _wire.free_socket()
        self.url = f"http://127.0.0.1:{listener.getsockname()[1]}/"
        app = Starlette(routes=[Route("/{path:path}", receive, methods=["POST"])])
        async with _wire.uvicorn_serving(app, listener, **options):
            yield self


def _find_state(body: Any) -> str | None:
    """The task state named anywhere in a push payload."""
    if isinstance(body, dict):
        for key, value in body.items():
            if key == "state" and value in TaskState.DESCRIPTOR.values_by_name:
                return state_name(TaskState.Value(value))
            found = _find_state(value)
            if found:
                return found
    if isinstance(body, list):
        for value in body:
            found = _find_state(value)
            if found:
                return found
    return None


class Stream:
    """Drain a stream of task events in the background; remember every event.

    The events of a handler's stream, a client's, or any async iterator of Tasks and updates;
    ``on_event`` is called with each as it comes.
    """

    def __init__(self, events: AsyncIterator[Any], on_event: Callable[[Any], None] | None = None) -> None:
        self.events: list[Any] = []
        self.error: BaseException | None = None
        self._on_event = on_event
        self.changes = Changes()  # At each event, and when the stream ends.
        self.task = asyncio.ensure_future(self._drain(events))
        self.task.add_done_callback(lambda _: self.changes.notify())

    async def _drain(self, events: AsyncIterator[Any]) -> None:
        try:
            async for event in events:
                self.events.append(event)
                self.changes.notify()
                if self._on_event is not None:
                    self._on_event(event)
        except Exception as error:  # The stream's outcome, reported by ``last``.
            self.error = error

    async def ended(self, seconds: float = BOUND) -> bool:
        """Wait up to ``seconds`` for the stream to end; whether it has."""
        await asyncio.wait({self.task}, timeout=seconds)  # Its consumer may have been cancelled.
        return self.task.done()

    async def until(self, condition: Callable[[], object], seconds: float = BOUND) -> None:
        """Wait until ``condition()`` holds, checked at each event and at the stream's end."""
        await self.changes.until(condition, seconds)

    @property
    def last(self) -> str:
        """The last task state the stream showed, the name of the error it ended with, or "nothing"."""
        if self.error is not None:
            return type(self.error).__name__
        states = [state for event in self.events if (state := state_of(event))]
        return states[-1] if states else "nothing"


def state_of(event: Any) -> str | None:
    """The state a Task or status update shows, without its ``TASK_STATE_`` prefix; None for other events."""
    if isinstance(event, (Task, TaskStatusUpdateEvent)):
        return state_name(event.status.state)
    return None
