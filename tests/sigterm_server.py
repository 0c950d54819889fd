"""An A2A server under uvicorn, to be stopped with SIGTERM as a deploy stops it (test_sigterm.py).

Run as ``python -m tests.sigterm_server stock|ours|patched DATABASE_URL`` (``patched``: the
SDK's handler, built after ``a2a_cancelfix.patch()``, as a framework would build it); it prints ``READY <port>``
once it serves on 127.0.0.1 (JSON-RPC at ``/``, REST under ``/rest``), and exits when its
standard input closes, so it never outlives the test that started it. Its lifespan's shutdown
calls the handler's ``aclose()``, as the README wires it (stock's exists from a2a-sdk 1.1.2).
``A2ACF_DRAIN`` sets ours' ``shutdown_drain_time`` (1 s).

A message ``finish`` runs until the server has its exit signal, then completes a few steps
later; any other runs longer than the shutdown waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Callable

import httpx
import uvicorn
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.context import ServerCallContext
from a2a.server.events.event_queue import EventQueue
from a2a.server.request_handlers import DefaultRequestHandlerV2
from a2a.server.routes import create_jsonrpc_routes, create_rest_routes
from a2a.server.tasks import (
    BasePushNotificationSender,
    DatabaseTaskStore,
    InMemoryPushNotificationConfigStore,
)
from a2a.types import AgentCapabilities, AgentCard
from sqlalchemy.ext.asyncio import create_async_engine
from starlette.applications import Starlette

from a2a_cancelfix import DefaultRequestHandler, FinalStateTaskStore, cancellable, patch
from tests.serving import begin, serve

DRAIN = float(os.environ.get("A2ACF_DRAIN", 1.0))  # shutdown_drain_time
GRACE = 1.0  # cancel_grace_period
STEP_SECONDS = 0.02
LONG_STEPS = 1500  # 30 s: far past the shutdown's bound.
STEPS_AFTER_SIGNAL = 5  # A finishing run's last 0.1 s, well within the drain.


class Executor(AgentExecutor):
    """Works in short steps with a checkpoint after each."""

    def __init__(self, exiting: Callable[[], bool]) -> None:
        self.exiting = exiting

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        updater = await begin(context, event_queue)
        await updater.start_work()
        if context.get_user_input() == "finish":
            while not self.exiting():
                await self.step()
            for _ in range(STEPS_AFTER_SIGNAL):
                await self.step()
        else:
            for _ in range(LONG_STEPS):
                await self.step()
        await updater.complete()

    @cancellable
    async def step(self) -> None:
        await asyncio.sleep(STEP_SECONDS)  # Stands in for a slice of real work.

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        pass


def build(kind: str, url: str, exiting: Callable[[], bool]) -> Starlette:
    engine = create_async_engine(url)
    store = DatabaseTaskStore(engine)
    configs = InMemoryPushNotificationConfigStore()
    card = AgentCard(
        name="sigterm",
        description="test server",
        version="1",
        capabilities=AgentCapabilities(streaming=True, push_notifications=True),
    )
    arguments = {
        "agent_executor": Executor(exiting),
        "task_store": FinalStateTaskStore(store) if kind == "ours" else store,
        "agent_card": card,
        "push_config_store": configs,
        # The sender reads push configs as this owner (1.0.x): the anonymous HTTP caller's.
        "push_sender": BasePushNotificationSender(httpx.AsyncClient(), configs, ServerCallContext()),
    }
    if kind == "ours":
        handler = DefaultRequestHandler(**arguments, cancel_grace_period=GRACE, shutdown_drain_time=DRAIN)
    else:
        if kind == "patched":
            patch(cancel_grace_period=GRACE, shutdown_drain_time=DRAIN)
        handler = DefaultRequestHandlerV2(**arguments)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        aclose = getattr(handler, "aclose", None)  # Stock's: a2a-sdk 1.1.2+.
        if aclose is not None:
            await aclose()

    routes = [*create_rest_routes(handler, path_prefix="/rest"), *create_jsonrpc_routes(handler, rpc_url="/")]
    return Starlette(routes=routes, lifespan=lifespan)


async def main(kind: str, url: str) -> None:
    # uvicorn's handler of the exit signal sets should_exit.
    app = build(kind, url, lambda: server.should_exit)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    await serve(server)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
