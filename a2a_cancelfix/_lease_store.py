"""What a replica's leases (_liveness.py) read and write in a guarded database store: its
tasks still running, and FAILED over a task whose run died with its process."""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Any

from a2a.server.context import ServerCallContext
from a2a.types import Message, Part, Role, Task, TaskState, TaskStatus, TaskStatusUpdateEvent

from a2a_cancelfix import _databases, _sdk
from a2a_cancelfix._databases import row_values, stored_names
from a2a_cancelfix.store import FinalStateTaskStore

# What runs, or is about to: the states a task whose process died is ended from.
_RUNNING = (TaskState.TASK_STATE_SUBMITTED, TaskState.TASK_STATE_WORKING)
_RUNNING_NAMES = stored_names(_RUNNING)


class LeaseStore:
    """What a replica's leases (_liveness.py) need of a guarded database store: its engine, its
    task table, the owner it files a caller's tasks under, and FAILED written over a task whose
    run died with its process, in the caller's transaction.

    Args:
        guard: a `FinalStateTaskStore` over a ``DatabaseTaskStore`` or, on a2a-sdk 1.2+, a
            ``VersionedDatabaseTaskStore``.
    """

    def __init__(self, guard: FinalStateTaskStore) -> None:
        store = guard.wrapped
        self.notices = guard.notices
        self._versioned = store if _sdk.is_versioned_database_store(store) else None
        self._database = store if self._versioned is None else _sdk.versioned_database(store)
        self.engine = _sdk.database_engine(self._database)
        self.model = _sdk.database_model(self._database)
        self.table_name: str = self.model.__table__.name
        self.dialect = _databases.dialect_of(self.engine, "a replica's leases")

    @classmethod
    def of(cls, store: Any) -> LeaseStore | None:
        """The lease store of ``store`` (the one a handler was given), if it is a guarded database
        store on a database with an entry in `_databases`."""
        if not isinstance(store, FinalStateTaskStore):
            return None
        engine = _databases.engine_of(store.wrapped)
        return cls(store) if engine is not None and _databases.known(engine) else None

    def owner(self, context: ServerCallContext) -> str:
        return _sdk.database_owner(self._database, context)

    def transaction(self) -> Any:
        """A session in a transaction on the store's engine (``async with``)."""
        return _sdk.database_transaction(self._database)

    async def ready(self) -> None:
        """Create the store's own tables, as its first save would."""
        if self._versioned is not None:
            await _sdk.versioned_tables_ready(self._versioned)
        else:
            await _sdk.database_ready(self._database)

    async def running(self, session: Any) -> list[tuple[str, str]]:
        """The id and owner of every task stored SUBMITTED or WORKING."""
        import sqlalchemy as sa

        model = self.model
        rows = await session.execute(
            sa.select(model.id, model.owner).where(model.status["state"].as_string().in_(_RUNNING_NAMES))
        )
        return [(task_id, owner) for task_id, owner in rows]

    async def running_among(self, connection: Any, task_ids: Collection[str]) -> dict[str, bool]:
        """Of ``task_ids``, those stored: whether each is SUBMITTED or WORKING."""
        import sqlalchemy as sa

        model = self.model
        state = model.status["state"].as_string()
        rows = await connection.execute(
            sa.select(model.id, state.in_(_RUNNING_NAMES)).where(model.id.in_(list(task_ids)))
        )
        return {task_id: bool(running) for task_id, running in rows}

    async def fail(
        self, session: Any, task_id: str, owner: str, why: str, *, bounded: bool = False
    ) -> Task | None:
        """In ``session``'s transaction, which holds the write lock (SQLite) or locks the rows
        it reads (PostgreSQL, MySQL): FAILED, with ``why`` as its status message, over the task
        if it is stored SUBMITTED or WORKING. The task as written, or None: nothing was.

        ``bounded``: the locking read takes the database's ``Dialect.for_update`` (MySQL's
        ``NOWAIT``): a row another transaction holds fails it, for a later pass to retry.
        """
        if self._versioned is not None:
            return await self._fail_versioned(session, task_id, owner, why)
        import sqlalchemy as sa

        model, database = self.model, self._database
        kept = await session.scalar(
            sa.select(model)
            .where(model.id == task_id, model.owner == owner)
            .with_for_update(**(self.dialect.for_update if bounded else {}))
        )
        if kept is None:
            return None
        failed = _failed(_sdk.task_from_row(database, kept), why)
        if failed is None:
            return None
        row = _sdk.database_row_of(database, failed, owner)
        table = sa.inspect(type(row)).local_table
        values = row_values(row)
        written = await session.execute(
            sa.update(table)
            .where(
                table.c.id == task_id,
                table.c.owner == owner,
                table.c.status["state"].as_string().in_(_RUNNING_NAMES),
            )
            .values({column: value for column, value in values.items() if not column.primary_key})
        )
        return failed if written.rowcount == 1 else None

    async def _fail_versioned(self, session: Any, task_id: str, owner: str, why: str) -> Task | None:
        """As `fail`, for a VersionedDatabaseTaskStore: as its save, the version row locked,
        bumped, the task merged, and the end journaled for the streams that tail it."""
        import sqlalchemy as sa

        store = self._versioned
        versions, journal = _sdk.version_model(store), _sdk.journal_model(store)
        stored_version = await _sdk.lock_version(store, session, task_id, owner)
        current = await _sdk.current_task(store, session, task_id, owner)
        failed = None if current is None else _failed(current, why)
        if failed is None:
            return None
        new_version = (stored_version or 0) + 1
        if stored_version is None:
            await _sdk.insert_version(store, session, task_id, owner, new_version)
        else:
            this = sa.and_(versions.task_id == task_id, versions.owner == owner)
            await session.execute(sa.update(versions).where(this).values(version=new_version))
        await session.merge(_sdk.versioned_row(store, failed, owner))
        event = TaskStatusUpdateEvent(task_id=task_id, context_id=failed.context_id, status=failed.status)
        await session.execute(
            sa.insert(journal).values(
                task_id=task_id, owner=owner, task_version=new_version, event_data=_sdk.journal_entry(event)
            )
        )
        return failed


def _failed(task: Task, why: str) -> Task | None:
    """``task`` FAILED, ``why`` its status message, if it is SUBMITTED or WORKING; else None."""
    if task.status.state not in _RUNNING:
        return None
    failed = Task()
    failed.CopyFrom(task)
    status = TaskStatus(
        state=TaskState.TASK_STATE_FAILED,
        message=Message(
            role=Role.ROLE_AGENT,
            message_id=f"{task.id}-failed",
            task_id=task.id,
            context_id=task.context_id,
            parts=[Part(text=why)],
        ),
    )
    status.timestamp.FromNanoseconds(time.time_ns())
    failed.status.CopyFrom(status)
    return failed
