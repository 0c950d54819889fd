"""Agents whose every move a test scripts: where they stop, how they answer a cancel."""

from __future__ import annotations

import asyncio
import contextlib

from a2a.helpers import new_task
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events.event_queue import EventQueue
from a2a.server.tasks import TaskUpdater
from a2a.types import Artifact, Part, TaskArtifactUpdateEvent, TaskState

from a2a_cancelfix.checkpoints import shielded
from a2a_cancelfix.testing.waits import Gate

IO_LATENCY = 0.05
"""How long the I/O of an executor's ``cancel()`` takes, in seconds."""


class ScriptedExecutor(AgentExecutor):
    """An agent that works one step (held at a gate) or parks for input, then completes.

    Args:
        park: ask for input instead of working, on the first message.
        cancel: what ``cancel()`` does: "empty", "publish" (CANCELED at once), "io" (awaits
            I/O, then publishes CANCELED), "gate" (waits at ``cancel_gate``, then publishes),
            "raise" or "hang".
        swallow: ``execute()`` swallows ``CancelledError`` and keeps running until released.
        shield: the step runs in a ``shielded()`` section.
        burst: how many artifact updates (streamed tokens) it enqueues before the step.
        linger: once COMPLETED is enqueued, ``execute()`` waits at ``finish`` before returning.
    """

    def __init__(
        self,
        *,
        park: bool = False,
        cancel: str = "empty",
        swallow: bool = False,
        shield: bool = False,
        burst: int = 0,
        linger: bool = False,
    ) -> None:
        self.park, self.cancel_mode, self.swallow = park, cancel, swallow
        self.shield, self.burst, self.linger = shield, burst, linger
        self.task_id: str | None = None
        self.step = Gate()
        self.finish = Gate()
        self.ready = asyncio.Event()
        self.cancel_called = asyncio.Event()
        self.cancel_returned = asyncio.Event()
        self.cancels = 0
        self.cancel_gate = Gate()
        self.completed = asyncio.Event()
        self.stopped = asyncio.Event()
        self.released = asyncio.Event()
        self.runs = 0

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        self.task_id, self.runs = context.task_id, self.runs + 1
        updater = TaskUpdater(event_queue, context.task_id or "", context.context_id or "")
        try:
            if context.current_task is None:
                await event_queue.enqueue_event(
                    new_task(
                        context.task_id or "",
                        context.context_id or "",
                        TaskState.TASK_STATE_SUBMITTED,
                        history=[context.message] if context.message else [],
                    )
                )
            await updater.start_work()
            if self.park and self.runs == 1:
                await updater.requires_input()
                self.ready.set()
                return
            for token in range(self.burst):
                await event_queue.enqueue_event(_token(context, token))
            self.ready.set()
            if self.shield:
                async with shielded():
                    await self._work_step()
            else:
                await self._work_step()
            await updater.complete()
            self.completed.set()
            if self.linger:
                await self.finish()
        finally:
            self.stopped.set()

    async def _work_step(self) -> None:
        if not self.swallow:
            await self.step()
            return
        self.step.reached.set()
        while not self.released.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await self.released.wait()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        self.cancel_called.set()
        self.cancels += 1
        mode = self.cancel_mode
        if mode == "raise":
            raise RuntimeError("cancel() failed")
        if mode == "hang":
            await asyncio.Event().wait()
        if mode == "io":
            await asyncio.to_thread(_io, IO_LATENCY)
        if mode == "gate":
            await self.cancel_gate()
        if mode in ("publish", "io", "gate"):
            await TaskUpdater(event_queue, context.task_id or "", context.context_id or "").cancel()
        self.cancel_returned.set()


def _token(context: RequestContext, index: int) -> TaskArtifactUpdateEvent:
    """One streamed token of the answer."""
    return TaskArtifactUpdateEvent(
        task_id=context.task_id or "",
        context_id=context.context_id or "",
        artifact=Artifact(artifact_id="answer", parts=[Part(text=f"token {index} ")]),
        append=index > 0,
    )


def _io(seconds: float) -> None:
    """Stand in for the network round trip of a real ``cancel()``."""
    import time

    time.sleep(seconds)
