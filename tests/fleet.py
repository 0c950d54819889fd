"""Many tasks at once, for the mass-cancel test and benchmark: an executor and how to start them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from a2a.helpers import new_task
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events.event_queue import EventQueue
from a2a.server.tasks import TaskUpdater
from a2a.types import SendMessageRequest, TaskState

from a2a_cancelfix.testing import BOUND, Server, Stream, caller, message, state_of, within


class FleetExecutor(AgentExecutor):
    """Many tasks at once: a message saying "park" asks for input, any other works until released.

    For mass cancels (``start_fleet`` starts them): tests/test_mass_cancel.py and
    benchmarks/mass_cancel.py.

    Args:
        publishes: ``cancel()`` publishes CANCELED itself; by default it is empty.
    """

    def __init__(self, publishes: bool = False) -> None:
        self.released = asyncio.Event()
        self.publishes = publishes

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        task_id, context_id = context.task_id or "", context.context_id or ""
        if context.current_task is None:
            await event_queue.enqueue_event(new_task(task_id, context_id, TaskState.TASK_STATE_SUBMITTED))
        updater = TaskUpdater(event_queue, task_id, context_id)
        if context.get_user_input() == "park":
            await updater.requires_input()
            return
        await updater.start_work()
        await self.released.wait()
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        if self.publishes:
            await TaskUpdater(event_queue, context.task_id or "", context.context_id or "").cancel()


async def start_fleet(server: Server, count: int, *, slowdown: float = 1.0) -> dict[str, Stream]:
    """Start ``count`` streamed tasks, half working and half parked; wait until all are stored so.

    For a ``FleetExecutor``'s server (``make_server``); each stream by its task's id.
    ``slowdown``: how many times slower than native the process runs (under valgrind, say),
    which the bound of the wait is stretched by.
    """
    settled = asyncio.Event()
    seen: set[int] = set()

    def note(index: int) -> Callable[[Any], None]:
        def on_event(event: Any) -> None:
            if state_of(event) in ("WORKING", "INPUT_REQUIRED"):
                seen.add(index)
                if len(seen) == count:
                    settled.set()

        return on_event

    streams = [
        Stream(
            server.handler.on_message_send_stream(
                SendMessageRequest(message=message("park" if index % 2 else "work")), caller()
            ),
            note(index),
        )
        for index in range(count)
    ]
    await within(settled.wait(), (BOUND + count / 20) * slowdown)
    return {stream.events[0].id: stream for stream in streams}
