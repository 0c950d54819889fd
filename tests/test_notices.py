"""Cancels pushed to the running replica: PostgreSQL's NOTIFY, Redis pub/sub, and polling
as the fallback when the listening connection drops.

Two handlers in one process are the replicas, each with its own engine and notices, over one
database: a PostgreSQL schema (NOTIFY), or a SQLite file (a SQL store without NOTIFY, with
Redis for the notices). Polling is set to an hour wherever a test shows that the notice, not
a poll, carried the cancel.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import urllib.parse
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import pytest_asyncio
from a2a.server.tasks import DatabaseTaskStore, InMemoryTaskStore
from a2a.types import Artifact, Part, TaskArtifactUpdateEvent

from a2a_cancelfix import FinalStateTaskStore, _replicas, _sdk
from a2a_cancelfix.notices import CancelNotices, PostgresNotices, RedisNotices, keep_listening
from a2a_cancelfix.testing import (
    Changes,
    Gate,
    ScriptedExecutor,
    Stream,
    cancel,
    make_server,
    start,
    stored,
    wait_all_tasks_blocked,
    within,
)
from a2a_cancelfix.testing.waits import eventually

from .test_replicas import CHECKPOINTS, PollingExecutor, outcome_within
from .test_store import PG_DSN, open_database

HOUR = 3600.0
REDIS_URL = "redis://127.0.0.1:6379/0"


class Listening:
    """What a replica's notices do: each attempt to listen, each time listening began. Every
    attempt after the first waits at ``reconnect`` (open at first: ``hold()`` closes it)."""

    def __init__(self, notices: CancelNotices) -> None:
        self.notices, self.attempts, self.starts = notices, 0, 0
        self.changes, self.reconnect = Changes(), Gate()
        self.reconnect.open()
        listen = notices.listen

        @contextlib.asynccontextmanager
        async def counted() -> AsyncIterator[AsyncIterator[str | None]]:
            self.attempts += 1
            self.changes.notify()
            if self.attempts > 1:
                await self.reconnect()
            async with listen() as ids:
                yield self._relay(ids)

        notices.listen = counted  # type: ignore[method-assign]

    async def _relay(self, ids: AsyncIterator[str | None]) -> AsyncIterator[str | None]:
        async for task_id in ids:
            yield task_id
            if task_id is None:  # The replica has switched to notices and looked once.
                self.starts += 1
                self.changes.notify()

    def hold(self) -> None:
        self.reconnect = Gate()

    async def heard(self, times: int = 1) -> None:
        await self.changes.until(lambda: self.starts >= times)

    async def retrying(self) -> None:
        """Wait until the connection was found lost and the next attempt waits at the gate."""
        await self.changes.until(lambda: self.attempts >= 2)
        await within(self.reconnect.reached.wait())


class Replicas(SimpleNamespace):
    kind: str
    stores: list[FinalStateTaskStore]
    listening: list[Listening]
    closers: list[Any]

    def store(self, *, notices: bool = True) -> FinalStateTaskStore:
        """One replica's store: its own engine (and notices) over the shared database."""
        engine = self.database.engine()
        made: CancelNotices | None = None
        if notices and self.kind == "postgres":
            made = PostgresNotices(engine, self.channel)
        elif notices:
            import redis.asyncio as redis

            # Named after the channel: `kill_listeners` kills this test's connections only.
            client = redis.Redis.from_url(REDIS_URL, client_name=self.channel)
            self.closers.append(client.aclose)
            made = RedisNotices(client, self.channel)
        store = FinalStateTaskStore(DatabaseTaskStore(engine), notices=made)
        if made is not None:
            self.listening.append(Listening(made))
        return store

    def pair(self, executor: ScriptedExecutor, kind: str = "ours", **options: Any):
        """Replica A runs ``executor``; replica B runs nothing and takes the cancel."""
        options.setdefault("replica_poll_interval", HOUR)
        if kind != "ours":
            options = {}
        a = make_server(kind, executor, store=self.store(), **options)
        b = make_server(kind, ScriptedExecutor(), store=self.store(), **options)
        self.servers += [a, b]
        return a, b

    async def cut_listener(self) -> Listening:
        """Once A listens, kill its connection and hold its reconnect (``reconnect`` opens it)."""
        listening = self.listening[0]
        await within(listening.heard())
        listening.hold()
        await self.kill_listeners()
        await listening.retrying()
        return listening

    async def kill_listeners(self) -> None:
        """Kill the listening connections from the server's side, as a failover would."""
        if self.kind == "postgres":
            import asyncpg

            admin = await asyncpg.connect(PG_DSN)
            try:
                name = f"a2a_cancelfix listening on {self.channel}"[:63]
                killed = await admin.fetch(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1", name
                )
            finally:
                await admin.close()
        else:
            import redis.asyncio as redis

            # Not every pubsub connection on the server: another worker's test has its own.
            admin = redis.Redis.from_url(REDIS_URL)
            try:
                listeners = await admin.client_list(_type="pubsub")
                killed = [
                    await admin.client_kill_filter(_id=listener["id"])
                    for listener in listeners
                    if listener.get("name") == self.channel
                ]
            finally:
                await admin.aclose()
        assert killed, "no listening connection to kill"


@pytest_asyncio.fixture(params=["postgres", "redis"])
async def replicas(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Replicas]:
    kind = request.param
    if kind == "redis":
        await _need_redis()
    async with open_database("postgresql" if kind == "postgres" else "sqlite", tmp_path) as database:
        made = Replicas(
            kind=kind,
            database=database,
            channel=f"a2acf_{uuid.uuid4().hex[:12]}",
            listening=[],
            closers=[],
            servers=[],
        )
        try:
            yield made
        finally:
            for listener in made.listening:
                listener.reconnect.open()
            for server in made.servers:
                server.executor.step.open()
                task_id = server.executor.task_id
                if task_id:  # Closed here, not cut by the loop's teardown mid-write.
                    await eventually(functools.partial(_run_closed, server, task_id))
                await within(server.handler.aclose())
            for close in made.closers:
                await close()


async def _need_redis() -> None:
    import redis.asyncio as redis

    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
    try:
        await client.ping()
    except (OSError, redis.RedisError) as error:
        pytest.skip(f"Redis at 127.0.0.1:6379 is unreachable: {error!r}")
    finally:
        await client.aclose()


@pytest.mark.asyncio
async def test_a_cancel_is_pushed_to_the_running_replica(replicas: Replicas) -> None:
    """B's cancel reaches A's run at once, with an hour between polls: callbacks, cancel(),
    the work stopped, A's stream and push end on CANCELED."""
    a, b = replicas.pair(ScriptedExecutor())
    stream = await start(a, push_url="http://push.invalid/a")
    await within(replicas.listening[0].heard())
    task_id = a.executor.task_id or ""
    assert await within(cancel(b, task_id)) == "CANCELED"
    await within(a.executor.cancel_called.wait())
    await within(a.executor.stopped.wait())
    assert not a.executor.completed.is_set()
    assert await stream.ended() and stream.last == "CANCELED"
    await a.push.posted("http://push.invalid/a", "CANCELED")
    assert await stored(a, task_id) == "CANCELED"


@pytest.mark.asyncio
async def test_without_notices_the_running_replica_does_not_hear(tmp_path: Path) -> None:
    """The same cancel with no notices (and an hour between polls), and under the stock
    handler: A's run goes on; B's stock cancel hangs up to a2a-sdk 1.1.5."""
    async with open_database("postgresql", tmp_path) as database:
        for kind in ("ours", "stock"):
            stores = [FinalStateTaskStore(DatabaseTaskStore(database.engine())) for _ in "ab"]
            options = {"replica_poll_interval": HOUR} if kind == "ours" else {}
            a = make_server(kind, ScriptedExecutor(), store=stores[0], **options)
            b = make_server(kind, ScriptedExecutor(), store=stores[1], **options)
            await start(a)
            answered = await outcome_within(cancel(b, a.executor.task_id or ""))
            assert answered == ("CANCELED" if kind == "ours" or _sdk.SDK_CANCELS_WHERE_NOT_LIVE else "HANG")
            await wait_all_tasks_blocked()
            assert not a.executor.cancel_called.is_set() and not a.executor.stopped.is_set()
            a.executor.step.open()
            await within(a.executor.stopped.wait())


@pytest.mark.asyncio
async def test_a_listening_replica_reads_nothing_until_a_cancel(replicas: Replicas) -> None:
    """Polling would read the store at every checkpoint (every millisecond); while the notices
    are heard, a run passes a hundred checkpoints with no read at all."""
    a, b = replicas.pair(PollingExecutor(), replica_poll_interval=0.001)
    await start(a)
    await within(replicas.listening[0].heard())
    reads = _count_reads(a.store)
    await a.executor.passed(CHECKPOINTS)
    assert reads.count == 0
    assert await within(cancel(b, a.executor.task_id or "")) == "CANCELED"
    await within(a.executor.stopped.wait())
    assert a.executor.cancel_called.is_set() and reads.count >= 1  # It looked once it was told.


@pytest.mark.asyncio
async def test_a_lost_listener_falls_back_to_polling(replicas: Replicas) -> None:
    """The listening connection is killed and cannot come back: A polls again, and B's
    cancel reaches its run by the next due checkpoint."""
    a, b = replicas.pair(PollingExecutor(), replica_poll_interval=0.01)
    await start(a)
    listening = await replicas.cut_listener()
    assert await within(cancel(b, a.executor.task_id or "")) == "CANCELED"
    await within(a.executor.stopped.wait())
    assert a.executor.cancel_called.is_set() and listening.starts == 1


@pytest.mark.asyncio
async def test_a_cancel_announced_while_not_listening_is_found_on_reconnect(replicas: Replicas) -> None:
    """B's notice comes while A's connection is down, and nothing polls for an hour: listening
    again, A looks at each of its runs once, and finds it."""
    a, b = replicas.pair(ScriptedExecutor())
    await start(a)
    listening = await replicas.cut_listener()
    assert await within(cancel(b, a.executor.task_id or "")) == "CANCELED"
    await wait_all_tasks_blocked()
    assert not a.executor.cancel_called.is_set()  # The notice is lost; nothing else told A.
    listening.reconnect.open()
    await within(listening.heard(2))
    await within(a.executor.stopped.wait())
    assert a.executor.cancel_called.is_set() and not a.executor.completed.is_set()


@pytest.mark.asyncio
async def test_a_task_parked_on_a_listening_replica_hears_the_cancel(replicas: Replicas) -> None:
    """A parked task has no run to look: the notice makes A look at it, and its subscriber
    and cancel() learn of B's CANCELED at once."""
    a, b = replicas.pair(ScriptedExecutor(park=True))
    await start(a)
    await within(replicas.listening[0].heard())
    task_id = a.executor.task_id or ""
    subscriber = Stream(a.calls.subscribe(task_id, "alice"))
    await subscriber.until(lambda: bool(subscriber.events))
    assert await within(cancel(b, task_id)) == "CANCELED"
    assert await subscriber.ended() and subscriber.last == "CANCELED"
    assert a.executor.cancel_called.is_set()


class Reporting(ScriptedExecutor):
    """Reports one artifact once the step opens, then waits: an update after the cancel."""

    def __init__(self) -> None:
        super().__init__()
        self.report = Gate()

    async def _work_step(self) -> None:
        await self.step()
        await self.queue.enqueue_event(
            TaskArtifactUpdateEvent(
                task_id=self.task_id or "",
                context_id=self.context_id,
                artifact=Artifact(artifact_id="report", parts=[Part(text="late")]),
            )
        )
        await self.report()

    async def execute(self, context: Any, event_queue: Any) -> None:
        self.queue, self.context_id = event_queue, context.context_id or ""
        await super().execute(context, event_queue)


@pytest.mark.asyncio
async def test_a_save_refused_over_the_cancel_tells_the_run_at_once() -> None:
    """No notices, no polling for an hour: A's next saved update is refused by the store,
    which holds B's CANCELED, and that refusal makes A's run look and cancel."""
    store = FinalStateTaskStore(InMemoryTaskStore())
    a = make_server("ours", Reporting(), store=store, replica_poll_interval=HOUR)
    b = make_server("ours", ScriptedExecutor(), store=store, replica_poll_interval=HOUR)
    stream = await start(a)
    assert await within(cancel(b, a.executor.task_id or "")) == "CANCELED"
    await wait_all_tasks_blocked()
    assert not a.executor.cancel_called.is_set()
    a.executor.step.open()  # The artifact is saved, refused: A learns.
    await within(a.executor.stopped.wait())
    assert a.executor.cancel_called.is_set() and not a.executor.completed.is_set()
    assert await stream.ended() and stream.last == "CANCELED"
    await eventually(lambda: _run_closed(a, a.executor.task_id or ""))


@pytest.mark.asyncio
async def test_notices_are_named_in_one_argument_and_checked_against_the_store(tmp_path: Path) -> None:
    """``"postgres"`` means NOTIFY on the store's engine, a Redis client means its pub/sub; what
    cannot travel with the store's writes is a TypeError at construction."""
    import redis.asyncio as redis

    async with open_database("postgresql", tmp_path) as database:
        engine = database.engine()
        store = FinalStateTaskStore(DatabaseTaskStore(engine), notices="postgres")
        assert isinstance(store.notices, PostgresNotices) and store.notices.engine is engine
        with pytest.raises(TypeError, match="DatabaseTaskStore on PostgreSQL"):
            FinalStateTaskStore(InMemoryTaskStore(), notices="postgres")
        with pytest.raises(TypeError, match="DatabaseTaskStore on PostgreSQL"):
            FinalStateTaskStore(InMemoryTaskStore(), notices=PostgresNotices(engine))
        # PostgreSQL keeps 63 bytes of a name: LISTEN would truncate a longer one, pg_notify refuse it.
        assert PostgresNotices(engine, "c" * 63).channel == "c" * 63
        with pytest.raises(ValueError, match="1 to 63 bytes"):
            PostgresNotices(engine, "c" * 64)
        with pytest.raises(ValueError, match="1 to 63 bytes"):
            PostgresNotices(engine, "é" * 32)
    async with open_database("sqlite", tmp_path) as database:
        with pytest.raises(TypeError, match="postgresql\\+asyncpg"):
            FinalStateTaskStore(DatabaseTaskStore(database.engine()), notices="postgres")
        client = redis.Redis.from_url(REDIS_URL)
        store = FinalStateTaskStore(DatabaseTaskStore(database.engine()), notices=client)
        assert isinstance(store.notices, RedisNotices) and store.notices.client is client
        with pytest.raises(TypeError, match="notices must be"):
            FinalStateTaskStore(DatabaseTaskStore(database.engine()), notices="redis")
        await client.aclose()
    async with open_database("mysql", tmp_path) as database:  # No NOTIFY: Redis, or polling.
        with pytest.raises(TypeError, match="mysql\\+aiomysql; on another database, give a redis"):
            FinalStateTaskStore(DatabaseTaskStore(database.engine()), notices="postgres")
        client = redis.Redis.from_url(REDIS_URL)
        store = FinalStateTaskStore(DatabaseTaskStore(database.engine()), notices=client)
        assert isinstance(store.notices, RedisNotices)
        await client.aclose()


@pytest.mark.parametrize(
    ("kind", "arguments", "error", "named"),
    [
        ("postgres", {"channel": None}, TypeError, "channel"),
        ("postgres", {"heartbeat": 0}, ValueError, "heartbeat"),
        ("postgres", {"heartbeat": float("inf")}, ValueError, "heartbeat"),
        ("postgres", {"heartbeat": "5"}, TypeError, "heartbeat"),
        ("redis", {"channel": None}, TypeError, "channel"),
        ("redis", {"channel": ""}, ValueError, "channel"),
        ("redis", {"heartbeat": -1}, ValueError, "heartbeat"),
        ("redis", {"heartbeat": None}, TypeError, "heartbeat"),
    ],
)
def test_notices_refuse_bad_arguments_naming_them(
    kind: str, arguments: dict, error: type, named: str
) -> None:
    """A channel or heartbeat outside its values is a TypeError or ValueError naming it, as
    the handler's options are (``PostgresNotices(engine, None)`` raised AttributeError; a
    heartbeat of 0 or "5" was taken, and every wait on the connection failed)."""
    import redis.asyncio as redis
    from sqlalchemy.ext.asyncio import create_async_engine

    from .test_store import PG_URL

    given: Any = create_async_engine(PG_URL) if kind == "postgres" else redis.Redis.from_url(REDIS_URL)
    notices = PostgresNotices if kind == "postgres" else RedisNotices
    with pytest.raises(error, match=rf"^{named}\b"):
        notices(given, **arguments)


@pytest.mark.parametrize("notices", [PostgresNotices, RedisNotices])
def test_notices_refuse_what_is_not_their_connection(notices: type) -> None:
    """``None`` for the engine or the client is a TypeError naming it (it was an AttributeError,
    or for Redis no error until the first cancel)."""
    with pytest.raises(TypeError, match="engine" if notices is PostgresNotices else "client"):
        notices(None)


@pytest.mark.asyncio
async def test_a_notice_redis_cannot_take_is_logged_and_the_cancel_stands(tmp_path: Path) -> None:
    """Redis is down when B records the cancel: B still answers CANCELED, as stored, and says
    that the notice was lost."""
    import redis.asyncio as redis

    async with open_database("sqlite", tmp_path) as database:
        down = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=1)
        store = FinalStateTaskStore(DatabaseTaskStore(database.engine()))
        a = make_server("ours", ScriptedExecutor(), store=store, replica_poll_interval=HOUR)
        await start(a)
        b_store = FinalStateTaskStore(
            DatabaseTaskStore(database.engine()), notices=RedisNotices(down, heartbeat=0.5)
        )
        b = make_server("ours", ScriptedExecutor(), store=b_store, replica_poll_interval=HOUR)
        lost = Warned("could not announce the cancel")
        logging.getLogger("a2a_cancelfix").addHandler(lost)
        try:
            assert await within(cancel(b, a.executor.task_id or "")) == "CANCELED"
            await within(lost.seen.wait())
        finally:
            logging.getLogger("a2a_cancelfix").removeHandler(lost)
        assert await stored(a, a.executor.task_id or "") == "CANCELED"
        a.executor.step.open()
        await within(a.executor.stopped.wait())
        assert not a.executor.completed.is_set()  # Before completing, A read the store.
        task_id = a.executor.task_id or ""
        await eventually(lambda: _run_closed(a, task_id))  # Not left to the loop's teardown.
        await down.aclose()


async def _run_closed(server: Any, task_id: str) -> bool:
    return await _sdk.live_task(server.handler, task_id) is None


class Warned(logging.Handler):
    """Sets ``seen`` when a record containing ``text`` is logged."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.WARNING)
        self.text, self.seen = text, asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.seen.set()


def _count_reads(store: FinalStateTaskStore) -> SimpleNamespace:
    reads, get = SimpleNamespace(count=0), store.get

    async def counted(*args: Any, **kwargs: Any) -> Any:
        reads.count += 1
        return await get(*args, **kwargs)

    store.get = counted  # type: ignore[method-assign]
    return reads


class _StallableLink:
    """A TCP link to Redis whose connections `stall` goes silent on, both ways, as a half-open
    link does; later connections cross it. (Redis's CLIENT PAUSE would stall every worker's
    connections to the shared server.)"""

    def __init__(self) -> None:
        self.url = ""  # Once entered: what a Redis client connects to instead of the server.
        self._pipes: list[tuple[asyncio.Future[None], list[bool]]] = []
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> _StallableLink:
        self._server = await asyncio.start_server(self._connected, "127.0.0.1", 0)
        self.url = f"redis://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/0"
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()
        for pipe, _stalled in self._pipes:
            pipe.cancel()
        await asyncio.gather(*(pipe for pipe, _stalled in self._pipes), return_exceptions=True)

    def stall(self) -> None:
        for _pipe, stalled in self._pipes:
            stalled[0] = True

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        server = urllib.parse.urlsplit(REDIS_URL)
        redis_reader, redis_writer = await asyncio.open_connection(server.hostname, server.port)
        stalled = [False]
        for source, sink in ((reader, redis_writer), (redis_reader, writer)):
            self._pipes.append((asyncio.ensure_future(self._carry(source, sink, stalled)), stalled))

    @staticmethod
    async def _carry(source: asyncio.StreamReader, sink: asyncio.StreamWriter, stalled: list[bool]) -> None:
        try:
            while data := await source.read(65536):
                if not stalled[0]:  # Stalled, what comes is lost, as on a link gone half-open.
                    sink.write(data)
                    await sink.drain()
        finally:
            sink.close()


@pytest.mark.asyncio
async def test_a_listener_that_hears_nothing_back_is_lost_and_polls(tmp_path: Path) -> None:
    """Redis stops answering (to the listener, a half-open link): the PING that the heartbeat
    sends goes unanswered, the connection counts as lost, and A polls again."""
    import redis.asyncio as redis

    await _need_redis()
    async with open_database("sqlite", tmp_path) as database, _StallableLink() as link:
        client = redis.Redis.from_url(link.url)
        notices = RedisNotices(client, f"a2acf_{uuid.uuid4().hex[:12]}", heartbeat=0.1)
        listening = Listening(notices)
        store = FinalStateTaskStore(DatabaseTaskStore(database.engine()), notices=notices)
        a = make_server("ours", PollingExecutor(), store=store, replica_poll_interval=0.01)
        try:
            await start(a)
            await within(listening.heard())
            assert a.handler.agent_executor.cancel_lifecycle.remote.interval == float("inf")
            listening.hold()
            link.stall()
            await listening.retrying()
            assert a.handler.agent_executor.cancel_lifecycle.remote.interval == 0.01
        finally:
            listening.reconnect.open()
            a.executor.released.set()
            await within(a.executor.stopped.wait())
            await eventually(lambda: _run_closed(a, a.executor.task_id or ""))
            await within(a.handler.aclose())
            await client.aclose()


@pytest.mark.asyncio
async def test_reconnects_that_keep_failing_leave_polling_alone(tmp_path: Path) -> None:
    """Redis unreachable from the start: each failed reconnect (0.1 s, 0.5 s, ... apart) leaves
    every run's next look where it was, so a poll interval longer than the back-off still polls
    (before, each failure moved it on by a whole interval, and past 5 s no run ever looked)."""
    import redis.asyncio as redis

    async with open_database("sqlite", tmp_path) as database:
        client = redis.Redis.from_url("redis://127.0.0.1:1/0")  # Nothing listens there.
        notices = RedisNotices(client, f"a2acf_{uuid.uuid4().hex[:12]}")
        listening = Listening(notices)
        store = FinalStateTaskStore(DatabaseTaskStore(database.engine()), notices=notices)
        a = make_server("ours", PollingExecutor(), store=store, replica_poll_interval=HOUR)
        try:
            sent = await start(a)
            run = a.handler.agent_executor.cancel_lifecycle.works[a.executor.task_id]
            due = run.next_look
            await listening.changes.until(lambda: listening.attempts >= 3)  # Two failures seen.
            assert run.next_look == due
        finally:
            a.executor.released.set()
            await within(a.executor.stopped.wait())
            assert await sent.ended()
            await eventually(lambda: _run_closed(a, a.executor.task_id or ""))
            await within(a.handler.aclose())
            await client.aclose()


class RedisProxy:
    """A relay to the real Redis that the test takes away: ``close()`` drops every connection
    through it and refuses new ones, as a Redis gone for good does (the server itself runs on)."""

    async def start(self) -> int:
        self.links: set[asyncio.StreamWriter] = set()
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", 6379)
        self.links |= {writer, up_writer}

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            except OSError:
                pass
            finally:
                sink.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def close(self) -> None:
        self.server.close()
        for link in self.links:
            link.transport.abort()
        await self.server.wait_closed()


@pytest.mark.asyncio
async def test_with_redis_gone_while_listening_polling_keeps_its_interval(tmp_path: Path) -> None:
    """A listens through a relay to the real Redis; the relay goes away for good, so every
    reconnect fails (0.1 s, 0.5 s, ... apart). Each failure leaves the run's next look where
    the loss put it, one poll interval on, and B's cancel (recorded in the store, its notice
    lost) reaches A's run by then. Before, each failure moved the look on by a whole interval."""
    import redis.asyncio as redis

    await _need_redis()
    interval = 2.0  # Longer than the first gaps between reconnects.
    proxy = RedisProxy()
    async with open_database("sqlite", tmp_path) as database:
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        # No retries inside redis-py: each of the listener's reconnects fails at once.
        port = await proxy.start()
        client = redis.Redis(
            host="127.0.0.1", port=port, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0)
        )
        notices = RedisNotices(client, f"a2acf_{uuid.uuid4().hex[:12]}")
        listening = Listening(notices)
        store = FinalStateTaskStore(DatabaseTaskStore(database.engine()), notices=notices)
        a = make_server("ours", PollingExecutor(), store=store, replica_poll_interval=interval)
        b_store = FinalStateTaskStore(DatabaseTaskStore(database.engine()))
        b = make_server("ours", ScriptedExecutor(), store=b_store, replica_poll_interval=HOUR)
        try:
            await start(a)
            task_id = a.executor.task_id or ""
            await within(listening.heard())
            run = a.handler.agent_executor.cancel_lifecycle.works[task_id]
            await proxy.close()
            await listening.changes.until(lambda: listening.attempts >= 2)  # Lost: polling again.
            due = run.next_look
            await listening.changes.until(lambda: listening.attempts >= 4)  # Two reconnects failed.
            assert run.next_look == due
            assert await within(cancel(b, task_id)) == "CANCELED"
            await within(a.executor.cancel_called.wait(), interval + 1.0)
            await within(a.executor.stopped.wait())
        finally:
            a.executor.released.set()
            await within(a.executor.stopped.wait())
            await eventually(lambda: _run_closed(a, a.executor.task_id or ""))
            await within(a.handler.aclose())
            await client.aclose()


def _postgres_notices() -> PostgresNotices:
    """PostgresNotices on an engine that only names its dialect: `_ids` is driven directly."""
    return PostgresNotices(SimpleNamespace(dialect=SimpleNamespace(name="postgresql", driver="asyncpg")))


@pytest.mark.asyncio
async def test_a_notice_in_the_turn_of_the_cancel_does_not_keep_the_listener_going() -> None:
    """A notice arrives in the loop turn the listener is cancelled in. The listener ends,
    cancelled: ``asyncio.wait_for`` (Python 3.10, 3.11) would hand it the notice and swallow
    the cancel, and it would listen on, past any ``aclose()``."""
    ids: asyncio.Queue[str | BaseException] = asyncio.Queue()
    heard: list[str] = []
    first = asyncio.Event()

    async def listen() -> None:
        async for task_id in _postgres_notices()._ids(ids, connection=None):
            if task_id is not None:
                heard.append(task_id)
                first.set()

    listener = asyncio.ensure_future(listen())
    ids.put_nowait("task-1")
    await within(first.wait())  # The listener waits for the next notice again.
    ids.put_nowait("task-2")
    listener.cancel()
    try:
        await asyncio.wait((listener,), timeout=1.0)
        assert listener.cancelled()
        assert heard == ["task-1"]
    finally:
        listener.cancel()  # A listener that went on: no notice comes with this one.


class Swallowing(CancelNotices):
    """Notices from a library whose wait swallows a cancel that comes with a notice (as
    ``asyncio.wait_for`` does up to Python 3.11)."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: asyncio.Queue[str] = asyncio.Queue()

    @contextlib.asynccontextmanager
    async def listen(self) -> AsyncIterator[AsyncIterator[str | None]]:
        yield self._ids()

    async def _ids(self) -> AsyncIterator[str | None]:
        yield None
        while True:
            yield await asyncio.wait_for(self.ids.get(), 60)


@pytest.mark.asyncio
async def test_listening_stops_at_a_cancel_a_library_swallowed() -> None:
    """Cancelled in the turn a notice comes, the library's wait swallows the cancel and hands
    on the notice: keep_listening sees its task is being cancelled and stops there."""
    notices = Swallowing()
    noticed: list[str] = []
    listening = asyncio.Event()
    listener = asyncio.ensure_future(keep_listening(notices, noticed.append, listening.set, lambda: None))
    await within(listening.wait())
    await wait_all_tasks_blocked()  # At the library's wait for the next notice.
    notices.ids.put_nowait("task-1")
    listener.cancel()
    try:
        await asyncio.wait((listener,), timeout=1.0)
        assert listener.cancelled()
        assert noticed == []
    finally:
        listener.cancel()  # A listener that went on: no notice comes with this one.


class Stuck(CancelNotices):
    """Notices whose listening connection does not give up when cancelled, until ``released``."""

    def __init__(self) -> None:
        super().__init__()
        self.released = asyncio.Event()
        self.entered = asyncio.Event()

    @contextlib.asynccontextmanager
    async def listen(self) -> AsyncIterator[AsyncIterator[str | None]]:
        self.entered.set()
        while not self.released.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await self.released.wait()
        raise ConnectionError("released")
        yield  # pragma: no cover - an async context manager's generator


@pytest.mark.asyncio
async def test_aclose_returns_though_the_listener_does_not_stop(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A listener that ignores its cancel: aclose() waits for it no longer than its bound,
    says so at WARNING, and returns."""
    monkeypatch.setattr(_replicas, "LISTENER_STOP", 0.05)
    notices = Stuck()
    server = make_server(
        "ours", ScriptedExecutor(), store=FinalStateTaskStore(InMemoryTaskStore(), notices=notices)
    )
    await start(server)
    await within(notices.entered.wait())
    server.executor.step.open()
    try:
        with caplog.at_level(logging.WARNING, logger="a2a_cancelfix"):
            await within(server.handler.aclose())
        assert any("did not stop within" in record.getMessage() for record in caplog.records)
    finally:
        notices.released.set()
