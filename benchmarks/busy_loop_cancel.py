"""Cancels of plain asyncio runs (no checkpoint) on a busy loop: does each run stop? ours vs stock.

Each run awaits a 2 ms model call per step, publishing nothing between, while 30 other tasks
keep the loop busy, so that a run woken from its await often waits in the loop's queue when
the cancel comes. Per handler: how many runs took more than one step after the cancel was
asked (the SDK's own cancel stops a run at its next await), the most steps any took, and the
slowest answer. The grace period is the default, 5 s.
"""

from __future__ import annotations

import argparse
import asyncio
import random

from a2a.helpers import new_task
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events.event_queue import EventQueue
from a2a.server.tasks import TaskUpdater
from a2a.types import SendMessageRequest, TaskState

from _common import clock, header
from a2a_cancelfix.testing import Stream, cancel, make_server, message, within

STEPS = 2_000
BUSY = 30


class PlainLoop(AgentExecutor):
    """A model call per step, no checkpoint: its steps are counted."""

    def __init__(self) -> None:
        self.steps = 0
        self.task_id = ""
        self.going = asyncio.Event()
        self.stopped = asyncio.Event()
        self.step = self  # What make_server's helpers look for: unused here.

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        self.task_id = context.task_id or ""
        updater = TaskUpdater(event_queue, self.task_id, context.context_id or "")
        await event_queue.enqueue_event(
            new_task(self.task_id, context.context_id or "", TaskState.TASK_STATE_SUBMITTED)
        )
        await updater.start_work()
        try:
            for _ in range(STEPS):
                await asyncio.sleep(0.002)
                self.steps += 1
                if self.steps == 5:
                    self.going.set()
            await updater.complete()
        finally:
            self.stopped.set()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        return None


async def busy(stop: asyncio.Event) -> None:
    """Other work on the loop: short bursts of computing between awaits."""
    while not stop.is_set():
        sum(range(random.randint(500, 5_000)))
        await asyncio.sleep(0)


async def one(kind: str) -> tuple[int, float]:
    """Start a run, cancel it a few steps in; the steps it took after the cancel, and the answer's time."""
    agent = PlainLoop()
    server = make_server(kind, agent, push=False, told=False, cancel_grace_period=5.0)  # type: ignore[arg-type]
    stream = Stream(server.calls.send_stream(SendMessageRequest(message=message()), "alice"))
    await within(agent.going.wait(), 30)
    await asyncio.sleep(random.uniform(0, 0.02))  # Land anywhere in a step.
    began, asked_at = clock(), agent.steps
    await within(cancel(server, agent.task_id), 30)
    took = clock() - began
    await within(agent.stopped.wait(), 30)
    stream.task.cancel()
    return agent.steps - asked_at, took


async def measure(count: int) -> dict[str, tuple[int, int, float]]:
    stop = asyncio.Event()
    others = [asyncio.ensure_future(busy(stop)) for _ in range(BUSY)]
    results: dict[str, list[tuple[int, float]]] = {"stock": [], "ours": []}
    try:
        for _ in range(count):
            for kind in results:  # Interleaved: both see the same load.
                results[kind].append(await one(kind))
    finally:
        stop.set()
        await asyncio.gather(*others)
    return {
        kind: (
            sum(1 for after, _ in runs if after > 1),
            max(after for after, _ in runs),
            max(t for _, t in runs),
        )
        for kind, runs in results.items()
    }


def main(quick: bool = False) -> None:
    count = 30 if quick else 150
    header(f"plain runs cancelled on a busy loop ({count} each, {BUSY} busy tasks)")
    figures = asyncio.run(measure(count))
    for kind, (went_on, most, slowest) in figures.items():
        print(
            f"{kind:5}  went on past the next await: {went_on:3}/{count}  most steps after the cancel:"
            f" {most:5}  slowest answer: {slowest * 1000:7.1f} ms"
        )
    print(f"slowest answer, ours / stock: {figures['ours'][2] / figures['stock'][2]:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    main(parser.parse_args().quick)
