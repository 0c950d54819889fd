"""Cancels across replicas sharing a task store (SQLite file, PostgreSQL): how fast the running
replica notices, against the poll interval, and how many store reads the watching adds."""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import uuid
from pathlib import Path

from a2a.server.tasks import DatabaseTaskStore
from sqlalchemy.ext.asyncio import create_async_engine

from _common import clock, header, percentile, run
from a2a_cancelfix import FinalStateTaskStore, checkpoint
from a2a_cancelfix.testing import ScriptedExecutor, cancel, make_server, start

STEP = 0.005  # seconds of work between two checkpoints


class SteppingExecutor(ScriptedExecutor):
    """Works in short steps, with a checkpoint after each, until cancelled."""

    async def _work_step(self) -> None:
        self.step.reached.set()
        while True:
            await asyncio.sleep(STEP)
            await checkpoint()


async def databases(kind: str):
    if kind == "sqlite":
        path = Path(tempfile.mkdtemp()) / "tasks.db"
        return f"sqlite+aiosqlite:///{path}", {}, None
    import asyncpg

    schema = f"a2acf_bench_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect("postgresql://postgres@127.0.0.1:5432/test")
    await admin.execute(f'CREATE SCHEMA "{schema}"')
    await admin.close()
    return "postgresql+asyncpg://postgres@127.0.0.1:5432/test", {"server_settings": {"search_path": schema}}, schema


async def drop(schema: str | None) -> None:
    if schema:
        import asyncpg

        admin = await asyncpg.connect("postgresql://postgres@127.0.0.1:5432/test")
        await admin.execute(f'DROP SCHEMA "{schema}" CASCADE')
        await admin.close()


def store(url: str, connect_args: dict) -> FinalStateTaskStore:
    return FinalStateTaskStore(DatabaseTaskStore(create_async_engine(url, connect_args=connect_args)))


async def close(*stores: FinalStateTaskStore) -> None:
    for each in stores:
        await each.wrapped.engine.dispose()


async def observation(kind: str, interval: float, samples: int) -> list[float]:
    """Seconds from B's cancel answering CANCELED to A's run having stopped."""
    url, connect_args, schema = await databases(kind)
    store_a, store_b = store(url, connect_args), store(url, connect_args)  # one engine each
    await store_a.wrapped.initialize()
    latencies = []
    try:
        for _ in range(samples):
            a = make_server("ours", SteppingExecutor(), store=store_a, push=False,
                            replica_poll_interval=interval)
            b = make_server("ours", ScriptedExecutor(), store=store_b, push=False,
                            replica_poll_interval=interval)
            await start(a)
            assert await cancel(b, a.executor.task_id) == "CANCELED"
            answered = clock()
            await asyncio.wait_for(a.executor.stopped.wait(), interval + 10)
            latencies.append(clock() - answered)
    finally:
        await close(store_a, store_b)
        await drop(schema)
    return latencies


async def reads_per_task_second(kind: str, interval: float, tasks: int, seconds: float) -> float:
    """Store reads that watching adds, per running task per second."""
    url, connect_args, schema = await databases(kind)
    shared = store(url, connect_args)
    await shared.wrapped.initialize()
    try:
        executor = SteppingExecutor()
        a = make_server("ours", executor, store=shared, push=False, replica_poll_interval=interval)
        wrapper = a.handler.agent_executor
        original, reads = wrapper.cancel_lifecycle.read_stored, 0

        async def counted(context):
            nonlocal reads
            reads += 1
            return await original(context)

        wrapper.cancel_lifecycle.read_stored = counted
        streams = []
        for _ in range(tasks):
            executor.step = type(executor.step)()
            streams.append(await start(a))
        reads = 0
        await asyncio.sleep(seconds)  # The measurement window.
        rate = reads / tasks / seconds
        for stream in streams:
            await cancel(a, stream.events[0].id)
        return rate
    finally:
        await close(shared)
        await drop(schema)


def main(quick: bool) -> None:
    samples = 10 if quick else 40
    header(f"cancel across replicas: B cancels, A (checkpoint every {STEP * 1e3:.0f} ms) notices")
    for kind in ("sqlite", "postgresql"):
        for interval in (0.1, 0.5, 1.0):
            latencies = run(observation(kind, interval, samples))
            p50, p99 = percentile(latencies, 0.5), percentile(latencies, 0.99)
            reads = run(reads_per_task_second(kind, interval, 5 if quick else 20, 2 * interval + 1))
            print(
                f"{kind:10} poll {interval:4.1f} s: A notices p50 {p50 * 1e3:6.0f} ms, p99 {p99 * 1e3:6.0f} ms "
                f"(bound: poll + step = {(interval + STEP) * 1e3:.0f} ms); "
                f"{reads:.2f} store reads per running task per second (1/poll = {1 / interval:.2f})"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    main(parser.parse_args().quick)
