"""SIGTERM to a real uvicorn server, as a deploy sends it, with streams open on running tasks.

At the signal, sse-starlette ends every event stream at once and uvicorn waits for the open
connections; the lifespan's ``aclose()`` comes after both. Ours begins its shutdown at the
signal and holds sse-starlette until its streams have closed on their tasks' terminal events.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from a2a.server.context import ServerCallContext
from a2a.server.tasks import DatabaseTaskStore
from a2a.types import StreamResponse, Task
from google.protobuf import json_format
from sqlalchemy.ext.asyncio import create_async_engine

from a2a_cancelfix.testing import PushReceiver, Stream

from .sigterm_server import DRAIN, GRACE

# A real server process, a few seconds each; the path does not differ between releases.
pytestmark = pytest.mark.edges_only

SERVER = Path(__file__).parent / "sigterm_server.py"
HEADERS = {"A2A-Version": "1.0"}
# aclose()'s bound (docs/behaviour.md), from the signal; then uvicorn's own steps to its exit.
SHUTDOWN_BOUND = DRAIN + GRACE + 3.0
EXIT_BOUND = SHUTDOWN_BOUND + 2.0
BOUND = 20.0  # Anything else, with room for a loaded machine.


class SigtermServer:
    """tests/sigterm_server.py in a process of its own; it exits when its standard input closes."""

    def __init__(self, process: asyncio.subprocess.Process, port: int) -> None:
        self.process, self.url = process, f"http://127.0.0.1:{port}"

    @classmethod
    async def start(cls, kind: str, url: str) -> SigtermServer:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            str(SERVER),
            kind,
            url,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            cwd=str(SERVER.parent.parent),
            env=os.environ.copy(),
        )
        line = await asyncio.wait_for(process.stdout.readline(), 60)
        if not line.startswith(b"READY "):
            process.kill()
            raise RuntimeError(f"server did not start: {line!r}")
        return cls(process, int(line.split()[1]))

    async def exited(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for the process to exit; whether it has."""
        try:
            await asyncio.wait_for(self.process.wait(), seconds)
        except asyncio.TimeoutError:
            return False
        return True

    async def stop(self) -> None:
        if self.process.returncode is None:
            self.process.stdin.close()
            if not await self.exited(10):
                self.process.kill()
                await self.process.wait()


def _event(data: dict[str, Any]) -> Any:
    """A Task or update from an SSE ``data:`` line: JSON-RPC's wraps it in ``result``."""
    event = StreamResponse()
    json_format.ParseDict(data.get("result", data), event, ignore_unknown_fields=True)
    return getattr(event, event.WhichOneof("payload"))


async def _events(client: httpx.AsyncClient, method: str, url: str, body: Any) -> AsyncIterator[Any]:
    async with client.stream(method, url, json=body, headers=HEADERS) as response:
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                yield _event(json.loads(line[5:]))


def _message(text: str, push_url: str | None) -> dict[str, Any]:
    configuration = {"taskPushNotificationConfig": {"url": push_url, "id": "p1"}} if push_url else {}
    message = {"role": "ROLE_USER", "messageId": uuid.uuid4().hex, "parts": [{"text": text}]}
    return {"message": message, "configuration": configuration}


def over_json_rpc(client: httpx.AsyncClient, url: str, text: str, push_url: str | None = None) -> Stream:
    request = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "SendStreamingMessage",
        "params": _message(text, push_url),
    }
    return Stream(_events(client, "POST", url + "/", request))


def over_rest(client: httpx.AsyncClient, url: str, text: str) -> Stream:
    return Stream(_events(client, "POST", url + "/rest/message:stream", _message(text, None)))


def subscribed_over_json_rpc(client: httpx.AsyncClient, url: str, task_id: str) -> Stream:
    request = {"jsonrpc": "2.0", "id": 2, "method": "SubscribeToTask", "params": {"id": task_id}}
    return Stream(_events(client, "POST", url + "/", request))


def subscribed_over_rest(client: httpx.AsyncClient, url: str, task_id: str) -> Stream:
    return Stream(_events(client, "POST", f"{url}/rest/tasks/{task_id}:subscribe", {}))


async def stored(url: str, task_id: str) -> Task | None:
    engine = create_async_engine(url)
    try:
        return await asyncio.wait_for(DatabaseTaskStore(engine).get(task_id, ServerCallContext()), BOUND)
    finally:
        await engine.dispose()


def status_text(event: Any) -> str:
    return " ".join(part.text for part in event.status.message.parts)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["stock", "ours", "patched"])
async def test_sigterm_ends_the_open_streams_on_their_tasks_terminal_events(
    kind: str, tmp_path: Path
) -> None:
    """SIGTERM with two tasks running, each with its sender's stream and a subscriber, over
    JSON-RPC and REST: ours (swapped in, or built by the SDK's class after ``patch()``) ends
    the run that does not finish within the drain CANCELED ("the server shut down") and lets
    the other complete; each stream ends on its task's terminal event, the store holds both,
    the push config hears CANCELED, and the process exits within the shutdown's bound.
    Stock's streams end on WORKING, as its store keeps it."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'tasks.db'}"
    engine = create_async_engine(url)
    await asyncio.wait_for(DatabaseTaskStore(engine).initialize(), BOUND)  # Before the server races to.
    await engine.dispose()
    server = await SigtermServer.start(kind, url)
    try:
        async with PushReceiver().serving() as pushed, httpx.AsyncClient(timeout=BOUND) as client:
            push_url = pushed.url + "push"
            long = over_json_rpc(client, server.url, "long", push_url)
            finishing = over_rest(client, server.url, "finish")
            for stream in (long, finishing):
                await stream.until(lambda stream=stream: stream.last == "WORKING", BOUND)
            long_id, finishing_id = long.events[0].id, finishing.events[0].id
            long_subscriber = subscribed_over_rest(client, server.url, long_id)
            finishing_subscriber = subscribed_over_json_rpc(client, server.url, finishing_id)
            for stream in (long_subscriber, finishing_subscriber):
                await stream.until(lambda stream=stream: stream.events, BOUND)  # The task, first.

            loop = asyncio.get_running_loop()
            signalled = loop.time()
            server.process.send_signal(signal.SIGTERM)
            streams = (long, finishing, long_subscriber, finishing_subscriber)
            for stream in streams:
                assert await stream.ended(BOUND) and stream.error is None, stream.error
            exited = await server.exited(BOUND if kind == "stock" else EXIT_BOUND)
            took = loop.time() - signalled
            received = list(pushed.received.get(push_url, []))
        long_stored = await stored(url, long_id)
        finishing_stored = await stored(url, finishing_id)
    finally:
        await server.stop()

    assert long_stored is not None and finishing_stored is not None
    if kind == "stock":
        assert long.last == "WORKING" and long_subscriber.last == "WORKING"
        assert long_stored.status.state == long.events[-1].status.state  # WORKING
        assert "CANCELED" not in received
        return
    assert long.last == "CANCELED" and long_subscriber.last == "CANCELED"
    assert "server shut down" in status_text(long.events[-1])
    assert finishing.last == "COMPLETED" and finishing_subscriber.last == "COMPLETED"
    assert long_stored.status.state == long.events[-1].status.state  # CANCELED
    assert "server shut down" in status_text(long_stored)
    assert finishing_stored.status.state == finishing.events[-1].status.state  # COMPLETED
    assert received[-1:] == ["CANCELED"], received
    assert exited and took <= EXIT_BOUND, took
