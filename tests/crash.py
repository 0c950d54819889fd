"""Real replicas for the crash-recovery tests and the lease benchmark: processes of
tests/crash_server.py on a shared database, a proxy that can cut one off from PostgreSQL, and
what the test reads: the store, the history of each task's states, the lease tables, the run log."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import sqlalchemy as sa
from a2a.server.tasks import DatabasePushNotificationConfigStore, DatabaseTaskStore
from a2a.types import StreamResponse
from google.protobuf import json_format
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from a2a_cancelfix.testing import PushReceiver, Stream

from . import serving
from .support import drop_schema, mysql_database

PG_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
PG_DSN = "postgresql://postgres@127.0.0.1:5432/test"
HEADERS = {"A2A-Version": "1.0"}
T = TypeVar("T")

START = 60.0  # A replica's start, on a loaded machine: a2a-sdk's imports take seconds.
EXIT = 20.0  # Its exit at SIGTERM: drain, cancels, their margins.
WAIT = 20.0  # A request's answer, a push, a stream's end.
ACTIVE = ("SUBMITTED", "WORKING")
TERMINAL = ("COMPLETED", "FAILED", "CANCELED", "REJECTED")


# -- what is read: the store, its history, the run log -------------------------------------


@dataclass
class Shared:
    """The database the replicas share, as the test reads it: states, their history, leases."""

    kind: str
    url: str
    schema: str | None
    engine: AsyncEngine
    runlog: Path

    def replica_url(self, port: int | None = None) -> str:
        """The URL a replica connects with; through a proxy listening on ``port`` if given."""
        if port is None:
            return self.url
        return self.url.replace("127.0.0.1:5432", f"127.0.0.1:{port}")

    async def states(self) -> dict[str, str]:
        """Each task's stored state, without ``TASK_STATE_``."""
        async with self.engine.connect() as connection:
            rows = await connection.execute(sa.text("SELECT id, status FROM tasks"))
            return {row[0]: _state(row[1]) for row in rows}

    async def history(self, task_id: str) -> list[Saved]:
        """Every state the task was stored with, in order (the trigger's record)."""
        async with self.engine.connect() as connection:
            rows = await connection.execute(
                sa.text("SELECT state, message, at FROM audit WHERE id = :id ORDER BY seq"), {"id": task_id}
            )
            return [Saved(row[0], row[1] or "", row[2]) for row in rows]

    async def histories(self) -> dict[str, list[Saved]]:
        """Every task's `history`."""
        async with self.engine.connect() as connection:
            rows = await connection.execute(sa.text("SELECT id, state, message, at FROM audit ORDER BY seq"))
            found: dict[str, list[Saved]] = {}
            for row in rows:
                found.setdefault(row[0], []).append(Saved(row[1], row[2] or "", row[3]))
            return found

    async def lease_rows(self) -> tuple[int, set[str]]:
        """How many replicas hold a lease, and the tasks with a run row."""
        async with self.engine.connect() as connection:
            replicas = (
                await connection.execute(sa.text("SELECT count(*) FROM a2a_cancelfix_replicas"))
            ).scalar_one()
            runs = await connection.execute(sa.text("SELECT task_id FROM a2a_cancelfix_runs"))
            return replicas, {row[0] for row in runs}

    def runs(self) -> list[Noted]:
        """The run log's lines: each run's start, its cancel() and its stop, in order."""
        if not self.runlog.exists():
            return []
        lines = self.runlog.read_text().splitlines()
        return [Noted(float(at), int(pid), event, task) for at, pid, event, task in map(str.split, lines)]


@dataclass
class Saved:
    """One state a task was stored with (``TASK_STATE_...``), its status message, and when."""

    state: str
    message: str
    at: float


@dataclass
class Noted:
    """One line of the run log: when, which process, start, cancel or stop, which task."""

    at: float
    pid: int
    event: str
    task_id: str


def _state(status: Any) -> str:
    status = json.loads(status) if isinstance(status, str) else status
    return str(status.get("state", "?")).removeprefix("TASK_STATE_")


@contextlib.asynccontextmanager
async def shared(kind: str, tmp_path: Path) -> AsyncIterator[Shared]:
    """A fresh database with the SDK's tables made (before replicas race to make them) and a
    trigger recording every state each task is stored with, and when."""
    schema = None
    if kind == "mysql":
        async with (
            mysql_database("a2acf_crash") as (url, connect_args),
            _made(kind, url, connect_args, schema, tmp_path) as world,
        ):
            yield world
        return
    if kind == "sqlite":
        url, connect_args = f"sqlite+aiosqlite:///{tmp_path / 'tasks.db'}", {}
    else:
        import asyncpg

        admin = await asyncpg.connect(PG_DSN, timeout=5)
        schema = f"a2acf_crash_{uuid.uuid4().hex[:12]}"
        await admin.execute(f'CREATE SCHEMA "{schema}"')
        settings = {"search_path": schema, "application_name": schema}  # See drop_schema.
        url, connect_args = PG_URL, {"server_settings": settings, "timeout": 5}
    try:
        async with _made(kind, url, connect_args, schema, tmp_path) as world:
            yield world
    finally:
        if schema is not None:
            await drop_schema(admin, schema)
            await admin.close()


@contextlib.asynccontextmanager
async def _made(
    kind: str, url: str, connect_args: dict[str, Any], schema: str | None, tmp_path: Path
) -> AsyncIterator[Shared]:
    """The SDK's tables and the audit trigger made in a fresh database, and its engine."""
    engine = create_async_engine(url, connect_args=connect_args)
    try:
        await asyncio.wait_for(DatabaseTaskStore(engine).initialize(), START)
        await asyncio.wait_for(DatabasePushNotificationConfigStore(engine).initialize(), START)
        await _audit(engine)
        yield Shared(kind, url, schema, engine, tmp_path / "runs.log")
    finally:
        await engine.dispose()


async def _audit(engine: AsyncEngine) -> None:
    async with engine.begin() as connection:
        if engine.dialect.name == "mysql":
            await connection.execute(
                sa.text(
                    "CREATE TABLE audit (seq BIGINT AUTO_INCREMENT PRIMARY KEY, id VARCHAR(255), "
                    "state TEXT, message TEXT, at DOUBLE)"
                )
            )
            row = (
                "INSERT INTO audit (id, state, message, at) VALUES (NEW.id, "
                "JSON_UNQUOTE(JSON_EXTRACT(NEW.status, '$.state')), "
                "JSON_UNQUOTE(JSON_EXTRACT(NEW.status, '$.message.parts[0].text')), "
                "UNIX_TIMESTAMP(SYSDATE(6)))"
            )
            for when in ("INSERT", "UPDATE"):
                await connection.execute(
                    sa.text(f"CREATE TRIGGER audit_{when} AFTER {when} ON tasks FOR EACH ROW {row}")
                )
            return
        if engine.dialect.name == "sqlite":
            await connection.execute(
                sa.text(
                    "CREATE TABLE audit (seq INTEGER PRIMARY KEY, id TEXT, state TEXT, message TEXT, at REAL)"
                )
            )
            row = (
                "INSERT INTO audit (id, state, message, at) VALUES (new.id, "
                "json_extract(new.status, '$.state'), json_extract(new.status, '$.message.parts[0].text'), "
                "(julianday('now') - 2440587.5) * 86400.0);"
            )
            for when in ("INSERT", "UPDATE"):
                await connection.execute(
                    sa.text(f"CREATE TRIGGER audit_{when} AFTER {when} ON tasks BEGIN {row} END")
                )
            return
        await connection.execute(
            sa.text(
                "CREATE TABLE audit (seq BIGSERIAL PRIMARY KEY, id TEXT, state TEXT, message TEXT, "
                "at DOUBLE PRECISION)"
            )
        )
        await connection.execute(
            sa.text(
                "CREATE FUNCTION audit_tasks() RETURNS trigger AS $$ BEGIN INSERT INTO audit "
                "(id, state, message, at) VALUES (NEW.id, NEW.status::json->>'state', "
                "NEW.status::json->'message'->'parts'->0->>'text', "
                "extract(epoch from clock_timestamp())); RETURN NEW; END $$ LANGUAGE plpgsql"
            )
        )
        await connection.execute(
            sa.text(
                "CREATE TRIGGER audit_tasks AFTER INSERT OR UPDATE ON tasks "
                "FOR EACH ROW EXECUTE FUNCTION audit_tasks()"
            )
        )


async def poll(read: Callable[[], Awaitable[T]], condition: Callable[[T], object], seconds: float) -> T:
    """Read until ``condition`` holds of what was read; fail after ``seconds`` with the last read."""
    deadline = time.monotonic() + seconds
    while True:
        value = await asyncio.wait_for(read(), seconds)
        if condition(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds:.1f} s: {value!r}")
        await asyncio.sleep(0.1)  # A poll interval: the store tells the test nothing by itself.


async def holds(read: Callable[[], Awaitable[T]], condition: Callable[[T], object], seconds: float) -> T:
    """Read for ``seconds``, failing as soon as ``condition`` does not hold of what was read."""
    deadline = time.monotonic() + seconds
    while True:
        value = await asyncio.wait_for(read(), seconds)
        assert condition(value), value
        if time.monotonic() > deadline:
            return value
        await asyncio.sleep(0.2)


# -- the replicas, and a proxy between one and its database ---------------------------------------


class Replica:
    """One server process; it exits at SIGTERM or when its standard input closes."""

    def __init__(self, process: asyncio.subprocess.Process, port: int, log: Path) -> None:
        self.process, self.url, self.log = process, f"http://127.0.0.1:{port}", log
        self.ready_at = time.time()
        self.died_at: float | None = None  # Once its death is seen: after it died.

    @classmethod
    async def start(cls, world: Shared, name: str, proxy: Proxy | None = None, **environment: str) -> Replica:
        log = world.runlog.with_name(f"{name}.{uuid.uuid4().hex[:6]}.log")
        arguments = [world.replica_url(proxy.port if proxy else None)]
        arguments += [world.schema] if world.schema else []
        with log.open("wb") as errors:
            try:
                process, port = await serving.start(
                    "crash_server", *arguments, errors=errors, A2ACF_RUNLOG=str(world.runlog), **environment
                )
            except RuntimeError as error:
                raise RuntimeError(f"{error}\n{log.read_text()}") from error
        return cls(process, port, log)

    @property
    def pid(self) -> int:
        return self.process.pid

    async def kill(self) -> None:
        """SIGKILL: nothing of it runs after; ``died_at`` is after its death."""
        self.process.kill()
        await asyncio.wait_for(self.process.wait(), EXIT)
        self.died_at = time.time()

    async def terminate(self) -> None:
        """SIGTERM, as a rolling deploy sends it; wait for it to exit."""
        self.process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.process.wait(), EXIT)
        except TimeoutError:
            self.process.send_signal(signal.SIGUSR1)  # Its tasks' stacks, to its log.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.process.wait(), 2)
            self.process.kill()
            raise AssertionError(
                f"not exited {EXIT:g} s after SIGTERM:\n{self.log.read_text()[-12000:]}"
            ) from None
        self.died_at = time.time()

    async def stop(self) -> None:
        if self.process.returncode is not None:
            return
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            await asyncio.wait_for(self.process.wait(), EXIT)
        except TimeoutError:
            self.process.kill()
            await asyncio.wait_for(self.process.wait(), EXIT)

    def said(self, text: str) -> bool:
        """Whether the replica has logged ``text`` (its stderr)."""
        return text in self.log.read_text()


class Proxy:
    """A TCP proxy to PostgreSQL that can freeze every connection through it, both ways."""

    def __init__(self) -> None:
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.port = 0
        self._server: asyncio.Server | None = None
        self._pumps: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Proxy:
        self._server = await asyncio.start_server(self._connect, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for pump in self._pumps:
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)

    def freeze(self) -> None:
        """Hold every byte either way, on the connections open and those opened later."""
        self.flowing.clear()

    def thaw(self) -> None:
        self.flowing.set()

    async def _connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", 5432)
        except OSError:
            writer.close()
            return
        for source, sink in ((reader, upstream_writer), (upstream_reader, writer)):
            pump = asyncio.ensure_future(self._pump(source, sink))
            self._pumps.add(pump)
            pump.add_done_callback(self._pumps.discard)

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(65536):
                await self.flowing.wait()
                sink.write(data)
                await sink.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            sink.close()


# -- the client's side ------------------------------------------------------------------------------


class Client:
    """Sends messages to replicas, each with a push config of its own; subscribes; reads."""

    def __init__(self, http: httpx.AsyncClient, pushed: PushReceiver) -> None:
        self.http, self.pushed = http, pushed
        self._push_urls: dict[str, str] = {}

    async def working(self, replica: Replica, text: str = "go") -> tuple[Stream, str]:
        """A task the replica runs, WORKING (or INPUT_REQUIRED for "park"), and its stream."""
        push_url = f"{self.pushed.url}push/{uuid.uuid4().hex}"
        stream = Stream(stream_message(self.http, replica.url, text, push_url))
        wanted = "INPUT_REQUIRED" if text == "park" else "WORKING"
        await stream.until(lambda: stream.last == wanted or stream.task.done(), START)
        assert stream.last == wanted, stream.error
        task_id = stream.events[0].id
        self._push_urls[task_id] = push_url
        return stream, task_id

    def pushes(self, task_id: str) -> list[str]:
        """The states pushed for the task, in order."""
        return self.pushed.received.get(self._push_urls[task_id], [])

    async def pushed_once(self, task_id: str, state: str) -> None:
        """Wait for the task's push of ``state``; fail if it came twice or another end came."""
        await self.pushed.posted(self._push_urls[task_id], state, WAIT)
        ends = [pushed for pushed in self.pushes(task_id) if pushed in TERMINAL]
        assert ends == [state], self.pushes(task_id)

    async def states(self, replica: Replica, *task_ids: str) -> dict[str, str]:
        """Each task's state as GetTask on ``replica`` answers it (its status code if not 200)."""
        found = {}
        for task_id in task_ids:
            response = await asyncio.wait_for(
                self.http.get(f"{replica.url}/rest/tasks/{task_id}", headers=HEADERS), WAIT
            )
            ok = response.status_code == 200
            found[task_id] = _state(response.json()["status"]) if ok else str(response.status_code)
        return found

    def subscribe(self, replica: Replica, task_id: str) -> Stream:
        return Stream(subscribe(self.http, replica.url, task_id))


def rpc(method: str, params: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": 1, "method": method, "params": params}


def message_params(text: str, push_url: str | None, **configuration: Any) -> dict[str, Any]:
    if push_url:
        configuration["taskPushNotificationConfig"] = {"url": push_url, "id": "p1"}
    return {
        "message": {"role": "ROLE_USER", "messageId": uuid.uuid4().hex, "parts": [{"text": text}]},
        "configuration": configuration,
    }


async def stream_message(
    http: httpx.AsyncClient, url: str, text: str, push_url: str | None
) -> AsyncIterator[Any]:
    """SendStreamingMessage over JSON-RPC, as plain HTTP: the Task and the updates it streams."""
    request = rpc("SendStreamingMessage", message_params(text, push_url))
    async for event in _events(http.stream("POST", url + "/", json=request, headers=HEADERS)):
        yield event


async def subscribe(http: httpx.AsyncClient, url: str, task_id: str) -> AsyncIterator[Any]:
    """SubscribeToTask over JSON-RPC, as plain HTTP."""
    request = rpc("SubscribeToTask", {"id": task_id})
    async for event in _events(http.stream("POST", url + "/", json=request, headers=HEADERS)):
        yield event


async def _events(opening: Any) -> AsyncIterator[Any]:
    async with opening as response:
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                body = json.loads(line[5:])
                if "error" in body:
                    raise RuntimeError(body["error"])
                event = StreamResponse()
                json_format.ParseDict(body["result"], event, ignore_unknown_fields=True)
                yield getattr(event, event.WhichOneof("payload"))


@contextlib.asynccontextmanager
async def client() -> AsyncIterator[Client]:
    receiver = PushReceiver()
    async with receiver.serving(shutdown_seconds=10), httpx.AsyncClient(timeout=WAIT) as http:
        yield Client(http, receiver)


@contextlib.asynccontextmanager
async def replicas(world: Shared, count: int, **environment: str) -> AsyncIterator[list[Replica]]:
    outcomes = await asyncio.gather(
        *(Replica.start(world, f"r{index}", **environment) for index in range(count)), return_exceptions=True
    )
    started = [outcome for outcome in outcomes if isinstance(outcome, Replica)]
    try:
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome  # After stopping those that did start.
        yield started
    finally:
        await asyncio.gather(*(replica.stop() for replica in started))
