"""Helpers the tests share, beyond a2a_cancelfix.testing's waits (Gate, within, Changes,
wait_all_tasks_blocked, eventually)."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import logging
import tomllib
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import wrapt
from a2a.types import TaskState

from a2a_cancelfix.testing import Gate, Report

ROOT = Path(__file__).parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def noxfile_list(name: str) -> list[str]:
    """A list or string constant of noxfile.py (which imports nox, not installed in the suite)."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            value = ast.literal_eval(node.value)
            return [value] if isinstance(value, str) else list(value)
    raise LookupError(name)


def tasks_since(before: set[asyncio.Task[Any]]) -> set[asyncio.Task[Any]]:
    """The tasks started since ``before`` was taken that have not ended, but the caller's own."""
    return asyncio.all_tasks() - before - {asyncio.current_task()}


async def set_within(event: asyncio.Event, seconds: float) -> bool:
    """Whether ``event`` is set within ``seconds``: for an event that a timer may cause."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(event.wait(), seconds)
    return event.is_set()


@contextlib.contextmanager
def logged(text: str, logger: str = "a2a_cancelfix") -> Iterator[asyncio.Event]:
    """An event, set once ``logger`` emits a record whose message contains ``text``.

    The logger's level must let the record through (``caplog.at_level``).
    """
    loop = asyncio.get_running_loop()
    event = asyncio.Event()

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if text in record.getMessage():
                loop.call_soon_threadsafe(event.set)

    handler = Seen()
    logging.getLogger(logger).addHandler(handler)
    try:
        yield event
    finally:
        logging.getLogger(logger).removeHandler(handler)


class CompletionHeld(wrapt.ObjectProxy):  # type: ignore[misc]
    """A task store whose next save of COMPLETED waits at ``gate``."""

    def __init__(self, store: Any) -> None:
        super().__init__(store)
        self._self_gate = Gate()

    @property
    def gate(self) -> Gate:
        return self._self_gate

    async def save(self, task: Any, *args: Any, **kwargs: Any) -> None:
        if task.status.state == TaskState.TASK_STATE_COMPLETED and not self._self_gate.reached.is_set():
            await self._self_gate()
        await self.__wrapped__.save(task, *args, **kwargs)


def told(report: Report) -> str:
    """A failing sweep's broken promises first, then its table: a CI log may keep only the start."""
    broken = [f"{row.moment} ({row.origin}): {'; '.join(row.failures)}" for row in report.failures]
    return "\n".join([*broken, "", str(report)])


async def drop_schema(admin: Any, schema: str) -> None:
    """Drop a test's PostgreSQL schema, whose connections name themselves after it
    (``application_name``): those still open are ended first, so that none left holding a
    lock (behind a frozen proxy, in a process that never exited) can hold the drop."""
    await admin.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE application_name = $1 AND pid <> pg_backend_pid()",
        schema,
    )
    await admin.execute("SET lock_timeout = '20s'")
    await admin.execute(f'DROP SCHEMA "{schema}" CASCADE')


# MariaDB (or MySQL) on this machine: user root, empty password. A test gets a database of its own.
MYSQL_HOST, MYSQL_PORT = "127.0.0.1", 3306
# Server-side bounds, as PostgreSQL's schema gets: no statement or lock wait can hang a test.
MYSQL_SESSION = "SET SESSION innodb_lock_wait_timeout = 20, SESSION max_statement_time = 20"


async def mysql_admin() -> Any:
    """A connection to MariaDB as root, or a skip saying it is unreachable."""
    import aiomysql  # a2a-sdk's mysql extra
    import pytest

    try:
        return await asyncio.wait_for(
            aiomysql.connect(host=MYSQL_HOST, port=MYSQL_PORT, user="root", autocommit=True), 5
        )
    except (TimeoutError, OSError, aiomysql.Error) as error:
        pytest.skip(f"MariaDB at {MYSQL_HOST}:{MYSQL_PORT} is unreachable: {error!r}")


@contextlib.asynccontextmanager
async def mysql_database(prefix: str) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """A MariaDB database of its own for one test: its SQLAlchemy URL and connect arguments.
    Dropped afterwards, once the connections still in it are ended (as `drop_schema` does)."""
    name = await create_mysql_database(prefix)
    try:
        url = f"mysql+aiomysql://root@{MYSQL_HOST}:{MYSQL_PORT}/{name}"
        yield url, {"connect_timeout": 5, "init_command": MYSQL_SESSION}
    finally:
        await drop_mysql_database(name)


async def create_mysql_database(prefix: str) -> str:
    """A new MariaDB database's name."""
    admin = await mysql_admin()
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    try:
        async with admin.cursor() as cursor:
            await cursor.execute(f"CREATE DATABASE `{name}`")
    finally:
        admin.close()
    return name


async def drop_mysql_database(name: str) -> None:
    """Drop a MariaDB database, once the connections still in it are ended."""
    admin = await mysql_admin()
    try:
        async with admin.cursor() as cursor:
            await cursor.execute(
                "SELECT id FROM information_schema.processlist WHERE db = %s AND id <> CONNECTION_ID()",
                (name,),
            )
            for (connection_id,) in await cursor.fetchall():
                with contextlib.suppress(Exception):  # Gone since.
                    await cursor.execute(f"KILL {int(connection_id)}")
            await cursor.execute("SET SESSION lock_wait_timeout = 20")
            await cursor.execute(f"DROP DATABASE `{name}`")
    finally:
        admin.close()
