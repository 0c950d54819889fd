"""FinalStateTaskStore: a terminal state is final, in memory, on SQLite and on PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import random
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import sqlalchemy as sa
from a2a.compat.v0_3.model_conversions import core_to_compat_task_model
from a2a.server.context import ServerCallContext
from a2a.server.models import TaskModel
from a2a.server.tasks import DatabaseTaskStore, InMemoryTaskStore, TaskManager, TaskStore
from a2a.types import (
    Artifact,
    ListTasksRequest,
    Message,
    Part,
    Role,
    Task,
    TaskState,
    TaskStatus,
    TaskStatusUpdateEvent,
)
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from a2a_cancelfix import _sdk
from a2a_cancelfix._lease_store import LeaseStore
from a2a_cancelfix._sdk import TERMINAL_STATES
from a2a_cancelfix.store import FinalStateTaskStore
from a2a_cancelfix.testing import ScriptedExecutor, caller, make_server

from .support import drop_schema, mysql_database

ROOT = Path(__file__).resolve().parent.parent
PG_DSN = "postgresql://postgres@127.0.0.1:5432/test"
PG_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
BACKENDS = ["memory", "sqlite", "postgresql", "mysql"]
DATABASES = ["sqlite", "postgresql", "mysql"]

WORKING = TaskState.TASK_STATE_WORKING
COMPLETED = TaskState.TASK_STATE_COMPLETED
CANCELED = TaskState.TASK_STATE_CANCELED
FAILED = TaskState.TASK_STATE_FAILED
REJECTED = TaskState.TASK_STATE_REJECTED


def make_task(state: int, mark: str = "", *, task_id: str = "task-1", artifacts: int = 0) -> Task:
    task = Task(id=task_id, context_id="ctx-1", status=TaskStatus(state=state))
    if mark:
        task.metadata.update({"mark": mark})
    for n in range(artifacts):
        task.artifacts.append(Artifact(artifact_id=f"a{n}", parts=[Part(text=f"part {n}")]))
    return task


def text_message(text: str) -> Message:
    return Message(message_id=uuid.uuid4().hex, role=Role.ROLE_AGENT, parts=[Part(text=text)])


@dataclass
class Database:
    """A database for one test: a SQLite file, or a PostgreSQL schema of its own."""

    url: str
    connect_args: dict[str, Any]
    engines: list[AsyncEngine] = field(default_factory=list)

    def engine(self) -> AsyncEngine:
        engine = create_async_engine(self.url, connect_args=self.connect_args)
        self.engines.append(engine)
        return engine


async def _pg_connect() -> Any:
    import asyncpg

    try:
        return await asyncpg.connect(PG_DSN, timeout=5)
    except (TimeoutError, OSError, asyncpg.PostgresError) as error:
        pytest.skip(f"PostgreSQL at 127.0.0.1:5432 is unreachable: {error!r}")


@contextlib.asynccontextmanager
async def open_database(kind: str, tmp_path: Path) -> AsyncIterator[Database]:
    """Open a fresh database; on PostgreSQL, a schema of its own that is dropped afterwards; on
    MariaDB, a database of its own, dropped afterwards."""
    if kind == "mysql":
        async with mysql_database("a2acf_store") as (url, connect_args):
            database = Database(url, connect_args)
            try:
                yield database
            finally:
                for engine in database.engines:
                    await engine.dispose()
        return
    if kind == "sqlite":
        database = Database(f"sqlite+aiosqlite:///{tmp_path / 'tasks.db'}", {})
        schema = None
    else:
        # A schema per test, so the SDK's default table name never collides between runs.
        admin = await _pg_connect()
        schema = f"a2acf_store_{uuid.uuid4().hex[:12]}"
        await admin.execute(f'CREATE SCHEMA "{schema}"')
        # Server-side bounds: no statement or lock wait can hang a test.
        # A session left in a transaction by a loop that closed under it (a test that never
        # closed its handler) is ended too, so that it cannot hold the schema's drop for good.
        settings = {
            "search_path": schema,
            "application_name": schema,  # Named, so that the drop can end what is left open.
            "statement_timeout": "20s",
            "lock_timeout": "20s",
            "idle_in_transaction_session_timeout": "10s",
        }
        database = Database(PG_URL, {"server_settings": settings, "timeout": 5})
    try:
        yield database
    finally:
        for engine in database.engines:
            await engine.dispose()
        if schema is not None:
            await drop_schema(admin, schema)
            await admin.close()


@pytest_asyncio.fixture(params=DATABASES)
async def database(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Database]:
    async with open_database(request.param, tmp_path) as opened:
        yield opened


@pytest_asyncio.fixture(params=BACKENDS)
async def bare(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[TaskStore]:
    """Yield the SDK's own store, empty: in memory, on SQLite, on PostgreSQL."""
    if request.param == "memory":
        yield InMemoryTaskStore()
        return
    async with open_database(request.param, tmp_path) as opened:
        yield DatabaseTaskStore(opened.engine())


class Recorder(logging.Handler):
    """Collect the refusals the ``a2a_cancelfix`` logger reports, at whatever level."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("refused save"):
            self.records.append(record)


@pytest.fixture
def refusals() -> Iterator[list[logging.LogRecord]]:
    recorder, logger = Recorder(), logging.getLogger("a2a_cancelfix")
    level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(recorder)
    try:
        yield recorder.records
    finally:
        logger.removeHandler(recorder)
        logger.setLevel(level)


# The refused update, given the terminal state stored ("artifact": that state, more artifacts).
UPDATES = {
    "completed": lambda stored: make_task(COMPLETED, "late"),
    "working": lambda stored: make_task(WORKING, "late"),
    "canceled": lambda stored: make_task(CANCELED, "late"),
    "artifact": lambda stored: make_task(stored, "final", artifacts=3),
}


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("stored_state", "update"),
    [
        pytest.param(CANCELED, "completed", id="CANCELED-then-COMPLETED"),
        pytest.param(CANCELED, "working", id="CANCELED-then-WORKING"),
        pytest.param(CANCELED, "artifact", id="CANCELED-then-artifact"),
        pytest.param(COMPLETED, "canceled", id="COMPLETED-then-CANCELED"),
        pytest.param(FAILED, "working", id="FAILED-then-WORKING"),
        pytest.param(REJECTED, "completed", id="REJECTED-then-COMPLETED"),
    ],
)
async def test_save_over_a_terminal_state_is_refused_and_logged(
    bare: TaskStore, refusals: list[logging.LogRecord], stored_state: int, update: str
) -> None:
    """A save over a stored terminal state returns normally, changes nothing, logs it once.

    A DEBUG line when it repeats the stored state, INFO where a cancel raced the run (how a
    cancel reaches another replica), a WARNING where another end is saved over an ended task.
    """
    store, alice = FinalStateTaskStore(bare), caller("alice")
    await store.save(make_task(WORKING, "w", artifacts=1), alice)
    await store.save(make_task(stored_state, "final", artifacts=1), alice)
    before = await store.get("task-1", alice)
    assert refusals == []

    late = UPDATES[update](stored_state)
    await store.save(late, alice)

    assert await store.get("task-1", alice) == before
    assert await bare.get("task-1", alice) == before
    [record] = refusals
    if late.status.state == stored_state:
        assert record.levelno == logging.DEBUG
    elif CANCELED in (stored_state, late.status.state):
        assert record.levelno == logging.INFO
    else:
        assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert "task=task-1" in message
    assert f"stored={TaskState.Name(stored_state)}" in message
    assert f"refused={TaskState.Name(late.status.state)}" in message


@pytest.mark.asyncio
async def test_same_terminal_state_with_more_data_is_refused(
    bare: TaskStore, refusals: list[logging.LogRecord]
) -> None:
    """Once CANCELED, even CANCELED again with a status message and more history is refused, quietly."""
    store, alice = FinalStateTaskStore(bare), caller("alice")
    await store.save(make_task(CANCELED, "first"), alice)
    before = await store.get("task-1", alice)

    again = make_task(CANCELED, "first")
    again.status.message.CopyFrom(text_message("cancelled by the user"))
    again.history.append(text_message("more history"))
    await store.save(again, alice)

    assert await store.get("task-1", alice) == before
    [record] = refusals
    assert "stored=TASK_STATE_CANCELED refused=TASK_STATE_CANCELED" in record.getMessage()
    # Routine when a replica records a cancel that another stored first: DEBUG, not WARNING.
    assert record.levelno == logging.DEBUG


@pytest.mark.asyncio
async def test_non_terminal_updates_and_the_first_terminal_write_pass(
    bare: TaskStore, refusals: list[logging.LogRecord]
) -> None:
    """Every update before the first terminal state, and that state itself, is stored as saved."""
    store, alice = FinalStateTaskStore(bare), caller("alice")
    steps = [
        make_task(TaskState.TASK_STATE_SUBMITTED, "s"),
        make_task(WORKING, "w"),
        make_task(WORKING, "w+artifact", artifacts=1),
        make_task(TaskState.TASK_STATE_INPUT_REQUIRED, "parked", artifacts=1),
        make_task(WORKING, "resumed", artifacts=2),
        make_task(TaskState.TASK_STATE_UNSPECIFIED, "no state"),  # a row without status.state
        make_task(COMPLETED, "done", artifacts=3),
    ]
    for step in steps:
        await store.save(step, alice)
        stored = await store.get("task-1", alice)
        assert stored is not None
        # Not ==: the SDK's database round trip drops an empty status message.
        assert stored.status.state == step.status.state
        assert (stored.metadata, stored.artifacts) == (step.metadata, step.artifacts)
    assert refusals == []


@pytest.mark.asyncio
async def test_a_terminal_first_write_creates_the_task_and_is_final(
    bare: TaskStore, refusals: list[logging.LogRecord]
) -> None:
    """A task whose first save is already terminal is stored, and then kept."""
    store, alice = FinalStateTaskStore(bare), caller("alice")
    await store.save(make_task(REJECTED, "rejected"), alice)
    await store.save(make_task(WORKING, "late"), alice)
    stored = await store.get("task-1", alice)
    assert stored is not None
    assert (stored.status.state, stored.metadata["mark"]) == (REJECTED, "rejected")
    assert len(refusals) == 1


@pytest.mark.asyncio
async def test_owner_scoping_is_the_wrapped_stores(
    bare: TaskStore, refusals: list[logging.LogRecord]
) -> None:
    """get, list and delete stay owner-scoped; another owner's save never changes a final task."""
    store, alice, bob = FinalStateTaskStore(bare), caller("alice"), caller("bob")
    await store.save(make_task(CANCELED, "alice's"), alice)

    assert await store.get("task-1", bob) is None
    assert list((await store.list(ListTasksRequest(), bob)).tasks) == []
    await store.delete("task-1", bob)
    assert (await store.get("task-1", alice)).metadata["mark"] == "alice's"
    assert [t.id for t in (await store.list(ListTasksRequest(), alice)).tasks] == ["task-1"]

    await store.save(make_task(COMPLETED, "bob's"), bob)
    assert (await store.get("task-1", alice)).status.state == CANCELED
    if isinstance(bare, InMemoryTaskStore):
        # The SDK keys memory by owner: bob's save is a task of his own, beside alice's.
        assert (await store.get("task-1", bob)).metadata["mark"] == "bob's"
        assert refusals == []
    else:
        # The database keys rows by id alone: bob's save would replace alice's row: refused.
        assert await store.get("task-1", bob) is None
        assert len(refusals) == 1

    await store.delete("task-1", alice)
    assert await store.get("task-1", alice) is None


@pytest.mark.asyncio
async def test_memory_store_without_copying_keeps_the_saved_object() -> None:
    """With use_copying=False the guarded store keeps the very object saved, as the SDK's does."""
    alice, task = caller("alice"), make_task(WORKING, "w")
    bare = InMemoryTaskStore(use_copying=False)
    await FinalStateTaskStore(bare).save(task, alice)
    assert await bare.get("task-1", alice) is task
    copying = InMemoryTaskStore()
    await FinalStateTaskStore(copying).save(task, alice)
    assert await copying.get("task-1", alice) == task
    assert await copying.get("task-1", alice) is not task


@pytest.mark.asyncio
async def test_legacy_v03_rows_are_final_too(database: Database, refusals: list[logging.LogRecord]) -> None:
    """A row stored in the v0.3 format (state 'canceled') is recognised as terminal."""
    engine = database.engine()
    bare = DatabaseTaskStore(engine, core_to_model_conversion=core_to_compat_task_model)
    store, alice = FinalStateTaskStore(bare), caller("alice")
    await store.save(make_task(WORKING, "w"), alice)
    await store.save(make_task(CANCELED, "final"), alice)
    await store.save(make_task(COMPLETED, "late"), alice)

    async with engine.connect() as connection:
        status = (await connection.execute(sa.select(TaskModel.status))).scalar_one()
    assert status["state"] == "canceled"
    assert (await store.get("task-1", alice)).status.state == CANCELED
    [record] = refusals
    assert "stored=TASK_STATE_CANCELED refused=TASK_STATE_COMPLETED" in record.getMessage()


@pytest.mark.asyncio
async def test_bare_database_store_lets_completed_overwrite_canceled(database: Database) -> None:
    """The defect fixed here: the SDK's DatabaseTaskStore lets COMPLETED replace CANCELED."""
    bare, alice = DatabaseTaskStore(database.engine()), caller("alice")
    await bare.save(make_task(CANCELED, "final"), alice)
    await bare.save(make_task(COMPLETED, "late", artifacts=1), alice)
    stored = await bare.get("task-1", alice)
    # Every release from 1.0.0 to 1.3.0 does this: its save is session.merge on the id.
    assert stored is not None
    assert (stored.status.state, stored.metadata["mark"], len(stored.artifacts)) == (
        COMPLETED,
        "late",
        1,
    )


@pytest.mark.asyncio
async def test_sdk_task_manager_save_after_cancel_returns_normally_with_one_write(
    database: Database, refusals: list[logging.LogRecord]
) -> None:
    """Via the SDK's TaskManager (1.2+: its LegacyTaskStoreAdapter) a refusal is one write
    (on MariaDB, an UPDATE that matches no ended row and an INSERT refused as a duplicate)."""
    engine = database.engine()
    store, alice = FinalStateTaskStore(DatabaseTaskStore(engine)), caller("alice")
    await store.save(make_task(CANCELED, "final"), alice)
    manager = TaskManager(
        task_store=store, context=alice, task_id="task-1", context_id="ctx-1", initial_message=None
    )
    adapter = getattr(manager, "_versioned_store", None)  # 1.2.0+
    if adapter is not None:
        assert type(adapter).__name__ == "LegacyTaskStoreAdapter" and adapter.store is store

    writes: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if statement.lstrip().upper().startswith(("INSERT", "UPDATE", "DELETE")):
            writes.append(statement)

    completed = TaskStatusUpdateEvent(
        task_id="task-1", context_id="ctx-1", status=TaskStatus(state=COMPLETED)
    )
    event.listen(engine.sync_engine, "before_cursor_execute", count)
    try:
        returned = await asyncio.wait_for(manager.save_task_event(completed), 20)
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", count)

    assert returned is not None and returned.status.state == COMPLETED  # the manager's own copy
    if engine.dialect.name == "mysql":
        assert [write.split()[0] for write in writes] == ["UPDATE", "INSERT"]
        assert "WHERE" in writes[0] and "ON DUPLICATE" not in writes[1]
    else:
        assert len(writes) == 1 and "ON CONFLICT" in writes[0]
    assert (await store.get("task-1", alice)).status.state == CANCELED
    assert len(refusals) == 1


def test_other_stores_are_refused_at_construction() -> None:
    """A store the guard cannot make atomic is rejected when wrapped, not guarded by a race."""

    class Custom(TaskStore):
        async def save(self, task: Task, context: ServerCallContext) -> None: ...
        async def get(self, task_id: str, context: ServerCallContext) -> None: ...
        async def list(self, params: Any, context: ServerCallContext) -> Any: ...
        async def delete(self, task_id: str, context: ServerCallContext) -> None: ...

    with pytest.raises(TypeError, match="DatabaseTaskStore or an InMemoryTaskStore"):
        FinalStateTaskStore(Custom())


@pytest.mark.asyncio
async def test_two_first_saves_of_a_task_at_once_never_fail(database: Database) -> None:
    """Two replicas' first saves of one task, at once (WORKING and CANCELED): each lands or is
    refused, none raises. On MariaDB each of their UPDATEs locks the gap the row would fill, and
    their INSERTs deadlock: the victim's transaction is run again."""
    one, other = (FinalStateTaskStore(DatabaseTaskStore(database.engine())) for _ in range(2))
    await one.wrapped.initialize()
    alice = caller("alice")
    for n in range(ROUNDS):
        task_id = f"first-{n}"
        saves = (
            one.save(make_task(WORKING, "run", task_id=task_id), alice),
            other.save(make_task(CANCELED, "cancel", task_id=task_id), alice),
        )
        await asyncio.wait_for(asyncio.gather(*saves), 20)
        kept = await one.get(task_id, alice)
        assert kept is not None and kept.status.state == CANCELED, n  # Final, whichever came first.


@pytest.mark.asyncio
async def test_a_database_store_on_a_database_without_an_entry_is_served_as_a_store_of_ones_own(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A DatabaseTaskStore on a database with no entry of ours (SQL Server, say): wrapping it is
    a TypeError naming what it takes; our handler serves it, as the stock one does (where it
    used to raise at construction, as on MySQL), guarded within the process as a store of one's
    own is, without leases, and says so in one line."""
    engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'tasks.db'}")
    engine.dialect.name = "mssql"  # What SQLAlchemy names SQL Server: nothing of ours knows it.
    try:
        store = DatabaseTaskStore(engine)
        with pytest.raises(TypeError, match="runs on mariadb, mysql, postgresql, sqlite, not mssql"):
            FinalStateTaskStore(store)
        make_server("stock", ScriptedExecutor(), store=store, told=False)
        with caplog.at_level(logging.WARNING, logger="a2a_cancelfix"):
            ours = make_server("ours", ScriptedExecutor(), store=store, told=False)
        guard = ours.handler.task_store
        assert isinstance(guard, FinalStateTaskStore) and guard.wrapped is store
        assert LeaseStore.of(guard) is None
        (said,) = [r.getMessage() for r in caplog.records if r.name == "a2a_cancelfix"]
        assert said.startswith("task store DatabaseTaskStore has no save_unless_final"), said
        assert "leases are off" in said
    finally:
        await engine.dispose()


class Audited(FinalStateTaskStore):
    """A subclass as users write one: an argument of its own, and methods it extends."""

    def __init__(self, store: Any, *, reads: list[str]) -> None:
        super().__init__(store)
        self.reads = reads
        self.saves: list[int] = []

    async def get(self, task_id: str, context: ServerCallContext) -> Any:
        self.reads.append(task_id)
        return await super().get(task_id, context)

    async def save(self, task: Task, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        self.saves.append(task.status.state)
        return await super().save(task, *args, **kwargs)


@pytest_asyncio.fixture(params=[*BACKENDS, "versioned"])
async def any_sdk_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    """Yield each store FinalStateTaskStore wraps, empty: the bare ones, and (a2a-sdk 1.2+)
    upstream's cluster-mode VersionedDatabaseTaskStore on SQLite."""
    if request.param == "versioned":
        if not _sdk.HAS_CLUSTER:
            pytest.skip("VersionedDatabaseTaskStore is a2a-sdk 1.2+")
        from a2a.server.cluster import VersionedDatabaseTaskStore

        async with open_database("sqlite", tmp_path) as opened:
            yield VersionedDatabaseTaskStore(opened.engine())
        return
    if request.param == "memory":
        yield InMemoryTaskStore()
        return
    async with open_database(request.param, tmp_path) as opened:
        yield DatabaseTaskStore(opened.engine())


@pytest.mark.asyncio
async def test_every_save_is_told_written_or_refused(any_sdk_store: Any) -> None:
    """A ``saved`` subscriber hears of each save once it is over, written or refused, on every store the
    guard wraps: what the testing kit's waits on GetTask look again at."""
    store, alice = FinalStateTaskStore(any_sdk_store), caller("alice")
    told: list[tuple[str, str | None]] = []

    async def state() -> str | None:
        stored = await store.get("task-1", alice)
        task = getattr(stored, "task", stored)  # A StoredTask, from a versioned store.
        return None if task is None else TaskState.Name(task.status.state)

    def saved(task_id: str) -> None:
        told.append((task_id, None))

    store.subscribe(saved=saved)
    states = (WORKING, CANCELED, COMPLETED)
    if _sdk.is_versioned_database_store(any_sdk_store):
        from a2a.server.cluster import ConcurrentTaskModificationError, TaskVersion

        version = TaskVersion.MISSING
        for each in states[:2]:
            version = await store.save(make_task(each), prev=None, prev_version=version, context=alice)
            told[-1] = (told[-1][0], await state())
        with pytest.raises(ConcurrentTaskModificationError):  # Refused.
            await store.save(make_task(COMPLETED), prev=None, prev_version=version, context=alice)
    else:
        for each in states:
            await store.save(make_task(each), alice)
            told[-1] = (told[-1][0], await state())
    # Each told after its write: the store already showed it (the refused one, what it kept).
    assert told[:2] == [("task-1", "TASK_STATE_WORKING"), ("task-1", "TASK_STATE_CANCELED")]
    assert [task_id for task_id, _ in told] == ["task-1"] * 3


@pytest.mark.asyncio
async def test_a_subclass_wraps_every_store(any_sdk_store: Any) -> None:
    """A subclass of FinalStateTaskStore wraps each store the class wraps, keeps its own
    methods, and a terminal state stays final through it."""
    store = Audited(any_sdk_store, reads=[])
    assert isinstance(store, Audited) and store.wrapped is any_sdk_store
    alice = caller("alice")
    if _sdk.is_versioned_database_store(any_sdk_store):
        from a2a.server.cluster import ConcurrentTaskModificationError, TaskVersion, VersionedTaskStore

        assert isinstance(store, VersionedTaskStore)
        version = TaskVersion.MISSING
        for state in (WORKING, CANCELED):
            version = await store.save(make_task(state), prev=None, prev_version=version, context=alice)
        with pytest.raises(ConcurrentTaskModificationError):  # Refused: the SDK's signal to reload.
            await store.save(make_task(COMPLETED), prev=None, prev_version=version, context=alice)
        stored = (await store.get("task-1", alice)).task
    else:
        for state in (WORKING, CANCELED, COMPLETED):
            await store.save(make_task(state), alice)
        stored = await store.get("task-1", alice)
    assert stored.status.state == CANCELED
    # Its own methods, not the guard's and the wrapped store's that the class binds for speed.
    assert store.reads == ["task-1"]
    assert store.saves == [WORKING, CANCELED, COMPLETED]


@pytest.mark.asyncio
async def test_a_subclass_that_makes_its_store_wraps_it_as_the_class_does(any_sdk_store: Any) -> None:
    """A subclass whose __init__ makes the store it wraps (from an engine, say) is a
    VersionedTaskStore around a VersionedDatabaseTaskStore too."""

    class Built(FinalStateTaskStore):
        def __init__(self, make: Any) -> None:
            super().__init__(make())

    store = Built(lambda: any_sdk_store)
    assert isinstance(store, Built) and store.wrapped is any_sdk_store
    versioned = _sdk.HAS_CLUSTER and isinstance(store, _sdk.VersionedTaskStore)
    assert versioned == _sdk.is_versioned_database_store(any_sdk_store)


# --- The race: two OS processes write one task at once, round after round. ------------------

ROUNDS = 16
WRITES = 24  # per writer and round
PROCESS_TIMEOUT = 120.0
STEP_TIMEOUT = 30.0


def race_writer() -> None:
    """Run one writer process; ``python -c`` calls this with the JSON spec as argv[1]."""
    asyncio.run(_race_writer(json.loads(sys.argv[1])))


def _race_write(role: str, task_id: str, j: int, completes_at: int, cancels_at: int) -> Task | None:
    """Return the runner's j-th write, or the canceler's (None: it only reads this time)."""
    if role == "runner":  # WORKING; from completes_at on, COMPLETED and WORKING in turn
        late = j >= completes_at and (j - completes_at) % 2 == 0
        state = COMPLETED if late else WORKING
        return make_task(state, f"runner-{j}", task_id=task_id, artifacts=j % 3)
    if j >= cancels_at:  # from cancels_at on, CANCELED again and again
        return make_task(CANCELED, f"canceler-{j}", task_id=task_id)
    return None


async def _race_writer(spec: dict[str, Any]) -> None:
    recorder, logger = Recorder(), logging.getLogger("a2a_cancelfix")
    logger.setLevel(logging.DEBUG)  # A repeated CANCELED is refused at DEBUG.
    logger.addHandler(recorder)  # for the life of this process
    engine = create_async_engine(spec["url"], connect_args=spec["connect_args"])
    store = FinalStateTaskStore(DatabaseTaskStore(engine, create_table=False))
    alice, rounds = caller("alice"), []
    for task_id, completes_at, cancels_at in spec["rounds"]:
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            break
        ops: list[dict[str, Any]] = []
        started = time.monotonic()
        for j in range(WRITES):
            write = _race_write(spec["role"], task_id, j, completes_at, cancels_at)
            op: dict[str, Any] = {}
            if write is not None:
                recorder.records.clear()
                await store.save(write, alice)
                refused = bool(recorder.records)
                op = {"mark": write.metadata["mark"], "state": write.status.state}
                op["refused"] = refused
            seen = await store.get(task_id, alice)
            if seen is not None:
                op |= {"seen_mark": seen.metadata["mark"], "seen_state": seen.status.state}
            ops.append(op)
        rounds.append({"started": started, "ended": time.monotonic(), "ops": ops})
    await engine.dispose()
    Path(spec["out"]).write_text(json.dumps(rounds))  # noqa: ASYNC240 (in its own process, at its end)


class Writer:
    """A writer process, driven round by round over its stdin and stdout."""

    def __init__(self, role: str, database: Database, plan: list[Any], tmp_path: Path) -> None:
        self.out, self.err = tmp_path / f"{role}.json", tmp_path / f"{role}.err"
        spec = {
            "role": role,
            "url": database.url,
            "connect_args": database.connect_args,
            "rounds": plan,
            "out": str(self.out),
        }
        command = "from tests.test_store import race_writer; race_writer()"
        with self.err.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", command, json.dumps(spec)],
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put(None)  # end of output: the process has exited

    def ready(self) -> None:
        try:
            line = self.lines.get(timeout=STEP_TIMEOUT)
        except queue.Empty:
            line = "nothing in time"
        assert line == "ready", f"writer said {line!r}: {self.err.read_text()}"

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def result(self) -> list[dict[str, Any]]:
        assert self.proc.wait(PROCESS_TIMEOUT) == 0, self.err.read_text()
        return json.loads(self.out.read_text())

    def stop(self) -> None:
        """Kill the process if it still runs, reap it and close its pipes."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(STEP_TIMEOUT)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


def run_race(database: Database, plan: list[Any], tmp_path: Path) -> dict[str, Any]:
    """Run both writers through every round of ``plan``; return what each recorded."""
    writers = {role: Writer(role, database, plan, tmp_path) for role in ("runner", "canceler")}
    try:
        for _ in plan:  # a barrier per round: both writers start each round together
            for writer in writers.values():
                writer.ready()
            for writer in writers.values():
                writer.go()
        return {role: writer.result() for role, writer in writers.items()}
    finally:
        for writer in writers.values():
            writer.stop()


def check_round(where: str, final: Task | None, ops: dict[str, list[dict[str, Any]]]) -> str:
    """Assert one round kept its first accepted terminal write; return who wrote it."""
    assert final is not None and final.status.state in TERMINAL_STATES, where
    mark = final.metadata["mark"]
    # The store accepted exactly one terminal write, and holds it.
    accepted = [
        op["mark"]
        for role_ops in ops.values()
        for op in role_ops
        if "mark" in op and not op["refused"] and op["state"] in TERMINAL_STATES
    ]
    assert accepted == [mark], where
    for role, role_ops in ops.items():
        terminal_seen = False
        for op in role_ops:
            if terminal_seen and "mark" in op:
                assert op["refused"], f"{where}: {role} wrote {op['mark']} over a terminal state"
            if op.get("seen_state") in TERMINAL_STATES:
                assert op["seen_mark"] == mark, f"{where}: {role} saw {op['seen_mark']}"
                terminal_seen = True
            else:
                assert not terminal_seen, f"{where}: {role} saw the task leave its terminal state"
        assert terminal_seen, f"{where}: {role} never saw the terminal state"
    return mark.split("-")[0]


@pytest.mark.edges_only  # The guard's SQL is the same on every release (see noxfile.py).
@pytest.mark.asyncio
async def test_race_between_processes_keeps_the_first_terminal_write(
    database: Database, tmp_path: Path
) -> None:
    """Processes racing CANCELED against WORKING/COMPLETED leave the first terminal write kept."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    plan = [[f"race-{n}", rng.randrange(WRITES), rng.randrange(WRITES)] for n in range(ROUNDS)]
    bare = DatabaseTaskStore(database.engine())
    await bare.initialize()  # here, so the writers never race to create the table

    results = await asyncio.to_thread(run_race, database, plan, tmp_path)

    winners, overlapping = {"runner": 0, "canceler": 0}, 0
    for n, (task_id, _, _) in enumerate(plan):
        final = await bare.get(task_id, caller("alice"))
        ops = {role: results[role][n]["ops"] for role in results}
        winners[check_round(f"round {n} (seed {seed})", final, ops)] += 1
        runner, canceler = results["runner"][n], results["canceler"][n]
        overlapping += max(runner["started"], canceler["started"]) < min(runner["ended"], canceler["ended"])
    # The writers really ran at once (CLOCK_MONOTONIC is one clock for all processes).
    assert overlapping >= ROUNDS // 2, (overlapping, winners)
