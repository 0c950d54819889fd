"""Where one cancel's time goes, by event-loop step: stock vs ours, medians of many cancels.

Each cancel (a task mid-step, on an otherwise idle loop, as `cancel_latency.py` times it) is
cut into the loop's steps that run between its request and its answer: a task's step is named
by its coroutine ("wake main" is the request's own task), a callback by its name. For each
step, in the order they run, its median start (from the request) and its median length.
The request's first step, already running when the clock starts, shows as the gap before the
first line, and its last one, which answers, as the gap after the last line. Timing every
step slows the loop a little, for both handlers alike; one handler's cancels run after the
other's, so the ratio printed is the layout's, not a figure to quote (`cancel_latency.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import asyncio.events
import collections
import statistics
import time
from typing import Any

from _common import header, settle, started
from a2a_cancelfix.testing import ScriptedExecutor, cancel, make_server

_run = asyncio.events.Handle._run
_steps: list[tuple[str, int, int]] | None = None  # (name, start, length) while a cancel is timed


def _name(handle: asyncio.Handle) -> str:
    callback: Any = handle._callback  # type: ignore[attr-defined]
    task = getattr(callback, "__self__", None)
    if isinstance(task, asyncio.Task):
        return "wake " + getattr(task.get_coro(), "__qualname__", "?")
    return getattr(callback, "__qualname__", type(callback).__name__)


def _timed_run(handle: asyncio.Handle) -> None:
    steps = _steps
    if steps is None:
        _run(handle)
        return
    began = time.perf_counter_ns()
    _run(handle)
    steps.append((_name(handle), began, time.perf_counter_ns() - began))


async def schedules(kind: str, mode: str, count: int) -> tuple[list[int], list[list[tuple[str, int, int]]]]:
    """``count`` cancels' totals and steps (starts relative to the request), the first 10 left out."""
    global _steps
    totals, runs = [], []
    for index in range(count + 10):
        server = make_server(kind, ScriptedExecutor(cancel=mode), push=False, told=False)
        await started(server)
        steps: list[tuple[str, int, int]] = []
        _steps, began = steps, time.perf_counter_ns()
        await cancel(server, server.executor.task_id)
        total, _steps = time.perf_counter_ns() - began, None
        if index >= 10:
            totals.append(total)
            runs.append([(name, start - began, length) for name, start, length in steps])
        server.executor.step.open()
        await settle(turns=10_000)
    return totals, runs


def report(kind: str, totals: list[int], runs: list[list[tuple[str, int, int]]]) -> None:
    starts, lengths = collections.defaultdict(list), collections.defaultdict(list)
    for steps in runs:
        seen: collections.Counter[str] = collections.Counter()
        for name, start, length in steps:
            seen[name] += 1
            starts[name, seen[name]].append(start)
            lengths[name, seen[name]].append(length)
    print(f"{kind}: median {statistics.median(totals) / 1e3:.0f} us from request to answer")
    for key in sorted(starts, key=lambda key: statistics.median(starts[key])):
        if len(starts[key]) * 2 > len(runs):  # A step most cancels take.
            name, nth = key
            print(
                f"  +{statistics.median(starts[key]) / 1e3:5.0f} us  {statistics.median(lengths[key]) / 1e3:5.1f} us"
                f"  {name}{f' ({nth})' if nth > 1 else ''}"
            )


async def main(mode: str, count: int) -> None:
    header(f"one cancel's loop steps, cancel() {mode}, medians of {count}")
    asyncio.events.Handle._run = _timed_run  # type: ignore[method-assign]
    try:
        results = {kind: await schedules(kind, mode, count) for kind in ("stock", "ours")}
    finally:
        asyncio.events.Handle._run = _run  # type: ignore[method-assign]
    for kind, (totals, runs) in results.items():
        report(kind, totals, runs)
    stock, ours = (statistics.median(results[kind][0]) for kind in ("stock", "ours"))
    print(f"ours/stock {ours / stock:.3f} (timed, in sequence)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mode", choices=("publish", "empty"), default="publish")
    parser.add_argument("--count", type=int, default=150)
    arguments = parser.parse_args()
    asyncio.run(main(arguments.mode, arguments.count))
