"""Executors with one cancellation defect each, as real agents have them: the sweep must catch
each; and some without, whose plain code or clean-up the sweep must not mistake for one."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from a2a.helpers import new_task
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events.event_queue import EventQueue
from a2a.server.tasks import TaskUpdater
from a2a.types import TaskState

from a2a_cancelfix import RunCancelled, cancel_requested, cancellable, shielded
from a2a_cancelfix.testing.examples import Pipeline, io, scrub


@cancellable
async def step() -> None:
    await io()


class Agent(AgentExecutor):
    """Starts its task, works, completes; ``cancel()`` does nothing. Subclasses add the defect."""

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        updater = TaskUpdater(event_queue, context.task_id or "", context.context_id or "")
        if context.current_task is None:
            task = new_task(context.task_id or "", context.context_id or "", TaskState.TASK_STATE_SUBMITTED)
            await event_queue.enqueue_event(task)
        await updater.start_work()
        await self.work()
        await updater.complete()

    async def work(self) -> None:
        await step()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        return None


class SwallowsTheCancel(Agent):
    """Catches the cancel around each step and goes on to the next."""

    async def work(self) -> None:
        for _ in range(3):
            with contextlib.suppress(asyncio.CancelledError):
                await step()


class StepAfterCaught(Agent):
    """Catches ``RunCancelled`` from one step, then starts another."""

    async def work(self) -> None:
        with contextlib.suppress(RunCancelled):
            await step()
        await scrub("and one more")


class ClaimOnHappyPath(Pipeline):
    """Releases its claim only when the work succeeds: not in a ``finally``."""

    @contextlib.asynccontextmanager
    async def claim(self, task_id: str) -> AsyncIterator[None]:
        await io()
        self.claims.add(task_id)
        yield
        self.claims.discard(task_id)


class BackgroundOutlivesRun(Agent):
    """Starts a background task for the step and never cancels it."""

    async def work(self) -> None:
        stepped = asyncio.Event()

        async def warm_cache() -> None:
            await stepped.wait()  # Done once the step is: after a cancel, never.

        background = asyncio.ensure_future(warm_cache())
        await step()
        stepped.set()
        await background


class ThreadNeverChecks(Agent):
    """Works in a thread that never calls ``checkpoint()``: the cancel cannot reach it."""

    def __init__(self) -> None:
        self.stop = threading.Event()

    async def work(self) -> None:
        await asyncio.to_thread(self.crunch)

    def crunch(self) -> None:
        self.stop.wait(0.8)  # Stands in for number crunching: four grace periods of it.


class CancelHangs(Agent):
    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        await asyncio.Event().wait()


class CancelRaises(Agent):
    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        raise RuntimeError("the LLM provider refused the abort")


class ShieldOutlastsGrace(Agent):
    """Shields a write that takes longer than the grace period: the teardown cuts it."""

    async def work(self) -> None:
        await step()
        async with shielded():
            await io()
            if cancel_requested():  # A write that, once the cancel came, never finishes.
                await asyncio.Event().wait()


class LoopWithoutCheckpoint(Agent):
    """No defect: calls tools in a loop that never awaits a checkpoint nor enqueues."""

    async def work(self) -> None:
        for _ in range(3):
            await io()


class PlainTokens(Agent):
    """No defect, and no checkpoint: plain asyncio, as frameworks write it. A model call per
    token, a tool every tenth, a claim released in ``finally``."""

    def __init__(self) -> None:
        self.claims = 0

    async def work(self) -> None:
        self.claims += 1
        try:
            for token in range(12):
                await io()  # The model's next token.
                if token % 10 == 9:
                    await io()  # A tool.
        finally:
            self.claims -= 1


class CleansUpShielded(Agent):
    """No defect: its clean-up runs in a shielded section, which raises again as it ends."""

    async def work(self) -> None:
        try:
            await step()
        finally:
            async with shielded():
                await io()  # Stands in for releasing a lease.


def unreleased(executor: Any) -> bool:
    return not getattr(executor, "claims", ())


class ToolSwallowsTheCancel(Agent):
    """Streams 25 tokens; the tool it calls every tenth swallows the cancel."""

    async def work(self) -> None:
        for token in range(25):
            await io()  # The model's next token.
            if token % 10 == 9:
                with contextlib.suppress(asyncio.CancelledError):
                    await io()  # The tool.


class ThirdPassClaim(Agent):
    """Takes a lease on its third pass only, and releases it on the happy path only."""

    def __init__(self) -> None:
        self.claims = 0

    async def work(self) -> None:
        for turn in range(5):
            self.claims += turn == 2
            await io()
            self.claims -= turn == 2


class StatusBeforeTask(Agent):
    """Starts work without enqueueing its Task first: the SDK refuses the status update."""

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        updater = TaskUpdater(event_queue, context.task_id or "", context.context_id or "")
        await updater.start_work()
        await updater.complete()


class RaisesOnItsWay(Agent):
    async def work(self) -> None:
        await step()
        raise ValueError("the model's answer was not JSON")


class PacedByTheWallClock(Agent):
    """Correct, but works for half a second of the wall clock, a step each 50 ms of it."""

    async def work(self) -> None:
        started = time.monotonic()
        while time.monotonic() - started < 0.5:  # noqa: ASYNC110 - the pace this executor has
            await asyncio.sleep(0.05)


# One pool for the process, as code that shares it for a synchronous client does (a vendor's
# SDK, boto3): its worker outlives each run, and started before most.
SHARED_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="shared-client")


class SyncClientOnASharedPool(Agent):
    """Correct: calls a synchronous client twice on `SHARED_POOL`, each call under a timeout."""

    async def work(self) -> None:
        for _ in range(2):  # A timer of 10 s: the loop's clock must not jump to it meanwhile.
            async with asyncio.timeout(10):  # Python 3.11+ (wait_for on 3.11 swallows a cancel).
                await asyncio.wrap_future(SHARED_POOL.submit(threading.Event().wait, 0.02))


async def tool_call() -> None:
    await io()


async def stubborn_tool_call() -> None:
    try:
        await io()
    except asyncio.CancelledError:  # Swallowed: it goes on three grace periods past the cancel.
        await asyncio.sleep(0.6)


class ParallelToolCalls(Agent):
    """Calls eight tools at once, as agents do, in child tasks started ``how``; with
    ``stubborn``, the fifth swallows the cancel."""

    def __init__(self, how: str = "TaskGroup", stubborn: bool = False) -> None:
        self.how, self.stubborn = how, stubborn

    def calls(self) -> list[Any]:
        return [stubborn_tool_call() if self.stubborn and number == 4 else tool_call() for number in range(8)]

    async def work(self) -> None:
        if self.how == "TaskGroup":
            async with asyncio.TaskGroup() as group:
                for call in self.calls():
                    group.create_task(call)
        elif self.how == "create_task":
            await asyncio.gather(*[asyncio.create_task(call) for call in self.calls()])
        else:
            await asyncio.gather(*self.calls())
