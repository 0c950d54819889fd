"""Upstream's cluster mode (a2a-sdk 1.2+): VersionedDatabaseTaskStore + DatabaseTaskEventStream.

Two replicas in one process, each a handler with its own engine, versioned store and event
stream over one database (a SQLite file, or a PostgreSQL schema of its own). Each test shows
what the stock handler and store do on the same setup, then what ours do.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import sqlalchemy as sa
from a2a.server.agent_execution import RequestContext
from a2a.server.events.event_queue import EventQueue
from a2a.server.request_handlers import DefaultRequestHandlerV2
from a2a.server.tasks import InMemoryTaskStore
from a2a.types import (
    AgentCapabilities,
    AgentCard,
    Artifact,
    Part,
    Task,
    TaskArtifactUpdateEvent,
    TaskState,
    TaskStatus,
    TaskStatusUpdateEvent,
)

from a2a_cancelfix import DefaultRequestHandler, FinalStateTaskStore, _sdk, on_cancel
from a2a_cancelfix.notices import CancelNotices
from a2a_cancelfix.testing import (
    BOUND,
    Gate,
    ScriptedExecutor,
    Server,
    Stream,
    caller,
    cancel,
    make_server,
    start,
    stored,
    wait_all_tasks_blocked,
    within,
)
from a2a_cancelfix.testing.waits import eventually

from .test_store import DATABASES, Database, open_database

pytestmark = pytest.mark.skipif(not _sdk.HAS_CLUSTER, reason="cluster mode is a2a-sdk 1.2+")

if _sdk.HAS_CLUSTER:
    from a2a.server.cluster import (
        ConcurrentTaskModificationError,
        DatabaseTaskEventStream,
        LegacyTaskStoreAdapter,
        TaskVersion,
        VersionedDatabaseTaskStore,
        VersionedTaskStore,
    )

KINDS = ["stock", "ours"]
PUSH_URL = "http://push.invalid/a"
JOURNAL_POLL = 0.02
"""Seconds between two reads of the event journal by a remote subscriber (the SDK's default: 0.5)."""
SAVE_BOUND = 10.0
"""Seconds a replica's save may take here: on SQLite a writer waits up to pysqlite's 5 s busy
timeout while another connection (a journal poll) reads, which a loaded machine makes happen."""

WORKING = TaskState.TASK_STATE_WORKING
COMPLETED = TaskState.TASK_STATE_COMPLETED
CANCELED = TaskState.TASK_STATE_CANCELED


@pytest_asyncio.fixture(params=DATABASES)
async def database(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Database]:
    async with open_database(request.param, tmp_path) as opened:
        yield opened


async def versioned(database: Database, kind: str) -> tuple[Any, Any]:
    """One replica's store over its own engine: the SDK's, or ours around it; and the SDK's."""
    sdk_store = VersionedDatabaseTaskStore(database.engine())
    await sdk_store.initialize()  # One replica at a time: SQLite would refuse two at once.
    return (sdk_store if kind == "stock" else FinalStateTaskStore(sdk_store)), sdk_store


async def replica(database: Database, kind: str, executor: ScriptedExecutor, **options: Any) -> Server:
    """A replica of ``kind`` over ``database``: its versioned store and journal-tailing event stream.

    Ours is given the SDK's store as stock is, as upstream's own set-up reads with only the
    handler's import swapped; its ``store`` is the guard the handler put around it.
    """
    _, sdk_store = await versioned(database, kind)
    stream = DatabaseTaskEventStream(database.engine(), poll_interval_s=JOURNAL_POLL)
    await stream.initialize()
    if kind == "stock":
        return make_server(kind, executor, store=sdk_store, event_stream=stream, **options)
    # Only the handler's class swapped: it guards the SDK's store itself.
    options.setdefault("cancel_grace_period", BOUND)
    server = make_server(kind, executor, store=sdk_store, event_stream=stream, **options)
    assert isinstance(server.handler.task_store, FinalStateTaskStore)
    return dataclasses.replace(server, store=server.handler.task_store)


def status(task: Task) -> TaskStatusUpdateEvent:
    return TaskStatusUpdateEvent(task_id=task.id, context_id=task.context_id, status=task.status)


def task_in(state: int, task_id: str = "task-1") -> Task:
    return Task(id=task_id, context_id="ctx-1", status=TaskStatus(state=state))


async def journal(database: Database, task_id: str = "task-1") -> list[int]:
    """The task versions of the journal rows DatabaseTaskEventStream would replay, in order."""
    engine = database.engine()
    async with engine.connect() as connection:
        rows = await connection.execute(
            sa.text("SELECT task_version FROM task_events WHERE task_id = :id ORDER BY seq"), {"id": task_id}
        )
        return [version for (version,) in rows]


# --- A cancel on B of a task running on A. -----------------------------------------------------


class HalfWritten(ScriptedExecutor):
    """Writes its answer in two halves inside a shielded section, the second one held at ``flush``.

    The first half is streamed, then the run waits at ``step`` (where B cancels); the second
    half is enqueued, and its write (I/O) waits at ``flush``. ``written`` says the section ran
    to its end. Under our handler an ``on_cancel`` callback sets ``called_back``.
    """

    def __init__(self) -> None:
        super().__init__(shield=True)
        self.flush = Gate()
        self.written = asyncio.Event()
        self.called_back = asyncio.Event()
        self.queue: EventQueue | None = None
        self.context: RequestContext | None = None

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        self.context, self.queue = context, event_queue
        await super().execute(context, event_queue)

    async def _work_step(self) -> None:
        assert self.queue is not None and self.context is not None
        # The stock handler runs no cancellation scope (RuntimeError): nothing could call it back.
        with contextlib.suppress(RuntimeError):
            on_cancel(self.called_back.set)
        await self.queue.enqueue_event(half(self.context, 1))
        await self.step()
        await self.queue.enqueue_event(half(self.context, 2))
        await self.flush()
        self.written.set()


def half(context: RequestContext, index: int) -> TaskArtifactUpdateEvent:
    return TaskArtifactUpdateEvent(
        task_id=context.task_id or "",
        context_id=context.context_id or "",
        artifact=Artifact(artifact_id="answer", parts=[Part(text=f"half {index}")]),
        append=index > 1,
    )


def artifacts_in(stream: Stream) -> int:
    """How many artifact updates (halves of the answer) ``stream`` has shown."""
    return sum(type(event) is TaskArtifactUpdateEvent for event in stream.events)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", KINDS)
async def test_a_cancel_on_b_cancels_the_run_on_a(database: Database, kind: str) -> None:
    """B records CANCELED; A's run meets it at its next save (B's CANCELED refuses it).

    Stock: A's producer is cancelled mid shielded section, cancel() never runs, A's push never
    sees CANCELED. Ours: the refused save makes A's run look at once (the poll is an hour off):
    callbacks fire, cancel() runs, the shielded section completes, then CANCELED goes through
    the SDK's consumer (its own save of it is refused quietly), so A's stream and push end on
    it and the run closes. Both: B answers CANCELED, B's remote subscriber ends on CANCELED.
    """
    options = {"replica_poll_interval": 3600} if kind == "ours" else {}
    a = await replica(database, kind, HalfWritten(), **options)
    b = await replica(database, kind, ScriptedExecutor(), **options)
    executor: HalfWritten = a.executor  # type: ignore[assignment]
    stream = await start(a, push_url=PUSH_URL)
    task_id = executor.task_id or ""
    remote = Stream(b.calls.subscribe(task_id, "alice"))  # Not live on B: tails the journal.
    await remote.until(lambda: bool(remote.events))
    # A streams its first half once it is saved. Had B's cancel raced that save, stock on SQLite
    # could hand both writes one version (see the next section), and A's second half land.
    await stream.until(lambda: artifacts_in(stream) == 1)

    assert await within(cancel(b, task_id)) == "CANCELED"
    executor.step.open()  # A's second half is saved over B's CANCELED.

    if kind == "stock":
        await within(executor.stopped.wait(), SAVE_BOUND)  # At its next save, after a reload.
        assert not executor.written.is_set()  # The shielded section was cut at its write.
        assert not executor.cancel_called.is_set() and not executor.called_back.is_set()
        assert await stream.ended() and stream.last == "CANCELED"
        await wait_all_tasks_blocked()
        assert "CANCELED" not in a.push.received.get(PUSH_URL, [])
    else:
        await within(executor.cancel_called.wait())
        assert executor.called_back.is_set()
        assert not executor.stopped.is_set()  # Still in its shielded section, at its write.
        executor.flush.open()
        await within(executor.stopped.wait())
        assert executor.written.is_set() and not executor.completed.is_set()
        assert await stream.ended() and stream.last == "CANCELED"
        await a.push.posted(PUSH_URL, "CANCELED")
        await eventually(lambda: _not_running(a, task_id))
    assert await remote.ended() and remote.last == "CANCELED"
    assert await stored(a, task_id) == "CANCELED" and await stored(b, task_id) == "CANCELED"


async def _not_running(server: Server, task_id: str) -> bool:
    return not await _sdk.has_run(server.handler, task_id)


# --- Upstream's two losses: a terminal state overwritten. --------------------------------------


def held_after_its_read(sdk_store: Any) -> Gate:
    """Hold the store's save between its read of the stored task and its write (a Gate)."""
    gate, read = Gate(), sdk_store._current_task  # 1.3.0: _save_once reads the task with it.

    async def held(*args: Any) -> Any:
        task = await read(*args)
        await gate()
        return task

    sdk_store._current_task = held
    return gate


def impatient_engine(database: Database) -> Any:
    """An engine whose writes fail at once on a lock held by another transaction, not wait."""
    from sqlalchemy.ext.asyncio import create_async_engine

    if database.url.startswith("sqlite"):
        connect_args: dict[str, Any] = {"timeout": 0}  # SQLite's busy timeout
    elif database.url.startswith("mysql"):  # InnoDB's lock wait, in whole seconds: 1 at least.
        connect_args = {**database.connect_args, "init_command": "SET SESSION innodb_lock_wait_timeout = 1"}
    else:
        settings = {**database.connect_args["server_settings"], "lock_timeout": "10ms"}
        connect_args = {**database.connect_args, "server_settings": settings}
    engine = create_async_engine(database.url, connect_args=connect_args)
    database.engines.append(engine)
    return engine


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", KINDS)
async def test_a_completion_racing_a_cancel_never_overwrites_it(database: Database, kind: str) -> None:
    """B's CANCELED save has read the task WORKING and is held there; A saves COMPLETED.

    Stock on SQLite: nothing is locked (the SELECTs run before pysqlite opens the transaction),
    so A's COMPLETED lands, and B's CANCELED then writes over it: two terminal states, both
    "saved" with one version, one lost. Stock on PostgreSQL, and ours on both: B holds the
    lock, so A cannot write (its engine does not wait for locks: it fails at once); once B has
    committed, A's save is told of the conflict. One end, one journal entry.
    """
    sdk_a = VersionedDatabaseTaskStore(impatient_engine(database), max_attempts=1)
    await sdk_a.initialize()
    a = sdk_a if kind == "stock" else FinalStateTaskStore(sdk_a)
    b, b_sdk = await versioned(database, kind)
    alice = caller("alice")
    working = task_in(WORKING)
    version = await a.save(working, event=None, prev=None, prev_version=TaskVersion.MISSING, context=alice)
    gate = held_after_its_read(b_sdk)
    canceled, completed = task_in(CANCELED), task_in(COMPLETED)
    b_cancels = asyncio.ensure_future(
        b.save(canceled, event=status(canceled), prev=working, prev_version=version, context=alice)
    )
    await within(gate.reached.wait())

    async def a_completes() -> Any:
        return await a.save(
            completed, event=status(completed), prev=working, prev_version=version, context=alice
        )

    unlocked = kind == "stock" and database.url.startswith("sqlite")
    if unlocked:
        landed = await within(a_completes())
        assert (await a.get("task-1", alice)).task.status.state == COMPLETED
    else:
        with pytest.raises(sa.exc.DBAPIError):  # Locked by B, until B commits.
            await within(a_completes())
    gate.open()
    await within(b_cancels)
    if unlocked:
        assert landed == b_cancels.result()  # One version handed out twice.
        assert await journal(database) == [2, 2]  # Two ends journalled.
    else:
        with pytest.raises(ConcurrentTaskModificationError):
            await within(a_completes())
        assert await journal(database) == [2]
    assert (await a.get("task-1", alice)).task.status.state == CANCELED


class Finishing(ScriptedExecutor):
    """Streams one more part of its answer and completes, back to back, after its step."""

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        self.queue, self.context = event_queue, context
        await super().execute(context, event_queue)

    async def _work_step(self) -> None:
        await self.step()
        await self.queue.enqueue_event(half(self.context, 1))


def held_at_artifact_save(store: Any) -> Gate:
    """Hold the replica's next save of an artifact update (its consumer) at a Gate, once."""
    gate, save = Gate(), store.save

    async def held(task: Task, **arguments: Any) -> Any:
        if isinstance(arguments.get("event"), TaskArtifactUpdateEvent) and not gate.reached.is_set():
            await gate()
        return await save(task, **arguments)

    store.save = held
    return gate


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", KINDS)
async def test_a_completion_queued_before_a_remote_cancel_never_lands_over_it(
    database: Database, kind: str
) -> None:
    """A's run has queued an artifact and COMPLETED; its consumer is saving the artifact when B
    records CANCELED.

    Stock: the artifact's save conflicts, the consumer reloads (CANCELED, told to A's stream),
    then saves the queued COMPLETED with the version it just reloaded: the store ends COMPLETED.
    Ours: the artifact is refused, COMPLETED is refused (the consumer reloads CANCELED): the
    store, A and B all end CANCELED, and A's run closes. Stock on a2a-sdk 1.2.0-1.2.2: after the
    reload its consumer waits for the streams to take all they got, and a stream there never
    marks the SDK's request marker taken, so A's run never closes (nor saves COMPLETED). Ours
    sees a run whose end was refused closed, forced if need be.
    """
    a = await replica(database, kind, Finishing())
    b = await replica(database, kind, ScriptedExecutor())
    stream = await start(a)
    task_id = a.executor.task_id or ""
    consumer = held_at_artifact_save(a.store)
    a.executor.step.open()
    await within(a.executor.completed.wait())  # Its COMPLETED is queued behind the artifact.
    await within(consumer.reached.wait())
    assert await within(cancel(b, task_id)) == "CANCELED"
    consumer.open()
    assert await stream.ended() and stream.last == "CANCELED"
    if kind == "ours" or _sdk.RUNS_CLOSE_THEMSELVES:
        await eventually(lambda: _not_running(a, task_id))
        assert await stored(b, task_id) == ("COMPLETED" if kind == "stock" else "CANCELED")
        return
    # Stock on 1.2.0-1.2.2: its consumer waits for good, with COMPLETED behind it, never saved.
    await wait_all_tasks_blocked()
    assert not await _not_running(a, task_id)
    assert await stored(b, task_id) == "CANCELED"
    await within(_sdk.force_close(await _sdk.run_of(a.handler, task_id), 1.0))


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", KINDS)
async def test_a_remote_cancel_racing_a_save_of_the_run_is_not_lost(database: Database, kind: str) -> None:
    """B's cancel has read the task WORKING and is held there when A's run saves its second half.

    Stock on SQLite: nothing is locked, so A's save lands, then B's CANCELED with the version A's
    save was handed (as the store's own race above): B answers CANCELED, yet A's run goes on,
    and its COMPLETED saves over CANCELED with that version. The cancel is lost. Stock on
    PostgreSQL: B holds the lock, A's save is then told of the conflict and its run's task
    cancelled. Ours on both: A's save waits for B's lock and is refused; the run is cancelled as
    a cancel here is (cancel() runs, the shielded section finishes): CANCELED everywhere.
    """
    a = await replica(database, kind, HalfWritten())
    b = await replica(database, kind, ScriptedExecutor())
    executor: HalfWritten = a.executor  # type: ignore[assignment]
    stream = await start(a)
    task_id = executor.task_id or ""
    await stream.until(lambda: artifacts_in(stream) == 1)  # A's first half is saved.
    consumer = held_at_artifact_save(a.store)
    b_read = held_after_its_read(b.store if kind == "stock" else b.store.wrapped)
    b_cancels = asyncio.ensure_future(cancel(b, task_id))
    await within(b_read.reached.wait())
    executor.step.open()
    await within(consumer.reached.wait())  # A's second half, on its way to the store.
    consumer.open()

    if kind == "stock" and database.url.startswith("sqlite"):
        await stream.until(lambda: artifacts_in(stream) == 2)  # Saved, though B read WORKING.
        b_read.open()
        assert await within(b_cancels) == "CANCELED"
        executor.flush.open()
        await within(executor.completed.wait())
        assert await stream.ended() and stream.last == "COMPLETED"
        assert await stored(b, task_id) == "COMPLETED"
        return
    b_read.open()  # A's save cannot land before B has committed CANCELED.
    assert await within(b_cancels) == "CANCELED"
    if kind == "stock":
        await within(executor.stopped.wait(), SAVE_BOUND)  # Its task cancelled, mid section.
        assert not executor.written.is_set() and not executor.cancel_called.is_set()
    else:
        await within(executor.cancel_called.wait(), SAVE_BOUND)
        executor.flush.open()
        await within(executor.stopped.wait())
        assert executor.written.is_set()
    assert not executor.completed.is_set()
    assert await stream.ended() and stream.last == "CANCELED"
    assert await stored(a, task_id) == "CANCELED" and await stored(b, task_id) == "CANCELED"
    saved = await b.calls.get(task_id, "alice")
    assert [len(artifact.parts) for artifact in saved.artifacts] == [1]  # The second half never landed.


# --- The guarded versioned save, on its own. ---------------------------------------------------


@pytest.mark.asyncio
async def test_a_refused_save_writes_nothing_and_answers_as_the_sdk_expects(database: Database) -> None:
    """Over a stored CANCELED: another end raises ConcurrentTaskModificationError; a live update,
    and CANCELED again, return the stored version. No task row, version or journal row changes.
    Stock: each of them lands (CAS on the version only) but CANCELED again."""
    ours, _ = await versioned(database, "ours")
    alice = caller("alice")
    working, canceled = task_in(WORKING), task_in(CANCELED)
    first = await ours.save(
        working, event=status(working), prev=None, prev_version=TaskVersion.MISSING, context=alice
    )
    version = await ours.save(
        canceled, event=status(canceled), prev=working, prev_version=first, context=alice
    )
    before = await ours.get("task-1", alice)
    for late in (task_in(COMPLETED), task_in(TaskState.TASK_STATE_FAILED)):
        with pytest.raises(ConcurrentTaskModificationError):
            await ours.save(late, event=status(late), prev=canceled, prev_version=version, context=alice)
    for stale in (first, version):
        assert (
            await ours.save(working, event=status(working), prev=None, prev_version=stale, context=alice)
            == version
        )
        assert (
            await ours.save(canceled, event=status(canceled), prev=None, prev_version=stale, context=alice)
            == version
        )
    assert await ours.get("task-1", alice) == before
    assert await journal(database) == [1, 2]

    stock, _ = await versioned(database, "stock")
    working, canceled, completed = (task_in(state, "task-2") for state in (WORKING, CANCELED, COMPLETED))
    first = await stock.save(working, event=None, prev=None, prev_version=TaskVersion.MISSING, context=alice)
    reloaded = await stock.save(canceled, event=None, prev=working, prev_version=first, context=alice)
    await stock.save(completed, event=status(completed), prev=canceled, prev_version=reloaded, context=alice)
    assert (await stock.get("task-2", alice)).task.status.state == COMPLETED


class Announcements(CancelNotices):
    def __init__(self) -> None:
        self.said: list[tuple[str, str]] = []

    async def announce_in(self, session: Any, task_id: str) -> None:
        assert session.in_transaction()
        self.said.append(("in the transaction", task_id))

    async def announce(self, task_id: str) -> None:
        self.said.append(("after commit", task_id))

    def listen(self) -> Any:
        raise NotImplementedError


@pytest.mark.asyncio
async def test_a_recorded_cancel_is_announced_and_a_refused_save_told(database: Database) -> None:
    """Recording CANCELED announces it in its transaction, then after commit; a refusal tells its subscribers."""
    notices = Announcements()
    sdk_store = VersionedDatabaseTaskStore(database.engine())
    store = FinalStateTaskStore(sdk_store, notices=notices)
    told: list[str] = []
    store.subscribe(refused=lambda task_id, _caller: told.append(task_id))
    alice, working, canceled = caller("alice"), task_in(WORKING), task_in(CANCELED)
    version = await store.save(
        working, event=None, prev=None, prev_version=TaskVersion.MISSING, context=alice
    )
    assert notices.said == [] and told == []
    await store.save(canceled, event=status(canceled), prev=working, prev_version=version, context=alice)
    assert notices.said == [("in the transaction", "task-1"), ("after commit", "task-1")]
    await store.save(working, event=None, prev=None, prev_version=version, context=alice)
    assert told == ["task-1"] and len(notices.said) == 2


# --- Real concurrency: completions and cancels of many tasks at once, from two replicas. -------

ROUNDS = 40


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", KINDS)
async def test_concurrent_completions_and_cancels_end_each_task_once(database: Database, kind: str) -> None:
    """Each task gets a COMPLETED from A and a CANCELED from B at once, every task at once.

    Stock on SQLite: for some tasks both saves land (measured: about 15 of 40), the second
    end over the first. Stock on PostgreSQL, and ours on both: exactly one of the two lands,
    the other is told of the conflict, and the store and the journal hold that one end.
    """
    a, _ = await versioned(database, kind)
    b, _ = await versioned(database, kind)
    alice = caller("alice")
    versions = {}
    for n in range(ROUNDS):
        working = task_in(WORKING, f"task-{n}")
        versions[n] = await a.save(
            working, event=None, prev=None, prev_version=TaskVersion.MISSING, context=alice
        )

    async def end(store: Any, n: int, state: int) -> bool:
        task = task_in(state, f"task-{n}")
        try:
            await store.save(task, event=status(task), prev=None, prev_version=versions[n], context=alice)
        except ConcurrentTaskModificationError:
            return False
        return True

    completions = [end(a, n, COMPLETED) for n in range(ROUNDS)]
    cancels = [end(b, n, CANCELED) for n in range(ROUNDS)]
    outcomes = await within(asyncio.gather(*completions, *cancels), 60)
    both = [n for n in range(ROUNDS) if outcomes[n] and outcomes[ROUNDS + n]]
    if kind == "stock" and database.url.startswith("sqlite"):
        assert both, "no task was ended twice"
        for n in both:
            assert await journal(database, f"task-{n}") == [2, 2]  # Two ends, one version.
        return
    for n in range(ROUNDS):
        completed, canceled = outcomes[n], outcomes[ROUNDS + n]
        assert completed != canceled, f"task-{n}: both or neither landed"
        state = (await a.get(f"task-{n}", alice)).task.status.state
        assert state == (COMPLETED if completed else CANCELED)
        assert await journal(database, f"task-{n}") == [2]


# --- Construction. ---------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_versioned_database_store_is_wrapped_as_a_versioned_store(database: Database) -> None:
    """Ours is a FinalStateTaskStore and a VersionedTaskStore, so the SDK uses it as it is, and
    our handler hears of its refusals. Other versioned stores are still refused."""
    store = FinalStateTaskStore(VersionedDatabaseTaskStore(database.engine()))
    assert isinstance(store, FinalStateTaskStore) and isinstance(store, VersionedTaskStore)
    server = await replica(database, "ours", ScriptedExecutor())
    assert server.store._told_refused == [server.handler._remote.refused]
    with pytest.raises(TypeError, match="VersionedDatabaseTaskStore"):
        FinalStateTaskStore(LegacyTaskStoreAdapter(InMemoryTaskStore()))


# --- The SDK's warnings about the caller's arguments point at the caller. ----------------------


CARD = AgentCard(name="w", description="w", version="1", capabilities=AgentCapabilities(streaming=True))


@pytest.mark.parametrize("kind", KINDS)
def test_the_sdks_warnings_point_at_the_callers_line(tmp_path: Path, kind: str) -> None:
    """No event_stream with a versioned store (UserWarning), a queue_manager (DeprecationWarning):
    stock says so at the caller's line; so does ours (it said so at its own line in _handler.py)."""
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'tasks.db'}")
    sdk_store = VersionedDatabaseTaskStore(engine)
    store = sdk_store if kind == "stock" else FinalStateTaskStore(sdk_store)
    handler = DefaultRequestHandlerV2 if kind == "stock" else DefaultRequestHandler
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        handler(ScriptedExecutor(), store, CARD, queue_manager=object())
    categories = {w.category: w for w in raised}
    assert set(categories) >= {UserWarning, DeprecationWarning}
    assert "without an event_stream" in str(categories[UserWarning].message)
    for warning in raised:
        assert warning.filename == __file__, (warning.category, warning.filename)


@pytest.mark.asyncio
async def test_notices_reach_a_run_that_saves_nothing(tmp_path: Path) -> None:
    """Cluster mode with ``notices="postgres"``: B's cancel reaches A's run at once, though A
    saves nothing that the store could refuse and polls once an hour."""
    async with open_database("postgresql", tmp_path) as database:
        servers = []
        for _ in "ab":
            sdk_store = VersionedDatabaseTaskStore(database.engine())
            await sdk_store.initialize()
            stream = DatabaseTaskEventStream(database.engine(), poll_interval_s=JOURNAL_POLL)
            await stream.initialize()
            store = FinalStateTaskStore(sdk_store, notices="postgres")
            servers.append(
                make_server(
                    "ours",
                    ScriptedExecutor(),
                    store=store,
                    event_stream=stream,
                    replica_poll_interval=3600,
                    cancel_grace_period=BOUND,
                )
            )
        a, b = servers
        sent = await start(a)
        task_id = a.executor.task_id or ""
        assert await within(cancel(b, task_id)) == "CANCELED"
        await within(a.executor.cancel_called.wait())
        await within(a.executor.stopped.wait())
        assert not a.executor.completed.is_set()
        assert await sent.ended() and sent.last == "CANCELED"
        await eventually(lambda: _not_running(a, task_id))
        for server in servers:
            await within(server.handler.aclose())


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", KINDS)
async def test_a_task_parked_on_a_and_canceled_on_b_ends_canceled_on_a(database: Database, kind: str) -> None:
    """Nothing runs on A for a parked task, and nothing saves there: stock's A never learns (its
    subscriber stays open, cancel() never runs); ours looks at its parked tasks once per poll
    interval, so A's subscriber and push end CANCELED and cancel() runs there."""
    options = {"replica_poll_interval": 0.01} if kind == "ours" else {}
    a = await replica(database, kind, ScriptedExecutor(park=True), **options)
    b = await replica(database, kind, ScriptedExecutor(), **options)
    await start(a, push_url=PUSH_URL)
    task_id = a.executor.task_id or ""
    subscriber = Stream(a.calls.subscribe(task_id, "alice"))
    await subscriber.until(lambda: bool(subscriber.events))
    assert await within(cancel(b, task_id)) == "CANCELED"
    if kind == "stock":
        await wait_all_tasks_blocked()
        assert not subscriber.task.done() and not a.executor.cancel_called.is_set()
    else:
        assert await subscriber.ended() and subscriber.last == "CANCELED"
        await a.push.posted(PUSH_URL, "CANCELED")
        assert a.executor.cancel_called.is_set()
    assert await stored(a, task_id) == "CANCELED"
    for server in (a, b):
        await within(server.handler.aclose())


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", KINDS)
async def test_a_subscriber_to_a_task_run_elsewhere_does_not_hold_the_shutdown(
    database: Database, kind: str
) -> None:
    """B serves a subscriber of A's running task from the journal: B's ``aclose()`` returns at
    once, stock or ours, though ours would let a run of its own finish for 30 s; the
    subscriber goes on to A's COMPLETED."""
    a = await replica(database, kind, ScriptedExecutor())
    b = await replica(database, kind, ScriptedExecutor(), shutdown_drain_time=30.0)
    await start(a)
    task_id = a.executor.task_id or ""
    subscriber = Stream(b.calls.subscribe(task_id, "alice"))
    await subscriber.until(lambda: bool(subscriber.events))
    await within(b.handler.aclose())
    a.executor.step.open()
    assert await subscriber.ended(SAVE_BOUND) and subscriber.last == "COMPLETED"
    await within(a.handler.aclose())
