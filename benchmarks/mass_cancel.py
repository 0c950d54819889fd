"""Mass cancel: time and peak memory per task at growing sizes, ours vs stock."""

from __future__ import annotations

import argparse
import asyncio
import gc
import tracemalloc

from _common import clock, header, ratio
from a2a_cancelfix.testing import cancel, make_server
from a2a_cancelfix.testing.executors import FleetExecutor
from a2a_cancelfix.testing.servers import start_fleet


async def cancel_all(
    kind: str, count: int, traced: bool, publishes: bool = False
) -> tuple[float, float, dict[str, int]]:
    """Cancel ``count`` live tasks (half parked) at once: seconds, peak bytes per task, answers.

    Time is measured untraced; peak memory in a separate, traced run (tracing slows Python).
    ``publishes``: the executor's ``cancel()`` publishes CANCELED itself.
    """
    server = make_server(kind, FleetExecutor(publishes), push=False)
    gc.collect()
    if traced:
        tracemalloc.start()
    try:
        streams = await start_fleet(server, count)
        started = clock()
        answers = await asyncio.gather(*(cancel(server, task_id) for task_id in streams))
        elapsed = clock() - started
        peak = tracemalloc.get_traced_memory()[1] if traced else 0
    finally:
        tracemalloc.stop()
    server.executor.released.set()
    await asyncio.wait([stream.task for stream in streams.values()], timeout=60)
    tally: dict[str, int] = {}
    for answer in answers:
        tally[answer] = tally.get(answer, 0) + 1
    return elapsed, peak / count, tally


def main(quick: bool) -> None:
    sizes = (100, 1000) if quick else (100, 1000, 10000)
    header("mass cancel: live tasks (half running, half parked) cancelled concurrently")
    for count in sizes:
        rows = {kind: asyncio.run(cancel_all(kind, count, traced=False)) for kind in ("stock", "ours")}
        memory = {kind: asyncio.run(cancel_all(kind, count, traced=True))[1] for kind in ("stock", "ours")}
        # The floor: stock whose cancel() publishes CANCELED sends the one event through the
        # SDK's pipeline that ours always sends (so that streams and push see the end).
        floor = asyncio.run(cancel_all("stock", count, traced=False, publishes=True))[0]
        (s_time, _, s_tally), (o_time, _, o_tally) = rows["stock"], rows["ours"]
        s_mem, o_mem = memory["stock"], memory["ours"]
        print(
            f"{count:6} tasks  stock {s_time:7.3f} s {s_mem / 1024:6.1f} KiB/task {s_tally}  "
            f"ours {o_time:7.3f} s ({o_time / count * 1e6:6.0f} us/task) {o_mem / 1024:6.1f} KiB/task {o_tally}  "
            f"time ours/stock {ratio(o_time, s_time)}  ours/(stock, cancel() publishes) {ratio(o_time, floor)}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    main(parser.parse_args().quick)
