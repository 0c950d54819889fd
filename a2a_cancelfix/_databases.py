"""What differs between the SQL databases a2a-sdk's stores run on: one entry per dialect.

The guard (store.py) and the leases (_liveness.py) write through these; nothing else of theirs
depends on the database. A fourth database is one more `Dialect` in `DIALECTS`.

- SQLite and PostgreSQL: a guarded save is one upsert, ``INSERT ... ON CONFLICT DO UPDATE ...
  WHERE`` the stored row is live ``RETURNING`` its key.
- Lock waits: a lapsed lease's end (_liveness.py) bounds its own. PostgreSQL: ``SET LOCAL
  lock_timeout`` for its transaction. MySQL and MariaDB: ``innodb_lock_wait_timeout`` is the
  session's, not a transaction's, so its locking read of the task row takes ``NOWAIT`` instead.
  SQLite has no row locks: a writer that holds the file is waited for up to the busy timeout
  (the ``timeout`` connect argument).
- MySQL and MariaDB: no ``RETURNING`` on an upsert, and ``ON DUPLICATE KEY UPDATE`` fires the
  table's UPDATE triggers even where it changes nothing. A guarded save is a conditional
  ``UPDATE`` (it matches no ended row, so fires nothing there), else an ``INSERT`` of a new row,
  else a locking read of the row that is there. Locking reads and writes see the newest
  committed row under InnoDB's REPEATABLE READ, as PostgreSQL's do under READ COMMITTED.

SQLAlchemy is there with a2a-sdk's database extras only: it is imported inside the functions.
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from a2a.server.tasks import DatabaseTaskStore
from a2a.types import TaskState

from a2a_cancelfix import _sdk
from a2a_cancelfix._sdk import state_name

T = TypeVar("T")

# Writes a row's ``values`` where no row is stored yet, or the stored one matches ``live``; True if written.
_SaveUnless = Callable[[Any, Any, Mapping[Any, Any], Any], Awaitable[bool]]
# Bounds every lock wait of the rest of the transaction of a session or connection to ``seconds``.
_BoundLockWaits = Callable[[Any, float], Awaitable[None]]
# Inserts a row's ``values``, or overwrites the ``updated`` columns of the row with its key.
_Upsert = Callable[[Any, Mapping[str, Any], Sequence[str]], Any]


@dataclass(frozen=True)
class Dialect:
    """A database's ways of writing what the guard and the leases write."""

    save_unless: _SaveUnless
    upsert: _Upsert
    # A read before the first write runs outside the transaction's lock (pysqlite opens the
    # transaction at its first write): a no-op write must come first.
    write_opens_transaction: bool = False
    # ``CREATE INDEX IF NOT EXISTS`` is MariaDB's, not MySQL's: the index is created, and an
    # error that it exists (another replica created it first) ignored.
    index_if_not_exists: bool = True
    # Whether an error says the transaction was rolled back whole as a deadlock's victim.
    deadlocked: Callable[[BaseException], bool] = lambda error: False
    # How a lapsed lease's end bounds its lock waits (none: SQLite's busy timeout does), and
    # what its locking read of the task row adds to ``FOR UPDATE`` (``with_for_update``'s
    # keywords), for a database with no such bound over one transaction.
    bound_lock_waits: _BoundLockWaits | None = None
    for_update: Mapping[str, Any] = field(default_factory=dict)
    # Whether an error says a row lock was not had in time (the bound, or NOWAIT).
    lock_unavailable: Callable[[BaseException], bool] = lambda error: False


# How often a transaction a deadlock rolled back is run again: InnoDB picks a victim at once.
DEADLOCK_ATTEMPTS = 5


async def deadlock_retried(dialect: Dialect, transaction: Callable[[], Awaitable[T]]) -> T:
    """``transaction()``, run again where the database rolled it back as a deadlock's victim.

    Under InnoDB's REPEATABLE READ, an UPDATE that finds no row locks the gap where it would be:
    two first writers of one task (two replicas, or a run and a cancel) each hold that gap, and
    each one's INSERT waits for the other's.
    """
    attempt = 1
    while True:
        try:
            return await transaction()
        except Exception as error:
            if attempt >= DEADLOCK_ATTEMPTS or not dialect.deadlocked(error):
                raise
            attempt += 1


def stored_names(states: Any) -> list[str]:
    """The stored ``status.state`` of ``states``: the enum name (1.0 rows), or the v0.3 value ('canceled')."""
    return sorted(name for state in states for name in (TaskState.Name(state), state_name(state).lower()))


def row_values(row: Any) -> dict[Any, Any]:
    """The columns the SDK's merge of ``row`` would write: those the row sets."""
    import sqlalchemy as sa

    mapper = sa.inspect(type(row))
    given = sa.inspect(row).dict
    return {p.columns[0]: getattr(row, p.key) for p in mapper.column_attrs if p.key in given}


def _key(table: Any, values: Mapping[Any, Any]) -> Any:
    import sqlalchemy as sa

    return sa.and_(*(column == values[column] for column in table.primary_key))


@functools.cache
def _insert_of(module: str) -> Any:
    """The ``insert`` of SQLAlchemy's dialect ``module``, with its ``ON CONFLICT``."""
    return importlib.import_module(f"sqlalchemy.dialects.{module}").insert


def _upsert_returning(module: str) -> _SaveUnless:
    """SQLite's and PostgreSQL's one statement: SQLite serialises writers; PostgreSQL locks the
    conflicting row and evaluates the WHERE on its newest committed version."""

    async def save_unless(session: Any, table: Any, values: Mapping[Any, Any], live: Any) -> bool:
        insert = _insert_of(module)(table).values(dict(values))
        statement = insert.on_conflict_do_update(
            index_elements=list(table.primary_key),
            set_={column: insert.excluded[column.key] for column in values if not column.primary_key},
            where=live,
        ).returning(*table.primary_key)
        return (await session.execute(statement)).first() is not None

    return save_unless


async def _update_else_insert(session: Any, table: Any, values: Mapping[Any, Any], live: Any) -> bool:
    """MySQL's and MariaDB's guarded save, in the caller's transaction.

    Its UPDATE and its locking read take the row's lock and judge its newest committed version;
    two first writers of one row meet at the primary key, the second told it is a duplicate
    (under a savepoint, so that its transaction goes on), then judging the first's row.
    """
    import sqlalchemy as sa
    from sqlalchemy.exc import IntegrityError

    key = _key(table, values)
    changed = {column: value for column, value in values.items() if not column.primary_key}
    for _ in range(3):  # A row inserted, then deleted, by others between our statements: again.
        # SQLAlchemy's MySQL drivers count the rows matched (CLIENT.FOUND_ROWS), not changed.
        if (await session.execute(sa.update(table).where(key, live).values(changed))).rowcount:
            return True
        try:
            async with session.begin_nested():
                await session.execute(sa.insert(table).values(dict(values)))
            return True
        except IntegrityError:
            pass  # A row is there, which the UPDATE did not match, or which came since.
        stored = (await session.execute(sa.select(live).where(key).with_for_update())).first()
        if stored is not None and not stored[0]:
            return False
    raise RuntimeError(f"the row of {dict(values)!r} kept changing under a guarded save")


def _on_conflict(module: str) -> _Upsert:
    def upsert(table: Any, values: Mapping[str, Any], updated: Sequence[str]) -> Any:
        insert = _insert_of(module)(table).values(dict(values))
        return insert.on_conflict_do_update(
            index_elements=[column.name for column in table.primary_key],
            set_={name: insert.excluded[name] for name in updated},
        )

    return upsert


def _on_duplicate_key(table: Any, values: Mapping[str, Any], updated: Sequence[str]) -> Any:
    from sqlalchemy.dialects import mysql

    insert = mysql.insert(table).values(dict(values))
    return insert.on_duplicate_key_update({name: insert.inserted[name] for name in updated})


def _mysql_deadlocked(error: BaseException | None) -> bool:
    """Whether ``error`` is a deadlock, or came of one: a deadlock inside a savepoint rolls the
    whole transaction back, and the savepoint's own rollback then fails (1305, no savepoint)."""
    while error is not None:
        if _error_code(error) == _MYSQL_DEADLOCK:
            return True
        error = error.__context__
    return False


async def _lock_timeout(session: Any, seconds: float) -> None:
    """PostgreSQL's ``lock_timeout``, for this transaction only (``SET LOCAL``), in ms."""
    import sqlalchemy as sa

    await session.execute(sa.text(f"SET LOCAL lock_timeout = {max(1, math.ceil(seconds * 1000))}"))


def _postgresql_lock_unavailable(error: BaseException) -> bool:
    """SQLSTATE 55P03 (lock_not_available): ``lock_timeout``, or ``NOWAIT``."""
    return getattr(getattr(error, "orig", None), "sqlstate", None) == "55P03"


def _mysql_lock_unavailable(error: BaseException) -> bool:
    """1205 (a lock wait timed out: MariaDB's ``NOWAIT`` too), or MySQL's 3572 (``NOWAIT``)."""
    return _error_code(error) in (_MYSQL_LOCK_WAIT_TIMEOUT, _MYSQL_LOCK_NOWAIT)


_MYSQL = Dialect(
    _update_else_insert,
    _on_duplicate_key,
    index_if_not_exists=False,
    deadlocked=_mysql_deadlocked,
    for_update={"nowait": True},
    lock_unavailable=_mysql_lock_unavailable,
)

# By SQLAlchemy's dialect name: ``mysql+aiomysql://`` and ``mysql+asyncmy://`` are "mysql",
# ``mariadb+...://`` is "mariadb"; the SQL is the same.
DIALECTS: dict[str, Dialect] = {
    "sqlite": Dialect(_upsert_returning("sqlite"), _on_conflict("sqlite"), write_opens_transaction=True),
    "postgresql": Dialect(
        _upsert_returning("postgresql"),
        _on_conflict("postgresql"),
        bound_lock_waits=_lock_timeout,
        lock_unavailable=_postgresql_lock_unavailable,
    ),
    "mysql": _MYSQL,
    "mariadb": _MYSQL,
}


def known(engine: Any) -> bool:
    """Whether ``engine``'s database has an entry here."""
    return engine.dialect.name in DIALECTS


def engine_of(store: Any) -> Any | None:
    """The engine ``store`` writes with: a ``DatabaseTaskStore``'s (a subclass's too) or, on
    a2a-sdk 1.2+, a ``VersionedDatabaseTaskStore``'s; None for any other store."""
    if isinstance(store, DatabaseTaskStore):
        return _sdk.database_engine(store)
    if _sdk.is_versioned_database_store(store):
        return _sdk.versioned_engine(store)
    return None


def dialect_of(engine: Any, what: str) -> Dialect:
    """The entry of ``engine``'s database; TypeError, naming ``what`` needs it, where none is."""
    name = engine.dialect.name
    dialect = DIALECTS.get(name)
    if dialect is None:
        supported = ", ".join(sorted(DIALECTS))
        raise TypeError(f"{what} runs on {supported}, not {name}")
    return dialect


def create_index(connection: Any, index: Any, dialect: Dialect) -> None:
    """Create ``index`` unless it exists (a synchronous connection, as ``run_sync`` gives)."""
    import sqlalchemy as sa

    if dialect.index_if_not_exists:
        connection.execute(sa.schema.CreateIndex(index, if_not_exists=True))
        return
    try:
        connection.execute(sa.schema.CreateIndex(index))
    except sa.exc.OperationalError as error:
        if _error_code(error) != _MYSQL_DUPLICATE_KEY_NAME:
            raise


_MYSQL_DUPLICATE_KEY_NAME = 1061
_MYSQL_DEADLOCK = 1213
_MYSQL_LOCK_WAIT_TIMEOUT = 1205
_MYSQL_LOCK_NOWAIT = 3572


def _error_code(error: BaseException) -> int | None:
    """The MySQL error number of a SQLAlchemy ``DBAPIError`` (PyMySQL's first argument)."""
    arguments = getattr(getattr(error, "orig", None), "args", ())
    return arguments[0] if arguments and isinstance(arguments[0], int) else None
