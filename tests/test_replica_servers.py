"""Real replicas: server processes sharing a task store on SQLite and on PostgreSQL.

A task runs on replica A; the cancel goes through replica B, which does not run it. The
outcome is checked on every replica, in the store, on A's stream and at a push receiver.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from a2a.server.tasks import DatabaseTaskStore

from a2a_cancelfix.testing import PushReceiver

from .test_store import open_database

SERVER = Path(__file__).parent / "replica_server.py"
HEADERS = {"A2A-Version": "1.0"}
BOUND = 20.0  # Poll interval (0.2 s) plus a step (0.02 s), with room for a loaded machine.


class Replica:
    """One server process; it exits when its standard input closes."""

    def __init__(self, process: asyncio.subprocess.Process, port: int) -> None:
        self.process, self.url = process, f"http://127.0.0.1:{port}"

    @classmethod
    async def start(cls, url: str, schema: str | None) -> Replica:
        arguments = [str(SERVER), url] + ([schema] if schema else [])
        process = await asyncio.create_subprocess_exec(
            sys.executable, *arguments, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            cwd=str(SERVER.parent.parent),
        )
        line = await asyncio.wait_for(process.stdout.readline(), 60)
        if not line.startswith(b"READY "):
            process.kill()
            raise RuntimeError(f"replica did not start: {line!r}")
        return cls(process, int(line.split()[1]))

    async def stop(self) -> None:
        self.process.stdin.close()
        try:
            await asyncio.wait_for(self.process.wait(), 10)
        except asyncio.TimeoutError:
            self.process.kill()
            await asyncio.wait_for(self.process.wait(), 10)


@pytest_asyncio.fixture(params=["sqlite", "postgresql"])
async def database(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[tuple[str, str | None]]:
    async with open_database(request.param, tmp_path) as opened:
        # One table, before replicas race to make it.
        await asyncio.wait_for(DatabaseTaskStore(opened.engine()).initialize(), BOUND)
        schema = opened.connect_args.get("server_settings", {}).get("search_path")
        yield opened.url, schema


@contextlib.asynccontextmanager
async def replicas(database: tuple[str, str | None], count: int) -> AsyncIterator[list[Replica]]:
    outcomes = await asyncio.gather(*(Replica.start(*database) for _ in range(count)), return_exceptions=True)
    started = [outcome for outcome in outcomes if isinstance(outcome, Replica)]
    try:
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome  # After stopping those that did start.
        yield started
    finally:
        await asyncio.gather(*(replica.stop() for replica in started))


class Stream:
    """A streaming SendMessage over JSON-RPC, read in the background."""

    def __init__(self, client: httpx.AsyncClient, url: str, push_url: str | None) -> None:
        self.states: list[str] = []
        self.task_id: str | None = None
        self.working = asyncio.Event()
        configuration = {"taskPushNotificationConfig": {"url": push_url, "id": "p1"}} if push_url else {}
        self.request = {
            "jsonrpc": "2.0", "id": 1, "method": "SendStreamingMessage",
            "params": {
                "message": {"role": "ROLE_USER", "messageId": uuid.uuid4().hex, "parts": [{"text": "go"}]},
                "configuration": configuration,
            },
        }
        self.task = asyncio.ensure_future(self._read(client, url))

    async def _read(self, client: httpx.AsyncClient, url: str) -> None:
        async with client.stream("POST", url + "/", json=self.request, headers=HEADERS) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                result = json.loads(line[5:])["result"]
                body = result.get("task") or result.get("statusUpdate") or {}
                self.task_id = self.task_id or body.get("id") or body.get("taskId")
                state = body.get("status", {}).get("state")
                if state:
                    self.states.append(state)
                if state == "TASK_STATE_WORKING":
                    self.working.set()


async def rest(client: httpx.AsyncClient, method: str, url: str) -> tuple[int, dict]:
    response = await asyncio.wait_for(client.request(method, url, headers=HEADERS), BOUND)
    return response.status_code, response.json()


@pytest.mark.asyncio
async def test_cancel_through_another_replica_reaches_the_running_one(database) -> None:
    """B cancels A's task: every replica and the store say CANCELED, A's run stops and tells its stream and push."""
    async with replicas(database, 3) as (a, b, c), PushReceiver().serving(shutdown_seconds=10) as pushed:
        push_url = pushed.url + "push"
        async with httpx.AsyncClient(timeout=BOUND) as client:
            stream = Stream(client, a.url, push_url)
            await asyncio.wait_for(stream.working.wait(), BOUND)
            status, answer = await rest(client, "POST", f"{b.url}/rest/tasks/{stream.task_id}:cancel")
            assert status == 200 and answer["status"]["state"] == "TASK_STATE_CANCELED"

            await asyncio.wait_for(stream.task, BOUND)  # A's stream ends ...
            assert stream.states[-1] == "TASK_STATE_CANCELED"  # ... on CANCELED.
            await pushed.posted(push_url, "CANCELED", BOUND)
            for replica in (a, b, c):
                status, task = await rest(client, "GET", f"{replica.url}/rest/tasks/{stream.task_id}")
                assert status == 200 and task["status"]["state"] == "TASK_STATE_CANCELED"
            _, debug = await rest(client, "GET", f"{a.url}/debug")
            assert stream.task_id in debug["cancelled"] and stream.task_id in debug["stopped"]
            assert (await rest(client, "GET", f"{b.url}/debug"))[1] == {"cancelled": [], "stopped": []}


@pytest.mark.asyncio
async def test_a_second_cancel_anywhere_is_refused(database) -> None:
    """Once CANCELED is stored, a cancel through any replica is not cancelable: the state stays."""
    async with replicas(database, 2) as (a, b):
        async with httpx.AsyncClient(timeout=BOUND) as client:
            stream = Stream(client, a.url, None)
            await asyncio.wait_for(stream.working.wait(), BOUND)
            first = await rest(client, "POST", f"{b.url}/rest/tasks/{stream.task_id}:cancel")
            await asyncio.wait_for(stream.task, BOUND)
            again_a = await rest(client, "POST", f"{a.url}/rest/tasks/{stream.task_id}:cancel")
            again_b = await rest(client, "POST", f"{b.url}/rest/tasks/{stream.task_id}:cancel")
            assert first[0] == 200 and again_a[0] in (400, 409) and again_b[0] in (400, 409)
            status, task = await rest(client, "GET", f"{a.url}/rest/tasks/{stream.task_id}")
            assert task["status"]["state"] == "TASK_STATE_CANCELED"
