"""Leases (_liveness.py): a replica whose process died has its tasks ended by the living.

Replica A runs on an event loop of its own, in a thread, with an engine of its own: stopping
that loop where it stands is its process dying (none of its code runs again, nothing is cleaned
up), as far as the shared database can tell. The survivors run on the test's loop. Each is
built stock beside ours: stock leaves a dead replica's task WORKING for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import sqlite3
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
import pytest_asyncio
import sqlalchemy as sa
import wrapt
from a2a.server.tasks import DatabaseTaskStore, InMemoryTaskStore
from a2a.types import (
    AgentCapabilities,
    AgentCard,
    SendMessageRequest,
    Task,
    TaskPushNotificationConfig,
    TaskState,
    TaskStatus,
)
from a2a.utils.errors import A2AError
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from a2a_cancelfix import DefaultRequestHandler, FinalStateTaskStore, _sdk
from a2a_cancelfix._cancel.settings import Timing
from a2a_cancelfix._lease_tables import REPLICAS, RUNS
from a2a_cancelfix._liveness import LAPSED
from a2a_cancelfix.testing import (
    Gate,
    ScriptedExecutor,
    Server,
    Stream,
    caller,
    make_server,
    message,
    start,
    within,
)

from .support import set_within
from .test_store import DATABASES, Database, open_database

T = TypeVar("T")


LEASE = 1.2
GRACE = 0.2
MARGIN = 0.05
OURS = {"cancel_grace_period": GRACE, "lease_time": LEASE, "timing": Timing(margin=MARGIN)}
# A dead replica's tasks are ended within a lease and a renewal after its last beat, and the
# write: how long stock is watched not doing it, and (with what a machine busy with other work
# adds) how long ours is waited for.
ENDED_WITHIN = LEASE + LEASE / 6 + 1.0
BOUND = ENDED_WITHIN + 4.0
POLL = 0.02  # Between two reads of the shared database, which no event of this loop announces.
PUSH_URL = "http://push.invalid/liveness"
CARD = AgentCard(
    name="leases", description="leases", version="1", capabilities=AgentCapabilities(streaming=True)
)

WORKING = TaskState.TASK_STATE_WORKING
FAILED = TaskState.TASK_STATE_FAILED
CANCELED = TaskState.TASK_STATE_CANCELED
INPUT_REQUIRED = TaskState.TASK_STATE_INPUT_REQUIRED
COMPLETED = TaskState.TASK_STATE_COMPLETED


@pytest_asyncio.fixture(params=DATABASES)
async def database(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Database]:
    async with open_database(request.param, tmp_path) as opened:
        yield opened


# --- Replicas -----------------------------------------------------------------------------------


def replica(
    kind: str, engine: AsyncEngine, executor: ScriptedExecutor | None = None, **options: Any
) -> Server:
    """A replica of ``kind`` over the SDK's own DatabaseTaskStore on ``engine`` (ours guards it)."""
    options = {**OURS, **options} if kind == "ours" else {}
    return make_server(kind, executor or ScriptedExecutor(), store=DatabaseTaskStore(engine), **options)


_DEAD_LOOPS: list[asyncio.AbstractEventLoop] = []


class Elsewhere:
    """A replica's own event loop, in a thread: a process of its own, to the database.

    Its engine holds no connection between two statements (``NullPool``), so that once its loop
    has stopped between two of them it holds nothing (no lock, no transaction) that a killed
    process would not have released either.
    """

    def __init__(self, database: Database) -> None:
        self.loop = asyncio.new_event_loop()
        self.engine = create_async_engine(
            database.url, connect_args=database.connect_args, poolclass=NullPool
        )
        self._checked_out = 0
        self._idle = asyncio.Event()
        self._idle.set()
        event.listen(self.engine.sync_engine, "checkout", self._out)
        event.listen(self.engine.sync_engine, "checkin", self._in)
        self._stopped = threading.Event()
        self._buried = threading.Event()
        self._thread = threading.Thread(target=self._live, name="replica-elsewhere", daemon=True)
        self._thread.start()

    # The pool's events come on the replica's loop, where its statements run.
    def _out(self, *_: Any) -> None:
        self._checked_out += 1
        self._idle.clear()

    def _in(self, *_: Any) -> None:
        self._checked_out -= 1
        if not self._checked_out:
            self._idle.set()

    def _live(self) -> None:
        self.loop.run_forever()
        self._stopped.set()
        self._buried.wait()
        # In this thread: the SDK's queues hold thread locks that their own thread must release.
        pending = [task for task in asyncio.all_tasks(self.loop) if not task.done()]
        for task in pending:
            task.cancel()
        if pending:
            self.loop.run_until_complete(asyncio.wait(pending, timeout=1.0))
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        # Neither closed nor collected (which closes it): a statement the driver's thread had
        # begun may still hand its outcome to the loop, which a closed one refuses (an error in
        # that thread, which pytest reports in whichever test runs then).
        _DEAD_LOOPS.append(self.loop)

    async def call(self, work: Coroutine[Any, Any, T], seconds: float = 10.0) -> T:
        """Run ``work`` on this replica's loop; its outcome, within ``seconds``."""
        return await asyncio.wait_for(
            asyncio.wrap_future(asyncio.run_coroutine_threadsafe(work, self.loop)), seconds
        )

    async def die(self) -> None:
        """Stop the loop where it stands, between two statements of its engine: no code of this
        replica's runs again, and its lease is no longer renewed."""

        async def stop_when_idle() -> None:
            while self._checked_out:
                await self._idle.wait()
            asyncio.get_running_loop().stop()

        asyncio.run_coroutine_threadsafe(stop_when_idle(), self.loop)
        assert await asyncio.to_thread(self._stopped.wait, 10.0)

    async def bury(self) -> None:
        """After the checks (it runs the dead replica's code again): cancel what the loop left,
        in its own thread."""
        if not self._stopped.is_set():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._buried.set()
        await asyncio.to_thread(self._thread.join, 15.0)
        assert not self._thread.is_alive()


@contextlib.asynccontextmanager
async def elsewhere(database: Database) -> AsyncIterator[Elsewhere]:
    place = Elsewhere(database)
    try:
        yield place
    finally:
        await place.bury()


async def build_elsewhere(place: Elsewhere, kind: str, executor: ScriptedExecutor, **options: Any) -> Server:
    async def build() -> Server:
        return replica(kind, place.engine, executor, **options)

    return await place.call(build())


async def run_elsewhere(place: Elsewhere, server: Server, text: str = "go") -> str:
    """Send a streaming message to the replica elsewhere; the task id once its run has begun."""

    async def send() -> None:
        Stream(server.calls.send_stream(SendMessageRequest(message=message(text)), "alice"))

    await place.call(send())
    await until(lambda: server.executor.task_id is not None)
    return server.executor.task_id or ""


# --- Observing the shared database ------------------------------------------------------------------


async def until(condition: Callable[[], Any], seconds: float = 10.0) -> bool:
    """Poll ``condition()`` (a value or an awaitable) until it holds; whether it did in ``seconds``.

    For what another loop or the database changes, which no event of this loop announces."""
    deadline = time.monotonic() + seconds
    while True:
        value = condition()
        if isinstance(value, Awaitable):
            value = await value
        if value:
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(POLL)


class Reader:
    """Reads the shared database as the SDK's store would, on an engine of the test's own."""

    def __init__(self, database: Database) -> None:
        self.engine = database.engine()
        self.store = DatabaseTaskStore(self.engine)

    async def task(self, task_id: str) -> Task | None:
        return await self.store.get(task_id, caller("alice"))

    async def state(self, task_id: str) -> int | None:
        task = await self.task(task_id)
        return None if task is None else task.status.state

    async def reaches(self, task_id: str, state: int, seconds: float = 10.0) -> bool:
        async def there() -> bool:
            return await self.state(task_id) == state

        return await until(there, seconds)

    async def rows(self, table: str) -> list[Any]:
        async with self.engine.connect() as connection:
            if not await connection.run_sync(lambda sync: sa.inspect(sync).has_table(table)):
                return []
            return list(await connection.execute(sa.text(f"SELECT * FROM {table}")))


@pytest_asyncio.fixture
async def reader(database: Database) -> Reader:
    return Reader(database)


def status_text(task: Task | None) -> str:
    assert task is not None
    return " ".join(part.text for part in task.status.message.parts)


def lapsed_ends(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if "path=lease_lapsed" in record.getMessage()]


async def watch(server: Server, task_id: str) -> Stream:
    """A subscriber on ``server`` (its first request), and a push config there, for ``task_id``."""
    subscriber = Stream(server.calls.subscribe(task_id, "alice"))
    await until(lambda: subscriber.events)
    config = TaskPushNotificationConfig(task_id=task_id, url=PUSH_URL, id=uuid.uuid4().hex)
    await server.calls.add_push_config(config, "alice")
    return subscriber


# --- A replica dies ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["stock", "ours"])
@pytest.mark.asyncio
async def test_a_dead_replicas_running_task_is_ended_failed_by_a_survivor(
    database: Database, reader: Reader, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A dies mid-run. Stock: the task stays WORKING for good, B's subscriber never ends. Ours:
    B ends it FAILED, saying why, within a lease and a renewal; B's subscriber ends on FAILED,
    and B pushes it."""
    caplog.set_level(logging.INFO, "a2a_cancelfix")
    survivor = replica(kind, database.engine())
    async with elsewhere(database) as place:
        runner = await build_elsewhere(place, kind, ScriptedExecutor())
        task_id = await run_elsewhere(place, runner)
        assert await reader.reaches(task_id, WORKING)
        subscriber = await watch(survivor, task_id)
        await place.die()
        died = time.monotonic()
        if kind == "stock":
            assert not await reader.reaches(task_id, FAILED, ENDED_WITHIN)
            assert await reader.state(task_id) == WORKING and not subscriber.task.done()
            subscriber.task.cancel()
            return
        assert await reader.reaches(task_id, FAILED, BOUND)
        took = time.monotonic() - died
        assert took <= ENDED_WITHIN, took
        assert status_text(await reader.task(task_id)) == LAPSED
        assert await subscriber.ended(), subscriber.events
        assert subscriber.last == "FAILED", subscriber.events
        await survivor.push.posted(PUSH_URL, "FAILED")
        assert len(lapsed_ends(caplog)) == 1
        await survivor.handler.aclose()


@pytest.mark.edges_only  # Our SQL and timers, the same on every release (see noxfile.py).
@pytest.mark.parametrize("kind", ["stock", "ours"])
@pytest.mark.asyncio
async def test_two_survivors_end_a_dead_replicas_task_once(
    database: Database, reader: Reader, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """B and C both take A for dead: one of them writes FAILED and pushes it, the other leaves
    it (its delete of the run's lease row takes nothing). Stock: neither ends it."""
    caplog.set_level(logging.INFO, "a2a_cancelfix")
    survivors = [replica(kind, database.engine()), replica(kind, database.engine())]
    async with elsewhere(database) as place:
        runner = await build_elsewhere(place, kind, ScriptedExecutor())
        task_id = await run_elsewhere(place, runner)
        assert await reader.reaches(task_id, WORKING)
        for survivor in survivors:
            await watch(survivor, task_id)
        await place.die()
        if kind == "stock":
            assert not await reader.reaches(task_id, FAILED, ENDED_WITHIN)
            return
        assert await reader.reaches(task_id, FAILED, BOUND)
        # Both have looked: A's replica row and its run's row are gone.
        assert await until(lambda: _no_rows(reader), BOUND)
        for survivor in survivors:
            await survivor.handler.aclose()
    pushed = [state for survivor in survivors for state in survivor.push.received.get(PUSH_URL, [])]
    assert pushed.count("FAILED") == 1, pushed
    assert len(lapsed_ends(caplog)) == 1, lapsed_ends(caplog)


async def _no_rows(reader: Reader) -> bool:
    return not await reader.rows(RUNS) and len(await reader.rows(REPLICAS)) <= 2


@pytest.mark.edges_only  # Our SQL and timers, the same on every release (see noxfile.py).
@pytest.mark.asyncio
async def test_a_dead_replicas_parked_and_completed_tasks_stay_as_they_are(
    database: Database, reader: Reader, caplog: pytest.LogCaptureFixture
) -> None:
    """A dies with a task parked (INPUT_REQUIRED) and one COMPLETED whose lease rows it had not
    removed yet, and one running: the survivor ends the running one only. (Stock ends none,
    as for a running one.)"""
    caplog.set_level(logging.INFO, "a2a_cancelfix")
    survivor = replica("ours", database.engine())
    async with elsewhere(database) as place:
        parker = await build_elsewhere(place, "ours", ScriptedExecutor(park=True))
        parked = await run_elsewhere(place, parker)
        assert await reader.reaches(parked, INPUT_REQUIRED)
        finisher = await build_elsewhere(place, "ours", ScriptedExecutor())
        completed = await run_elsewhere(place, finisher)
        assert await reader.reaches(completed, WORKING)
        place.loop.call_soon_threadsafe(finisher.executor.step.open)
        assert await reader.reaches(completed, COMPLETED)
        runner = await build_elsewhere(place, "ours", ScriptedExecutor())
        running = await run_elsewhere(place, runner)
        assert await reader.reaches(running, WORKING)
        # As if A had died before a renewal deleted the ended runs' rows.
        await _lease_rows_left(reader, parker, parked, finisher, completed)
        await survivor.calls.get(running, "alice")  # The survivor's first request.
        await place.die()
        assert await reader.reaches(running, FAILED, BOUND)
        assert await until(lambda: _gone(reader, parked, completed), BOUND)
        assert await reader.state(parked) == INPUT_REQUIRED
        assert await reader.state(completed) == COMPLETED
        assert len(lapsed_ends(caplog)) == 1
        await survivor.handler.aclose()


# Each database's INSERT that leaves a row already there as it is: its verb and its tail.
INSERT_UNLESS_THERE = {
    "sqlite": ("INSERT", " ON CONFLICT DO NOTHING"),
    "postgresql": ("INSERT", " ON CONFLICT DO NOTHING"),
    "mysql": ("INSERT IGNORE", ""),
}


async def _lease_rows_left(reader: Reader, *servers_and_tasks: Any) -> None:
    pairs = list(zip(servers_and_tasks[::2], servers_and_tasks[1::2], strict=True))
    async with reader.engine.begin() as connection:
        for server, task_id in pairs:
            leases = server.handler._lifecycle.leases
            insert, conflict = INSERT_UNLESS_THERE[reader.engine.dialect.name]
            await connection.execute(
                sa.text(
                    f"{insert} INTO {RUNS} (store, task_id, replica_id, owner) "
                    f"VALUES ('tasks', :t, :r, :o){conflict}"  # Unless a renewal has not deleted it yet.
                ),
                {"t": task_id, "r": leases.replica_id, "o": "alice"},
            )


async def _gone(reader: Reader, *task_ids: str) -> bool:
    return not any(row.task_id in task_ids for row in await reader.rows(RUNS))


# --- A replica that cannot renew -----------------------------------------------------------------------


class Cut:
    """Every statement of ``engine``'s on the replicas' lease table fails while ``on``."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.on = False
        event.listen(engine.sync_engine, "before_cursor_execute", self._check)

    def _check(self, connection: Any, cursor: Any, statement: str, *_: Any) -> None:
        if self.on and REPLICAS in statement:
            raise OSError("the connection to the lease table is cut")


class HeldCanceled(wrapt.ObjectProxy):  # type: ignore[misc]
    """A guarded store whose saves of CANCELED wait at ``gate``."""

    def __init__(self, store: Any) -> None:
        super().__init__(store)
        self._self_gate = Gate()

    @property
    def gate(self) -> Gate:
        return self._self_gate

    async def save(self, task: Task, *args: Any, **kwargs: Any) -> Any:
        if task.status.state == CANCELED:
            await self._self_gate()
        return await self.__wrapped__.save(task, *args, **kwargs)


@pytest.mark.edges_only  # Our SQL and timers, the same on every release (see noxfile.py).
@pytest.mark.parametrize("kind", ["stock", "ours"])
@pytest.mark.asyncio
async def test_a_replica_that_cannot_renew_cancels_its_runs_before_anyone_takes_them_for_dead(
    database: Database, reader: Reader, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A's renewals fail. Ours: within half a lease A cancels its run through the lifecycle
    (``cancel()`` called, the work stopped, CANCELED stored with its own message); B then takes
    A for dead and finds nothing running to end. Stock: A's run goes on, nothing notices."""
    caplog.set_level(logging.INFO, "a2a_cancelfix")
    engine = database.engine()
    cut = Cut(engine)
    runner = replica(kind, engine)
    survivor = replica(kind, database.engine())
    stream = await start(runner)
    task_id = runner.executor.task_id or ""
    await survivor.calls.get(task_id, "alice")
    assert await reader.reaches(task_id, WORKING)
    cut.on = True
    cut_at = time.monotonic()
    if kind == "stock":
        assert not await set_within(runner.executor.cancel_called, LEASE + LEASE / 6)
        assert await reader.state(task_id) == WORKING
        runner.executor.step.open()
        assert await stream.ended()
        return
    assert await set_within(runner.executor.cancel_called, LEASE / 2 + LEASE / 6 + 1.0)
    assert await within(runner.executor.stopped.wait(), GRACE + 1.0)
    assert time.monotonic() - cut_at < LEASE  # Before anyone can take A for dead.
    assert await reader.reaches(task_id, CANCELED)
    assert status_text(await reader.task(task_id)) == "Canceled: this server lost contact with its task store"
    assert await stream.ended() and stream.last == "CANCELED"
    # B takes A for dead (A's replica row goes), and ends nothing: the task had ended.
    assert await until(lambda: _replicas_left(reader, 1), BOUND)
    assert await reader.state(task_id) == CANCELED
    assert lapsed_ends(caplog) == []
    assert any("path=lease_lost" in record.getMessage() for record in caplog.records)
    cut.on = False
    for server in (runner, survivor):
        await server.handler.aclose()


async def _replicas_left(reader: Reader, count: int) -> bool:
    return len(await reader.rows(REPLICAS)) == count


@pytest.mark.edges_only  # Our SQL and timers, the same on every release (see noxfile.py).
@pytest.mark.asyncio
async def test_a_late_canceled_of_a_replica_taken_for_dead_is_refused_over_the_failed_stored(
    database: Database, reader: Reader, caplog: pytest.LogCaptureFixture
) -> None:
    """A's renewals fail and its CANCELED cannot be written (held) until B has ended the task
    FAILED: A's CANCELED then meets the final-state guard, and the task stays FAILED."""
    caplog.set_level(logging.INFO, "a2a_cancelfix")
    engine = database.engine()
    cut = Cut(engine)
    store = HeldCanceled(FinalStateTaskStore(DatabaseTaskStore(engine)))
    runner = make_server("ours", ScriptedExecutor(), store=store, **OURS)
    survivor = replica("ours", database.engine())
    stream = await start(runner)
    task_id = runner.executor.task_id or ""
    await survivor.calls.get(task_id, "alice")
    cut.on = True
    assert await set_within(runner.executor.cancel_called, LEASE)
    await within(store.gate.reached.wait(), LEASE)
    assert await reader.reaches(task_id, FAILED, BOUND)
    store.gate.open()
    assert await until(lambda: any("refused save task=" in r.getMessage() for r in caplog.records), BOUND)
    assert await reader.state(task_id) == FAILED
    assert len(lapsed_ends(caplog)) == 1
    assert await stream.ended()
    cut.on = False
    for server in (runner, survivor):
        await server.handler.aclose()


@pytest.mark.edges_only  # Our SQL and timers, the same on every release (see noxfile.py).
@pytest.mark.asyncio
async def test_a_renewal_that_hangs_is_a_renewal_that_failed(reader: Reader, database: Database) -> None:
    """A's renewal waits for its replica row, which another transaction holds locked: the fence's
    own timer, not the renewal's, cancels A's run within half a lease."""
    if "postgresql" not in database.url:
        pytest.skip("a row lock that holds one statement while the others go on: PostgreSQL's")
    runner = replica("ours", database.engine())
    stream = await start(runner)
    task_id = runner.executor.task_id or ""
    leases = runner.handler._lifecycle.leases
    assert await until(lambda: _replicas_left(reader, 1))
    async with reader.engine.connect() as holder, holder.begin():
        await holder.execute(
            sa.text(f"SELECT * FROM {REPLICAS} WHERE replica_id = :r FOR UPDATE"), {"r": leases.replica_id}
        )
        held_at = time.monotonic()
        assert await set_within(runner.executor.cancel_called, LEASE)
        assert time.monotonic() - held_at < LEASE / 2 + LEASE / 6 + 0.5
        assert await stream.ended() and stream.last == "CANCELED"
    assert await reader.state(task_id) == CANCELED
    await runner.handler.aclose()


@pytest.mark.edges_only  # Our SQL and timers, the same on every release (see noxfile.py).
@pytest.mark.asyncio
async def test_a_run_started_once_a_hung_renewal_completes_is_not_cancelled(
    reader: Reader, database: Database, caplog: pytest.LogCaptureFixture
) -> None:
    """A's renewal hangs past its fence (A's run is cancelled), then completes: done after its
    fence time, it vouches for nothing, so A renews again at once and only then takes runs
    leased. A run A starts then goes on to COMPLETED, and no "could not renew" follows the
    "renewed its lease again"."""
    if "postgresql" not in database.url:
        pytest.skip("a row lock that holds one statement while the others go on: PostgreSQL's")
    caplog.set_level(logging.INFO, "a2a_cancelfix")
    runner = replica("ours", database.engine())
    first = await start(runner)
    leases = runner.handler._lifecycle.leases
    assert await until(lambda: _replicas_left(reader, 1))
    async with reader.engine.connect() as holder, holder.begin():
        await holder.execute(
            sa.text(f"SELECT * FROM {REPLICAS} WHERE replica_id = :r FOR UPDATE"), {"r": leases.replica_id}
        )
        held_at = time.monotonic()
        assert await first.ended() and first.last == "CANCELED"
        assert leases.fenced
        # The stall's length, not a wait for an event: it outlasts the hung renewal's own fence
        # time (sent within a renewal period of the lock, plus half a lease).
        await asyncio.sleep(max(held_at + LEASE / 6 + LEASE / 2 + 0.1 - time.monotonic(), 0.0))
    assert await until(lambda: any("renewed its lease again" in r.getMessage() for r in caplog.records))
    runner.executor.cancel_called.clear()
    second = Stream(runner.calls.send_stream(SendMessageRequest(message=message("again")), "alice"))
    await second.until(lambda: second.last == "WORKING")
    assert not await set_within(runner.executor.cancel_called, LEASE / 2)
    runner.executor.step.open()
    assert await second.ended() and second.last == "COMPLETED", second.events
    said = [r.getMessage() for r in caplog.records if "renew" in r.getMessage()]
    again = min(i for i, text in enumerate(said) if "renewed its lease again" in text)
    assert not [text for text in said[again:] if "could not renew" in text], said
    await runner.handler.aclose()


@pytest.mark.asyncio
async def test_the_orphan_scan_reads_the_orphans_alone(database: Database, reader: Reader) -> None:
    """Among a live replica's many run rows, the scan for runs whose replica row is gone gets
    from the database only those rows."""
    server = replica("ours", database.engine(), lease_time=60.0)  # No scan of its own meanwhile.
    leases = server.handler._lifecycle.leases
    assert await until(lambda: _replicas_left(reader, 1))
    row = {"store": leases.store.table_name, "replica_id": leases.replica_id, "owner": "alice"}
    rows = [dict(row, task_id=f"live-{n}") for n in range(200)]
    orphans = [dict(row, task_id=f"orphan-{n}", replica_id="gone") for n in range(3)]
    async with reader.engine.begin() as connection:
        await connection.execute(sa.insert(leases.tables.runs), rows + orphans)
    found = await leases._orphans()
    assert sorted(found) == sorted(("orphan-" + str(n), "gone", "alice") for n in range(3))
    async with reader.engine.begin() as connection:
        await connection.execute(sa.delete(leases.tables.runs))
    await server.handler.aclose()


@pytest.mark.edges_only  # Our SQL and timers, the same on every release (see noxfile.py).
@pytest.mark.asyncio
async def test_a_replica_taken_for_dead_that_comes_back_leases_its_new_runs_again(
    database: Database, reader: Reader, caplog: pytest.LogCaptureFixture
) -> None:
    """A cannot renew for over a lease: B takes it for dead and removes its row. Once A can renew
    again, it registers anew: a run it starts then is leased, and B leaves it running."""
    caplog.set_level(logging.INFO, "a2a_cancelfix")
    engine = database.engine()
    cut = Cut(engine)
    runner = replica("ours", engine)
    survivor = replica("ours", database.engine())
    first = await start(runner)
    await survivor.calls.get(runner.executor.task_id or "", "alice")
    leases = runner.handler._lifecycle.leases
    dead_id = leases.replica_id
    cut.on = True
    assert await first.ended() and first.last == "CANCELED"
    assert await until(lambda: _replica_gone(reader, dead_id), BOUND)  # B took A for dead.
    cut.on = False
    assert await until(lambda: leases.replica_id != dead_id and not leases.fenced, BOUND)
    second = Stream(runner.calls.send_stream(SendMessageRequest(message=message("again")), "alice"))
    await second.until(lambda: second.last == "WORKING")
    task_id = second.events[0].id
    assert await until(lambda: _leased_by(reader, task_id, leases.replica_id))
    assert not await reader.reaches(task_id, FAILED, LEASE + LEASE / 3)
    assert await reader.state(task_id) == WORKING
    runner.executor.step.open()
    assert await second.ended() and second.last == "COMPLETED"
    for server in (runner, survivor):
        await server.handler.aclose()


async def _replica_gone(reader: Reader, replica_id: str) -> bool:
    return all(row.replica_id != replica_id for row in await reader.rows(REPLICAS))


async def _leased_by(reader: Reader, task_id: str, replica_id: str) -> bool:
    return any(row.task_id == task_id and row.replica_id == replica_id for row in await reader.rows(RUNS))


# --- Shutdown, restart, off ----------------------------------------------------------------------------


@pytest.mark.edges_only  # Our SQL and timers, the same on every release (see noxfile.py).
@pytest.mark.asyncio
async def test_aclose_removes_the_replicas_lease_rows_and_leaves_the_survivors_nothing(
    database: Database, reader: Reader, caplog: pytest.LogCaptureFixture
) -> None:
    """A shuts down with a run going: its shutdown cancels the run (CANCELED), then removes its
    run's lease row and its own: B, which saw A's lease, has nothing left to end."""
    caplog.set_level(logging.INFO, "a2a_cancelfix")
    # A margin that a busy machine keeps: aclose() removes the rows within one after its cancels.
    options = {"lease_time": 4.0, "timing": Timing(margin=0.5)}
    runner = replica("ours", database.engine(), shutdown_drain_time=0.1, **options)
    survivor = replica("ours", database.engine(), **options)
    stream = await start(runner)
    task_id = runner.executor.task_id or ""
    leases = runner.handler._lifecycle.leases
    await survivor.calls.get(task_id, "alice")
    assert await until(lambda: _leased_by(reader, task_id, leases.replica_id))
    assert await until(lambda: _replicas_left(reader, 2))
    await within(runner.handler.aclose(), 5.0)
    assert await stream.ended() and stream.last == "CANCELED"
    assert await reader.rows(RUNS) == []
    assert [row.replica_id for row in await reader.rows(REPLICAS)] == [
        survivor.handler._lifecycle.leases.replica_id
    ]
    await survivor.handler.aclose()
    assert await reader.rows(REPLICAS) == []
    assert lapsed_ends(caplog) == []


async def _left_to_the_survivor(reader: Reader, task_id: str, replica_id: str) -> None:
    """A replica stopped with ``task_id`` stored WORKING and nothing running it: its own row is
    gone, its run's stayed, so the survivor ends the task FAILED at its next look (a renewal
    period, not a lease) and claims the row."""
    assert await reader.state(task_id) == WORKING
    assert await _replica_gone(reader, replica_id)
    assert await reader.reaches(task_id, FAILED, LEASE / 6 + 4.0)
    assert status_text(await reader.task(task_id)) == LAPSED
    assert await until(lambda: _gone(reader, task_id))


class EndsRefused(wrapt.ObjectProxy):  # type: ignore[misc]
    """A guarded store whose saves of a terminal state fail: the store cut off as a run ends."""

    async def save(self, task: Task, *args: Any, **kwargs: Any) -> Any:
        if task.status.state in _sdk.TERMINAL_STATES:
            raise OSError("the connection to the task store is cut")
        return await self.__wrapped__.save(task, *args, **kwargs)


@pytest.mark.edges_only  # Our SQL and timers, the same on every release (see noxfile.py).
@pytest.mark.parametrize("kind", ["stock", "ours"])
@pytest.mark.asyncio
async def test_a_shutdown_that_could_not_store_canceled_leaves_the_task_to_a_survivor(
    database: Database, reader: Reader, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A shuts down with a run going, and its CANCELED cannot be stored. Ours: A's run lease
    stays, its replica row goes, so B ends the task FAILED at its next look, not after a lease.
    Stock: the task stays WORKING with nothing running."""
    caplog.set_level(logging.INFO, "a2a_cancelfix")
    store = EndsRefused(FinalStateTaskStore(DatabaseTaskStore(database.engine())))
    if kind == "ours":
        runner = make_server("ours", ScriptedExecutor(), store=store, shutdown_drain_time=0.1, **OURS)
    else:
        runner = replica("stock", database.engine())
    survivor = replica(kind, database.engine())
    stream = await start(runner)
    task_id = runner.executor.task_id or ""
    await survivor.calls.get(task_id, "alice")
    assert await reader.reaches(task_id, WORKING)
    if kind == "stock":
        close = getattr(runner.handler, "aclose", None)  # a2a-sdk 1.1.2+
        if close is not None:
            await within(close(), 5.0)
        assert not await reader.reaches(task_id, FAILED, ENDED_WITHIN)
        assert await reader.state(task_id) == WORKING
        runner.executor.step.open()
        assert await stream.ended()
        return
    leases = runner.handler._lifecycle.leases
    assert await until(lambda: _leased_by(reader, task_id, leases.replica_id))
    await within(runner.handler.aclose(), 5.0)
    await _left_to_the_survivor(reader, task_id, leases.replica_id)  # The CANCELED never landed.
    assert len(lapsed_ends(caplog)) == 1
    await survivor.handler.aclose()


@pytest.mark.edges_only  # Our SQL and timers, the same on every release (see noxfile.py).
@pytest.mark.asyncio
async def test_a_run_that_returned_before_its_end_was_stored_leaves_its_task_to_a_survivor(
    database: Database, reader: Reader, caplog: pytest.LogCaptureFixture
) -> None:
    """A's run completes but the store fails its COMPLETED: the task shows WORKING with nothing
    running. A's lease on it stays, so once A stops, B ends the task FAILED."""
    caplog.set_level(logging.INFO, "a2a_cancelfix")
    store = EndsRefused(FinalStateTaskStore(DatabaseTaskStore(database.engine())))
    runner = make_server("ours", ScriptedExecutor(), store=store, **OURS)
    survivor = replica("ours", database.engine())
    await start(runner)
    task_id = runner.executor.task_id or ""
    await survivor.calls.get(task_id, "alice")
    leases = runner.handler._lifecycle.leases
    assert await until(lambda: _leased_by(reader, task_id, leases.replica_id))
    runner.executor.step.open()
    await within(runner.executor.stopped.wait())
    await within(runner.handler.aclose(), 5.0)
    await _left_to_the_survivor(reader, task_id, leases.replica_id)  # Its end never landed.
    assert len(lapsed_ends(caplog)) == 1
    await survivor.handler.aclose()


class LeaseFailsOnce:
    """The first statement of ``engine``'s that inserts a run's lease row fails."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.failed = False
        event.listen(engine.sync_engine, "before_cursor_execute", self._check)

    def _check(self, connection: Any, cursor: Any, statement: str, *_: Any) -> None:
        if not self.failed and statement.startswith(f"INSERT INTO {RUNS}"):
            self.failed = True
            raise OSError("the connection dropped")


@pytest.mark.asyncio
async def test_a_run_whose_lease_could_not_be_written_is_leased_by_the_next_renewal(
    database: Database, reader: Reader
) -> None:
    """The insert of a run's lease row fails: the run goes on, and the next renewal leases it
    (else a death of this replica would leave the task running for good)."""
    engine = database.engine()
    fails = LeaseFailsOnce(engine)
    runner = replica("ours", engine)
    await start(runner)
    task_id = runner.executor.task_id or ""
    assert fails.failed
    leases = runner.handler._lifecycle.leases
    assert await until(lambda: _leased_by(reader, task_id, leases.replica_id), LEASE)
    runner.executor.step.open()
    await runner.handler.aclose()


@pytest.mark.asyncio
async def test_a_run_started_before_its_replica_is_registered_is_leased_once_it_is(
    database: Database, reader: Reader
) -> None:
    """A's registration fails (its store cut off from the lease table): a run it starts is not
    leased until A's own row is in, else B would take the run's row for an orphan's and end
    the task while it runs. Once A registers, the run is leased."""
    survivor = replica("ours", database.engine())
    await survivor.handler._lifecycle.leases.begin()  # The tables are there.
    engine = database.engine()
    cut = Cut(engine)
    cut.on = True
    runner = replica("ours", engine)
    await start(runner)
    task_id = runner.executor.task_id or ""
    leases = runner.handler._lifecycle.leases
    assert not await _leased_by(reader, task_id, leases.replica_id)
    cut.on = False
    assert await until(lambda: _leased_by(reader, task_id, leases.replica_id), LEASE)
    assert not await _replica_gone(reader, leases.replica_id)
    assert await reader.state(task_id) == WORKING
    runner.executor.step.open()
    for server in (runner, survivor):
        await server.handler.aclose()


@pytest.mark.asyncio
async def test_a_replica_registers_though_another_creates_the_tables_meanwhile(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two replicas start at once on one SQLite file: the other creates each of our tables just
    before this one does. This one registers all the same, with no warning (its check, then
    its create, lost that race and failed the registration until the next renewal)."""
    path = tmp_path / "tasks.db"
    engine = create_async_engine(f"sqlite+aiosqlite:///{path}")

    def the_other_first(connection: Any, cursor: Any, statement: str, *_: Any) -> None:
        if statement.lstrip().startswith("CREATE TABLE") and "a2a_cancelfix_" in statement:
            create = re.sub(r"^\s*CREATE TABLE (IF NOT EXISTS )?", "CREATE TABLE IF NOT EXISTS ", statement)
            with contextlib.closing(sqlite3.connect(path)) as other:
                other.execute(create)
                other.commit()

    event.listen(engine.sync_engine, "before_cursor_execute", the_other_first)
    server = replica("ours", engine)
    with caplog.at_level(logging.WARNING, "a2a_cancelfix"):
        await within(server.handler._lifecycle.leases.begin())
    assert [record.getMessage() for record in caplog.records if record.name == "a2a_cancelfix"] == []
    await server.handler.aclose()
    await engine.dispose()


@pytest.mark.asyncio
async def test_a_cancelled_runs_lease_row_goes_once_its_canceled_is_stored(
    database: Database, reader: Reader
) -> None:
    """A cancelled run's row outlives its run until its CANCELED is stored, no longer: the runs
    table does not grow with the cancels a replica served."""
    runner = replica("ours", database.engine())
    await start(runner)
    task_id = runner.executor.task_id or ""
    leases = runner.handler._lifecycle.leases
    assert await until(lambda: _leased_by(reader, task_id, leases.replica_id))
    await runner.calls.cancel(task_id, "alice")
    assert await reader.reaches(task_id, CANCELED)
    assert await until(lambda: _gone(reader, task_id), LEASE)
    await runner.handler.aclose()


async def _saved(reader: Reader, state: int) -> str:
    """A task of a previous process, saved as it left it, with no lease (a stock server's, say)."""
    task_id = uuid.uuid4().hex
    await reader.store.save(
        Task(id=task_id, context_id="ctx", status=TaskStatus(state=state)), caller("alice")
    )
    return task_id


@pytest.mark.edges_only  # Our SQL and timers, the same on every release (see noxfile.py).
@pytest.mark.parametrize("kind", ["stock", "ours", "ours, sole_replica"])
@pytest.mark.asyncio
async def test_a_restarted_sole_server_ends_what_its_previous_process_left_running(
    database: Database, reader: Reader, kind: str
) -> None:
    """The previous process died with a leased run going, and left tasks WORKING and SUBMITTED
    with no lease, one parked and one COMPLETED. Restarted with ``sole_replica``, its first
    request ends the running ones FAILED at once; the parked and completed ones stay. Without
    it, the leased one is ended one lease after the first request, the others stay. Stock:
    everything stays."""
    async with elsewhere(database) as place:
        previous = await build_elsewhere(place, "ours", ScriptedExecutor())
        leased = await run_elsewhere(place, previous)
        assert await reader.reaches(leased, WORKING)
        await place.die()
        # Within the block: the dead loop is cleaned up (its code run) only after the checks.
        working, submitted = (
            await _saved(reader, WORKING),
            await _saved(reader, TaskState.TASK_STATE_SUBMITTED),
        )
        parked, completed = await _saved(reader, INPUT_REQUIRED), await _saved(reader, COMPLETED)
        restarted = replica(
            kind.partition(",")[0], database.engine(), sole_replica=kind.endswith("sole_replica")
        )
        await restarted.calls.get(parked, "alice")  # Its first request.
        started = time.monotonic()
        if kind == "stock":
            assert not await reader.reaches(leased, FAILED, ENDED_WITHIN)
            ended: set[str] = set()
        elif kind == "ours":
            assert await reader.reaches(leased, FAILED, BOUND)
            assert time.monotonic() - started >= LEASE * 0.9  # The first sighting starts the clock.
            ended = {leased}
        else:
            ended = {leased, working, submitted}  # Already: the first request waited for them.
        for task_id, state in [
            (leased, WORKING),
            (working, WORKING),
            (submitted, TaskState.TASK_STATE_SUBMITTED),
            (parked, INPUT_REQUIRED),
            (completed, COMPLETED),
        ]:
            assert await reader.state(task_id) == (FAILED if task_id in ended else state)
        if kind != "stock":
            assert status_text(await reader.task(leased)) == LAPSED
            await restarted.handler.aclose()


async def _outside_a_loop(kind: str, engine: AsyncEngine, **options: Any) -> Server:
    """A replica built where no loop runs (a server script's module level): only its start, or a
    request, begins its lease."""
    return await asyncio.to_thread(replica, kind, engine, **options)


def _entered(server: Server) -> contextlib.AbstractAsyncContextManager[Any]:
    """Ours started as a lifespan starts it (``async with handler``); stock has no such start."""
    handler: Any = server.handler
    return handler if isinstance(handler, DefaultRequestHandler) else contextlib.nullcontext()


@pytest.mark.edges_only  # Our SQL and timers, the same on every release (see noxfile.py).
@pytest.mark.parametrize("kind", ["stock", "ours"])
@pytest.mark.asyncio
async def test_a_restarted_sole_replica_ends_what_its_previous_process_left_running_at_its_start(
    database: Database, reader: Reader, kind: str
) -> None:
    """Restarted with ``sole_replica`` and entered as a lifespan enters it, with no request at
    all: the tasks its previous process left WORKING, leased or not, are FAILED once the start
    returns. Stock: they stay WORKING."""
    async with elsewhere(database) as place:
        previous = await build_elsewhere(place, "ours", ScriptedExecutor())
        leased = await run_elsewhere(place, previous)
        assert await reader.reaches(leased, WORKING)
        await place.die()
        working = await _saved(reader, WORKING)
        restarted = await _outside_a_loop(kind, database.engine(), sole_replica=kind == "ours")
        async with _entered(restarted):
            if kind == "stock":
                assert not await reader.reaches(leased, FAILED, ENDED_WITHIN)
                assert await reader.state(working) == WORKING
                return
            # No wait: the start waited for its first pass.
            assert [await reader.state(leased), await reader.state(working)] == [FAILED, FAILED]
            assert status_text(await reader.task(working)) == LAPSED


@pytest.mark.parametrize("kind", ["stock", "ours"])
@pytest.mark.asyncio
async def test_an_idle_survivor_ends_a_dead_replicas_task(
    database: Database, reader: Reader, kind: str
) -> None:
    """B is started and never asked anything; A dies mid-run. Ours: B ends A's task FAILED within
    the bound. Stock: it stays WORKING."""
    async with elsewhere(database) as place:
        survivor = await _outside_a_loop(kind, database.engine())
        async with _entered(survivor):
            runner = await build_elsewhere(place, kind, ScriptedExecutor())
            task_id = await run_elsewhere(place, runner)
            assert await reader.reaches(task_id, WORKING)
            await place.die()
            if kind == "stock":
                assert not await reader.reaches(task_id, FAILED, ENDED_WITHIN)
                return
            assert await reader.reaches(task_id, FAILED, BOUND)
            assert status_text(await reader.task(task_id)) == LAPSED


@pytest.mark.asyncio
async def test_a_start_left_by_an_exception_still_shuts_down(database: Database, reader: Reader) -> None:
    """An error inside ``async with handler`` (a lifespan's): the exit still runs ``aclose()``,
    which removes the replica's lease rows and refuses new messages."""
    server = await _outside_a_loop("ours", database.engine())
    with pytest.raises(RuntimeError, match="the app failed"):
        async with server.handler:
            assert await until(lambda: _replicas_left(reader, 1))
            raise RuntimeError("the app failed")
    assert await reader.rows(REPLICAS) == []
    refused = Stream(server.calls.send_stream(SendMessageRequest(message=message("late")), "alice"))
    assert await refused.ended()
    assert isinstance(refused.error, A2AError) and server.executor.task_id is None


@pytest.mark.parametrize("kind", ["stock", "ours"])
@pytest.mark.asyncio
async def test_a_replica_built_in_a_running_loop_begins_its_lease_at_once(
    database: Database, reader: Reader, kind: str
) -> None:
    """Built in the server's loop (a framework's factory), with no start and no request: ours
    registers its lease at once. Stock has none."""
    server = replica(kind, database.engine())
    if kind == "stock":
        assert not await until(lambda: _replicas_left(reader, 1), LEASE / 2)
        return
    assert await until(lambda: _replicas_left(reader, 1))
    await server.handler.aclose()


@pytest.mark.parametrize("store", ["database, lease_time=None", "in memory"])
@pytest.mark.asyncio
async def test_without_leases_nothing_is_leased_nor_runs_behind(store: str, tmp_path: Path) -> None:
    """``lease_time=None`` over a database, or any in-memory store: no lease tables, no
    background work; a run is served as without leases."""
    async with open_database("sqlite", tmp_path) as database:
        if store == "in memory":
            server = make_server("ours", ScriptedExecutor(), **OURS)
        else:
            server = replica("ours", database.engine(), lease_time=None)
        assert server.handler._lifecycle.leases is None
        before = asyncio.all_tasks()
        stream = await start(server)
        server.executor.step.open()
        assert await stream.ended() and stream.last == "COMPLETED"
        behind = [task for task in asyncio.all_tasks() - before if not task.done()]
        assert not [task for task in behind if "_liveness" in repr(task.get_coro())], behind
        reader = Reader(database)
        assert await reader.rows(REPLICAS) == [] and await reader.rows(RUNS) == []
        async with reader.engine.connect() as connection:
            tables = await connection.run_sync(lambda sync: sa.inspect(sync).get_table_names())
        assert REPLICAS not in tables and RUNS not in tables


@pytest.mark.parametrize(
    ("options", "error", "named"),
    [
        ({"lease_time": 10.0, "cancel_grace_period": 5.0}, ValueError, ("lease_time", "cancel_grace_period")),
        # The default's value, given: judged as any other (it was taken, and raised to 46 s).
        (
            {"lease_time": 30.0, "cancel_grace_period": 20.0},
            ValueError,
            ("lease_time", "cancel_grace_period"),
        ),
        ({"lease_time": 30, "cancel_grace_period": 20.0}, ValueError, ("lease_time", "cancel_grace_period")),
        ({"lease_time": 0}, ValueError, ("lease_time",)),
        ({"lease_time": math.inf}, ValueError, ("lease_time",)),
        ({"lease_time": math.nan}, ValueError, ("lease_time",)),
        ({"lease_time": "30"}, TypeError, ("lease_time",)),
        ({"lease_time": True}, TypeError, ("lease_time",)),
        ({"sole_replica": 1}, TypeError, ("sole_replica",)),
    ],
    ids=[
        "shorter than the grace needs",
        "30 given",
        "30 given as an int",
        "zero",
        "infinite",
        "nan",
        "a string",
        "a bool",
        "sole_replica",
    ],
)
def test_a_lease_outside_its_documented_values_is_refused(
    options: dict[str, Any], error: type[Exception], named: tuple[str, ...]
) -> None:
    """Refused at construction, naming the option (and the grace period it must hold)."""
    with pytest.raises(error) as raised:
        DefaultRequestHandler(ScriptedExecutor(), InMemoryTaskStore(), CARD, **options)
    for name in named:
        assert name in str(raised.value)


def test_the_default_lease_is_long_enough_for_the_grace_period() -> None:
    """30 s by default; with a grace period that needs more, the least lease that holds a cancel
    in its first half; given, it is kept."""

    def lease(**options: Any) -> float | None:
        handler = DefaultRequestHandler(ScriptedExecutor(), InMemoryTaskStore(), CARD, **options)
        return handler._lifecycle.settings.lease_time

    assert lease() == 30.0
    assert lease(cancel_grace_period=20.0) == 2 * (20.0 + 3 * Timing().margin)
    assert lease(cancel_grace_period=20.0, lease_time=60.0) == 60.0
    assert lease(lease_time=30) == 30.0 and type(lease(lease_time=30)) is float
    assert lease(lease_time=None) is None


@pytest.mark.skipif(not _sdk.HAS_CLUSTER, reason="cluster mode is a2a-sdk 1.2+")
@pytest.mark.parametrize("kind", ["stock", "ours"])
@pytest.mark.asyncio
async def test_in_cluster_mode_a_dead_replicas_task_ends_failed_in_the_journal_too(
    database: Database, reader: Reader, kind: str
) -> None:
    """Upstream's cluster mode (a versioned store, a stream tailing its journal): the survivor's
    FAILED is a versioned save, journaled, so that B's subscriber, served by the SDK's stream,
    ends on it. Stock: WORKING for good, the subscriber never ends."""
    from a2a.server.cluster import DatabaseTaskEventStream, VersionedDatabaseTaskStore

    async def clustered(engine: AsyncEngine, executor: ScriptedExecutor) -> Server:
        store = VersionedDatabaseTaskStore(engine)
        await store.initialize()
        events = DatabaseTaskEventStream(engine, poll_interval_s=0.02)
        await events.initialize()
        options = OURS if kind == "ours" else {}
        return make_server(kind, executor, store=store, event_stream=events, **options)

    async with elsewhere(database) as place:
        runner = await place.call(clustered(place.engine, ScriptedExecutor()))
        task_id = await run_elsewhere(place, runner)
        assert await reader.reaches(task_id, WORKING)
        survivor = await clustered(database.engine(), ScriptedExecutor())
        subscriber = Stream(survivor.calls.subscribe(task_id, "alice"))
        assert await until(lambda: subscriber.events)
        await place.die()
        if kind == "stock":
            assert not await reader.reaches(task_id, FAILED, ENDED_WITHIN)
            assert not subscriber.task.done()
            subscriber.task.cancel()
            return
        assert await reader.reaches(task_id, FAILED, BOUND)
        assert await subscriber.ended() and subscriber.last == "FAILED", subscriber.events
        async with reader.engine.connect() as connection:
            versions = await connection.execute(
                sa.text("SELECT task_version FROM task_events WHERE task_id = :t ORDER BY seq"),
                {"t": task_id},
            )
            journaled = [version for (version,) in versions]
        assert journaled == sorted(journaled) and len(set(journaled)) == len(journaled)
        await survivor.handler.aclose()


@pytest.mark.edges_only  # Our SQL and timers, the same on every release (see noxfile.py).
@pytest.mark.asyncio
async def test_a_run_that_starts_while_its_replica_cannot_renew_is_cancelled_at_once(
    database: Database, reader: Reader
) -> None:
    """A has not renewed for half a lease: a run it starts then is not left to run unprotected,
    it is cancelled as the others were (``cancel()`` called, CANCELED)."""
    engine = database.engine()
    cut = Cut(engine)
    runner = replica("ours", engine)
    first = await start(runner)
    leases = runner.handler._lifecycle.leases
    cut.on = True
    assert await first.ended() and first.last == "CANCELED"
    assert leases.fenced
    runner.executor.cancel_called.clear()
    second = Stream(runner.calls.send_stream(SendMessageRequest(message=message("again")), "alice"))
    assert await set_within(runner.executor.cancel_called, GRACE + 1.0)
    assert await second.ended() and second.last == "CANCELED", second.events
    cut.on = False
    await runner.handler.aclose()


# --- Lapses judged in time, and ended each on its own ---------------------------------------------

# Long enough that a renewal (a sixth) late stands out of what a loaded machine adds to a write.
TIMED_LEASE = 6.0


@pytest.mark.edges_only  # Our SQL and timers, the same on every release (see noxfile.py).
@pytest.mark.parametrize("kind", ["stock", "ours"])
@pytest.mark.asyncio
async def test_a_restarted_replica_ends_its_predecessors_tasks_one_lease_after_its_start(
    database: Database, reader: Reader, kind: str
) -> None:
    """Without ``sole_replica``: the restarted process reads the others' beats as it registers,
    and ends its predecessor's leased task one ``lease_time`` after its start (plus the write),
    not a renewal or two later. Stock: the task stays WORKING."""
    async with elsewhere(database) as place:
        previous = await build_elsewhere(place, "ours", ScriptedExecutor(), lease_time=TIMED_LEASE)
        task_id = await run_elsewhere(place, previous)
        assert await reader.reaches(task_id, WORKING)
        await place.die()
        restarted = await _outside_a_loop(kind, database.engine(), lease_time=TIMED_LEASE)
        started = time.monotonic()
        async with _entered(restarted):
            if kind == "stock":
                assert not await reader.reaches(task_id, FAILED, TIMED_LEASE + TIMED_LEASE / 6)
                assert await reader.state(task_id) == WORKING
                return
            assert await reader.reaches(task_id, FAILED, TIMED_LEASE + BOUND)
            took = time.monotonic() - started
            assert TIMED_LEASE * 0.95 <= took <= TIMED_LEASE + 0.9 * TIMED_LEASE / 6, took
            assert status_text(await reader.task(task_id)) == LAPSED


@pytest.mark.edges_only  # Our SQL and timers, the same on every release (see noxfile.py).
@pytest.mark.parametrize("kind", ["stock", "ours"])
@pytest.mark.asyncio
async def test_a_survivor_judges_a_lapse_on_the_beat_it_noted(
    database: Database, reader: Reader, kind: str
) -> None:
    """A survivor ends a dead replica's task one ``lease_time`` after it first read that
    replica's last beat (plus the write), not at a renewal after that. Stock: WORKING stays."""
    survivor = replica(kind, database.engine(), lease_time=TIMED_LEASE)
    async with elsewhere(database) as place:
        runner = await build_elsewhere(place, kind, ScriptedExecutor(), lease_time=TIMED_LEASE)
        task_id = await run_elsewhere(place, runner)
        assert await reader.reaches(task_id, WORKING)
        await survivor.calls.get(task_id, "alice")  # Its first request: it begins its lease.
        await place.die()
        if kind == "stock":
            assert not await reader.reaches(task_id, FAILED, TIMED_LEASE + TIMED_LEASE / 6)
            return
        dead_id = runner.handler._lifecycle.leases.replica_id
        leases = survivor.handler._lifecycle.leases
        (last_beat,) = [row.beat for row in await reader.rows(REPLICAS) if row.replica_id == dead_id]
        # The survivor notes the last beat at its first renewal after it was written.
        assert await until(lambda: leases._seen.get(dead_id, (None, 0.0))[0] == last_beat, BOUND)
        noted = leases._seen[dead_id][1]
        assert await reader.reaches(task_id, FAILED, TIMED_LEASE + BOUND)
        took = asyncio.get_running_loop().time() - noted
        assert TIMED_LEASE * 0.95 <= took <= TIMED_LEASE + 0.6 * TIMED_LEASE / 6, took
        await survivor.handler.aclose()


@pytest_asyncio.fixture(params=["postgresql", "mysql"])
async def locking_database(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Database]:
    """A database with row locks (SQLite has none: a writer holds the whole file)."""
    async with open_database(request.param, tmp_path) as opened:
        yield opened


@contextlib.asynccontextmanager
async def holding(database: Database, task_id: str) -> AsyncIterator[None]:
    """The task's row locked by a transaction left open: a runner frozen between its write and
    its COMMIT. Rolled back on leaving."""
    engine = database.engine()
    async with engine.connect() as connection:
        transaction = await connection.begin()
        await connection.execute(sa.text("SELECT id FROM tasks WHERE id = :id FOR UPDATE"), {"id": task_id})
        try:
            yield
        finally:
            await transaction.rollback()


@pytest.mark.edges_only  # Our SQL and timers, the same on every release (see noxfile.py).
@pytest.mark.parametrize("kind", ["stock", "ours"])
@pytest.mark.asyncio
async def test_a_held_row_delays_only_its_own_tasks_lapsed_end(
    locking_database: Database, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A dies with two runs, one task's row held by a transaction that never commits. The other
    task ends FAILED within the bound, and so does a task whose lease lapses later; the held one
    ends once the row is let go, at the next pass. Stock: all three stay WORKING."""
    caplog.set_level(logging.INFO, "a2a_cancelfix")
    database = locking_database
    reader = Reader(database)
    survivor = replica(kind, database.engine())
    async with elsewhere(database) as place:
        held = await run_elsewhere(place, await build_elsewhere(place, kind, ScriptedExecutor()))
        free = await run_elsewhere(place, await build_elsewhere(place, kind, ScriptedExecutor()))
        for task_id in (held, free):
            assert await reader.reaches(task_id, WORKING)
        await survivor.calls.get(held, "alice")  # Its first request: it begins its lease.
        owners = {row.task_id: row.owner for row in await reader.rows(RUNS)}
        async with holding(database, held):
            await place.die()
            if kind == "stock":
                assert not await reader.reaches(free, FAILED, ENDED_WITHIN)
                assert [await reader.state(held), await reader.state(free)] == [WORKING, WORKING]
                return
            assert await reader.reaches(free, FAILED, BOUND)
            # A lapse found later: a run row whose replica row is gone, of a task running.
            later = await _saved(reader, WORKING)
            async with reader.engine.begin() as connection:
                values = {"store": "tasks", "task_id": later, "replica_id": "gone", "owner": owners[held]}
                await connection.execute(
                    sa.text(f"INSERT INTO {RUNS} VALUES (:store, :task_id, :replica_id, :owner)"), values
                )
            assert await reader.reaches(later, FAILED, LEASE + BOUND)
            assert await reader.state(held) == WORKING
        assert await reader.reaches(held, FAILED, BOUND)
        assert status_text(await reader.task(held)) == LAPSED
        assert len(lapsed_ends(caplog)) == 3, lapsed_ends(caplog)
        await survivor.handler.aclose()
