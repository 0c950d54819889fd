"""A task's saves through `FinalStateTaskStore` beside the SDK's own `DatabaseTaskStore.save`, on
each database the guard knows (SQLite, PostgreSQL, MariaDB): the time per save of a task's
updates (the row there, the common case) and of its first save (the row inserted), ours over
stock, measured in the same run, alternating rounds so that neither gets the warmer database.

    python benchmarks/guarded_save.py [--saves 400] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from a2a.server.context import ServerCallContext
from a2a.server.tasks import DatabaseTaskStore
from a2a.types import Task, TaskState, TaskStatus
from sqlalchemy.ext.asyncio import create_async_engine

from _common import header
from a2a_cancelfix import FinalStateTaskStore
from tests.support import create_mysql_database, drop_mysql_database  # _common makes tests importable

WORKING = TaskState.TASK_STATE_WORKING


async def per_save(store: object, saves: int, *, first: bool) -> float:
    """Seconds per save: ``saves`` updates of one task, or the first saves of ``saves`` tasks."""
    context = ServerCallContext()
    task_id = uuid.uuid4().hex
    started = time.perf_counter()
    for n in range(saves):
        task = Task(
            id=uuid.uuid4().hex if first else task_id, context_id="c", status=TaskStatus(state=WORKING)
        )
        task.metadata.update({"step": n})
        await store.save(task, context)  # type: ignore[attr-defined]
    return (time.perf_counter() - started) / saves


async def measure(url: str, saves: int, rounds: int) -> dict[str, float]:
    engine = create_async_engine(url)
    try:
        stock = DatabaseTaskStore(engine)
        await stock.initialize()
        ours = FinalStateTaskStore(DatabaseTaskStore(engine))
        times: dict[str, list[float]] = {}
        for _ in range(rounds):
            for first in (False, True):
                for name, store in (("stock", stock), ("ours", ours)):
                    key = f"{name} {'first' if first else 'update'}"
                    times.setdefault(key, []).append(await per_save(store, saves, first=first))
        return {key: statistics.median(values) for key, values in times.items()}
    finally:
        await engine.dispose()


async def main(saves: int, rounds: int) -> None:
    header(f"a task's saves, guarded over stock ({saves} saves, median of {rounds} rounds)")
    with_mysql = await create_mysql_database("a2acf_bench")
    try:
        with tempfile.TemporaryDirectory() as directory:
            urls = {
                "SQLite": f"sqlite+aiosqlite:///{Path(directory) / 'tasks.db'}",
                "PostgreSQL": "postgresql+asyncpg://postgres@127.0.0.1:5432/test",
                "MariaDB": f"mysql+aiomysql://root@127.0.0.1:3306/{with_mysql}",
            }
            for name, url in urls.items():
                found = await measure(url, saves, rounds)
                for kind in ("update", "first"):
                    stock, ours = found[f"stock {kind}"], found[f"ours {kind}"]
                    print(
                        f"{name:<11} {kind:<7} stock {stock * 1e3:6.2f} ms  ours {ours * 1e3:6.2f} ms  "
                        f"ours/stock {ours / stock:.2f}"
                    )
    finally:
        await drop_mysql_database(with_mysql)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--saves", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    arguments = parser.parse_args()
    asyncio.run(main(arguments.saves, arguments.rounds))
