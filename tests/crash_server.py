"""One replica for the crash-recovery tests: runs that never end by themselves, on a shared store.

Run as ``python -m tests.crash_server DATABASE_URL [SCHEMA]``; it prints ``READY <port>`` once it
serves on 127.0.0.1 and stops as uvicorn does at SIGTERM (its lifespan closing the handler) or
when its standard input closes, so it never outlives the test that started it. Options, from
the environment:

- ``A2ACF_HANDLER``: ``ours`` (the default) or ``stock`` (the SDK's own handler and store);
- ``A2ACF_LEASE_TIME``: our handler's ``lease_time`` (``off`` for None; unset, its default);
- ``A2ACF_SOLE_REPLICA``: ``1`` for our handler's ``sole_replica``;
- ``A2ACF_DRAIN``: our handler's ``shutdown_drain_time``;
- ``A2ACF_NOTICES``: ``postgres`` or a Redis URL; ``A2ACF_CHANNEL``, their channel;
- ``A2ACF_RUNLOG``: a file each run appends a line to as it starts, as its ``cancel()`` is
  called and as it stops: ``<time.time()> <pid> start|cancel|stop <task id>``.

Push configs live in the shared database, so any replica can push for any task. The
``a2a_cancelfix`` logger's INFO lines (each cancel, each refused save) go to standard error,
and at SIGUSR1 where each of the loop's tasks waits. A message
saying "park" asks for input and returns; any other works in steps until it is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.context import ServerCallContext
from a2a.server.events.event_queue import EventQueue
from a2a.server.request_handlers.default_request_handler_v2 import DefaultRequestHandlerV2
from a2a.server.routes import create_jsonrpc_routes, create_rest_routes
from a2a.server.tasks import (
    BasePushNotificationSender,
    DatabasePushNotificationConfigStore,
    DatabaseTaskStore,
)
from a2a.types import AgentCapabilities, AgentCard
from sqlalchemy.ext.asyncio import create_async_engine
from starlette.applications import Starlette

from a2a_cancelfix import DefaultRequestHandler, FinalStateTaskStore, cancellable
from a2a_cancelfix.notices import PostgresNotices, RedisNotices
from tests.serving import begin, serve

STEP_SECONDS = 0.02
GRACE = 0.5


class EndlessExecutor(AgentExecutor):
    """Works in short steps, a checkpoint after each, until cancelled; logs its run's life."""

    def __init__(self, log_path: str | None) -> None:
        self._log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT) if log_path else None

    def note(self, event: str, task_id: str) -> None:
        if self._log is not None:  # One write of one short line: appends never interleave.
            os.write(self._log, f"{time.time():.6f} {os.getpid()} {event} {task_id}\n".encode())

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        updater = await begin(context, event_queue)
        task_id = context.task_id or ""
        if context.get_user_input() == "park":
            await updater.requires_input()
            return
        self.note("start", task_id)
        try:
            await updater.start_work()
            while True:
                await self.step()
        finally:
            self.note("stop", task_id)

    @cancellable
    async def step(self) -> None:
        await asyncio.sleep(STEP_SECONDS)  # Stands in for a slice of real work.

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        self.note("cancel", context.task_id or "")


def build(url: str, schema: str | None) -> Starlette:
    settings = {"search_path": schema, "application_name": schema} if schema else {}
    engine = create_async_engine(url, connect_args={"server_settings": settings} if schema else {})
    environment = os.environ
    stock = environment.get("A2ACF_HANDLER", "ours") == "stock"
    channel = environment.get("A2ACF_CHANNEL", "a2a_cancelfix_cancels")
    notices: Any = None
    if environment.get("A2ACF_NOTICES") == "postgres":
        notices = PostgresNotices(engine, channel)
    elif environment.get("A2ACF_NOTICES"):
        import redis.asyncio as redis

        notices = RedisNotices(redis.Redis.from_url(environment["A2ACF_NOTICES"]), channel)
    executor = EndlessExecutor(environment.get("A2ACF_RUNLOG"))
    configs = DatabasePushNotificationConfigStore(engine)
    card = AgentCard(
        name="replica",
        description="test replica",
        version="1",
        capabilities=AgentCapabilities(streaming=True, push_notifications=True),
    )
    # The sender reads push configs as this owner (1.0.x): the anonymous HTTP caller's.
    sender = BasePushNotificationSender(httpx.AsyncClient(), configs, ServerCallContext())
    handler: DefaultRequestHandlerV2
    if stock:
        handler = DefaultRequestHandlerV2(
            executor, DatabaseTaskStore(engine), card, push_config_store=configs, push_sender=sender
        )
    else:
        options: dict[str, Any] = {}
        lease_time = environment.get("A2ACF_LEASE_TIME")
        if lease_time is not None:
            options["lease_time"] = None if lease_time == "off" else float(lease_time)
        if environment.get("A2ACF_SOLE_REPLICA") == "1":
            options["sole_replica"] = True
        if environment.get("A2ACF_DRAIN"):
            options["shutdown_drain_time"] = float(environment["A2ACF_DRAIN"])
        handler = DefaultRequestHandler(
            executor,
            FinalStateTaskStore(DatabaseTaskStore(engine), notices=notices),
            card,
            push_config_store=configs,
            push_sender=sender,
            cancel_grace_period=GRACE,
            **options,
        )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if isinstance(handler, DefaultRequestHandler):
            async with handler:  # Its start: its lease, sole_replica's pass; its end: aclose().
                yield
            return
        yield
        close = getattr(handler, "aclose", None)  # Stock's from a2a-sdk 1.1.2.
        if close is not None:
            await close()

    routes = [*create_rest_routes(handler, path_prefix="/rest"), *create_jsonrpc_routes(handler, rpc_url="/")]
    return Starlette(routes=routes, lifespan=lifespan)


async def main(url: str, schema: str | None) -> None:
    config = uvicorn.Config(build(url, schema), log_level="warning", timeout_graceful_shutdown=5)
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, _print_tasks)
    await serve(uvicorn.Server(config))


def _print_tasks() -> None:
    """At SIGUSR1, where each of the loop's tasks waits: what a test prints of a replica that hangs."""
    for task in asyncio.all_tasks():
        task.print_stack(limit=8, file=sys.stderr)


if __name__ == "__main__":
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("a2a_cancelfix").setLevel(logging.INFO)
    asyncio.run(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None))
