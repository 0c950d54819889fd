"""What an end-to-end test holds: its servers, clients and streams, and a bounded wait."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

from a2a.client import Client
from a2a.types import SendMessageConfiguration, SendMessageRequest, TaskPushNotificationConfig

from a2a_cancelfix.testing import BOUND, PushReceiver, ScriptedExecutor, Stream, message, within

from .clients import connect, payloads
from .servers import Agent, serve_agent


class Wire:
    """The servers, clients and streams of one test, torn down in reverse when it ends."""

    def __init__(self, transport: str) -> None:
        self.transport = transport
        self._resources = contextlib.AsyncExitStack()
        self._executors: list[ScriptedExecutor] = []
        self._streams: list[Stream] = []

    async def serve(
        self, executor: ScriptedExecutor | None = None, *, stock: bool = False, **options: Any
    ) -> Agent:
        """An agent server for ``executor``, behind our handler (with ``options``) or
        (``stock``) the SDK's."""
        executor = executor or ScriptedExecutor()
        self._executors.append(executor)
        return await self._resources.enter_async_context(
            serve_agent(self.transport, executor, stock=stock, **options)
        )

    async def connect(self, agent: Agent, user: str | None = None) -> Client:
        return await self._resources.enter_async_context(connect(agent, user))

    async def push_receiver(self) -> PushReceiver:
        """A push receiver on 127.0.0.1, for the servers' push configs to post to."""
        return await self._resources.enter_async_context(PushReceiver().serving())

    def watch(self, responses: AsyncIterator[Any]) -> Stream:
        """Drain a client's event stream in the background."""
        stream = Stream(payloads(responses))
        self._streams.append(stream)
        return stream

    async def start(self, client: Client, agent: Agent, *, push_url: str | None = None) -> tuple[Stream, str]:
        """Stream a message; return once the run is mid-step (or parked) and the stream shows it."""
        configuration = SendMessageConfiguration()
        if push_url:
            configuration.task_push_notification_config.CopyFrom(
                TaskPushNotificationConfig(url=push_url, id=uuid.uuid4().hex)
            )
        request = SendMessageRequest(message=message(), configuration=configuration)
        stream = self.watch(client.send_message(request))
        executor = agent.executor
        await within(executor.ready.wait() if executor.park else executor.step.reached.wait())
        # The SDK stores each event before it streams it: seen here, GetTask shows it too.
        await stream.until(lambda: stream.last == ("INPUT_REQUIRED" if executor.park else "WORKING"))
        return stream, executor.task_id or ""

    async def aclose(self) -> None:
        for stream in self._streams:  # Streams first: an open stream delays server shutdown.
            stream.task.cancel()
        await within(asyncio.gather(*(stream.task for stream in self._streams), return_exceptions=True))
        for executor in self._executors:  # Let any run still held at a gate finish.
            executor.step.open()
            executor.cancel_gate.open()
            executor.released.set()
        await self._resources.aclose()  # Clients, then servers.
        # Nothing outlives the test. What still runs was left by the SDK: up to 1.1.5 a run's
        # producer can wait forever on a subscriber queue never acknowledged; sse-starlette's
        # per-thread shutdown watcher only lets the next test's loop start its own once it ends.
        leftovers = asyncio.all_tasks() - {asyncio.current_task()}
        for task in leftovers:
            task.cancel()
        if leftovers:
            await asyncio.wait(leftovers, timeout=BOUND)
        for task in leftovers:
            if task.done() and not task.cancelled():
                task.exception()  # Retrieved: its error is the SDK's, not this test's.
