"""Real replicas: server processes sharing a task store on SQLite and on PostgreSQL.

A task runs on replica A; the cancel goes through replica B, which does not run it. The
outcome is checked on every replica, in the store, on A's stream and at a push receiver.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from a2a.server.tasks import DatabaseTaskStore
from a2a.types import StreamResponse
from google.protobuf import json_format

from a2a_cancelfix import _sdk
from a2a_cancelfix.testing import PushReceiver, Stream

from . import serving
from .test_store import open_database

# Server processes take seconds to start; what they add to the in-process twins (test_replicas,
# test_notices, test_cluster: on every release) does not differ between releases (noxfile.py).
pytestmark = pytest.mark.edges_only

HEADERS = {"A2A-Version": "1.0"}
BOUND = 20.0  # Poll interval (0.2 s) plus a step (0.02 s), with room for a loaded machine.


class Replica:
    """One server process; it exits when its standard input closes."""

    def __init__(self, process: asyncio.subprocess.Process, port: int) -> None:
        self.process, self.url = process, f"http://127.0.0.1:{port}"

    @classmethod
    async def start(cls, url: str, schema: str | None, **environment: str) -> Replica:
        process, port = await serving.start(
            "replica_server", url, *([schema] if schema else []), **environment
        )
        return cls(process, port)

    async def stop(self) -> None:
        self.process.stdin.close()
        try:
            await asyncio.wait_for(self.process.wait(), 10)
        except TimeoutError:
            self.process.kill()
            await asyncio.wait_for(self.process.wait(), 10)


@pytest_asyncio.fixture(params=["sqlite", "postgresql", "mysql"])
async def database(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[tuple[str, str | None]]:
    async with open_database(request.param, tmp_path) as opened:
        # One table, before replicas race to make it.
        await asyncio.wait_for(DatabaseTaskStore(opened.engine()).initialize(), BOUND)
        schema = opened.connect_args.get("server_settings", {}).get("search_path")
        yield opened.url, schema


@contextlib.asynccontextmanager
async def replicas(
    database: tuple[str, str | None], count: int, **environment: str
) -> AsyncIterator[list[Replica]]:
    starting = (Replica.start(*database, **environment) for _ in range(count))
    outcomes = await asyncio.gather(*starting, return_exceptions=True)
    started = [outcome for outcome in outcomes if isinstance(outcome, Replica)]
    try:
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome  # After stopping those that did start.
        yield started
    finally:
        await asyncio.gather(*(replica.stop() for replica in started))


async def send_streaming(client: httpx.AsyncClient, url: str, push_url: str | None) -> AsyncIterator[Any]:
    """A streaming SendMessage over JSON-RPC, as plain HTTP: the Task and updates it streams."""
    configuration = {"taskPushNotificationConfig": {"url": push_url, "id": "p1"}} if push_url else {}
    request = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "SendStreamingMessage",
        "params": {
            "message": {"role": "ROLE_USER", "messageId": uuid.uuid4().hex, "parts": [{"text": "go"}]},
            "configuration": configuration,
        },
    }
    async with client.stream("POST", url + "/", json=request, headers=HEADERS) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            event = StreamResponse()
            json_format.ParseDict(json.loads(line[5:])["result"], event, ignore_unknown_fields=True)
            yield getattr(event, event.WhichOneof("payload"))


async def working(client: httpx.AsyncClient, url: str, push_url: str | None) -> tuple[Stream, str]:
    """Stream a message to the replica at ``url``; return once its run is WORKING, with the task's id."""
    stream = Stream(send_streaming(client, url, push_url))
    await stream.until(lambda: stream.last == "WORKING", BOUND)
    return stream, stream.events[0].id


async def rest(client: httpx.AsyncClient, method: str, url: str) -> tuple[int, dict]:
    response = await asyncio.wait_for(client.request(method, url, headers=HEADERS), BOUND)
    return response.status_code, response.json()


@pytest.mark.asyncio
async def test_cancel_through_another_replica_reaches_the_running_one(database) -> None:
    """B cancels A's task: every replica and the store say CANCELED, A's run stops and tells its stream and push."""
    async with replicas(database, 3) as (a, b, c), PushReceiver().serving(shutdown_seconds=10) as pushed:
        push_url = pushed.url + "push"
        async with httpx.AsyncClient(timeout=BOUND) as client:
            stream, task_id = await working(client, a.url, push_url)
            status, answer = await rest(client, "POST", f"{b.url}/rest/tasks/{task_id}:cancel")
            assert status == 200 and answer["status"]["state"] == "TASK_STATE_CANCELED"

            assert await stream.ended(BOUND)  # A's stream ends ...
            assert stream.last == "CANCELED"  # ... on CANCELED.
            await pushed.posted(push_url, "CANCELED", BOUND)
            for replica in (a, b, c):
                status, task = await rest(client, "GET", f"{replica.url}/rest/tasks/{task_id}")
                assert status == 200 and task["status"]["state"] == "TASK_STATE_CANCELED"
            _, debug = await rest(client, "GET", f"{a.url}/debug")
            assert task_id in debug["cancelled"] and task_id in debug["stopped"]
            assert (await rest(client, "GET", f"{b.url}/debug"))[1] == {"cancelled": [], "stopped": []}


@pytest.mark.asyncio
async def test_a_second_cancel_anywhere_is_refused(database) -> None:
    """Once CANCELED is stored, a cancel through any replica is not cancelable: the state stays."""
    async with replicas(database, 2) as (a, b), httpx.AsyncClient(timeout=BOUND) as client:
        stream, task_id = await working(client, a.url, None)
        first = await rest(client, "POST", f"{b.url}/rest/tasks/{task_id}:cancel")
        assert await stream.ended(BOUND) and stream.error is None
        again_a = await rest(client, "POST", f"{a.url}/rest/tasks/{task_id}:cancel")
        again_b = await rest(client, "POST", f"{b.url}/rest/tasks/{task_id}:cancel")
        assert first[0] == 200 and again_a[0] in (400, 409) and again_b[0] in (400, 409)
        _, task = await rest(client, "GET", f"{a.url}/rest/tasks/{task_id}")
        assert task["status"]["state"] == "TASK_STATE_CANCELED"


@pytest.mark.asyncio
async def test_a_pushed_cancel_reaches_the_running_process_with_polling_an_hour_apart(database) -> None:
    """NOTIFY on PostgreSQL, Redis pub/sub beside SQLite and MariaDB: A's run stops on B's cancel, told
    by the notice alone (A polls once an hour, and saves nothing between its steps)."""
    url, _ = database
    notices = "postgres" if url.startswith("postgresql") else "redis://127.0.0.1:6379/0"
    async with (
        replicas(database, 2, A2ACF_NOTICES=notices, A2ACF_POLL="3600") as (a, b),
        httpx.AsyncClient(timeout=BOUND) as client,
    ):
        stream, task_id = await working(client, a.url, None)
        status, answer = await rest(client, "POST", f"{b.url}/rest/tasks/{task_id}:cancel")
        assert status == 200 and answer["status"]["state"] == "TASK_STATE_CANCELED"
        assert await stream.ended(BOUND) and stream.last == "CANCELED"
        _, debug = await rest(client, "GET", f"{a.url}/debug")
        assert task_id in debug["cancelled"] and task_id in debug["stopped"]


@pytest.mark.asyncio
@pytest.mark.skipif(not _sdk.HAS_CLUSTER, reason="cluster mode is a2a-sdk 1.2+")
async def test_in_cluster_mode_a_cancel_through_another_replica_reaches_the_running_one(database) -> None:
    """Upstream's cluster mode between processes: A's cancel() runs and its stream ends
    CANCELED; a subscriber on B, tailing the journal, ends CANCELED too."""
    from a2a.server.cluster import DatabaseTaskEventStream, VersionedDatabaseTaskStore
    from sqlalchemy.ext.asyncio import create_async_engine

    url, schema = database
    # The versions and journal tables, before the replicas race to make them.
    engine = create_async_engine(
        url, connect_args={"server_settings": {"search_path": schema}} if schema else {}
    )
    await VersionedDatabaseTaskStore(engine).initialize()
    await DatabaseTaskEventStream(engine).initialize()
    await engine.dispose()
    async with (
        replicas(database, 2, A2ACF_CLUSTER="1") as (a, b),
        httpx.AsyncClient(timeout=BOUND) as client,
    ):
        stream, task_id = await working(client, a.url, None)
        remote = Stream(subscribe(client, b.url, task_id))
        await remote.until(lambda: bool(remote.events), BOUND)
        status, answer = await rest(client, "POST", f"{b.url}/rest/tasks/{task_id}:cancel")
        assert status == 200 and answer["status"]["state"] == "TASK_STATE_CANCELED"
        assert await stream.ended(BOUND) and stream.last == "CANCELED"
        assert await remote.ended(BOUND) and remote.last == "CANCELED"
        _, debug = await rest(client, "GET", f"{a.url}/debug")
        assert task_id in debug["cancelled"] and task_id in debug["stopped"]


async def subscribe(client: httpx.AsyncClient, url: str, task_id: str) -> AsyncIterator[Any]:
    """SubscribeToTask over JSON-RPC, as plain HTTP."""
    request = {"jsonrpc": "2.0", "id": 2, "method": "SubscribeToTask", "params": {"id": task_id}}
    async with client.stream("POST", url + "/", json=request, headers=HEADERS) as response:
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                event = StreamResponse()
                json_format.ParseDict(json.loads(line[5:])["result"], event, ignore_unknown_fields=True)
                yield getattr(event, event.WhichOneof("payload"))
