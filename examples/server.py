"""A complete A2A server whose cancels end: run `python examples/server.py`, then cancel away."""

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import uvicorn
from a2a.helpers import new_task
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events.event_queue import EventQueue
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types import AgentCapabilities, AgentCard, AgentInterface, AgentSkill, TaskState
from starlette.applications import Starlette

from a2a_cancelfix import DefaultRequestHandler, cancellable

URL = "http://127.0.0.1:8000/"


class Summariser(AgentExecutor):
    """Summarises in five steps, each one call to a model."""

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        task_id, context_id = context.task_id or "", context.context_id or ""
        if context.current_task is None:  # The Task first: the SDK wants it before any update.
            await event_queue.enqueue_event(new_task(task_id, context_id, TaskState.TASK_STATE_SUBMITTED))
        updater = TaskUpdater(event_queue, task_id, context_id)
        await updater.start_work()
        for part in range(5):
            await self.summarise(part)
        await updater.complete()

    @cancellable  # A checkpoint before and after each step.
    async def summarise(self, part: int) -> None:
        await asyncio.sleep(1.0)  # Stands in for the model's answer.

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        pass  # Nothing to release: the handler ends the task CANCELED once the work has stopped.


card = AgentCard(
    name="summariser",
    description="Summarises in five steps; cancel it at any time.",
    version="1.0.0",
    capabilities=AgentCapabilities(streaming=True),
    default_input_modes=["text/plain"],
    default_output_modes=["text/plain"],
    supported_interfaces=[AgentInterface(url=URL, protocol_binding="JSONRPC", protocol_version="1.0")],
    skills=[AgentSkill(id="summarise", name="Summarise", description="Summarises a text.", tags=["text"])],
)
handler = DefaultRequestHandler(Summariser(), InMemoryTaskStore(), card, cancel_grace_period=5.0)


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    # Starts the handler in the server's loop (its lease, over a database store); on leaving,
    # awaits handler.aclose(): lets the runs finish, cancels what is left, sends queued pushes.
    # Under uvicorn, that began at SIGTERM, so that every open stream ended on its task's end.
    async with handler:
        yield


app = Starlette(
    routes=[*create_agent_card_routes(card), *create_jsonrpc_routes(handler, rpc_url="/")],
    lifespan=lifespan,
)

if __name__ == "__main__":
    logging.basicConfig(format="%(levelname)s:  %(name)s: %(message)s")  # WARNING and above, from all.
    logging.getLogger("a2a_cancelfix").setLevel(logging.INFO)  # And one line per cancel.
    uvicorn.run(app, host="127.0.0.1", port=8000)
