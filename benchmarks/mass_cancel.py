"""Mass cancel: time and peak memory per task at growing sizes, ours vs stock."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import time
import tracemalloc

from _common import clock, header, in_processes, ratio, settle
from a2a_cancelfix.testing import cancel, make_server
from tests.fleet import FleetExecutor, start_fleet


class CollectorTime:
    """Seconds the cyclic garbage collector has run in this process (its callbacks time it)."""

    def __init__(self) -> None:
        self.total = 0.0
        self._began = 0.0
        gc.callbacks.append(self._timed)

    def _timed(self, phase: str, _: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._began


COLLECTOR = CollectorTime()


async def cancel_all(
    kind: str, count: int, traced: bool, publishes: bool = False
) -> tuple[float, float, float, dict[str, int], float, float, float]:
    """Cancel ``count`` live tasks (half parked) at once.

    Returns the seconds to the last answer, the seconds until every run has closed (no task
    of the server's is left: ours answers before a run closes, stock after only part of it),
    peak bytes per task, the answers, and the process's CPU seconds to the last answer (what
    a shared machine's load moves least), how much of the seconds to the last answer the
    garbage collector ran (see `CollectorTime`), and the seconds to the median answer. Time
    is measured untraced; peak memory in a separate, traced run (tracing slows Python).
    ``publishes``: the executor's ``cancel()`` publishes CANCELED itself.
    """
    idle = len(asyncio.all_tasks())
    server = make_server(kind, FleetExecutor(publishes), push=False, told=False)
    gc.collect()
    if traced:
        tracemalloc.start()
    try:
        streams = await start_fleet(server, count)
        # Each answer's time, CPU time and collector time so far.
        times: list[tuple[float, float, float]] = []

        async def timed(task_id: str) -> str:
            answer = await cancel(server, task_id)
            times.append((clock() - started, time.process_time() - cpu_started, COLLECTOR.total - collected))
            return answer

        started, cpu_started, collected = clock(), time.process_time(), COLLECTOR.total
        answers = await asyncio.gather(*(timed(task_id) for task_id in streams))
        # The last answer's own figures, not the gather's: it returns two loop turns later,
        # after whatever else those turns run (the runs' closing: ours' more than stock's,
        # since ours answers before a run closes).
        answered, cpu, collecting = max(times)
        peak = tracemalloc.get_traced_memory()[1] if traced else 0
    finally:
        tracemalloc.stop()
    await settle(idle)
    closed = clock() - started
    server.executor.released.set()
    await asyncio.wait([stream.task for stream in streams.values()], timeout=60)
    tally: dict[str, int] = {}
    for answer in answers:
        tally[answer] = tally.get(answer, 0) + 1
    return (
        answered,
        closed,
        peak / count,
        tally,
        cpu,
        collecting,
        statistics.median(took for took, _, _ in times),
    )


def measure(count: int) -> dict:
    """One size's figures (a worker process's share): medians of several bursts at small sizes."""
    # A burst of 100 takes tens of milliseconds: one sample says little, so small sizes take
    # the median of several bursts, each kind in turn.
    repeats = max(1, 3000 // count)
    samples: dict[str, list] = {"stock": [], "ours": [], "floor": []}
    for _ in range(repeats):
        for kind in ("stock", "ours"):
            samples[kind].append(asyncio.run(cancel_all(kind, count, traced=False)))
        # The floor: stock whose cancel() publishes CANCELED sends the one event through the
        # SDK's pipeline that ours always sends (so that streams and push see the end).
        samples["floor"].append(asyncio.run(cancel_all("stock", count, traced=False, publishes=True)))
    return {
        "answered": {kind: statistics.median(run[0] for run in runs) for kind, runs in samples.items()},
        "closed": {kind: statistics.median(run[1] for run in runs) for kind, runs in samples.items()},
        "cpu": {kind: statistics.median(run[4] for run in runs) for kind, runs in samples.items()},
        "collector": {kind: statistics.median(run[5] for run in runs) for kind, runs in samples.items()},
        "outside": {
            kind: statistics.median(run[0] - run[5] for run in runs) for kind, runs in samples.items()
        },
        "median": {kind: statistics.median(run[6] for run in runs) for kind, runs in samples.items()},
        "tally": {kind: runs[0][3] for kind, runs in samples.items()},
        "memory": {kind: asyncio.run(cancel_all(kind, count, traced=True))[2] for kind in ("stock", "ours")},
    }


def main(quick: bool) -> None:
    sizes = (100, 1000) if quick else (100, 1000, 10000)
    header(
        "mass cancel: live tasks (half running, half parked) cancelled concurrently; "
        "each size in a process of its own, each row the median of 3,000 / size bursts"
    )
    for count in sizes:
        # A process per size: a heap that earlier bursts have churned slows the full
        # collections that dominate a burst of 10,000.
        row = in_processes(__file__, [str(count)], 1)[0]
        answered, closed, tally, memory = row["answered"], row["closed"], row["tally"], row["memory"]
        s_time, o_time, floor = answered["stock"], answered["ours"], answered["floor"]
        s_mem, o_mem = memory["stock"], memory["ours"]
        print(
            f"{count:6} tasks  stock {s_time:7.3f} s (all closed {closed['stock']:7.3f} s) "
            f"{s_mem / 1024:6.1f} KiB/task {tally['stock']}  "
            f"ours {o_time:7.3f} s ({o_time / count * 1e6:6.0f} us/task, all closed {closed['ours']:7.3f} s) "
            f"{o_mem / 1024:6.1f} KiB/task {tally['ours']}"
        )
        print(
            f"{'':13} time ours/stock {ratio(o_time, s_time)} (all closed {ratio(closed['ours'], closed['stock'])})  "
            f"ours/(stock, cancel() publishes) {ratio(o_time, floor)} "
            f"(all closed {ratio(closed['ours'], closed['floor'])}); "
            f"CPU to the last answer ours/stock {ratio(row['cpu']['ours'], row['cpu']['stock'])} "
            f"ours/floor {ratio(row['cpu']['ours'], row['cpu']['floor'])}"
        )
        collector, outside = row["collector"], row["outside"]
        print(
            f"{'':13} of that, the garbage collector: stock {collector['stock'] / s_time:.0%}, "
            f"ours {collector['ours'] / o_time:.0%}, floor {collector['floor'] / floor:.0%}; "
            f"outside it ours/floor {ratio(outside['ours'], outside['floor'])}"
        )
        median = row["median"]
        print(
            f"{'':13} to the median answer: stock {median['stock']:7.3f} s, ours {median['ours']:7.3f} s, "
            f"floor {median['floor']:7.3f} s; ours/floor {ratio(median['ours'], median['floor'])}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", type=int, metavar="SIZE", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.worker:
        print(json.dumps(measure(arguments.worker)))
    else:
        main(arguments.quick)
