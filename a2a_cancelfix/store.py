"""Make a terminal state final, enforced by the task store itself.

``FinalStateTaskStore(store)`` is the ``TaskStore`` to hand the handler: once the stored task
is COMPLETED, FAILED, CANCELED or REJECTED, every later ``save`` of it is refused (logged, and
returning normally: the SDK saves from its event consumer, where an exception would leave the
run or its streams hanging). The check and the write are one step of the wrapped store, never
a read then a write in Python (see `_database_write`, `_memory_save`, `_versioned_write`).
get, list and delete go straight to the wrapped store, owner scoping included.

A subclass of the SDK's ``TaskStore``, not a wrapt proxy: a proxy would pass
``isinstance(store, DatabaseTaskStore)`` and hand out the wrapped engine, past the guard.
On a2a-sdk 1.2+ the SDK wraps it in ``LegacyTaskStoreAdapter``, whose ``save`` calls ours once,
so every write still meets the guard; over a ``VersionedDatabaseTaskStore`` it is itself a
``VersionedTaskStore`` (upstream's cluster mode).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from a2a.server.context import ServerCallContext
from a2a.server.tasks import DatabaseTaskStore, InMemoryTaskStore, TaskStore
from a2a.types import (
    ListTasksRequest,
    ListTasksResponse,
    Task,
    TaskState,
)

from a2a_cancelfix import _databases, _sdk, _telemetry
from a2a_cancelfix._databases import row_values, stored_names
from a2a_cancelfix._sdk import CANCELED, TERMINAL_STATES
from a2a_cancelfix.notices import LocalNotices, notices_for

if TYPE_CHECKING:
    from a2a_cancelfix.notices import CancelNotices

logger = logging.getLogger("a2a_cancelfix")

__all__ = ["FinalStateTaskStore"]

# Writes ``task`` unless the stored copy is terminal; returns None, or the stored state.
_Write = Callable[[Task, ServerCallContext], Awaitable[int | None]]
# A whole guarded save: the write, then what a recorded cancel or a refusal calls for.
_Save = Callable[[Task, ServerCallContext], Awaitable[None]]
# Called in the transaction that records CANCELED, with its session and the task id.
_Announce = Callable[[Any, str], Awaitable[None]]


_TERMINAL_NAMES = stored_names(TERMINAL_STATES)


class FinalStateTaskStore(TaskStore):
    """Wrap a ``DatabaseTaskStore`` or an ``InMemoryTaskStore`` so that a terminal state is final.

    ``DefaultRequestHandler(executor, FinalStateTaskStore(DatabaseTaskStore(engine)), ...)``.
    On a2a-sdk 1.2+ it also wraps a ``VersionedDatabaseTaskStore`` (upstream's cluster mode),
    and is then a ``VersionedTaskStore`` itself; so is a subclass of it, whose own methods
    come first. A store of your own is guarded through its ``save_unless_final`` (docs/stores.md);
    without one it raises ``TypeError``: the guard would be a read then a write, a race.

    Args:
        notices: how a recorded cancel is pushed to the replica running the task (see
            notices.py): ``"postgres"`` (NOTIFY on this store's engine), a
            ``redis.asyncio.Redis`` client, or a ``CancelNotices``; None polls only.
    """

    def __init__(self, store: Any, *, notices: CancelNotices | str | Any | None = None) -> None:
        if _sdk.is_versioned_database_store(store) and not isinstance(self, _sdk.VersionedTaskStore):
            # Here, not in __new__: a subclass's own __init__ may make the store it wraps.
            self.__class__ = _versioned_class(type(self))
        self.wrapped = store
        self.notices = notices_for(store, notices)
        self._told_refused: list[Callable[[str, ServerCallContext], None]] = []  # See `subscribe`.
        self._told_saved: list[Callable[[str], None]] = []
        self._guarded = self._guard(store)
        # The SDK saves every event and reads the task on every request: bound here, each is
        # one call, not a method that calls another (a subclass's own methods still come first).
        if type(self).save is FinalStateTaskStore.save:
            self.save = self._guarded  # type: ignore[method-assign]
        if type(self).get is FinalStateTaskStore.get:
            self.get = store.get  # type: ignore[method-assign]

    def _guard(self, store: Any) -> Any:
        """The guarded save for ``store``; TypeError for a store it cannot guard in one step."""
        if _save_unless_final_of(store) is not None:  # A store of the user's own (docs/stores.md).
            return _conditional_save(store, self)
        if isinstance(store, DatabaseTaskStore):
            write = _database_write(store, self._announce_in)

            async def save(task: Task, context: ServerCallContext) -> None:
                await self._saved(task, await write(task, context), context)

            return save
        if isinstance(store, InMemoryTaskStore):
            return _memory_save(store, self)
        raise TypeError(
            "FinalStateTaskStore wraps a DatabaseTaskStore or an InMemoryTaskStore (or, on a2a-sdk "
            f"1.2+, a VersionedDatabaseTaskStore), or a store with a method {_SAVE_UNLESS_FINAL}(task, "
            f"context): {type(store).__name__} has none. Give it one (docs/stores.md), or hand the "
            "store to DefaultRequestHandler as it is, which guards it within this process only"
        )

    def subscribe(
        self,
        *,
        refused: Callable[[str, ServerCallContext], None] | None = None,
        saved: Callable[[str], None] | None = None,
    ) -> Callable[[], None]:
        """Be told a task's id: ``refused``, for each save refused over the end it holds (another
        replica ended the task), with the context of the refused save (whose owner may read
        the task); ``saved``, after each save, written or refused (for waits on what the
        store shows). Returns what ends the subscription."""
        told: list[tuple[list[Any], Any]] = [
            (listeners, listener)
            for listeners, listener in ((self._told_refused, refused), (self._told_saved, saved))
            if listener is not None
        ]
        for listeners, listener in told:
            listeners.append(listener)

        def unsubscribe() -> None:
            for listeners, listener in told:
                if listener in listeners:
                    listeners.remove(listener)

        return unsubscribe

    def save(self, task: Task, context: ServerCallContext) -> Awaitable[None]:  # type: ignore[override]
        """Save ``task``, unless the stored task is terminal: then log and leave it as it is."""
        # What a subclass's save reaches through super(); the store's own is bound in __init__.
        return self._guarded(task, context)  # type: ignore[no-any-return]

    async def _saved(self, task: Task, stored: int | None, context: ServerCallContext) -> None:
        """After a guarded write (``stored``: the terminal state that refused it, or None):
        announce a recorded cancel, or report the refusal."""
        if stored is not None:
            self._refused(task, stored, context)
        elif task.status.state == CANCELED and self.notices is not None:
            await self.notices.announce(task.id)
        self._tell_saved(task)

    def _tell_saved(self, task: Task) -> None:
        for saved in self._told_saved:
            saved(task.id)

    def _refused(self, task: Task, stored: int, context: ServerCallContext) -> None:
        """Tell our handler, and log, that a save over the ended task was refused."""
        for refused in self._told_refused:
            refused(task.id, context)
        _telemetry.save_refused(task.id, TaskState.Name(stored), TaskState.Name(task.status.state))
        logger.log(
            _refusal_level(stored, task.status.state),
            "refused save task=%s stored=%s refused=%s: a terminal state is final",
            task.id,
            TaskState.Name(stored),
            TaskState.Name(task.status.state),
        )

    async def _announce_in(self, session: Any, task_id: str) -> None:
        """Announce a cancel in the transaction that records it (PostgreSQL's NOTIFY)."""
        if self.notices is not None:
            await self.notices.announce_in(session, task_id)

    # Reads and deletes are the wrapped store's own coroutines, handed on (get is bound to it
    # in __init__).

    def get(  # type: ignore[override]
        self, task_id: str, context: ServerCallContext
    ) -> Awaitable[Task | None]:
        """Get the task from the wrapped store, scoped to the caller as it scopes it."""
        return self.wrapped.get(task_id, context)  # type: ignore[no-any-return]

    def list(  # type: ignore[override]
        self, params: ListTasksRequest, context: ServerCallContext
    ) -> Awaitable[ListTasksResponse]:
        """List the caller's tasks from the wrapped store."""
        return self.wrapped.list(params, context)  # type: ignore[no-any-return]

    def delete(self, task_id: str, context: ServerCallContext) -> Awaitable[None]:  # type: ignore[override]
        """Delete the task from the wrapped store (a delete is not a save: it is not refused)."""
        return self.wrapped.delete(task_id, context)  # type: ignore[no-any-return]


def _refusal_level(stored: int, refused: int) -> int:
    """How loud a refused save is: a cancel that raced the run is how a cancel reaches another
    replica, routine; something else saved over an ended task is worth a look."""
    if stored == refused:
        return logging.DEBUG  # A replica records a cancel another one stored.
    if CANCELED in (stored, refused):
        return logging.INFO
    return logging.WARNING


_SAVE_UNLESS_FINAL = "save_unless_final"
"""The method a store of the user's own implements to be guarded across processes (docs/stores.md):
``async def save_unless_final(self, task, context) -> TaskState | None``, which writes ``task``
unless the stored one is terminal, in one atomic step of its backend, and returns None when it
wrote, else the stored terminal state."""


def _save_unless_final_of(store: Any) -> Callable[[Task, ServerCallContext], Awaitable[int | None]] | None:
    """``store``'s own conditional write, if it has one."""
    method = getattr(store, _SAVE_UNLESS_FINAL, None)
    return method if callable(method) else None


def _conditional_save(store: Any, guard: FinalStateTaskStore) -> _Save:
    """The guarded save through ``store``'s own ``save_unless_final``, run to its end once begun
    (landing late, it still meets the store's own condition)."""
    whole = _to_the_end(getattr(store, _SAVE_UNLESS_FINAL))

    async def save(task: Task, context: ServerCallContext) -> None:
        stored = await whole(task, context)
        if stored is not None and stored not in TERMINAL_STATES:
            raise TypeError(
                f"{_SAVE_UNLESS_FINAL} returned {stored!r} for task {task.id}: it returns None when it "
                "wrote the task, else the stored terminal state (docs/stores.md)"
            )
        await guard._saved(task, stored, context)

    return save


def guardable(store: Any) -> bool:
    """Whether a `FinalStateTaskStore` can wrap ``store``: exactly one of the SDK's stores (the
    guard writes through their insides, past a subclass's own save) on a database it knows, or
    one with a ``save_unless_final``."""
    if type(store) is InMemoryTaskStore:
        return True
    if type(store) is DatabaseTaskStore or _sdk.is_versioned_database_store(store):
        return _databases.known(_databases.engine_of(store))
    return _save_unless_final_of(store) is not None


def _database_write(store: DatabaseTaskStore, announce_in: _Announce) -> _Write:
    """Return the guarded write for a DatabaseTaskStore: one transaction, on the SDK's own row.

    The row is written where the stored ``status ->> 'state'`` is NULL or not terminal, in the
    database's own way (`_databases`); the state is stored as the enum name, or as the v0.3
    value in an older row: both count. Nothing written means refused.
    """
    # SQLAlchemy is only there with a2a-sdk's database extras, so it is imported here.
    import sqlalchemy as sa

    dialect = _databases.dialect_of(store.engine, "FinalStateTaskStore's guard")

    async def write(task: Task, context: ServerCallContext) -> int | None:
        await store.initialize()  # creates the table once, as the SDK's save does
        row = _sdk.database_row(store, task, context)
        table = sa.inspect(type(row)).local_table

        async def transaction() -> int | None:
            async with _sdk.database_transaction(store) as session:
                if await dialect.save_unless(session, table, row_values(row), _live(table)):
                    if task.status.state == CANCELED:
                        await announce_in(session, task.id)
                    return None
                # Only for the WARNING: the write above has already decided.
                model = type(row)
                kept = await session.scalar(sa.select(model).where(model.id == task.id))
                if kept is None:  # deleted by another writer between the two statements
                    return TaskState.TASK_STATE_UNSPECIFIED
                return _sdk.task_from_row(store, kept).status.state

        return await _databases.deadlock_retried(dialect, transaction)

    return _to_the_end(write)


def _live(table: Any) -> Any:
    """Whether a stored task row is not terminal. A row without a state (MessageToDict omits
    UNSPECIFIED) is not terminal, but NOT IN alone would read its NULL as terminal."""
    import sqlalchemy as sa

    stored_state = table.c.status["state"].as_string()
    return sa.or_(stored_state.is_(None), stored_state.not_in(_TERMINAL_NAMES))


def _to_the_end(write: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """``write``, run to its end even when its caller is cancelled (the caller still leaves).

    A transaction cut mid-statement can leave its connection holding SQLite's write lock
    (pysqlite keeps a statement not run to its end alive), so that no later write lands. Run
    whole, it commits or rolls back; landing late, it still meets the guard.
    """

    async def to_the_end(*args: Any) -> Any:
        work = asyncio.ensure_future(write(*args))
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            _left_behind.add(work)
            work.add_done_callback(_ended_behind)
            raise

    return to_the_end


_left_behind: set[asyncio.Future[Any]] = set()  # Writes whose caller left, referenced to their end.


def _ended_behind(work: asyncio.Future[Any]) -> None:
    _left_behind.discard(work)
    error = None if work.cancelled() else work.exception()
    if isinstance(error, Exception) and not isinstance(error, _Refused):
        logger.warning("a save whose caller had left failed: %r", error)


def _memory_save(store: InMemoryTaskStore, guard: FinalStateTaskStore) -> _Save:
    """Return the guarded save for an InMemoryTaskStore: check and write under its lock.

    The store's own lock (a ``threading.RLock``, or an ``asyncio.Lock`` before 1.1.3, which it
    never holds across an await): code that never awaits is atomic either way.
    """
    memory = _sdk.memory_tasks(store)
    tasks, lock, owner_of, copying = memory.tasks, memory.lock, memory.owner_resolver, memory.copying
    # Notices that only this process's handlers hear: nothing to announce until two share it.
    local = guard.notices if isinstance(guard.notices, LocalNotices) else None
    announcing = guard.notices is not None and local is None

    async def save(task: Task, context: ServerCallContext) -> None:
        # Every save of every message comes through here: no call of ours inside, and each
        # protobuf field read once (each read builds a Python object).
        owner = owner_of(context)
        with lock:  # Nothing inside awaits.
            owned = tasks.get(owner)
            if owned is None:
                owned = tasks[owner] = {}
            task_id = task.id
            kept = owned.get(task_id)
            stored = None if kept is None else kept.status.state
            if stored not in TERMINAL_STATES:
                stored = None
                if copying:  # As the SDK's CopyingTaskStoreAdapter stores it.
                    kept = Task()
                    kept.CopyFrom(task)
                    owned[task_id] = kept
                else:
                    owned[task_id] = task
        if stored is not None or announcing or (local is not None and local.shared):
            await guard._saved(task, stored, context)
        elif guard._told_saved:
            guard._tell_saved(task)

    return save


class _Refused(Exception):
    """Raised inside a guarded versioned save to roll it back: the stored task has ended."""

    def __init__(self, state: int, version: Any) -> None:
        super().__init__(state)
        self.state, self.version = state, version


def _versioned_write(store: Any, announce_in: _Announce) -> Any:
    """Return the guarded versioned save for a VersionedDatabaseTaskStore (a2a-sdk 1.2+).

    Its ``_save_once``, with the lock taken first (``FOR UPDATE``; on SQLite a no-op UPDATE,
    so that the transaction holds the write lock) and the stored state checked under it.
    Returns the new TaskVersion, or raises `_Refused` (nothing written: no task row, no
    version, no journal row) or, as the SDK's does, ConcurrentTaskModificationError for a
    stale version. A refused save of another end raises that too (the SDK reloads and tells
    its subscribers the stored task); any other refusal returns the stored version, and our
    handler cancels the run (``subscribe``).
    """
    import sqlalchemy as sa

    dialect = _databases.dialect_of(_sdk.versioned_engine(store), "FinalStateTaskStore's guard")
    versions, journal = _sdk.version_model(store), _sdk.journal_model(store)
    TaskVersion, Conflict = _sdk.TaskVersion, _sdk.ConcurrentTaskModificationError  # noqa: N806 (classes)

    async def save_once(task: Task, event: Any, prev_version: Any, owner: str) -> Any:
        row = _sdk.versioned_row(store, task, owner)
        this = sa.and_(versions.task_id == task.id, versions.owner == owner)
        async with _sdk.versioned_transaction(store) as session:
            if dialect.write_opens_transaction:
                # pysqlite opens the transaction at the first write only: a SELECT before it
                # would read outside it, and another writer could commit between that read
                # and this write. A no-op write first takes SQLite's write lock for it all.
                await session.execute(sa.update(versions).where(this).values(version=versions.version))
            # As the SDK's save: the version row is locked before the task row.
            stored_version = await _sdk.lock_version(store, session, task.id, owner)
            current = await _sdk.current_task(store, session, task.id, owner)
            if current is not None and current.status.state in TERMINAL_STATES:
                raise _Refused(current.status.state, TaskVersion(stored_version or 0))
            if task.status.state == CANCELED:  # Over any live state, unversioned, as the SDK's.
                if current is None:
                    raise Conflict(task.id)
                new_version = (stored_version or 0) + 1
                if stored_version is None:
                    await _sdk.insert_version(store, session, task.id, owner, new_version)
                else:
                    await session.execute(sa.update(versions).where(this).values(version=new_version))
            elif prev_version.is_missing:
                new_version = 1
                await _sdk.insert_version(store, session, task.id, owner, new_version)
            else:
                expected = _sdk.version_number(prev_version)
                new_version = expected + 1
                swapped = await session.execute(
                    sa.update(versions).where(this, versions.version == expected).values(version=new_version)
                )
                if swapped.rowcount == 0:
                    raise Conflict(task.id)
            await session.merge(row)
            if event is not None:
                entry = _sdk.journal_entry(event)
                await session.execute(
                    sa.insert(journal).values(
                        task_id=task.id, owner=owner, task_version=new_version, event_data=entry
                    )
                )
            if task.status.state == CANCELED:
                await announce_in(session, task.id)
        return TaskVersion(new_version)

    return _to_the_end(save_once)


@functools.cache
def _versioned_class(base: type[FinalStateTaskStore]) -> type[FinalStateTaskStore]:
    """``base`` (FinalStateTaskStore or a subclass) as a VersionedTaskStore too, made once per
    class, on a release that has one. A subclass's own methods come first."""
    if base is not FinalStateTaskStore:
        attributes = {"__module__": base.__module__, "__doc__": base.__doc__}
        return type(f"Versioned{base.__name__}", (base, _versioned_class(FinalStateTaskStore)), attributes)
    from sqlalchemy.exc import DBAPIError  # There with a2a-sdk's database extras only.

    # Before 1.2.0 (no cluster layer) the checker knows the second base only as Any.
    class VersionedFinalStateTaskStore(FinalStateTaskStore, _sdk.VersionedTaskStore):  # type: ignore[misc, unused-ignore]
        """``FinalStateTaskStore(VersionedDatabaseTaskStore(engine))``: see `_versioned_write`."""

        def _guard(self, store: Any) -> Any:
            return _versioned_write(store, self._announce_in)

        async def save(  # type: ignore[override]
            self,
            task: Task,
            *,
            event: Any = None,
            prev: Task | None = None,
            prev_version: Any,
            context: ServerCallContext,
        ) -> Any:
            """The wrapped store's versioned save, refused over a stored terminal state."""
            del prev
            store = self.wrapped
            await _sdk.versioned_tables_ready(store)
            owner = _sdk.versioned_owner(store, context)
            attempts, (most, delay) = 0, _sdk.save_retries(store)
            while True:  # Transient contention is retried, as the SDK's save does.
                attempts += 1
                try:
                    version = await self._guarded(task, event, prev_version, owner)
                    break
                except _Refused as refused:
                    self._tell_saved(task)
                    return self._refused_versioned(task, refused, context)
                except DBAPIError as error:
                    if not _sdk.is_transient(error) or attempts >= most:
                        raise
                    await asyncio.sleep(delay * attempts)
            if task.status.state == CANCELED and self.notices is not None:
                await self.notices.announce(task.id)
            self._tell_saved(task)
            return version

        def _refused_versioned(self, task: Task, refused: _Refused, context: ServerCallContext) -> Any:
            self._refused(task, refused.state, context)
            state = task.status.state
            if state in TERMINAL_STATES and state != refused.state:
                # Another end than the stored one: the SDK's signal to reload and tell its
                # subscribers the stored task (its consumer), or answer with it (a cancel).
                raise _sdk.ConcurrentTaskModificationError(task.id)
            # Nothing to reload: a live update is moot (our handler cancels the run), the
            # same end is the stored one. The SDK's consumer goes on, and publishes it.
            return refused.version

        async def get(self, task_id: str, context: ServerCallContext) -> Any:
            """The task with its version (a ``StoredTask``), as the wrapped store has it."""
            return await self.wrapped.get(task_id, context)

    VersionedFinalStateTaskStore.__qualname__ = VersionedFinalStateTaskStore.__name__
    return VersionedFinalStateTaskStore
