"""The SDK's own client, and raw wire calls where the client hides the wire codes.

Client-side differences between a2a-sdk releases are kept in this module.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
from a2a.client import Client, ClientConfig, ClientFactory
from a2a.types import CancelTaskRequest, StreamResponse, TaskState, a2a_pb2_grpc

from a2a_cancelfix.testing._wire import BINDINGS

from .servers import Agent

VERSION = {"A2A-Version": "1.0"}
"""Without it the HTTP servers take a request for protocol 0.3 and refuse it."""


@contextlib.asynccontextmanager
async def connect(agent: Agent, user: str | None = None) -> AsyncIterator[Client]:
    """A client of ``agent`` as the SDK builds it, authenticated as ``user`` (HTTP only)."""
    if user and agent.transport == "grpc":
        raise ValueError("these servers authenticate HTTP callers only")
    headers = {"Authorization": f"Bearer {user}"} if user else {}
    # Our own httpx client: before 1.3.0 the factory shares one across its clients and the
    # first close() closes it; closing it twice is harmless.
    async with httpx.AsyncClient(headers=headers) as http:
        config = ClientConfig(
            httpx_client=http,
            grpc_channel_factory=grpc.aio.insecure_channel,
            supported_protocol_bindings=[BINDINGS[agent.transport]],
        )
        factory = ClientFactory(config)
        if agent.transport == "grpc":
            client = factory.create(agent.card)  # A gRPC agent serves no card over HTTP.
        else:
            client = await factory.create_from_url(agent.url)
        try:
            yield client
        finally:
            await client.close()


async def payloads(responses: AsyncIterator[StreamResponse]) -> AsyncIterator[Any]:
    """The Task / status update / artifact update / Message inside each streamed response."""
    async for response in responses:
        yield getattr(response, response.WhichOneof("payload"))


async def raw_cancel(agent: Agent, task_id: str, user: str | None = None) -> str:
    """CancelTask as plain wire traffic: the returned task's state, or the wire error code.

    The error code is the JSON-RPC ``error.code``, the HTTP status (REST) or the gRPC status name.
    """
    if agent.transport == "grpc":
        async with grpc.aio.insecure_channel(agent.url) as channel:
            stub = a2a_pb2_grpc.A2AServiceStub(channel)
            try:
                task = await stub.CancelTask(CancelTaskRequest(id=task_id))
            except grpc.aio.AioRpcError as error:
                return error.code().name
            return TaskState.Name(task.status.state).removeprefix("TASK_STATE_")
    headers = {**VERSION, **({"Authorization": f"Bearer {user}"} if user else {})}
    async with httpx.AsyncClient(base_url=agent.url, headers=headers) as http:
        if agent.transport == "rest":
            response = await http.post(f"tasks/{task_id}:cancel")
            if response.status_code != 200:
                return str(response.status_code)
            task = response.json()
        else:
            request = {"jsonrpc": "2.0", "id": 1, "method": "CancelTask", "params": {"id": task_id}}
            body = (await http.post("", json=request)).json()
            if "error" in body:
                return str(body["error"]["code"])
            task = body["result"]
    return task["status"]["state"].removeprefix("TASK_STATE_")
