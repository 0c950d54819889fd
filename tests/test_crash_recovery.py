"""Real replicas that die: a task whose process stopped is ended by the living, within a bound.

Each replica is its own uvicorn process (tests/crash_server.py) on a shared store; runs never
end by themselves. A replica is killed (SIGKILL), stopped (SIGTERM), killed and started again,
or cut off from its database by a proxy that freezes its traffic; the store (with a trigger
recording every state it takes), the replicas' run log, a push receiver and a subscriber on a
survivor say what happened. The stock handler beside ours, each time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import sqlalchemy as sa
from a2a.server.tasks import DatabasePushNotificationConfigStore, DatabaseTaskStore
from a2a.types import StreamResponse
from google.protobuf import json_format
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from a2a_cancelfix.testing import PushReceiver, Stream

from .test_replica_servers import HEADERS, subscribe
from .test_store import PG_URL, _pg_connect

# Server processes, killed and started again, and a bound of seconds to wait out each time:
# what they add to the in-process tests does not differ between releases (noxfile.py).
pytestmark = pytest.mark.edges_only

SERVER = Path(__file__).parent / "crash_server.py"
T = TypeVar("T")

# The replicas' lease: the least the handler takes with their grace period (0.5 s) and the
# default margins is 2 x (0.5 + 3 x 1.0) = 7 s.
LEASE = 7.0
# The documented bound from a replica's death to its tasks ended: a lease, then the survivor's
# next look (a sixth of a lease), and room for a loaded machine.
SLACK = 3.0
BOUND = LEASE + LEASE / 6 + SLACK
START = 60.0  # A replica's start, on a loaded machine: a2a-sdk's imports take seconds.
EXIT = 20.0  # Its exit at SIGTERM: drain, cancels, their margins.
ACTIVE = ("SUBMITTED", "WORKING")
TERMINAL = ("COMPLETED", "FAILED", "CANCELED", "REJECTED")
LAPSED = "the server process running this task stopped (lease lapsed)"


# -- what the test reads: the store, its history, the run log -------------------------------------


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
    state: str
    message: str
    at: float


@dataclass
class Noted:
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
    if kind == "sqlite":
        url, connect_args = f"sqlite+aiosqlite:///{tmp_path / 'tasks.db'}", {}
    else:
        admin = await _pg_connect()
        schema = f"a2acf_crash_{uuid.uuid4().hex[:12]}"
        await admin.execute(f'CREATE SCHEMA "{schema}"')
        url, connect_args = PG_URL, {"server_settings": {"search_path": schema}, "timeout": 5}
    engine = create_async_engine(url, connect_args=connect_args)
    try:
        await asyncio.wait_for(DatabaseTaskStore(engine).initialize(), START)
        await asyncio.wait_for(DatabasePushNotificationConfigStore(engine).initialize(), START)
        await _audit(engine)
        yield Shared(kind, url, schema, engine, tmp_path / "runs.log")
    finally:
        await engine.dispose()
        if schema is not None:
            await admin.execute(f'DROP SCHEMA "{schema}" CASCADE')
            await admin.close()


async def _audit(engine: AsyncEngine) -> None:
    async with engine.begin() as connection:
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
        arguments = [str(SERVER), world.replica_url(proxy.port if proxy else None)]
        arguments += [world.schema] if world.schema else []
        with log.open("wb") as errors:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                *arguments,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=errors,
                cwd=str(SERVER.parent.parent),
                env={**os.environ, "A2ACF_RUNLOG": str(world.runlog), **environment},
            )
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), START)
        if not line.startswith(b"READY "):
            process.kill()
            raise RuntimeError(f"replica did not start: {line!r}\n{log.read_text()}")
        return cls(process, int(line.split()[1]), log)

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
        await asyncio.wait_for(self.process.wait(), EXIT)
        self.died_at = time.time()

    async def stop(self) -> None:
        if self.process.returncode is not None:
            return
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            await asyncio.wait_for(self.process.wait(), EXIT)
        except asyncio.TimeoutError:
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
        await self.pushed.posted(self._push_urls[task_id], state, BOUND)
        ends = [pushed for pushed in self.pushes(task_id) if pushed in TERMINAL]
        assert ends == [state], self.pushes(task_id)

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
    async with receiver.serving(shutdown_seconds=10), httpx.AsyncClient(timeout=BOUND) as http:
        yield Client(http, receiver)


def options(handler: str, notices: str | None = None, **more: str) -> dict[str, str]:
    """A replica's environment: its handler, our lease, notices on a channel of this test's own."""
    environment = {"A2ACF_HANDLER": handler, "A2ACF_LEASE_TIME": str(LEASE), **more}
    if notices:
        environment |= {"A2ACF_NOTICES": notices, "A2ACF_CHANNEL": f"a2acf_crash_{uuid.uuid4().hex[:12]}"}
    return environment


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


def ended_by_lease(history: list[Saved], died_at: float) -> Saved:
    """The task's last stored state: FAILED saying its process stopped, stored after the
    process died, after most of a lease, within the bound; the only end it was stored with."""
    end = history[-1]
    assert (end.state, end.message) == ("TASK_STATE_FAILED", LAPSED), history
    assert died_at + LEASE * 2 / 3 < end.at < died_at + BOUND, (end.at - died_at, history)
    assert [saved.state for saved in history if saved.state.removeprefix("TASK_STATE_") in TERMINAL] == [
        "TASK_STATE_FAILED"
    ], history
    return end


KILLED = [
    pytest.param("stock", None, id="stock"),
    pytest.param("ours", "postgres", id="ours-notify"),
    pytest.param("ours", "redis://127.0.0.1:6379/0", id="ours-redis"),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(("handler", "notices"), KILLED)
async def test_a_killed_replicas_tasks_end_failed_on_a_survivor(
    handler: str, notices: str | None, tmp_path: Path
) -> None:
    """SIGKILL of the replica running two tasks: ours ends both FAILED on the survivor within a
    lease and a sixth (and slack), a subscriber there ends on it, each push config hears it
    once, the parked task stays, no lease row is left; stock leaves them WORKING past that bound."""
    async with (
        shared("postgresql", tmp_path) as world,
        client() as c,
        replicas(world, 2, **options(handler, notices)) as (a, b),
    ):
        (_, one), (_, two), (_, parked) = [await c.working(a, text) for text in ("go", "go", "park")]
        follower = c.subscribe(b, one)
        await follower.until(lambda: bool(follower.events) or follower.task.done(), BOUND)
        await a.kill()
        if handler == "stock":
            await holds(world.states, lambda states: states[one] == states[two] == "WORKING", BOUND)
            assert not {*c.pushes(one), *c.pushes(two)} & set(TERMINAL)
            assert follower.last != "FAILED"
            return
        states = await poll(world.states, lambda states: states[one] == states[two] == "FAILED", BOUND)
        assert states[parked] == "INPUT_REQUIRED"
        assert a.died_at is not None
        for task_id in (one, two):
            ended_by_lease(await world.history(task_id), a.died_at)
            await c.pushed_once(task_id, "FAILED")
        assert await follower.ended(BOUND) and follower.last == "FAILED"
        await poll(world.lease_rows, lambda rows: rows == (1, {parked} & rows[1]), BOUND)


@pytest.mark.asyncio
@pytest.mark.parametrize("handler", ["stock", "ours"])
async def test_sigterm_drains_then_cancels_what_runs(handler: str, tmp_path: Path) -> None:
    """SIGTERM of the replica running two tasks (uvicorn's graceful exit, its lifespan closing
    the handler): when it has exited, ours stored both CANCELED saying the server shut down,
    their runs stopped, each push config heard CANCELED once, the parked task is as it was and
    the process left no lease row; stock leaves them WORKING and pushes nothing."""
    async with (
        shared("postgresql", tmp_path) as world,
        client() as c,
        replicas(world, 2, **options(handler, "postgres", A2ACF_DRAIN="1")) as (a, _b),
    ):
        (_, one), (_, two), (_, parked) = [await c.working(a, text) for text in ("go", "go", "park")]
        await a.terminate()
        states = await world.states()
        if handler == "stock":
            assert states[one] == states[two] == "WORKING"
            assert not {*c.pushes(one), *c.pushes(two)} & set(TERMINAL)
            return
        assert (states[one], states[two], states[parked]) == ("CANCELED", "CANCELED", "INPUT_REQUIRED")
        for task_id in (one, two):
            end = (await world.history(task_id))[-1]
            assert end.message == "Canceled: the server shut down before the task finished"
            await c.pushed_once(task_id, "CANCELED")
            stops = [noted for noted in world.runs() if noted.task_id == task_id and noted.event == "stop"]
            assert [noted.pid for noted in stops] == [a.pid]
        replicas_left, runs = await world.lease_rows()
        assert replicas_left == 1 and not runs & {one, two}


SOLE_BOUND = 10.0  # From a process's start to its sweep's end, on a loaded machine.


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("handler", "sole"),
    [("stock", ""), ("ours", "1"), ("ours", "")],
    ids=["stock", "ours-sole_replica", "ours-lease"],
)
async def test_a_process_killed_and_started_again_on_sqlite(handler: str, sole: str, tmp_path: Path) -> None:
    """One process on a SQLite file, killed (SIGKILL) with two tasks running, started again:
    ours with ``sole_replica`` ends them FAILED as it starts, without it after a lease; the
    parked task stays; stock leaves them WORKING past the bound."""
    environment = options(handler, A2ACF_SOLE_REPLICA=sole)
    async with shared("sqlite", tmp_path) as world, client() as c:
        first = await Replica.start(world, "first", **environment)
        try:
            (_, one), (_, two), (_, parked) = [await c.working(first, text) for text in ("go", "go", "park")]
        finally:
            await first.kill()
        again = await Replica.start(world, "again", **environment)
        try:
            if handler == "stock":
                await holds(world.states, lambda states: states[one] == states[two] == "WORKING", BOUND)
                return
            if sole:
                states = await poll(
                    world.states, lambda states: states[one] == states[two] == "FAILED", SOLE_BOUND
                )
            else:
                states = await world.states()
                assert states[one] == states[two] == "WORKING"  # Not before a lease has passed.
                states = await poll(
                    world.states, lambda states: states[one] == states[two] == "FAILED", BOUND
                )
            assert states[parked] == "INPUT_REQUIRED"
            for task_id in (one, two):
                end = (await world.history(task_id))[-1]
                assert (end.state, end.message) == ("TASK_STATE_FAILED", LAPSED)
                if not sole:
                    assert end.at > again.ready_at + LEASE - 1.0  # Its first sighting, then a lease.
                await c.pushed_once(task_id, "FAILED")
        finally:
            await again.stop()


@pytest.mark.asyncio
@pytest.mark.parametrize("handler", ["stock", "ours"])
async def test_a_runner_cut_off_from_its_store_stops_its_runs_before_a_survivor_ends_them(
    handler: str, tmp_path: Path
) -> None:
    """A's connections to PostgreSQL freeze past a lease: ours has A call cancel() and stop
    the run before B ends the task FAILED; once the traffic flows again, A's late CANCELED is
    refused: the task ended once, FAILED, pushed once. Stock's run goes on, WORKING."""
    environment = options(handler, "postgres")
    async with shared("postgresql", tmp_path) as world, client() as c, Proxy() as proxy:
        a = await Replica.start(world, "a", proxy, **environment)
        b = await Replica.start(world, "b", **environment)
        try:
            _, task_id = await c.working(a)
            proxy.freeze()
            frozen_at = time.time()
            if handler == "stock":
                await holds(world.states, lambda states: states[task_id] == "WORKING", BOUND)
                proxy.thaw()
                assert [noted.event for noted in world.runs() if noted.task_id == task_id] == ["start"]
                return
            await poll(world.states, lambda states: states[task_id] == "FAILED", BOUND)
            end = ended_by_lease(await world.history(task_id), frozen_at)
            noted = {n.event: n.at for n in world.runs() if n.task_id == task_id and n.pid == a.pid}
            assert noted.keys() == {"start", "cancel", "stop"}
            assert noted["cancel"] < end.at and noted["stop"] < end.at  # Never while the run lives.
            proxy.thaw()

            async def refused() -> bool:
                return a.said(f"refused save task={task_id} stored=TASK_STATE_FAILED")

            await poll(refused, bool, BOUND)  # A's late write came, and was refused.
            ended_by_lease(await world.history(task_id), frozen_at)
            await c.pushed_once(task_id, "FAILED")
        finally:
            proxy.thaw()
            await asyncio.gather(a.stop(), b.stop())
