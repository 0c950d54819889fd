"""Real A2A servers on 127.0.0.1, run in the test's own event loop so its gates stay reachable.

Server-side differences between a2a-sdk releases are kept in this module.
"""

from __future__ import annotations

import contextlib
import inspect
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
from a2a.auth.user import UnauthenticatedUser
from a2a.server.context import ServerCallContext
from a2a.server.request_handlers.default_request_handler_v2 import DefaultRequestHandlerV2
from a2a.server.request_handlers.grpc_handler import GrpcHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes, create_rest_routes
from a2a.server.tasks import (
    BasePushNotificationSender,
    InMemoryPushNotificationConfigStore,
    InMemoryTaskStore,
)
from a2a.types import AgentCard, a2a_pb2_grpc
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from a2a_cancelfix import DefaultRequestHandler
from a2a_cancelfix.testing import Changes, ScriptedExecutor
from a2a_cancelfix.testing._wire import agent_card, bearer_names, free_socket, uvicorn_serving

TRANSPORTS = ("jsonrpc", "rest", "grpc")
GRACE = 0.5
"""Our handler's grace period: far more than these executors take to wind down, and with the
handler's one-second margin still inside the bound of every wait (``testing.BOUND``, 2.5 s)."""


@dataclass
class Agent:
    """A running A2A server: where to reach it, and the executor behind it."""

    transport: str
    url: str
    """The interface URL of the agent card: http://host:port/ or host:port (gRPC)."""
    card: AgentCard
    executor: ScriptedExecutor
    callers: Callable[[], frozenset[Any]]
    """What the server holds for its callers right now: open HTTP connections (uvicorn), or
    CancelTask calls in progress (gRPC). A caller that went away drops out of it."""
    callers_changed: Changes
    """Notified each time a caller drops out of ``callers``."""


def push_sender(client: httpx.AsyncClient, configs: InMemoryPushNotificationConfigStore) -> Any:
    """The SDK's push sender; 1.0.0 requires the owner context it reads push configs under."""
    context = inspect.signature(BasePushNotificationSender).parameters["context"]
    if context.default is inspect.Parameter.empty:
        # The push tests' callers are anonymous: their tasks and configs are owned by "".
        anonymous = ServerCallContext(user=UnauthenticatedUser())
        return BasePushNotificationSender(client, configs, anonymous)
    return BasePushNotificationSender(client, configs)


@contextlib.asynccontextmanager
async def serve_agent(
    transport: str, executor: ScriptedExecutor, *, stock: bool = False, **options: Any
) -> AsyncIterator[Agent]:
    """Serve ``executor`` over ``transport`` behind our handler (or the SDK's, ``stock``), with
    our handler's ``options``."""
    # The port is bound first: the card names it, and the handler takes the card.
    if transport == "grpc":
        grpc_server = grpc.aio.server()
        url = f"127.0.0.1:{grpc_server.add_insecure_port('127.0.0.1:0')}"
    else:
        listener = free_socket()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/"
    card = agent_card(transport, url)
    configs = InMemoryPushNotificationConfigStore()
    async with httpx.AsyncClient() as push_client:
        arguments: dict[str, Any] = {
            "agent_executor": executor,
            "task_store": InMemoryTaskStore(),
            "agent_card": card,
            "push_config_store": configs,
            "push_sender": push_sender(push_client, configs),
        }
        handler = (
            DefaultRequestHandlerV2(**arguments)
            if stock
            else DefaultRequestHandler(**arguments, **{"cancel_grace_period": GRACE, **options})
        )
        serving = (
            serve_grpc(grpc_server, handler)
            if transport == "grpc"
            else serve_http(listener, transport, handler, card)
        )
        async with serving as (callers, callers_changed):
            yield Agent(transport, url, card, executor, callers, callers_changed)


@contextlib.asynccontextmanager
async def serve_http(
    listener: socket.socket, transport: str, handler: DefaultRequestHandlerV2, card: AgentCard
) -> AsyncIterator[tuple[Callable[[], frozenset[Any]], Changes]]:
    routes = create_jsonrpc_routes(handler, "/") if transport == "jsonrpc" else create_rest_routes(handler)
    app = Starlette(
        routes=[*create_agent_card_routes(card), *routes],
        middleware=[Middleware(AuthenticationMiddleware, backend=bearer_names())],
    )
    changes = Changes()

    class Connection(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        """uvicorn's HTTP protocol, telling ``changes`` when its connection is gone."""

        def connection_lost(self, exc: Exception | None) -> None:
            super().connection_lost(exc)
            changes.notify()

    async with uvicorn_serving(app, listener, http=Connection) as server:
        yield (lambda: frozenset(server.server_state.connections)), changes


class TrackedGrpcHandler(GrpcHandler):
    """The SDK's gRPC servicer, noting which CancelTask calls are still being served."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cancels_in_progress: set[Any] = set()
        self.changes = Changes()

    async def CancelTask(  # noqa: N802 (the gRPC method's name)
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        self.cancels_in_progress.add(context)
        try:
            return await super().CancelTask(request, context)
        finally:
            self.cancels_in_progress.discard(context)
            self.changes.notify()


@contextlib.asynccontextmanager
async def serve_grpc(
    server: grpc.aio.Server, handler: DefaultRequestHandlerV2
) -> AsyncIterator[tuple[Callable[[], frozenset[Any]], Changes]]:
    servicer = TrackedGrpcHandler(handler)
    a2a_pb2_grpc.add_A2AServiceServicer_to_server(servicer, server)
    await server.start()
    try:
        yield (lambda: frozenset(servicer.cancels_in_progress)), servicer.changes
    finally:
        await server.stop(None)
