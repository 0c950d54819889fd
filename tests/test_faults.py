"""Faults in a real task store, met as an operator meets them (issue 30): a row another
transaction holds locked, a statement timeout, a connection killed mid-write.

Every cancel answers within its bound (grace period plus two margins at the very worst: one
for the SDK's part, one for the direct write), never CANCELED that the store does not hold;
the CANCELED it could not record in time is recorded behind the answer, and the task never
stays WORKING with nothing running. Stock, on the same release, beside ours where it differs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from a2a.server.tasks import DatabaseTaskStore
from a2a.utils.errors import A2AError, InternalError
from sqlalchemy.ext.asyncio import create_async_engine

from a2a_cancelfix import FinalStateTaskStore, _sdk
from a2a_cancelfix._cancel.settings import Timing
from a2a_cancelfix._sdk import state_name
from a2a_cancelfix.testing import (
    ScriptedExecutor,
    Stream,
    caller,
    cancel,
    make_server,
    start,
    stored,
    within,
)
from a2a_cancelfix.testing.servers import GRACE
from a2a_cancelfix.testing.waits import eventually

from .support import MYSQL_HOST, MYSQL_PORT
from .test_replicas import outcome_within
from .test_store import CANCELED, PG_DSN, WORKING, Database, make_task, open_database

# The whole cancel's bound: the grace period, the SDK's margin, the direct write's margin.
ANSWER_BOUND = GRACE + 2 * Timing().margin
# What the caller is told while the CANCELED write waits for the store.
NOT_YET = "has not recorded CANCELED yet"
SLACK = 1.0
# How long a CANCELED recorded behind the answer may take to land once the lock is gone: a
# write that lost the race for the lock (SQLite fails it at once) is retried 0.1, 0.5, 1, 2 s on.
LANDING = 10.0


class Writes:
    """Sets ``in_flight`` when a statement that writes the task table starts on ``engine``:
    the CANCELED write has reached the database (and waits there, if the row is locked)."""

    def __init__(self, engine: Any) -> None:
        self.in_flight = asyncio.Event()
        self.armed = False
        self.backends: list[int] = []  # PostgreSQL: the server pid of each connection writing.
        loop = asyncio.get_running_loop()

        def started(conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
            if self.armed and statement.lstrip().upper().startswith(("INSERT", "UPDATE")):
                driver = conn.connection.driver_connection
                if hasattr(driver, "get_server_pid"):
                    self.backends.append(driver.get_server_pid())
                loop.call_soon_threadsafe(self.in_flight.set)

        sa.event.listen(engine.sync_engine, "before_cursor_execute", started)


@contextlib.asynccontextmanager
async def row_locked(kind: str, database: Database, tmp_path: Path, task_id: str) -> AsyncIterator[None]:
    """Another transaction holds the lock the CANCELED write needs, until the block ends."""
    if kind == "postgresql":
        import asyncpg

        schema = database.connect_args["server_settings"]["search_path"]
        holder = await asyncpg.connect(PG_DSN, server_settings={"search_path": schema})
        transaction = holder.transaction()
        await transaction.start()
        try:
            assert await holder.fetchval("SELECT id FROM tasks WHERE id = $1 FOR UPDATE", task_id) == task_id
            yield
        finally:
            await transaction.rollback()
            await holder.close()
    elif kind == "mysql":
        import aiomysql

        holder = await aiomysql.connect(
            host=MYSQL_HOST, port=MYSQL_PORT, user="root", db=database.url.rsplit("/", 1)[1]
        )
        try:
            async with holder.cursor() as cursor:
                await cursor.execute("BEGIN")
                await cursor.execute("SELECT id FROM tasks WHERE id = %s FOR UPDATE", (task_id,))
                assert await cursor.fetchone() == (task_id,)
                yield
        finally:
            await holder.rollback()
            holder.close()
    else:
        import aiosqlite

        async with aiosqlite.connect(tmp_path / "tasks.db", isolation_level=None) as holder:
            await holder.execute("BEGIN IMMEDIATE")
            try:
                yield
            finally:
                await holder.execute("ROLLBACK")


def guarded(database: Database) -> tuple[FinalStateTaskStore, Writes]:
    engine = database.engine()
    return FinalStateTaskStore(DatabaseTaskStore(engine)), Writes(engine)


async def _closed(server: Any, task_id: str) -> bool:
    return await _sdk.live_task(server.handler, task_id) is None


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["postgresql", "sqlite", "mysql"])
async def test_a_locked_row_does_not_hold_a_live_cancel_past_its_bound(kind: str, tmp_path: Path) -> None:
    """The run here stops, and its CANCELED waits for a row another transaction holds: the
    caller gets InternalError within the bound, saying the write goes on; nothing claims a
    CANCELED the store does not hold; once the lock is released CANCELED lands and the
    sender's stream ends. Stock, on the same release, answers only when the lock is released."""
    async with open_database(kind, tmp_path) as database:
        store, writes = guarded(database)
        server = make_server("ours", ScriptedExecutor(), store=store)
        stream = await start(server)
        task_id = server.executor.task_id or ""
        async with row_locked(kind, database, tmp_path, task_id):
            await _cancel_answers_internal_error(server, task_id, writes, match=NOT_YET)
            assert server.executor.stopped.is_set()
            assert await stored(server, task_id) == "WORKING"  # Said as it is: not yet.
        await eventually(lambda: _stored_is(server, task_id, "CANCELED"), seconds=LANDING)
        assert await stream.ended()
        assert stream.last == "CANCELED" or isinstance(stream.error, InternalError), stream.last
        await eventually(lambda: _closed(server, task_id))

    async with (
        _fresh_sqlite(tmp_path) if kind == "sqlite" else open_database(kind, tmp_path / "stock") as database
    ):
        store, writes = guarded(database)
        server = make_server("stock", ScriptedExecutor(), store=store)
        stream = await start(server)
        task_id = server.executor.task_id or ""
        async with row_locked(kind, database, _sqlite_dir(database, tmp_path), task_id):
            stock = await outcome_within(cancel(server, task_id), ANSWER_BOUND + SLACK)
        # Stock: no answer within the bound (it waits for the lock; or, up to 1.1.x, for ever),
        # or WORKING (1.0.0-1.1.3 answer before anything is saved, and leave the run going).
        assert stock in ("HANG", "WORKING"), stock
        server.executor.step.open()
        await stream.ended()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["postgresql", "sqlite", "mysql"])
async def test_a_locked_row_does_not_hold_a_cancel_not_live_here_past_its_bound(
    kind: str, tmp_path: Path
) -> None:
    """B has no run of the task (A runs it): B's CANCELED write waits for the locked row. B
    answers InternalError within the bound; the write goes on behind it and lands once the
    lock is released."""
    async with open_database(kind, tmp_path) as database:
        store_a, _ = guarded(database)
        store_b, writes = guarded(database)
        a = make_server("ours", ScriptedExecutor(), store=store_a, replica_poll_interval=0.05)
        b = make_server("ours", ScriptedExecutor(), store=store_b)
        await start(a)
        task_id = a.executor.task_id or ""
        async with row_locked(kind, database, tmp_path, task_id):
            await _cancel_answers_internal_error(b, task_id, writes, match=NOT_YET)
            assert await stored(b, task_id) == "WORKING"
        await eventually(lambda: _stored_is(b, task_id, "CANCELED"), seconds=LANDING)
        a.executor.step.open()
        await within(a.executor.stopped.wait())
        assert not a.executor.completed.is_set()  # A found B's CANCELED before it could complete.
        await eventually(lambda: _closed(a, task_id))


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["postgresql", "sqlite", "mysql"])
async def test_a_save_cut_while_it_waits_for_a_locked_row_does_not_lock_out_later_saves(
    kind: str, tmp_path: Path
) -> None:
    """A save cancelled while its statement waits for a locked row (a run closed by force
    cuts the SDK's save so) returns at once, yet runs to its end once the lock is gone: the
    next save lands. Cut mid-statement on SQLite, pysqlite kept the abandoned connection's
    write lock, and every later save failed "database is locked"."""
    async with open_database(kind, tmp_path) as database:
        store, writes = guarded(database)
        alice = caller("alice")
        await store.save(make_task(WORKING), alice)
        async with row_locked(kind, database, tmp_path, "task-1"):
            writes.armed = True
            cut = asyncio.ensure_future(store.save(make_task(WORKING, "cut"), alice))
            await within(writes.in_flight.wait())
            cut.cancel()
            with pytest.raises(asyncio.CancelledError):
                await within(cut, SLACK)  # The caller leaves at once.
        await within(store.save(make_task(CANCELED), alice), LANDING)
        stored = await store.get("task-1", alice)
        assert stored is not None and stored.status.state == CANCELED


@contextlib.asynccontextmanager
async def _fresh_sqlite(tmp_path: Path) -> AsyncIterator[Database]:
    folder = tmp_path / "stock"
    folder.mkdir()
    async with open_database("sqlite", folder) as database:
        yield database


def _sqlite_dir(database: Database, tmp_path: Path) -> Path:
    return (
        Path(database.url.removeprefix("sqlite+aiosqlite:///")).parent
        if "sqlite" in database.url
        else tmp_path
    )


async def _cancel_answers_internal_error(
    server: Any, task_id: str, writes: Writes, match: str | None = None
) -> None:
    """Arm ``writes``, cancel through ``server``, and expect InternalError within the bound
    once the CANCELED write is under way (and held)."""
    writes.armed = True
    answer = asyncio.ensure_future(server.calls.cancel(task_id, "alice"))
    await within(writes.in_flight.wait())
    with pytest.raises(InternalError, match=match):
        await within(answer, ANSWER_BOUND + SLACK)


async def _stored_is(server: Any, task_id: str, *states: str) -> bool:
    """Whether GetTask shows the task in one of ``states``."""
    return await stored(server, task_id) in states


@pytest.mark.asyncio
async def test_a_statement_timeout_on_the_canceled_write_leaves_no_task_working_with_nothing_running(
    tmp_path: Path,
) -> None:
    """The engine's statement_timeout (300 ms) cuts every CANCELED write while another
    transaction holds the row: the run here is stopped and closed, the caller gets InternalError
    in bound, and the write is retried behind the answer until it lands once the lock is gone.
    Before, the task stayed WORKING with nothing running anywhere."""
    async with open_database("postgresql", tmp_path) as database:
        settings = {**database.connect_args["server_settings"], "statement_timeout": "300ms"}
        engine = create_async_engine(
            database.url, connect_args={**database.connect_args, "server_settings": settings}
        )
        database.engines.append(engine)
        writes = Writes(engine)
        server = make_server("ours", ScriptedExecutor(), store=FinalStateTaskStore(DatabaseTaskStore(engine)))
        stream = await start(server)
        task_id = server.executor.task_id or ""
        async with row_locked("postgresql", database, tmp_path, task_id):
            await _cancel_answers_internal_error(server, task_id, writes)
            assert server.executor.stopped.is_set()
            await eventually(lambda: _closed(server, task_id))  # Nothing runs it here any more.
            assert await stored(server, task_id) == "WORKING"
        await eventually(lambda: _stored_is(server, task_id, "CANCELED"), seconds=LANDING)
        assert await stream.ended()
        assert stream.last == "CANCELED" or isinstance(stream.error, A2AError), stream.last

    async with open_database("postgresql", tmp_path) as database:  # Stock, its cancel() publishing CANCELED.
        settings = {**database.connect_args["server_settings"], "statement_timeout": "300ms"}
        engine = create_async_engine(
            database.url, connect_args={**database.connect_args, "server_settings": settings}
        )
        database.engines.append(engine)
        writes = Writes(engine)
        store = FinalStateTaskStore(DatabaseTaskStore(engine))
        server = make_server("stock", ScriptedExecutor(cancel="publish"), store=store)
        stream = await start(server)
        task_id = server.executor.task_id or ""
        async with row_locked("postgresql", database, tmp_path, task_id):
            writes.armed = True
            answer = asyncio.ensure_future(cancel(server, task_id))
            await within(writes.in_flight.wait())
            stock = await outcome_within(answer, ANSWER_BOUND + SLACK)
            await stream.ended()
        # Stock: answered CANCELED (up to 1.2.x) or a raw DBAPIError (1.3.0), its stream ends on
        # the DBAPIError, and the task stays WORKING with nothing running: the zombie. On 1.0.3
        # the cancel answers FAILED, the end its consumer tried to save after its own failed
        # save, a save the locked row refused too.
        assert stock in ("CANCELED", "FAILED") or stock.startswith("raised"), stock
        await eventually(lambda: _closed(server, task_id))
        assert await stored(server, task_id) == "WORKING"
        server.executor.released.set()


@pytest.mark.asyncio
async def test_a_connection_killed_during_the_canceled_write_ends_streams_on_an_a2a_outcome(
    tmp_path: Path,
) -> None:
    """pg_terminate_backend on the connection writing CANCELED, on the replica running the task:
    the caller, the sender's stream and a subscriber end on a terminal state or an A2A error,
    never a raw DBAPIError, and the store ends CANCELED (the write is retried). Stock's sender
    stream ends on the DBAPIError itself."""
    async with open_database("postgresql", tmp_path) as database:
        store, writes = guarded(database)
        server = make_server("ours", ScriptedExecutor(), store=store)
        stream = await start(server)
        task_id = server.executor.task_id or ""
        subscriber = Stream(server.calls.subscribe(task_id, "alice"))
        await subscriber.until(lambda: bool(subscriber.events))
        async with row_locked("postgresql", database, tmp_path, task_id):
            writes.armed = True
            answer = asyncio.ensure_future(server.calls.cancel(task_id, "alice"))
            await within(writes.in_flight.wait())
            await _terminate(writes.backends)
        # The end the store must come to: CANCELED once the caller was told so. Where the SDK
        # answers its own failed save by recording FAILED (1.0.3: the caller then gets
        # TaskNotCancelable, "reached FAILED"), that end is as final.
        ends = ("CANCELED", "FAILED")
        try:
            answered = await within(answer, ANSWER_BOUND + SLACK)
        except A2AError:
            pass  # An A2A error is an answer a client can act on.
        else:
            assert state_name(answered.status.state) == "CANCELED"
            ends = ("CANCELED",)
        for observer in (stream, subscriber):
            assert await observer.ended()
            assert observer.error is None or isinstance(observer.error, A2AError), repr(observer.error)
            assert observer.error is not None or observer.last in ("CANCELED", "FAILED"), observer.last
        await eventually(lambda: _stored_is(server, task_id, *ends), seconds=LANDING)

    async with open_database("postgresql", tmp_path) as database:  # Stock, its cancel() publishing CANCELED.
        store, writes = guarded(database)
        server = make_server("stock", ScriptedExecutor(cancel="publish"), store=store)
        stream = await start(server)
        task_id = server.executor.task_id or ""
        async with row_locked("postgresql", database, tmp_path, task_id):
            writes.armed = True
            answer = asyncio.ensure_future(cancel(server, task_id))
            await within(writes.in_flight.wait())
            await _terminate(writes.backends)
        stock = await outcome_within(answer, ANSWER_BOUND + SLACK)
        await stream.ended()
        # Stock (1.0.0-1.3.0): the sender's stream ends on the driver's own exception.
        assert stream.error is not None and not isinstance(stream.error, A2AError), (stock, stream.last)
        # Its answer is CANCELED, whatever the store holds (on 1.0.0, WORKING).
        server.executor.released.set()


async def _terminate(backends: list[int]) -> None:
    import asyncpg

    admin = await asyncpg.connect(PG_DSN)
    try:
        killed = await admin.fetch("SELECT pg_terminate_backend(pid) FROM unnest($1::int[]) AS pid", backends)
    finally:
        await admin.close()
    assert killed and all(row[0] for row in killed), killed
