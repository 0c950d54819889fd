"""SIGTERM to a uvicorn server, as a deploy sends it, with streams open on running tasks.

At the signal, sse-starlette ends every event stream at once and uvicorn waits for the open
connections; the lifespan's ``aclose()`` comes after both. Ours begins its shutdown at the
signal and holds sse-starlette until its streams have closed on their tasks' terminal events
(a2a_cancelfix/_exit_signal.py). First the hook in process, on every release; then real server
processes, stock beside ours.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import types
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from a2a.server.context import ServerCallContext
from a2a.server.tasks import DatabaseTaskStore
from a2a.types import StreamResponse, Task
from google.protobuf import json_format
from sqlalchemy.ext.asyncio import create_async_engine

from a2a_cancelfix import _exit_signal
from a2a_cancelfix._exit_signal import ExitHook, Streams
from a2a_cancelfix.testing import (
    Gate,
    PushReceiver,
    ScriptedExecutor,
    Stream,
    make_server,
    start,
    wait_all_tasks_blocked,
    within,
)

from . import serving
from .sigterm_server import DRAIN, GRACE

HEADERS = {"A2A-Version": "1.0"}
# aclose()'s bound (docs/behaviour.md), from the signal; then uvicorn's own steps to its exit.
SHUTDOWN_BOUND = DRAIN + GRACE + 3.0
EXIT_BOUND = SHUTDOWN_BOUND + 2.0
BOUND = 20.0  # Anything else, with room for a loaded machine.
FORCED_EXIT_BOUND = 10.0  # A third of the drain the forced exit cuts short.


class AppStatus:
    """sse-starlette 3.x's ``AppStatus``, as _exit_signal.py uses it, for one test: the real
    one is the process's, and once it ends the streams it ends every later one at once."""

    def __init__(self, automatic: bool = True) -> None:
        self.enable_automatic_graceful_drain = automatic
        self.ended = asyncio.Event()  # should_exit was set: every stream ends.

    @property
    def should_exit(self) -> bool:
        return self.ended.is_set()

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        if value:
            self.ended.set()

    def disable_automatic_graceful_drain(self) -> None:
        self.enable_automatic_graceful_drain = False

    def enable_automatic_graceful_drain_mode(self) -> None:
        self.enable_automatic_graceful_drain = True


class Handler:
    """What the hook begins the shutdown of: a gate it waits at."""

    def __init__(self) -> None:
        self.shutdown = Gate()

    @staticmethod
    async def shut_down(handler: Handler) -> None:
        await handler.shutdown()


def hooked(
    status: AppStatus, handler: Handler, bound: float = BOUND
) -> tuple[ExitHook, list[tuple[int, bool]]]:
    """The hook, in front of a stand-in for uvicorn's handler that notes each signal and
    whether sse-starlette's automatic ending of streams was on as it came."""
    seen: list[tuple[int, bool]] = []

    def uvicorns(sig: int, frame: types.FrameType | None) -> None:
        seen.append((sig, status.enable_automatic_graceful_drain))

    hook = ExitHook(uvicorns, asyncio.get_running_loop(), Streams(status))
    hook.add(handler, Handler.shut_down, bound)
    return hook, seen


@pytest.mark.asyncio
async def test_the_exit_signal_begins_the_shutdown_and_the_streams_end_after_it() -> None:
    """At SIGTERM, sse-starlette's ending of streams is switched off before uvicorn's handler
    runs, the handler's shutdown begins, and the streams are ended only once it is over."""
    status, handler = AppStatus(), Handler()
    hook, seen = hooked(status, handler)
    hook(signal.SIGTERM, None)
    assert seen == [(signal.SIGTERM, False)]
    await within(handler.shutdown.reached.wait())
    assert not status.should_exit
    handler.shutdown.open()
    await within(status.ended.wait())
    assert status.enable_automatic_graceful_drain  # Back as it was.


@pytest.mark.asyncio
async def test_a_second_signal_ends_the_streams_at_once() -> None:
    """A second signal, the shutdown still going: the streams are ended at once, and uvicorn's
    handler sees the signal too (a second SIGINT forces its exit)."""
    status, handler = AppStatus(), Handler()
    hook, seen = hooked(status, handler)
    hook(signal.SIGTERM, None)
    await within(handler.shutdown.reached.wait())
    hook(signal.SIGINT, None)
    assert status.should_exit and seen[-1][0] == signal.SIGINT
    handler.shutdown.open()


@pytest.mark.asyncio
async def test_the_streams_end_at_the_bound_of_a_shutdown_that_does_not() -> None:
    """A shutdown that never returns holds the streams for its bound, no longer."""
    status, handler = AppStatus(), Handler()
    hook, _ = hooked(status, handler, bound=0.2)
    loop = asyncio.get_running_loop()
    signalled = loop.time()
    hook(signal.SIGTERM, None)
    await within(status.ended.wait())
    assert loop.time() - signalled >= 0.19  # The loop's clock may fire a timer a tick early.
    handler.shutdown.open()


@pytest.mark.asyncio
async def test_an_application_that_ends_the_streams_itself_is_left_to_it() -> None:
    """sse-starlette's automatic ending switched off by the application: the hook neither
    switches it on nor ends the streams; the shutdown still begins at the signal."""
    status, handler = AppStatus(automatic=False), Handler()
    hook, _ = hooked(status, handler)
    hook(signal.SIGTERM, None)
    await within(handler.shutdown.reached.wait())
    handler.shutdown.open()
    await wait_all_tasks_blocked()  # The hook's own ending, after the shutdown's.
    assert not status.should_exit and not status.enable_automatic_graceful_drain


@pytest.mark.asyncio
@pytest.mark.parametrize("sse_starlette", ["installed", "3.1"])
async def test_under_uvicorn_a_handler_hooks_the_exit_signal_or_warns_once(
    sse_starlette: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Under uvicorn's signal handlers, our handler's first message puts the hook in front of
    them, with the installed sse-starlette. With one that cannot hold its streams (before
    3.2), they stay uvicorn's, as the shutdown stays aclose()'s; one WARNING says so, once."""
    monkeypatch.setattr(_exit_signal, "_hook", None)
    monkeypatch.setattr(_exit_signal, "_warned", False)
    if sse_starlette == "3.1":
        older = types.ModuleType("sse_starlette.sse")
        older.AppStatus = type("AppStatus", (), {"should_exit": False})  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "sse_starlette.sse", older)
    else:
        import sse_starlette.sse  # What the SDK's routes import.
    server = uvicorn.Server(uvicorn.Config(app=None))
    with server.capture_signals(), caplog.at_level(logging.WARNING, logger="a2a_cancelfix"):
        uvicorns = signal.getsignal(signal.SIGTERM)
        for _ in range(2):
            ours = make_server("ours", ScriptedExecutor(park=True))
            await start(ours)
            await within(ours.handler.aclose())
        handlers = {signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)}
    warnings = [record for record in caplog.records if "sse-starlette" in record.getMessage()]
    if sse_starlette == "3.1":
        assert handlers == {uvicorns} and len(warnings) == 1
    else:
        assert all(isinstance(handler, ExitHook) for handler in handlers) and len(handlers) == 1
        assert not warnings
    assert signal.getsignal(signal.SIGTERM) is not uvicorns  # uvicorn put its saved ones back.


class SigtermServer:
    """tests/sigterm_server.py in a process of its own; it exits when its standard input closes."""

    def __init__(self, process: asyncio.subprocess.Process, port: int) -> None:
        self.process, self.url = process, f"http://127.0.0.1:{port}"

    @classmethod
    async def start(cls, kind: str, url: str, **environment: str) -> SigtermServer:
        process, port = await serving.start("sigterm_server", kind, url, **environment)
        return cls(process, port)

    async def exited(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for the process to exit; whether it has."""
        try:
            await asyncio.wait_for(self.process.wait(), seconds)
        except TimeoutError:
            return False
        return True

    async def refusing(self, seconds: float) -> bool:
        """Poll, up to ``seconds``, until the server takes no new connection (uvicorn closes its
        socket as it begins to shut down); whether it does."""
        host, port = self.url.removeprefix("http://").split(":")
        deadline = asyncio.get_running_loop().time() + seconds
        while asyncio.get_running_loop().time() < deadline:
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), seconds)
            except OSError:
                return True
            writer.close()
            await asyncio.sleep(0.05)  # A poll, on an observable condition, with a deadline.
        return False

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


async def sqlite_store(tmp_path: Path) -> str:
    """A fresh SQLite store's URL, its table made before the server's first save races to."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'tasks.db'}"
    engine = create_async_engine(url)
    await asyncio.wait_for(DatabaseTaskStore(engine).initialize(), BOUND)
    await engine.dispose()
    return url


async def stored(url: str, task_id: str) -> Task | None:
    engine = create_async_engine(url)
    try:
        return await asyncio.wait_for(DatabaseTaskStore(engine).get(task_id, ServerCallContext()), BOUND)
    finally:
        await engine.dispose()


def status_text(event: Any) -> str:
    return " ".join(part.text for part in event.status.message.parts)


# A real server process, a few seconds each; the path does not differ between releases.
@pytest.mark.edges_only
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
    url = await sqlite_store(tmp_path)
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


@pytest.mark.edges_only
@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["stock", "ours"])
async def test_a_second_sigint_forces_the_exit_as_uvicorn_does(kind: str, tmp_path: Path) -> None:
    """SIGTERM, then SIGINT (a second Ctrl-C), a run going and its stream open: the process
    exits at once, stock or ours, though ours' drain would have let the run go on for 30 s."""
    server = await SigtermServer.start(kind, await sqlite_store(tmp_path), A2ACF_DRAIN="30")
    try:
        async with httpx.AsyncClient(timeout=BOUND) as client:
            stream = over_json_rpc(client, server.url, "long")
            await stream.until(lambda: stream.last == "WORKING", BOUND)
            server.process.send_signal(signal.SIGTERM)
            # Sent at once, the two would be handled in signal number order, SIGINT first.
            assert await server.refusing(BOUND)
            server.process.send_signal(signal.SIGINT)
            loop = asyncio.get_running_loop()
            signalled = loop.time()
            exited = await server.exited(BOUND)
            took = loop.time() - signalled
            assert await stream.ended(BOUND)
    finally:
        await server.stop()
    assert exited and took < FORCED_EXIT_BOUND, took


@pytest.mark.edges_only
@pytest.mark.asyncio
async def test_sigterm_lets_the_last_run_finish_and_its_streams_show_completed(tmp_path: Path) -> None:
    """The one run going finishes a tenth of a second after SIGTERM: ours' shutdown goes on as
    soon as it has, yet its sender's stream and its subscriber, over REST, end on COMPLETED
    before the run's queues are closed, and the process exits well before the drain time.
    (Stock's outcome here is a race with sse-starlette's half-second look at the signal.)"""
    url = await sqlite_store(tmp_path)
    server = await SigtermServer.start("ours", url, A2ACF_DRAIN="10")
    try:
        async with httpx.AsyncClient(timeout=BOUND) as client:
            sender = over_rest(client, server.url, "finish")
            await sender.until(lambda: sender.last == "WORKING", BOUND)
            subscriber = subscribed_over_rest(client, server.url, sender.events[0].id)
            await subscriber.until(lambda: subscriber.events, BOUND)
            loop = asyncio.get_running_loop()
            signalled = loop.time()
            server.process.send_signal(signal.SIGTERM)
            for stream in (sender, subscriber):
                assert await stream.ended(BOUND) and stream.error is None, stream.error
            exited = await server.exited(BOUND)
            took = loop.time() - signalled
        task = await stored(url, sender.events[0].id)
    finally:
        await server.stop()
    assert sender.last == "COMPLETED" and subscriber.last == "COMPLETED"
    assert task is not None and task.status.state == sender.events[-1].status.state
    assert exited and took < 10.0 / 2, took
