"""What leases cost and bound, on 2, 4 and 8 replica processes sharing PostgreSQL (with NOTIFY).

Each replica is a process of tests/crash_server.py (runs that never end by themselves). For
each size: the liveness traffic, idle and with tasks running (the lease tables' row writes and
reads per second, from PostgreSQL's per-table statistics), what starting a task writes beside
stock's replicas doing the same in the same run, and the bound: from the SIGKILL of a replica
running tasks to the last of them stored FAILED, over a few kills.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

from _common import header
from tests.crash import HEADERS, Replica, Shared, message_params, poll, rpc, shared

LEASE = 7.0  # The least the replicas' grace period (0.5 s) allows with the default margins.
TASKS = 40  # Running during the traffic's second window, spread over the replicas.
PER_KILL = 4  # Tasks running on the replica killed.
LEASE_TABLES = ("a2a_cancelfix_replicas", "a2a_cancelfix_runs")


def environment(handler: str) -> dict[str, str]:
    return {
        "A2ACF_HANDLER": handler,
        "A2ACF_LEASE_TIME": str(LEASE),
        "A2ACF_NOTICES": "postgres",
        "A2ACF_CHANNEL": f"a2acf_bench_{uuid.uuid4().hex[:12]}",
    }


async def table_stats(world: Shared) -> dict[str, dict[str, int]]:
    """Row writes and reads of each table of the world's schema, as PostgreSQL counts them."""
    async with world.engine.connect() as connection:
        await connection.execute(sa.text("SELECT pg_stat_clear_snapshot()"))
        rows = await connection.execute(
            sa.text(
                "SELECT relname, n_tup_ins + n_tup_upd + n_tup_del, seq_scan + coalesce(idx_scan, 0), "
                "seq_tup_read + coalesce(idx_tup_fetch, 0) FROM pg_stat_user_tables WHERE schemaname = :schema"
            ),
            {"schema": world.schema},
        )
        return {row[0]: {"writes": row[1], "scans": row[2], "read": row[3]} for row in rows}


def store_tables(stats: dict[str, dict[str, int]]) -> list[str]:
    """The task store's tables (tasks, push configs): not ours, nor the test's record of states."""
    return [table for table in stats if table not in ("audit", *LEASE_TABLES)]


def delta(after: dict[str, dict[str, int]], before: dict[str, dict[str, int]], tables: Any, key: str) -> int:
    return sum(after.get(t, {}).get(key, 0) - before.get(t, {}).get(key, 0) for t in tables)


async def window(
    world: Shared, seconds: float
) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]:
    """The statistics before and after ``seconds`` of whatever goes on.

    A backend flushes its counts at most once a second, an idle one within 10 s: over a long
    window, what is counted late at its end was counted late at its start too.
    """
    before = await table_stats(world)
    await asyncio.sleep(seconds)
    return before, await table_stats(world)


async def start_tasks(http: httpx.AsyncClient, replicas: list[Replica], count: int) -> list[str]:
    """Start ``count`` tasks round-robin over ``replicas``, answered at once; their ids."""
    ids = []
    for index in range(count):
        replica = replicas[index % len(replicas)]
        params = message_params("go", None, returnImmediately=True)
        response = await http.post(replica.url + "/", json=rpc("SendMessage", params), headers=HEADERS)
        ids.append(response.json()["result"]["task"]["id"])
    return ids


async def all_in(world: Shared, ids: list[str], state: str, seconds: float) -> None:
    await poll(world.states, lambda states: all(states.get(i) == state for i in ids), seconds)


async def measure(handler: str, size: int, seconds: float, kills: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as directory:
        async with shared("postgresql", Path(directory)) as world, httpx.AsyncClient(timeout=30) as http:
            options = environment(handler)
            replicas = list(
                await asyncio.gather(*(Replica.start(world, f"r{i}", **options) for i in range(size)))
            )
            try:
                return await _measure(world, http, replicas, handler, seconds, kills, options)
            finally:
                await asyncio.gather(*(replica.stop() for replica in replicas))


async def _measure(
    world: Shared,
    http: httpx.AsyncClient,
    replicas: list[Replica],
    handler: str,
    seconds: float,
    kills: int,
    options: dict[str, str],
) -> dict[str, Any]:
    result: dict[str, Any] = {}
    # Every replica serves once (ours leases from its first request), then a lease passes.
    await all_in(world, await start_tasks(http, replicas, len(replicas)), "WORKING", 60)
    await asyncio.sleep(LEASE + 11)
    idle = await window(world, seconds)
    started_at = await table_stats(world)
    ids = await start_tasks(http, replicas, TASKS)
    await all_in(world, ids, "WORKING", 60)
    await asyncio.sleep(11)  # The starts' counts flushed.
    busy = await window(world, seconds)
    parts = {"replicas": [LEASE_TABLES[0]], "runs": [LEASE_TABLES[1]], "store": store_tables(busy[0])}
    result["start writes/task"] = {
        part: delta(busy[0], started_at, tables, "writes") / TASKS for part, tables in parts.items()
    }
    for name, (before, after) in (("idle", idle), ("busy", busy)):
        result[name] = {
            part: {key: delta(after, before, tables, key) / seconds for key in ("writes", "scans", "read")}
            for part, tables in parts.items()
        }
    if handler == "ours":
        result["bounds"] = [await kill_one(world, http, replicas, index, options) for index in range(kills)]
    return result


async def kill_one(
    world: Shared, http: httpx.AsyncClient, replicas: list[Replica], index: int, options: dict[str, str]
) -> float:
    """SIGKILL a replica running ``PER_KILL`` tasks; seconds from the signal to the last stored
    FAILED. The replica is started again in its place."""
    slot = index % len(replicas)
    ids = await start_tasks(http, [replicas[slot]], PER_KILL)
    await all_in(world, ids, "WORKING", 60)
    killed_at = time.time()
    await replicas[slot].kill()
    await all_in(world, ids, "FAILED", 3 * LEASE + 30)
    ended = [(await world.history(task_id))[-1].at for task_id in ids]
    replicas[slot] = await Replica.start(world, f"r{slot}", **options)
    await all_in(world, await start_tasks(http, [replicas[slot]], 1), "WORKING", 60)
    return max(ended) - killed_at


def main(quick: bool) -> None:
    sizes, seconds, kills = ((2, 4, 8), 15.0, 2) if quick else ((2, 4, 8), 30.0, 3)
    header(
        f"leases: {', '.join(map(str, sizes))} replica processes on PostgreSQL with NOTIFY, "
        f"lease_time {LEASE:g} s; traffic over {seconds:g} s windows, idle (a task per replica) "
        f"and with {TASKS} more running; the bound from a SIGKILL to the last of its {PER_KILL} tasks stored FAILED"
    )
    for size in sizes:
        ours = asyncio.run(measure("ours", size, seconds, kills))
        stock = asyncio.run(measure("stock", size, seconds, 0))
        bounds = ours["bounds"]
        print(
            f"{size} replicas: bound median {statistics.median(bounds):.2f} s max {max(bounds):.2f} s "
            f"({', '.join(f'{b:.2f}' for b in bounds)}; lease + lease/6 = {LEASE * 7 / 6:.2f} s)"
        )
        for part, what in (("replicas", "beats (replicas table)"), ("runs", "runs table")):
            idle, busy = ours["idle"][part], ours["busy"][part]
            print(
                f"  {what}: {idle['writes']:.2f} row writes/s idle, {busy['writes']:.2f} busy; "
                f"{idle['scans']:.2f} scans/s idle ({idle['read']:.1f} rows read/s), "
                f"{busy['scans']:.2f} busy ({busy['read']:.1f} rows read/s)"
            )
        o, s = ours["start writes/task"], stock["start writes/task"]
        print(
            f"  a task's start, row writes: task store ours {o['store']:.2f} stock {s['store']:.2f}, "
            f"runs table {o['runs']:.2f}: ours/stock {(o['store'] + o['runs']) / s['store']:.2f}; "
            f"the task store while {TASKS} run: ours {ours['busy']['store']['writes']:.2f}/s "
            f"stock {stock['busy']['store']['writes']:.2f}/s"
        )
        sys.stdout.flush()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="shorter windows, fewer kills")
    main(parser.parse_args().quick)
