"""Cancels pushed to every replica at once: PostgreSQL's NOTIFY, or Redis pub/sub.

A replica that records CANCELED in the shared store announces the task id; every replica
listens on one connection, and the one running the task reads the store once and cancels the
run there. The store stays the truth: a notice only says "look now", so a late or doubled
notice costs a read, never a wrong state. While a replica listens it does not poll; when its
connection drops it polls again, reconnects, and then looks once at every task it runs, so a
cancel announced during the gap is not lost.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from a2a_cancelfix._aio import being_cancelled, bounded, checked_seconds, in_background

__all__ = ["CancelNotices", "PostgresNotices", "RedisNotices"]

logger = logging.getLogger("a2a_cancelfix")

CHANNEL = "a2a_cancelfix_cancels"
# How often an idle listening connection is checked: a dead peer that sent nothing (a
# network partition) shows up within this, not never.
HEARTBEAT = 5.0
# Waits between two attempts to listen again, the last one repeated.
RETRY_AFTER = (0.1, 0.5, 1.0, 2.0, 5.0)

_Notices = contextlib.AbstractAsyncContextManager[AsyncIterator[str | None]]


class CancelNotices(abc.ABC):
    """How replicas tell each other of a cancel: announce a task id, listen for them.

    Args:
        channel: the channel's name, the same on every replica.
        heartbeat: seconds within which an idle listening connection is checked, and a
            notice sent.

    Raises:
        TypeError, ValueError: a channel that is not a non-empty string, a heartbeat that is
            not a finite number of seconds above 0.
    """

    def __init__(self, channel: str = CHANNEL, *, heartbeat: float = HEARTBEAT) -> None:
        if not isinstance(channel, str):
            raise TypeError(f"channel must be a string, not {type(channel).__name__}")
        if not channel:
            raise ValueError("channel must be a name, not empty")
        self.channel = channel
        self.heartbeat = checked_seconds("heartbeat", heartbeat)

    async def announce_in(self, session: Any, task_id: str) -> None:
        """Announce in the transaction that records the cancel: delivered on its commit."""
        return None  # By default notices go out after the commit (announce).

    async def announce(self, task_id: str) -> None:
        """Announce once the transaction that recorded the cancel has committed."""
        return None  # By default notices went out in the transaction (announce_in).

    def check_store(self, store: Any) -> None:
        """Raise ``TypeError`` if these notices cannot be announced with ``store``'s writes."""
        return None  # By default any store will do.

    async def tell(self, notice: str) -> None:
        """Send ``notice`` to every replica, outside any cancel (what a replica watches)."""
        try:
            await bounded(self._send(notice), self.heartbeat)
        except Exception:  # Lost, it costs a watched task no more than its next announcement.
            logger.warning("could not send a notice on %s", type(self).__name__, exc_info=True)

    async def _send(self, notice: str) -> None:  # noqa: B027 - optional: channels predating tell()
        """Send ``notice`` on the channel, on its own (a channel without it tells nothing)."""

    @abc.abstractmethod
    def listen(self) -> _Notices:
        """Listen on one connection: yield each task id announced, and None each time the
        listening (re)starts, after which a look at the store sees every cancel announced
        before. Raise when the connection is lost."""


class Member(Protocol):
    """One handler's end of `LocalNotices`: what it is told directly."""

    def noticed(self, notice: str) -> None:
        """A task id announced, or a notice told, by a handler sharing the store."""

    def store_shared(self) -> None:
        """A second handler shares the store: from now on the others may write there."""


class LocalNotices(CancelNotices):
    """Notices between the handlers of this process that share one ``InMemoryTaskStore``.

    Each announcement reaches every handler that joined (`join`) and every listener at once.
    Our handler joins the notices of the in-memory store it is given (`of`); until another
    one joins, or somebody listens, nobody could hear an announcement: none is made (`shared`).
    """

    def __init__(self) -> None:
        super().__init__()
        self.shared = False
        self._members: weakref.WeakSet[Member] = weakref.WeakSet()
        self._listeners: set[asyncio.Queue[str]] = set()

    @classmethod
    def of(cls, store: Any) -> LocalNotices:
        """The notices of the handlers sharing ``store`` (an ``InMemoryTaskStore``): one each."""
        notices = _LOCAL.get(store)
        if notices is None:
            notices = _LOCAL[store] = cls()
        return notices

    def join(self, member: Member) -> None:
        """``member``'s handler uses the store: once a second one does, each is told so."""
        self._members.add(member)
        if len(self._members) < 2:
            return
        told = (member,) if self.shared else tuple(self._members)
        self.shared = True
        for joined in told:
            joined.store_shared()

    async def announce(self, task_id: str) -> None:
        self.deliver(task_id)

    async def _send(self, notice: str) -> None:
        self.deliver(notice)

    def deliver(self, notice: str) -> None:
        """Hand ``notice`` to every handler that joined and every listener, now."""
        for member in tuple(self._members):
            member.noticed(notice)
        for listener in self._listeners:
            listener.put_nowait(notice)

    @contextlib.asynccontextmanager
    async def listen(self) -> AsyncIterator[AsyncIterator[str | None]]:
        heard: asyncio.Queue[str] = asyncio.Queue()
        self._listeners.add(heard)
        self.shared = True  # Somebody hears: announce.
        try:
            yield _heard(heard)
        finally:
            self._listeners.discard(heard)


async def _heard(heard: asyncio.Queue[str]) -> AsyncIterator[str | None]:
    yield None  # Listening from now on.
    while True:
        yield await heard.get()


# The notices of each in-memory store, for as long as the store lives.
_LOCAL: weakref.WeakKeyDictionary[Any, LocalNotices] = weakref.WeakKeyDictionary()


# PostgreSQL's longest identifier (NAMEDATALEN - 1), which a channel name is.
_LONGEST_NAME = 63


class PostgresNotices(CancelNotices):
    """NOTIFY in the transaction that records CANCELED; LISTEN on one pooled connection.

    Args:
        engine: the SQLAlchemy engine of the ``DatabaseTaskStore`` (``postgresql+asyncpg``).
        channel: the NOTIFY channel, the same on every replica.
        heartbeat: as `CancelNotices`'s.

    Raises:
        TypeError: an engine that is not PostgreSQL through asyncpg.
        ValueError: a channel name PostgreSQL would not keep whole (over 63 bytes): its
            ``LISTEN`` truncates it silently while ``pg_notify`` refuses it, so every cancel
            would fail.
        TypeError, ValueError: as `CancelNotices`'s.
    """

    def __init__(self, engine: Any, channel: str = CHANNEL, *, heartbeat: float = HEARTBEAT) -> None:
        dialect = getattr(engine, "dialect", None)
        if dialect is None:
            raise TypeError(
                f"engine must be a SQLAlchemy engine (postgresql+asyncpg), not {type(engine).__name__}"
            )
        if (dialect.name, dialect.driver) != ("postgresql", "asyncpg"):
            raise TypeError(
                f"PostgresNotices needs a postgresql+asyncpg engine, not {dialect.name}+{dialect.driver}; "
                f"{_ELSEWHERE}"
            )
        super().__init__(channel, heartbeat=heartbeat)
        if len(channel.encode()) > _LONGEST_NAME:
            raise ValueError(
                f"the NOTIFY channel must be a name of 1 to {_LONGEST_NAME} bytes (PostgreSQL's "
                f"limit), not {len(channel.encode())}: {channel!r}"
            )
        self.engine = engine
        self.name = f"a2a_cancelfix listening on {channel}"[:63]

    def check_store(self, store: Any) -> None:
        engine = _engine(store)
        if engine is None or engine.dialect.name != "postgresql":
            raise TypeError(
                "PostgresNotices announces in the transactions of a DatabaseTaskStore on PostgreSQL; "
                f"{_ELSEWHERE}"
            )

    async def announce_in(self, session: Any, task_id: str) -> None:
        import sqlalchemy as sa

        await session.execute(sa.select(sa.func.pg_notify(self.channel, task_id)))

    async def _send(self, notice: str) -> None:
        import sqlalchemy as sa

        async with self.engine.begin() as connection:
            await connection.execute(sa.select(sa.func.pg_notify(self.channel, notice)))

    @contextlib.asynccontextmanager
    async def listen(self) -> AsyncIterator[AsyncIterator[str | None]]:
        async with self.engine.connect() as pooled:
            raw = await pooled.get_raw_connection()
            connection = raw.driver_connection  # asyncpg's own: it alone can LISTEN
            ids: asyncio.Queue[str | BaseException] = asyncio.Queue()

            def notified(_connection: Any, _pid: int, _channel: str, task_id: str) -> None:
                ids.put_nowait(task_id)

            def terminated(_connection: Any) -> None:
                ids.put_nowait(ConnectionError("the listening connection was closed"))

            connection.add_termination_listener(terminated)
            # Named, so that an operator sees in pg_stat_activity which connection listens.
            await connection.execute("SELECT set_config('application_name', $1, false)", self.name)
            await connection.add_listener(self.channel, notified)
            try:
                yield self._ids(ids, connection)
            except BaseException:
                await pooled.invalidate()  # Never handed back to the pool half-listening.
                raise
            finally:
                connection.remove_termination_listener(terminated)
            await connection.remove_listener(self.channel, notified)

    async def _ids(
        self, ids: asyncio.Queue[str | BaseException], connection: Any
    ) -> AsyncIterator[str | None]:
        yield None
        while True:
            try:
                item = await bounded(ids.get(), self.heartbeat)
            except TimeoutError:
                await bounded(connection.execute("SELECT 1"), self.heartbeat)
                continue
            if isinstance(item, BaseException):
                raise item
            yield item


class RedisNotices(CancelNotices):
    """PUBLISH once the cancel is committed; SUBSCRIBE on one connection of the client.

    Args:
        client: a ``redis.asyncio.Redis``, the same server for every replica.
        channel: the pub/sub channel.
        heartbeat: as `CancelNotices`'s.

    Raises:
        TypeError: a client without ``publish`` and ``pubsub``.
        TypeError, ValueError: as `CancelNotices`'s.
    """

    def __init__(self, client: Any, channel: str = CHANNEL, *, heartbeat: float = HEARTBEAT) -> None:
        if not all(callable(getattr(client, method, None)) for method in ("publish", "pubsub")):
            raise TypeError(f"client must be a redis.asyncio.Redis, not {type(client).__name__}")
        super().__init__(channel, heartbeat=heartbeat)
        self.client = client

    async def announce(self, task_id: str) -> None:
        # In the background: a Redis that is slow or gone must not hold up the cancel's answer.
        in_background(self._publish(task_id))

    async def _send(self, notice: str) -> None:
        await self.client.publish(self.channel, notice)

    async def _publish(self, task_id: str) -> None:
        try:
            await bounded(self.client.publish(self.channel, task_id), self.heartbeat)
        except Exception:  # The cancel is recorded: losing its notice must not fail it.
            logger.warning(
                "could not announce the cancel of task %s on Redis; the replica running it "
                "learns at its next saved event, or when it ends",
                task_id,
                exc_info=True,
            )

    @contextlib.asynccontextmanager
    async def listen(self) -> AsyncIterator[AsyncIterator[str | None]]:
        pubsub = self.client.pubsub()
        try:
            await pubsub.subscribe(self.channel)
            yield self._ids(pubsub)
        finally:
            await pubsub.aclose()

    async def _ids(self, pubsub: Any) -> AsyncIterator[str | None]:
        subscribed = pinged = False
        while True:
            message = await pubsub.get_message(timeout=self.heartbeat)
            if message is None:
                if pinged:  # A link that looks alive but carries nothing (half-open).
                    raise ConnectionError("Redis did not answer the listening connection's PING")
                await pubsub.ping()  # Its answer comes back as a message: the link is alive.
                pinged = True
                continue
            pinged = False
            if message["type"] == "subscribe":
                if subscribed:
                    # redis-py reconnected and subscribed again by itself: whatever was
                    # published meanwhile is gone. Lost it is, as for any other drop.
                    raise ConnectionError("the listening connection to Redis was re-made")
                subscribed = True
                yield None
            elif message["type"] == "message":
                data = message["data"]
                yield data.decode() if isinstance(data, bytes) else data


def _engine(store: Any) -> Any:
    """The engine of a DatabaseTaskStore, or of the one a VersionedDatabaseTaskStore is made on."""
    return getattr(getattr(store, "as_task_store", store), "engine", None)


# What a store on another database can hear instead (MySQL and SQLite have no NOTIFY).
_ELSEWHERE = "on another database, give a redis.asyncio.Redis client, or None (the replicas poll)"


def notices_for(store: Any, notices: Any) -> CancelNotices | None:
    """The notices ``FinalStateTaskStore(store, notices=...)`` means: ``"postgres"`` (NOTIFY on
    the store's own engine), a ``redis.asyncio.Redis`` client, or notices made here.

    Raises:
        TypeError: anything else, or notices that cannot travel with this store's writes.
    """
    if notices is None:
        return None
    if notices == "postgres":
        engine = _engine(store)
        if engine is None:
            raise TypeError(f"notices='postgres' needs a DatabaseTaskStore on PostgreSQL; {_ELSEWHERE}")
        notices = PostgresNotices(engine)
    elif not isinstance(notices, CancelNotices) and callable(getattr(notices, "pubsub", None)):
        notices = RedisNotices(notices)
    if not isinstance(notices, CancelNotices):
        raise TypeError(
            f"notices must be 'postgres', a redis.asyncio.Redis or CancelNotices, not {notices!r}"
        )
    notices.check_store(store)
    return notices


async def keep_listening(
    notices: CancelNotices,
    noticed: Callable[[str], None],
    listening: Callable[[], None],
    lost: Callable[[], None],
) -> None:
    """Listen until cancelled; after each loss call ``lost`` and listen again, backing off.

    A cancel that a library below swallowed (a notice came in the same loop turn) still ends
    the listening, at the next notice or heartbeat.
    """
    failures = 0
    while True:
        try:
            async with notices.listen() as ids:
                async for task_id in ids:
                    if being_cancelled():
                        raise asyncio.CancelledError
                    if task_id is None:
                        failures = 0
                        listening()
                    else:
                        noticed(task_id)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.warning(
                "lost the connection that listens for cancels (%s); polling until it is back",
                type(notices).__name__,
                exc_info=True,
            )
        if being_cancelled():
            raise asyncio.CancelledError
        lost()
        await asyncio.sleep(RETRY_AFTER[min(failures, len(RETRY_AFTER) - 1)])
        failures += 1
