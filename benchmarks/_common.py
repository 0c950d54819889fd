"""What the benchmarks share: handlers built the same way, timing, and a report line."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from a2a.helpers import new_task
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events.event_queue import EventQueue
from a2a.server.tasks import TaskUpdater
from a2a.types import SendMessageRequest, TaskState

from a2a_cancelfix._sdk import SDK_VERSION

if TYPE_CHECKING:
    from a2a_cancelfix.testing import Server, Stream

logging.basicConfig(level=logging.CRITICAL)
# The suite's helpers some benchmarks share (tests/fleet.py): the repository root is importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class QuickExecutor(AgentExecutor):
    """Creates the task, reports WORKING and completes: the work a hot path carries."""

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        task_id, context_id = context.task_id or "", context.context_id or ""
        await event_queue.enqueue_event(new_task(task_id, context_id, TaskState.TASK_STATE_SUBMITTED))
        updater = TaskUpdater(event_queue, task_id, context_id)
        await updater.start_work()
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        return None


async def started(server: Server) -> Stream:
    """`start`'s wait on a server built with ``make_server(told=False)``: the executor is
    mid-step and the sender's stream has shown WORKING, which the SDK streams once it has
    saved it. (The kit's ear on the store, which `start` waits on, would be counted for one
    handler and not the other: a wrapper around stock's store, a callback of ours' guard.)"""
    # Imported here: hot_path_instructions.py's workers hold the handlers they count, not the kit.
    from a2a_cancelfix.testing import Stream, message, within

    stream = Stream(server.calls.send_stream(SendMessageRequest(message=message()), "alice"))
    await within(server.executor.step.reached.wait())
    await stream.until(lambda: stream.last == "WORKING")
    return stream


def header(title: str) -> None:
    print(f"\n== {title} (a2a-sdk {SDK_VERSION})")


def interleaved(
    measure: Callable[[str], Awaitable[float]], rounds: int
) -> tuple[dict[str, list[float]], list[float]]:
    """Measure stock and ours ``rounds`` times each, in pairs, alternating which goes first.

    Returns each kind's measurements and the ratio ours/stock of each pair: a pair runs back
    to back, so the drift of a shared machine mostly cancels out within it.
    """
    results: dict[str, list[float]] = {"stock": [], "ours": []}
    for index in range(rounds):
        for kind in ("stock", "ours") if index % 2 == 0 else ("ours", "stock"):
            results[kind].append(asyncio.run(measure(kind)))
    return results, [ours / stock for ours, stock in zip(results["ours"], results["stock"], strict=True)]


def in_processes(script: str, arguments: list[str], processes: int) -> list[Any]:
    """Run ``script --worker ARGUMENTS`` in ``processes`` processes; the JSON each printed last.

    Each process has a hash seed of its own: one process's memory layout moves every
    handler's speed by a few percent, more than the differences measured.
    """
    shares = []
    for seed in range(processes):
        command = [sys.executable, script, "--worker", *arguments]
        environment = {**os.environ, "PYTHONHASHSEED": str(seed)}
        output = subprocess.run(command, env=environment, capture_output=True, text=True, check=True)
        shares.append(json.loads(output.stdout.strip().splitlines()[-1]))
    return shares


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def clock() -> float:
    return time.perf_counter()


def ratio(ours: float, stock: float) -> str:
    return f"{ours / stock:.3f}" if stock else "n/a"


async def settle(idle: int = 1, turns: int = 10_000_000) -> None:
    """Let the loop run until only ``idle`` tasks are left (what the runs still had to do,
    closing down, is done), or ``turns`` have passed."""
    for _ in range(turns):
        if len(asyncio.all_tasks()) <= idle:
            return
        await asyncio.sleep(0)
