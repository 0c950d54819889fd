"""The example executor of the README's test, ready to sweep, and an agent card to serve it.

``a2a-cancelfix sweep a2a_cancelfix.testing.examples:Pipeline`` shows what its sweep looks like.

Three steps on a claimed input, as agents in production are built: scrub the input, orchestrate
tool calls, store the result (a write that must not be cut in half). The claim (a lease on the
input, a row locked in a database) is released however the run ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from a2a.helpers import new_task
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events.event_queue import EventQueue
from a2a.server.tasks import TaskUpdater
from a2a.types import AgentCapabilities, AgentCard, AgentInterface, AgentSkill, TaskState

from a2a_cancelfix import cancellable, checkpoint, shielded

__all__ = ["Pipeline", "card", "claim_released"]

LATENCY = 0.001
"""Seconds each call to the outside world takes here."""


async def io() -> None:
    """Stand in for a call to the outside world: an LLM, a tool, a database."""
    await asyncio.sleep(LATENCY)


@cancellable
async def scrub(text: str) -> str:
    await io()
    return text.strip()


@cancellable
async def orchestrate(text: str) -> list[str]:
    await io()
    return ["search", "summarise"]


async def call(tool: str) -> None:
    await io()


async def store(text: str) -> None:
    await io()


class Pipeline(AgentExecutor):
    """Scrub, orchestrate, store, holding a claim on the task's input throughout."""

    def __init__(self) -> None:
        self.claims: set[str] = set()

    @contextlib.asynccontextmanager
    async def claim(self, task_id: str) -> AsyncIterator[None]:
        await io()
        self.claims.add(task_id)
        try:
            yield
        finally:
            self.claims.discard(task_id)  # However the run ends.

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        task_id, context_id = context.task_id or "", context.context_id or ""
        updater = TaskUpdater(event_queue, task_id, context_id)
        if context.current_task is None:
            await event_queue.enqueue_event(new_task(task_id, context_id, TaskState.TASK_STATE_SUBMITTED))
        await updater.start_work()
        async with self.claim(task_id):
            text = await scrub(context.get_user_input())
            for tool in await orchestrate(text):
                await checkpoint()  # Between tool calls: a cancel stops before the next one.
                await call(tool)
            async with shielded():  # Stored whole, or not at all.
                await store(text)
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        return None  # Nothing to do here: the work stops at its checkpoints.


def claim_released(executor: Pipeline) -> bool:
    """The ``released`` predicate for `sweep`: the executor holds no claim."""
    return not executor.claims


card = AgentCard(
    name="pipeline",
    description="Scrubs, calls its tools, stores the result; cancel it at any time.",
    version="1.0.0",
    capabilities=AgentCapabilities(streaming=True),
    default_input_modes=["text/plain"],
    default_output_modes=["text/plain"],
    supported_interfaces=[
        AgentInterface(url="http://127.0.0.1:8000/", protocol_binding="JSONRPC", protocol_version="1.0")
    ],
    skills=[AgentSkill(id="pipeline", name="Pipeline", description="Processes a text.", tags=["text"])],
)
"""A spec-complete card for `Pipeline` (the SDK warns of one lacking a required field), as the
docs' snippets serve it; yours names your agent, as examples/server.py's does."""
