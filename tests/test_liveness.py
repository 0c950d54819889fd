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
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
import pytest_asyncio
import sqlalchemy as sa
from a2a.server.tasks import DatabaseTaskStore
from a2a.types import SendMessageRequest, Task, TaskPushNotificationConfig, TaskState
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from a2a_cancelfix._cancel.settings import Timing
from a2a_cancelfix._liveness import LAPSED
from a2a_cancelfix.testing import ScriptedExecutor, Server, Stream, caller, make_server, message

from .test_store import DATABASES, Database, open_database

T = TypeVar("T")

# A dead replica's loop, closed after the test, may leave a driver's thread (aiosqlite's) to hand
# the outcome of a statement it had begun to that closed loop: that thread's error is moot.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")

LEASE = 1.2
GRACE = 0.2
MARGIN = 0.05
OURS = {"cancel_grace_period": GRACE, "lease_time": LEASE, "timing": Timing(margin=MARGIN)}
# A dead replica's tasks are ended within a lease and a renewal after its last beat, and the
# write; what a machine busy with other work adds to that.
BOUND = LEASE + LEASE / 6 + 2.0
POLL = 0.02  # Between two reads of the shared database, which no event of this loop announces.
PUSH_URL = "http://push.invalid/liveness"

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
            self.loop.run_until_complete(asyncio.wait(pending, timeout=5.0))
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

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
        """After the test: cancel what the loop left, in its own thread, and close it."""
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
            assert not await reader.reaches(task_id, FAILED, BOUND)
            assert await reader.state(task_id) == WORKING and not subscriber.task.done()
            subscriber.task.cancel()
            return
        assert await reader.reaches(task_id, FAILED, BOUND)
        took = time.monotonic() - died
        assert took <= LEASE + LEASE / 6 + 1.0, took
        assert status_text(await reader.task(task_id)) == LAPSED
        assert await subscriber.ended(), subscriber.events
        assert subscriber.last == "FAILED", subscriber.events
        await survivor.push.posted(PUSH_URL, "FAILED")
        assert len(lapsed_ends(caplog)) == 1
        await survivor.handler.aclose()
