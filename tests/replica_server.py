"""One replica of an A2A server for the multi-process tests: our handler on a shared store.

Run as ``python -m tests.replica_server DATABASE_URL [SCHEMA]``; it prints ``READY <port>``
once it serves on 127.0.0.1, and exits when its standard input closes, so it never outlives
the test that started it. ``A2ACF_NOTICES`` (``postgres`` or a Redis URL) gives its store
notices, ``A2ACF_POLL`` its poll interval, and ``A2ACF_CLUSTER`` puts it in upstream's
cluster mode (a versioned store, an event stream tailing its journal).
"""

from __future__ import annotations

import asyncio
import os
import sys

import httpx
import uvicorn
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.context import ServerCallContext
from a2a.server.events.event_queue import EventQueue
from a2a.server.routes import create_jsonrpc_routes, create_rest_routes
from a2a.server.tasks import (
    BasePushNotificationSender,
    DatabaseTaskStore,
    InMemoryPushNotificationConfigStore,
)
from a2a.types import AgentCapabilities, AgentCard
from sqlalchemy.ext.asyncio import create_async_engine
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from a2a_cancelfix import DefaultRequestHandler, FinalStateTaskStore, cancellable
from tests.serving import begin, serve

POLL_INTERVAL = float(os.environ.get("A2ACF_POLL", 0.2))
STEP_SECONDS = 0.02
STEPS = 1500


class StepExecutor(AgentExecutor):
    """Works in short steps with a checkpoint after each; records what cancel() saw."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []
        self.stopped: list[str] = []

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        updater = await begin(context, event_queue)
        task_id = context.task_id or ""
        try:
            await updater.start_work()
            for _ in range(STEPS):
                await self.step()
            await updater.complete()
        finally:
            self.stopped.append(task_id)

    @cancellable
    async def step(self) -> None:
        await asyncio.sleep(STEP_SECONDS)  # Stands in for a slice of real work.

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        self.cancelled.append(context.task_id or "")


def build(url: str, schema: str | None) -> Starlette:
    connect_args = {"server_settings": {"search_path": schema, "application_name": schema}} if schema else {}
    engine = create_async_engine(url, connect_args=connect_args)
    notices = os.environ.get("A2ACF_NOTICES") or None
    if notices and notices != "postgres":
        import redis.asyncio as redis

        notices = redis.Redis.from_url(notices)
    event_stream = None
    if os.environ.get("A2ACF_CLUSTER"):  # upstream's cluster mode (a2a-sdk 1.2+)
        from a2a.server.cluster import DatabaseTaskEventStream, VersionedDatabaseTaskStore

        store = FinalStateTaskStore(VersionedDatabaseTaskStore(engine), notices=notices)
        event_stream = DatabaseTaskEventStream(engine, poll_interval_s=0.05)
    else:
        store = FinalStateTaskStore(DatabaseTaskStore(engine), notices=notices)
    executor = StepExecutor()
    configs = InMemoryPushNotificationConfigStore()
    card = AgentCard(
        name="replica",
        description="test replica",
        version="1",
        capabilities=AgentCapabilities(streaming=True, push_notifications=True),
    )
    handler = DefaultRequestHandler(
        executor,
        store,
        card,
        push_config_store=configs,
        # The sender reads push configs as this owner (1.0.x): the anonymous HTTP caller's.
        push_sender=BasePushNotificationSender(httpx.AsyncClient(), configs, ServerCallContext()),
        cancel_grace_period=2.0,
        replica_poll_interval=POLL_INTERVAL,
        **({"event_stream": event_stream} if event_stream is not None else {}),
    )

    async def debug(request):  # What this replica's executor saw.
        return JSONResponse({"cancelled": executor.cancelled, "stopped": executor.stopped})

    routes = [
        Route("/debug", debug),
        *create_rest_routes(handler, path_prefix="/rest"),
        *create_jsonrpc_routes(handler, rpc_url="/"),
    ]
    return Starlette(routes=routes)


async def main(url: str, schema: str | None) -> None:
    await serve(uvicorn.Server(uvicorn.Config(build(url, schema), log_level="warning", lifespan="off")))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None))
