"""Cooperative cancellation inside executors: checkpoints, @cancellable, shielded(), on_cancel()."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
import time

import pytest
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events.event_queue import EventQueue
from a2a.server.tasks import TaskUpdater
from a2a.types import Task, TaskState, TaskStatus

import a2a_cancelfix
from a2a_cancelfix import (
    CancellableExecutor,
    RunCancelled,
    cancel_requested,
    cancellable,
    checkpoint,
    on_cancel,
    shielded,
)
from a2a_cancelfix.testing import (
    BOUND,
    Gate,
    ScriptedExecutor,
    caller,
    cancel,
    make_server,
    start,
    stored,
    wait_all_tasks_blocked,
    within,
)
from a2a_cancelfix.testing.servers import GRACE

SLACK = 1.5


class ClaimingExecutor(ScriptedExecutor):
    """Holds a claim on its scope while it works in three steps, the last a shielded write."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[str] = []
        self.write = Gate()
        self.aborted_call = asyncio.Event()

    async def _work_step(self) -> None:
        self.log.append("claimed")
        in_flight = asyncio.get_running_loop().create_future()
        # Not wrapped (RuntimeError): the stock handler has no cancellation scope.
        with contextlib.suppress(RuntimeError):
            on_cancel(in_flight.cancel)  # Aborts the "HTTP call" below the moment the cancel lands.
        try:
            await self.scrub()
            await self.orchestrate(in_flight)
            await self.store()
        finally:
            self.log.append("released")

    @cancellable
    async def scrub(self) -> None:
        self.log.append("scrubbed")

    @cancellable
    async def orchestrate(self, in_flight: asyncio.Future) -> None:
        self.step.reached.set()
        try:
            await in_flight  # The slow call a cancel should abort.
        except asyncio.CancelledError:
            self.aborted_call.set()
            raise

    @cancellable
    async def store(self) -> None:
        async with shielded():
            self.log.append("write started")
            await self.write()
            await checkpoint()  # Deferred inside the shield: must not raise here.
            self.log.append("write finished")


class WritingExecutor(ClaimingExecutor):
    """Goes straight to the shielded write, and stays there until the test opens it."""

    async def orchestrate(self, in_flight: asyncio.Future) -> None:
        self.step.reached.set()


# Outside a run


@pytest.mark.asyncio
async def test_outside_a_run_checks_pass_and_callbacks_are_refused() -> None:
    """With no run, checkpoints pass, nothing is cancelled, shields do nothing, callbacks raise."""
    await checkpoint()
    checkpoint()
    assert cancel_requested() is False
    async with shielded():
        pass
    with pytest.raises(RuntimeError, match="outside a run"):
        on_cancel(lambda: None)


# @cancellable


def test_cancellable_keeps_signatures_and_hints() -> None:
    """Decorated sync and async functions and methods keep their names, signatures and hints."""

    @cancellable
    async def fetch(url: str, *, retries: int = 3) -> bytes:
        """Fetch."""
        return b""

    @cancellable
    def parse(data: bytes) -> dict[str, int]:
        return {}

    class Agent:
        @cancellable
        async def step(self, n: int) -> int:
            return n

    assert fetch.__name__ == "fetch" and fetch.__doc__ == "Fetch."
    assert inspect.signature(fetch) == inspect.signature(fetch.__wrapped__)
    assert inspect.iscoroutinefunction(fetch) and not inspect.iscoroutinefunction(parse)
    assert parse(b"") == {} and inspect.signature(parse).return_annotation == "dict[str, int]"
    assert asyncio.run(Agent().step(4)) == 4


def test_cancellable_refuses_generators_at_decoration() -> None:
    """A generator or a class cannot be a step: the decorator says so at once."""

    def numbers():
        yield 1

    async def events():
        yield 1

    with pytest.raises(TypeError, match="numbers"):
        cancellable(numbers)
    with pytest.raises(TypeError, match="events"):
        cancellable(events)
    with pytest.raises(TypeError):
        cancellable(int)


# The executor proxy


def test_proxy_is_transparent_and_wraps_once() -> None:
    """isinstance, attributes and repr see the wrapped executor; wrapping twice is a no-op."""
    executor = ScriptedExecutor(park=True)
    wrapped = CancellableExecutor(executor)
    assert isinstance(wrapped, AgentExecutor) and isinstance(wrapped, ScriptedExecutor)
    assert wrapped.park is True and wrapped.cancel_mode == "empty"
    assert CancellableExecutor(wrapped) is wrapped
    assert "ScriptedExecutor" in repr(wrapped)
    with pytest.raises(ValueError, match=r"^grace_period"):
        CancellableExecutor(ScriptedExecutor(), grace_period=0)
    with pytest.raises(ValueError, match=r"^grace_period must be .* not -1"):
        CancellableExecutor(ScriptedExecutor(), grace_period=-1)  # Named as the caller named it.
    with pytest.raises(TypeError, match=r"^grace_period"):
        CancellableExecutor(ScriptedExecutor(), grace_period="5")  # type: ignore[arg-type]


class RecordingQueue:
    """An event queue that keeps what it is given."""

    def __init__(self) -> None:
        self.events: list[object] = []

    async def enqueue_event(self, event: object) -> None:
        self.events.append(event)


def run_context() -> RequestContext:
    task = Task(id="t-1", context_id="c-1", status=TaskStatus(state=TaskState.TASK_STATE_WORKING))
    return RequestContext(call_context=caller(), task_id="t-1", context_id="c-1", task=task)


class ReportingExecutor(AgentExecutor):
    """Reports progress, one report each time the test lets it go on, and never checks for
    cancellation itself."""

    def __init__(self) -> None:
        self.reports = 0
        self.first_report = asyncio.Event()
        self.go_on = asyncio.Event()
        self.ended = asyncio.Event()
        self.errors: list[BaseException] = []

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        try:
            while True:
                await updater.update_status(TaskState.TASK_STATE_WORKING)
                self.reports += 1
                self.first_report.set()
                await self.go_on.wait()
                self.go_on.clear()
        except BaseException as error:
            self.errors.append(error)
            raise
        finally:
            self.ended.set()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        """Let the work go on to its next report while the cancel is in, and wait for its end."""
        self.go_on.set()
        await self.ended.wait()


@pytest.mark.asyncio
async def test_every_enqueue_is_a_checkpoint() -> None:
    """An executor that only reports progress stops at its next report after the cancel."""
    inner, queue = ReportingExecutor(), RecordingQueue()
    executor = CancellableExecutor(inner, grace_period=GRACE)
    running = asyncio.ensure_future(executor.execute(run_context(), queue))
    await within(inner.first_report.wait())
    await within(executor.cancel(run_context(), queue))
    await within(running)
    (error,) = inner.errors
    assert isinstance(error, RunCancelled) and isinstance(error, asyncio.CancelledError)
    assert error.reason == "cancel requested" and error.requested_at <= time.time()
    states = [event.status.state for event in queue.events]
    assert states[-1] == TaskState.TASK_STATE_CANCELED
    assert states.count(TaskState.TASK_STATE_CANCELED) == 1


class StubbornExecutor(ReportingExecutor):
    """Swallows the first cancellation at a checkpoint and tries to carry on."""

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        self.first_report.set()
        try:
            await self.go_on.wait()  # Until the cancel is in.
            try:
                await checkpoint()
            except asyncio.CancelledError as first:
                self.errors.append(first)
            await checkpoint()  # Level-triggered: raises again.
            self.reports += 1
        finally:
            self.ended.set()


@pytest.mark.asyncio
async def test_checkpoints_are_level_triggered() -> None:
    """Once cancelled, every checkpoint raises, so a swallowed one cannot keep the work going."""
    inner, queue = StubbornExecutor(), RecordingQueue()
    executor = CancellableExecutor(inner, grace_period=GRACE)
    running = asyncio.ensure_future(executor.execute(run_context(), queue))
    await within(inner.first_report.wait())
    await within(executor.cancel(run_context(), queue))
    await within(running)
    assert len(inner.errors) == 1 and inner.reports == 0


# Through the handlers


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["ours", "wrapped"])
async def test_cancel_aborts_the_call_and_releases_the_claim(kind: str) -> None:
    """A cancel mid-step aborts the in-flight call and the claim is free when cancel returns."""
    server = make_server(kind, ClaimingExecutor())
    await start(server)
    executor = server.executor
    assert await within(cancel(server, executor.task_id), GRACE + SLACK) == "CANCELED"
    assert executor.aborted_call.is_set()
    assert executor.log == ["claimed", "scrubbed", "released"]
    assert await stored(server, executor.task_id) == "CANCELED"


@pytest.mark.asyncio
async def test_stock_keeps_the_claim_until_the_run_is_killed_mid_write() -> None:
    """Without the fix, the SDK kills the run wherever it is: here in the middle of a write."""
    server = make_server("stock", WritingExecutor())
    await start(server)
    executor = server.executor
    await within(executor.write.reached.wait())
    canceller = asyncio.ensure_future(cancel(server, executor.task_id))
    await within(executor.stopped.wait())
    assert executor.log == ["claimed", "scrubbed", "write started", "released"]
    canceller.cancel()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["ours", "wrapped"])
async def test_shielded_write_finishes_before_the_claim_is_released(kind: str) -> None:
    """A cancel during a shielded write never interrupts it; the claim is released after it.

    CANCELED, and so the answer, waits for the write: under our handler and under the SDK's
    around the wrapper alike.
    """
    server = make_server(kind, WritingExecutor())
    await start(server)
    executor = server.executor
    await within(executor.write.reached.wait())
    cancelling = asyncio.ensure_future(cancel(server, executor.task_id))
    await within(executor.cancel_called.wait())
    await wait_all_tasks_blocked()  # Give a wrong implementation every chance to interrupt the write.
    assert executor.log[-1] == "write started"
    assert not cancelling.done()
    assert await stored(server, executor.task_id) == "WORKING"
    executor.write.open()
    assert await within(cancelling, GRACE + SLACK) == "CANCELED"
    await within(executor.stopped.wait())
    assert executor.log == ["claimed", "scrubbed", "write started", "write finished", "released"]


@pytest.mark.asyncio
async def test_a_shield_that_never_ends_is_bounded_by_the_grace_period(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A shielded section cannot hold the cancel past the grace period; cutting it is a WARNING
    that names the executor, the task and where the section was cut."""
    server = make_server("ours", WritingExecutor())
    await start(server)
    executor = server.executor
    await within(executor.write.reached.wait())
    with caplog.at_level(logging.WARNING, logger="a2a_cancelfix"):
        assert await within(cancel(server, executor.task_id), GRACE + SLACK) == "CANCELED"
    assert executor.log == ["claimed", "scrubbed", "write started", "released"]
    cut = [(r.levelno, r.getMessage()) for r in caplog.records if "shielded section" in r.getMessage()]
    assert [level for level, _ in cut] == [logging.WARNING]
    cut = [message for _, message in cut]
    assert "WritingExecutor" in cut[0] and executor.task_id in cut[0] and "test_checkpoints.py:" in cut[0]


class ThreadedExecutor(ScriptedExecutor):
    """Does its step in a worker thread that checks for cancellation between chunks."""

    def __init__(self) -> None:
        super().__init__()
        self.thread_started = threading.Event()
        self.proceed = threading.Event()
        self.thread_reported = threading.Event()
        self.thread_saw: list[object] = []

    async def _work_step(self) -> None:
        self.step.reached.set()
        await asyncio.to_thread(self._chunks)

    def _chunks(self) -> None:
        self.thread_started.set()
        self.proceed.wait(timeout=5)
        try:
            self.thread_saw.append(cancel_requested())
            checkpoint()
        except RunCancelled as error:
            self.thread_saw.append(error)
        finally:
            self.thread_reported.set()


@pytest.mark.asyncio
async def test_checkpoints_reach_threads_started_by_the_run() -> None:
    """A thread started with asyncio.to_thread sees the cancel and its checkpoint raises."""
    server = make_server("ours", ThreadedExecutor())
    await start(server)
    executor = server.executor
    await within(asyncio.to_thread(executor.thread_started.wait, 5))
    assert await within(cancel(server, executor.task_id), GRACE + SLACK) == "CANCELED"
    executor.proceed.set()
    assert await within(asyncio.to_thread(executor.thread_reported.wait, BOUND), BOUND + 1)
    assert executor.thread_saw[0] is True and isinstance(executor.thread_saw[1], RunCancelled)


def test_public_names_are_few_and_sorted() -> None:
    """The package exports a short, sorted list of names."""
    assert a2a_cancelfix.__all__ == sorted(a2a_cancelfix.__all__)
    assert len(a2a_cancelfix.__all__) <= 13
    assert a2a_cancelfix.__version__


class ReleasingExecutor(ScriptedExecutor):
    """Holds a claim around its step whose release awaits I/O, as the README's pattern does.

    Its step is stopped by an ``on_cancel`` callback aborting the in-flight call, by a checkpoint
    in its loop, or by the framework's interrupt of a plain await.
    """

    def __init__(self, stopped_by: str, cancel: str | None, release: float) -> None:
        super().__init__(cancel=cancel)
        self.stopped_by, self.release = stopped_by, release
        self.claim_released = False
        self.release_cut = False

    @contextlib.asynccontextmanager
    async def claim(self):
        try:
            yield
        finally:
            try:
                await asyncio.sleep(self.release)  # The release's own I/O.
            except asyncio.CancelledError:
                self.release_cut = True
                raise
            self.claim_released = True

    async def _work_step(self) -> None:
        async with self.claim():
            self.step.reached.set()
            if self.stopped_by == "on_cancel":
                call = asyncio.ensure_future(asyncio.Event().wait())  # An in-flight LLM call.
                on_cancel(call.cancel)
                await call
            elif self.stopped_by == "checkpoint":
                while True:
                    await checkpoint()
                    await asyncio.sleep(0.005)  # A slice of real work.
            else:
                await asyncio.Event().wait()


@pytest.mark.parametrize("release", [0.02, 0.08])
@pytest.mark.parametrize("cancel_mode", [None, "io", "publish"], ids=["empty", "io", "publish"])
@pytest.mark.parametrize("stopped_by", ["on_cancel", "checkpoint", "plain await"])
@pytest.mark.asyncio
async def test_cleanup_the_work_has_begun_runs_to_its_end(
    stopped_by: str, cancel_mode: str | None, release: float
) -> None:
    """However the work is stopped, a release it has begun in ``__aexit__`` is not interrupted:
    the framework interrupts only a run still suspended where the cancel found it."""
    server = make_server("ours", ReleasingExecutor(stopped_by, cancel_mode, release))
    await start(server)
    executor = server.executor
    assert await within(cancel(server, executor.task_id), GRACE + SLACK) == "CANCELED"
    assert not executor.release_cut
    assert executor.claim_released
