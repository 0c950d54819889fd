"""A handler as clients meet it: the SDK's own JSON-RPC (or REST) app behind uvicorn, or the
SDK's gRPC servicer, on 127.0.0.1, on a port of its own, in the caller's event loop; and the
SDK's own client to call it.

The scenarios run in the same event loop as the server, so their gates stay reachable, while
every request still crosses a real socket, the transport's framing and the SDK's dispatcher.
Client- and server-side differences between a2a-sdk releases are kept in this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

import httpx
from a2a.client import Client, ClientConfig, ClientFactory
from a2a.types import AgentCapabilities, AgentCard, AgentInterface, AgentSkill
from a2a.utils.constants import TransportProtocol

BINDINGS = {
    "jsonrpc": TransportProtocol.JSONRPC,
    "rest": TransportProtocol.HTTP_JSON,
    "grpc": TransportProtocol.GRPC,
}
_HTTP = ("uvicorn", "starlette", "sse_starlette")
_NEEDS = {"jsonrpc": _HTTP, "rest": _HTTP, "grpc": ("grpc",)}
_EXTRAS = {
    "jsonrpc": "a2a-sdk[http-server] uvicorn",
    "rest": "a2a-sdk[http-server] uvicorn",
    "grpc": "a2a-sdk[grpc]",
}
_SHUTDOWN = 2.0
"""Seconds a server gets to stop; a request the stock handler never answers is cut off."""


def missing(transport: str) -> str | None:
    """What to install to serve over ``transport``, or None when it is all there."""
    absent = [name for name in _NEEDS[transport] if importlib.util.find_spec(name) is None]
    return f"pip install '{_EXTRAS[transport]}'" if absent else None


def agent_card(transport: str, url: str) -> AgentCard:
    """A spec-complete card naming ``url`` (the SDK warns about a missing required field)."""
    return AgentCard(
        name="a2a-cancelfix",
        description="cancel scenarios",
        version="1",
        supported_interfaces=[
            AgentInterface(protocol_binding=BINDINGS[transport], url=url, protocol_version="1.0")
        ],
        capabilities=AgentCapabilities(streaming=True, push_notifications=True),
        default_input_modes=["text/plain"],
        default_output_modes=["text/plain"],
        skills=[AgentSkill(id="work", name="work", description="works until cancelled", tags=["cancel"])],
    )


@dataclass
class Endpoint:
    """A running server: where to reach it, and who is connected to it."""

    transport: str
    url: str
    """http://127.0.0.1:port/ (JSON-RPC, REST) or 127.0.0.1:port (gRPC)."""
    callers: Callable[[], frozenset[Any]]
    """What the server holds for its callers now: open HTTP connections, or gRPC calls in
    progress. A caller that went away drops out of it."""
    left: asyncio.Event
    """Set each time a caller drops out of ``callers``."""

    async def gone(self, callers: frozenset[Any]) -> None:
        """Wait until none of ``callers`` is held any more: the server noticed they left."""
        while self.callers() & callers:
            self.left.clear()
            if self.callers() & callers:
                await self.left.wait()


def free_socket() -> socket.socket:
    """A socket bound to a free port of 127.0.0.1."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    return listener


def serve(handler: Any, transport: str, **http_options: Any) -> AbstractAsyncContextManager[Endpoint]:
    """Serve ``handler`` over ``transport`` until the block exits; ``http_options`` go to
    ``uvicorn_serving``."""
    return _serve_grpc(handler) if transport == "grpc" else _serve_http(handler, transport, **http_options)


@contextlib.asynccontextmanager
async def _serve_http(handler: Any, transport: str, **options: Any) -> AsyncIterator[Endpoint]:
    from a2a.server.routes import create_jsonrpc_routes, create_rest_routes
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.middleware.authentication import AuthenticationMiddleware
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    app = Starlette(
        routes=create_jsonrpc_routes(handler, "/") if transport == "jsonrpc" else create_rest_routes(handler),
        middleware=[Middleware(AuthenticationMiddleware, backend=bearer_names())],
    )
    left = asyncio.Event()

    class Connection(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        """uvicorn's HTTP protocol, saying when its connection is gone."""

        def connection_lost(self, exc: Exception | None) -> None:
            super().connection_lost(exc)
            left.set()

    listener = free_socket()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/"
    async with uvicorn_serving(app, listener, http=Connection, **options) as server:
        yield Endpoint(transport, url, lambda: frozenset(server.server_state.connections), left)


def bearer_names() -> Any:
    """``Authorization: Bearer <name>`` authenticates as ``name``; no header, anonymous.

    The SDK's routes build the caller as ``StarletteUser(request.user)``, whose ``user_name``
    is ``display_name``: the name the task store scopes tasks by.
    """
    from starlette.authentication import AuthCredentials, AuthenticationBackend, SimpleUser

    class BearerNames(AuthenticationBackend):
        async def authenticate(self, conn: Any) -> tuple[AuthCredentials, SimpleUser] | None:
            scheme, _, name = conn.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not name:
                return None
            return AuthCredentials(["authenticated"]), SimpleUser(name)

    return BearerNames()


@contextlib.asynccontextmanager
async def uvicorn_serving(
    app: Any, listener: socket.socket, *, shutdown_seconds: float = _SHUTDOWN, **options: Any
) -> AsyncIterator[Any]:
    """Serve ``app`` on ``listener`` (a bound socket) with uvicorn until the block exits.

    Started and stopped without uvicorn's main loop, which wakes every 0.1 s and sleeps 0.1 s
    more on the way out: a scenario's server lives a few milliseconds. On exit, requests still
    open after ``shutdown_seconds`` are cut off: a stock handler may never answer them.
    """
    import uvicorn

    class Server(uvicorn.Server):
        """One whose lifespan is made with it: uvicorn's main loop, not run here, makes it."""

        def __init__(self, config: uvicorn.Config) -> None:
            super().__init__(config)
            self.lifespan = config.lifespan_class(config)

    config = uvicorn.Config(app, lifespan="off", **{"log_level": "warning", "log_config": None, **options})
    config.load()
    server = Server(config)
    await server.startup(sockets=[listener])
    try:
        yield server
    finally:
        for each in server.servers:
            each.close()
        for connection in list(server.server_state.connections):
            connection.shutdown()
        requests = set(server.server_state.tasks)
        if requests:
            _, open_requests = await asyncio.wait(requests, timeout=shutdown_seconds)
            for request in open_requests:
                request.cancel()
            if open_requests:
                await asyncio.wait(open_requests, timeout=shutdown_seconds)
        listener.close()


@contextlib.asynccontextmanager
async def _serve_grpc(handler: Any) -> AsyncIterator[Endpoint]:
    import grpc
    from a2a.server.request_handlers.grpc_handler import GrpcHandler
    from a2a.types import a2a_pb2_grpc

    left = asyncio.Event()
    calls: set[Any] = set()

    class Servicer(GrpcHandler):
        """The SDK's gRPC servicer, noting which CancelTask calls are still being served."""

        async def CancelTask(self, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC's name)
            calls.add(context)
            try:
                return await super().CancelTask(request, context)
            finally:
                calls.discard(context)
                left.set()

    server = grpc.aio.server()
    url = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    a2a_pb2_grpc.add_A2AServiceServicer_to_server(Servicer(handler), server)
    await server.start()
    try:
        yield Endpoint("grpc", url, lambda: frozenset(calls), left)
    finally:
        await server.stop(None)


@contextlib.asynccontextmanager
async def connect(
    endpoint: Endpoint, user: str | None = None, *, streaming: bool = True
) -> AsyncIterator[Client]:
    """The SDK's own client of ``endpoint``, authenticated as ``user`` (over HTTP only), on a
    connection of its own."""
    headers = {"Authorization": f"Bearer {user}"} if user and endpoint.transport != "grpc" else {}
    # Our own httpx client: before 1.3.0 the factory shares one across its clients and the
    # first close() closes it; closing it twice is harmless.
    async with httpx.AsyncClient(headers=headers) as http:
        config = ClientConfig(
            httpx_client=http,
            streaming=streaming,
            supported_protocol_bindings=[BINDINGS[endpoint.transport]],
            **_grpc_channels(endpoint.transport),
        )
        client = ClientFactory(config).create(agent_card(endpoint.transport, endpoint.url))
        try:
            yield client
        finally:
            await client.close()


def _grpc_channels(transport: str) -> dict[str, Any]:
    if transport != "grpc":
        return {}
    import grpc

    return {"grpc_channel_factory": grpc.aio.insecure_channel}
