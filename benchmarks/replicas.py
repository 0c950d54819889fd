"""Cancels across replicas sharing a task store (SQLite file, PostgreSQL): how fast the running
replica notices, polling or told by a notice (PostgreSQL NOTIFY, Redis pub/sub), how many store
reads the watching adds, and whether a cancel racing the run's completion ever answers other
than the store holds or overwrites a terminal state (docs/replicas.md: its set-up and cluster mode)."""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import tempfile
import uuid
from pathlib import Path

import sqlalchemy as sa
from a2a.server.tasks import DatabaseTaskStore
from sqlalchemy.ext.asyncio import create_async_engine

from _common import clock, header, percentile
from a2a_cancelfix import FinalStateTaskStore, _sdk, checkpoint
from a2a_cancelfix.testing import Gate, ScriptedExecutor, cancel, make_server, start, stored
from a2a_cancelfix.testing.waits import in_own_loop

REDIS_URL = "redis://127.0.0.1:6379/0"

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
    return (
        "postgresql+asyncpg://postgres@127.0.0.1:5432/test",
        {"server_settings": {"search_path": schema}},
        schema,
    )


async def drop(schema: str | None) -> None:
    if schema:
        import asyncpg

        admin = await asyncpg.connect("postgresql://postgres@127.0.0.1:5432/test")
        await admin.execute(f'DROP SCHEMA "{schema}" CASCADE')
        await admin.close()


def store(url: str, connect_args: dict, mode: str = "poll") -> FinalStateTaskStore:
    """One replica's store, its own engine; ``mode`` "notify" or "redis" gives it notices."""
    engine = create_async_engine(url, connect_args=connect_args)
    notices = None
    if mode == "notify":
        notices = "postgres"
    elif mode == "redis":
        import redis.asyncio as redis

        notices = redis.Redis.from_url(REDIS_URL)
    return FinalStateTaskStore(DatabaseTaskStore(engine), notices=notices)


async def close(*stores: FinalStateTaskStore) -> None:
    for each in stores:
        await each.wrapped.engine.dispose()
        client = getattr(each.notices, "client", None)
        if client is not None:
            await client.aclose()


def rearm(executor: ScriptedExecutor) -> None:
    """Let one executor run a fresh task: its gates and events anew."""
    executor.step, executor.ready, executor.stopped = Gate(), asyncio.Event(), asyncio.Event()


async def listening(server) -> None:
    """Wait until the replica hears its notices: it then polls no more (a benchmark may poll)."""
    while server.handler.agent_executor.cancel_lifecycle.remote.interval != math.inf:  # noqa: ASYNC110
        await asyncio.sleep(0.005)  # Nothing signals it: the watch sets its interval when it hears.


async def observation(kind: str, mode: str, interval: float, samples: int) -> list[float]:
    """Seconds from B's cancel answering CANCELED to A's run having stopped."""
    url, connect_args, schema = await databases(kind)
    store_a, store_b = store(url, connect_args, mode), store(url, connect_args, mode)
    await store_a.wrapped.initialize()
    executor = SteppingExecutor()
    a = make_server("ours", executor, store=store_a, push=False, replica_poll_interval=interval)
    b = make_server("ours", ScriptedExecutor(), store=store_b, push=False, replica_poll_interval=interval)
    latencies = []
    try:
        for sample in range(samples + 1):
            rearm(executor)
            stream = await start(a)  # Held: a stream nobody reads would hold the run open.
            if mode != "poll" and sample == 0:
                await listening(a)  # The first sample only warms the listener up.
            assert await cancel(b, executor.task_id) == "CANCELED"
            answered = clock()
            await asyncio.wait_for(executor.stopped.wait(), interval + 10)
            if mode == "poll" or sample > 0:
                latencies.append(clock() - answered)
            await asyncio.wait_for(stream.ended(), 10)
    finally:
        await a.handler.aclose()
        await close(store_a, store_b)
        await drop(schema)
    return latencies[-samples:]


async def reads_per_task_second(kind: str, mode: str, interval: float, tasks: int, seconds: float) -> float:
    """Store reads that watching adds, per running task per second."""
    url, connect_args, schema = await databases(kind)
    shared = store(url, connect_args, mode)
    await shared.wrapped.initialize()
    try:
        executor = SteppingExecutor()
        a = make_server("ours", executor, store=shared, push=False, replica_poll_interval=interval)
        wrapper = a.handler.agent_executor
        original, reads = wrapper.cancel_lifecycle.remote.read_for, 0

        async def counted(context):
            nonlocal reads
            reads += 1
            return await original(context)

        wrapper.cancel_lifecycle.remote.read_for = counted
        streams = []
        for _ in range(tasks):
            executor.step = type(executor.step)()
            streams.append(await start(a))
        if mode != "poll":
            await listening(a)
        reads = 0
        await asyncio.sleep(seconds)  # The measurement window.
        rate = reads / tasks / seconds
        for stream in streams:
            await cancel(a, stream.events[0].id)
        await a.handler.aclose()
        return rate
    finally:
        await close(shared)
        await drop(schema)


class Finisher(ScriptedExecutor):
    """Completes the task as soon as its step opens: the run's side of a race with a cancel."""


async def races(kind: str, setup: str, handler: str, rounds: int) -> tuple[int, int, int]:
    """Race B's cancel against A's completion ``rounds`` times, the cancel up to 4 ms before or
    after the run is let go. Returns (cancels that won, answers unlike the store, terminal
    states overwritten), the last counted by a trigger on the tasks table."""
    url, connect_args, schema = await databases(kind)
    engines = [create_async_engine(url, connect_args=connect_args) for _ in "ab"]
    servers = []
    for engine in engines:
        executor = Finisher()
        if setup == "cluster":
            from a2a.server.cluster import DatabaseTaskEventStream, VersionedDatabaseTaskStore

            sdk_store = VersionedDatabaseTaskStore(engine)
            await sdk_store.initialize()
            the_store = FinalStateTaskStore(sdk_store) if handler == "ours" else sdk_store
            stream = DatabaseTaskEventStream(engine, poll_interval_s=0.05)
            await stream.initialize()
            servers.append(make_server(handler, executor, store=the_store, push=False, event_stream=stream))
        else:
            sdk_store = DatabaseTaskStore(engine)
            await sdk_store.initialize()
            the_store = FinalStateTaskStore(sdk_store) if handler == "ours" else sdk_store
            servers.append(make_server(handler, executor, store=the_store, push=False))
    a, b = servers
    await audit(engines[0])
    won = differ = 0
    try:
        for _ in range(rounds):
            rearm(a.executor)
            stream = await start(a)
            task_id = a.executor.task_id or ""
            # Where in the window the cancel lands: up to 4 ms before the run is let go, or after.
            lead = random.uniform(-0.004, 0.004)
            if lead > 0:
                a.executor.step.open()
                await asyncio.sleep(lead)
            cancelling = asyncio.ensure_future(cancel(b, task_id))
            if lead <= 0:
                await asyncio.sleep(-lead)
                a.executor.step.open()
            answer = await asyncio.wait_for(cancelling, 10)
            await asyncio.wait_for(a.executor.stopped.wait(), 10)
            await asyncio.wait_for(stream.ended(), 10)
            final = await _settled(a, task_id)
            won += answer == "CANCELED"
            differ += answer != final and not (answer == "TaskNotCancelable" and final != "CANCELED")
        overwritten = await _overwrites(engines[0])
    finally:
        for server in servers:
            if hasattr(server.handler, "aclose"):
                await server.handler.aclose()
        for engine in engines:
            await engine.dispose()
        await drop(schema)
    return won, differ, overwritten


async def _settled(server, task_id: str) -> str:
    """The stored state once the run has closed (or after a second: what it holds then)."""
    for _ in range(100):
        if await _sdk.live_task(server.handler, task_id) is None:
            break
        await asyncio.sleep(0.01)
    return await stored(server, task_id)


_TERMINAL = ("TASK_STATE_COMPLETED", "TASK_STATE_CANCELED", "TASK_STATE_FAILED", "TASK_STATE_REJECTED")


async def audit(engine) -> None:
    """A trigger that records every update of a stored terminal state (the measurement only)."""
    async with engine.begin() as connection:
        await connection.execute(sa.text("CREATE TABLE audit (id TEXT, was TEXT, now TEXT)"))
        if engine.dialect.name == "sqlite":
            await connection.execute(
                sa.text(
                    "CREATE TRIGGER audit_tasks AFTER UPDATE ON tasks BEGIN INSERT INTO audit VALUES "
                    "(new.id, json_extract(old.status, '$.state'), json_extract(new.status, '$.state')); END"
                )
            )
        else:
            await connection.execute(
                sa.text(
                    "CREATE FUNCTION audit_tasks() RETURNS trigger AS $$ BEGIN INSERT INTO audit VALUES "
                    "(NEW.id, OLD.status::json->>'state', NEW.status::json->>'state'); RETURN NEW; END $$ "
                    "LANGUAGE plpgsql"
                )
            )
            await connection.execute(
                sa.text(
                    "CREATE TRIGGER audit_tasks AFTER UPDATE ON tasks FOR EACH ROW EXECUTE FUNCTION audit_tasks()"
                )
            )


async def _overwrites(engine) -> int:
    """Updates that replaced a terminal state with another state."""
    names = ", ".join(f"'{name}'" for name in _TERMINAL)
    async with engine.connect() as connection:
        rows = await connection.execute(
            sa.text(f"SELECT count(*) FROM audit WHERE was IN ({names}) AND now != was")
        )
        return rows.scalar_one()


def main(quick: bool) -> None:
    samples = 10 if quick else 40
    rounds = 20 if quick else 100
    header(f"cancel across replicas: B cancels, A (checkpoint every {STEP * 1e3:.0f} ms) notices")
    configurations = [
        (kind, "poll", interval) for kind in ("sqlite", "postgresql") for interval in (0.1, 0.5, 1.0)
    ]
    configurations += [("postgresql", "notify", 1.0), ("sqlite", "redis", 1.0), ("postgresql", "redis", 1.0)]
    for kind, mode, interval in configurations:
        latencies = in_own_loop(observation, kind, mode, interval, samples)
        p50, p99 = percentile(latencies, 0.5), percentile(latencies, 0.99)
        reads = in_own_loop(reads_per_task_second, kind, mode, interval, 5 if quick else 20, 2 * interval + 1)
        how = f"poll {interval:4.1f} s" if mode == "poll" else f"{mode:6} (poll {interval:.1f} s as fallback)"
        print(
            f"{kind:10} {how:30}: A notices p50 {p50 * 1e3:6.1f} ms, p99 {p99 * 1e3:6.1f} ms; "
            f"{reads:.2f} store reads per running task per second"
        )
    header(
        f"cancel racing completion, {rounds} races each: cancels won, answers unlike the store, overwrites"
    )
    setups = ["readme"] + (["cluster"] if _sdk.HAS_CLUSTER else [])
    for setup in setups:
        for kind in ("sqlite", "postgresql"):
            for handler in ("stock", "ours"):
                won, differ, overwritten = in_own_loop(races, kind, setup, handler, rounds)
                print(
                    f"{setup:8} {kind:10} {handler:5}: {won:3} of {rounds} cancels won, "
                    f"{differ} answers unlike the store, {overwritten} terminal states overwritten"
                )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    main(parser.parse_args().quick)
