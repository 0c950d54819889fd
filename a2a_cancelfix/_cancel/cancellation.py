"""One task's cancel (`Cancellation`), built by one constructor per origin, and its steps."""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from a2a.server.agent_execution import RequestContext
from a2a.types import Task, TaskState

from a2a_cancelfix import _telemetry
from a2a_cancelfix._aio import Deadlines, Once, deadlines, wait_patiently
from a2a_cancelfix._cancel.queues import CancelQueue
from a2a_cancelfix._sdk import CANCELED, drop_backlog

if TYPE_CHECKING:
    from a2a.server.agent_execution import AgentExecutor
    from a2a.server.events.event_queue import EventQueue

    from a2a_cancelfix._cancel.settings import Timeline
    from a2a_cancelfix._cancel.work import Work

logger = logging.getLogger("a2a_cancelfix")

FAILED = TaskState.TASK_STATE_FAILED


class CanceledWrite:
    """One cancel's direct write: its first attempt's outcome (the task as it ends up, or what
    the store raised), the time the answer waits for it until, and whether the answer came
    first (then the write goes on behind it)."""

    __slots__ = ("by", "first", "outlived")

    def __init__(self, by: tuple[float, float]) -> None:
        self.first: asyncio.Future[Task | Exception | None] = asyncio.get_running_loop().create_future()
        self.by = by
        self.outlived = False

    def outlive(self) -> None:
        self.outlived = True


class Step(enum.IntEnum):
    """How far a cancel has come; each step is reached once, in this order."""

    REQUESTED = 1
    SIGNALLED = 2
    CALLING = 3
    STOPPING = 4
    STOPPED = 5
    PUBLISHED = 6
    ANSWERED = 7
    TORN_DOWN = 8


class Cancellation:
    """One task's cancel, from the first request to the run's teardown.

    Its steps come in this order on every path (a request here, a parked task, a cancel
    noticed from another replica, a request whose caller left), each at most once:

    1. requested: the deadline is fixed, once; later requests join this cancel.
    2. signalled: the run's ``on_cancel`` callbacks have fired; its checkpoints raise.
    3. calling: the executor's ``cancel()`` runs, once, in a task of its own that outlives
       whoever waits for it, cut off at the deadline. What it publishes is its own choice.
    4. stopping: a shielded section runs to its end; then the work is interrupted, once,
       unless it already unwinds (a checkpoint raised in it, or a ``@cancellable`` step
       failed); at the deadline it is abandoned.
    5. stopped: the work has ended (its ``finally`` blocks ran), or was abandoned.
    6. published: the framework's terminal state is in the run's queue, after the work
       stopped: CANCELED, or FAILED when ``cancel()`` raised. Only now can anyone see it.
    7. answered: every caller has the same answer (the handler's part).
    8. torn down: the cancel is forgotten; the run's closing goes on behind the answer,
       forced if it does not close in time (the handler's part).

    Steps 2-6 are `carry_out`; interrupted, it can be called again and resumes.
    """

    def __init__(
        self,
        task_id: str,
        executor: AgentExecutor,
        work: Work | None,
        timeline: Timeline,
        *,
        reason: str,
        span: Any,
        path: str | None = None,
        message: str | None = None,
        recorded: bool = False,
    ) -> None:
        self.task_id = task_id
        self.executor = executor
        self.name = executor.__class__.__name__  # A proxy's too, as isinstance sees it.
        self.work = work
        self.timeline = timeline
        self.deadline = timeline.deadline
        self.reason = reason
        self.span = span  # Where its steps are recorded: the request's span, or the origin's.
        # The path said in the log and telemetry (None: the run's state says it), and the text
        # of the CANCELED status message, for a cancel with an origin of its own.
        self.path = path
        self.message = message
        # The store holds CANCELED already (another replica recorded it): that is how the
        # task ends, even if cancel() raises here.
        self.recorded = recorded
        self.step = Step.REQUESTED
        self.failure: BaseException | None = None  # What the executor's cancel() raised.
        self.callers: list[asyncio.Future[Task]] = []
        self.done = Once()  # Published, or given up on: execute() may return.
        self._call: asyncio.Future[None] | None = None
        self._cut_off_at: tuple[Deadlines, list[Any]]  # Set as the call starts: its deadline's entry.
        self._returned = Once()
        self._settle_by: tuple[float, float] | None = None  # Fixed by the first wait for the SDK.
        self._write: CanceledWrite | None = None

    @classmethod
    def requested(
        cls, task_id: str, executor: AgentExecutor, work: Work | None, timeline: Timeline
    ) -> Cancellation:
        """A client's cancel here, or the stock handler's: its steps go on the current span."""
        return cls(
            task_id, executor, work, timeline, reason="cancel requested", span=_telemetry.current_span()
        )

    @classmethod
    def recorded_elsewhere(
        cls, stored: Task, executor: AgentExecutor, work: Work | None, timeline: Timeline
    ) -> Cancellation:
        """The cancel of a task another replica cancelled in the store, as noticed here.

        Its steps go on a span of their own (see ``_telemetry.remote_cancel_span``), which
        whoever carries it out ends; its task ends CANCELED even if ``cancel()`` raises.
        """
        status = stored.status
        stored_at = status.timestamp.ToMicroseconds() / 1e6 if status.HasField("timestamp") else None
        return cls(
            stored.id,
            executor,
            work,
            timeline,
            reason="canceled on another replica",
            span=_telemetry.remote_cancel_span(stored.id, stored_at),
            path="parked, canceled elsewhere",
            recorded=True,
        )

    @classmethod
    def unwatched(
        cls, task_id: str, after: float, executor: AgentExecutor, work: Work | None, timeline: Timeline
    ) -> Cancellation:
        """The cancel of a task nobody watched for ``after`` seconds; on a span of its own."""
        why = f"Canceled: nobody watched the task for {after:g} s (no stream, blocking sender or push config)"
        span = _telemetry.unwatched_span(task_id, after)
        return cls(task_id, executor, work, timeline, reason=why, span=span, path="unwatched", message=why)

    @classmethod
    def shut_down(
        cls, task_id: str, executor: AgentExecutor, work: Work | None, timeline: Timeline
    ) -> Cancellation:
        """The cancel of a run still going when the server shut down; on a span of its own."""
        why = "Canceled: the server shut down before the task finished"
        span = _telemetry.shutdown_span(task_id)
        return cls(task_id, executor, work, timeline, reason=why, span=span, path="shutdown", message=why)

    @classmethod
    def lease_lost(
        cls, task_id: str, executor: AgentExecutor, work: Work | None, timeline: Timeline
    ) -> Cancellation:
        """The cancel of a run whose replica could not renew its lease: another replica may soon
        take the task for dead. On a span of its own."""
        why = "Canceled: this server lost contact with its task store"
        span = _telemetry.lease_lost_span(task_id)
        return cls(task_id, executor, work, timeline, reason=why, span=span, path="lease_lost", message=why)

    @property
    def late(self) -> bool:
        """Whether the deadline has passed."""
        return asyncio.get_running_loop().time() >= self.deadline

    def write(self, start: Callable[[], CanceledWrite]) -> CanceledWrite:
        """The direct write of CANCELED for this cancel: ``start``-ed by the first call only."""
        if self._write is None:
            self._write = start()
        return self._write

    async def settled(self, wait: Callable[[float], Awaitable[bool]]) -> bool:
        """``wait`` for the SDK's part, asked as the work has stopped; whether it came in time.

        In time is a margin from now, never before the deadline's, in the loop's own time,
        stretched by the loop's lateness (see `wait_patiently`): on a loop busy with thousands
        of cancels every step runs late, and only a run stuck for a margin of the loop's time
        is forced. Fixed by the first call: a cancel resumed after its first caller left
        waits until the same time.
        """
        if self._settle_by is None:
            self._settle_by = self.timeline.margin_from_now()
        return await wait_patiently(wait, *self._settle_by)

    def join(self) -> asyncio.Future[Task]:
        """A future for one more caller's answer."""
        answer: asyncio.Future[Task] = asyncio.get_running_loop().create_future()
        self.callers.append(answer)
        return answer

    def answer(self, result: Task | BaseException) -> None:
        """Give every caller the same answer: the task, or the error to raise."""
        for caller in self.callers:
            if caller.done():
                continue
            if isinstance(result, BaseException):
                caller.set_exception(result)
            else:
                caller.set_result(result)
        self.reach(Step.ANSWERED)

    async def published(self) -> None:
        """Wait until the terminal state is in the run's queue, or the cancel gave up."""
        await self.settled(self.done.wait)

    def signal(self, queue: EventQueue) -> None:
        """Drop the run's moot backlog, fire its callbacks, make its checkpoints raise (step 2).

        What execute() queued that the SDK has not saved yet is moot now: saved one by one
        ahead of CANCELED, a backlog (tokens ahead of a slow store) would outlast the bound
        and the streams would end on WORKING. Dropped with no await before the signal (after
        it, the run enqueues no more), so CANCELED comes next, after only what ``cancel()``
        itself publishes; once, so a resumed cancel keeps that.
        """
        if self.step >= Step.SIGNALLED:
            return
        dropped = drop_backlog(queue)
        _log_dropped(self.task_id, dropped)
        if self.work is not None:
            self.work.signalled()
            self.work.cancel(self.reason)
        self.reach(Step.SIGNALLED)
        _telemetry.step(self.span, "callbacks_fired", dropped=sum(dropped.values()))

    async def carry_out(
        self, context: RequestContext, queue: EventQueue, *, publish_first: bool = False
    ) -> None:
        """Do steps 2-6, each once and by the deadline; never raise for the executor.

        Args:
            publish_first: publish CANCELED before ``cancel()`` runs: for a parked task under
                the SDK's stock handler, which closes the run's queue on its own.
        """
        publisher = CancelQueue(queue, context)
        if publish_first:
            self.signal(queue)
            await self._publish(publisher)
        self.call_cancel(context, publisher)
        await self.cancel_returned()
        if self.work is not None:
            self.reach(Step.STOPPING)
            await self.work.stop(self.deadline, self.name)
            if self.step < Step.STOPPED:
                _telemetry.step(self.span, "work_stopped", abandoned=self.work.abandoned)
        self.reach(Step.STOPPED)
        await self._publish(publisher)
        self.done.give()

    def call_cancel(self, context: RequestContext, queue: CancelQueue) -> None:
        """Signal the run and call the executor's ``cancel()`` (steps 2 and 3), once, in a task
        of its own that outlives whoever waits for it, cut off at the deadline.

        Both in that task's first step, with nothing in between: the work cannot notice the
        cancel (a checkpoint that raises, a ``finally`` that runs) before ``cancel()`` is called.
        """
        if self._call is None:
            self._call = asyncio.ensure_future(self._run_cancel(context, queue))
            timers = deadlines()
            self._cut_off_at = timers, timers.at(self.deadline, self._cut_off)

    async def cancel_returned(self) -> None:
        """Wait until ``cancel()`` has returned, raised or been cut off (see `_cut_off`)."""
        await self._returned.wait()

    async def _run_cancel(self, context: RequestContext, queue: CancelQueue) -> None:
        self.signal(queue.__wrapped__)
        self.reach(Step.CALLING)
        try:
            await self.executor.cancel(context, queue)
            _telemetry.step(self.span, "cancel_returned")
        except Exception as error:
            self.failure = error
            _telemetry.step(self.span, "cancel_raised", error=type(error).__name__)
            logger.warning(
                "%s.cancel() raised for task %s; the task ends FAILED",
                self.name,
                self.task_id,
                exc_info=error,
            )
        finally:
            self._returned.give()
            timers, cut_off = self._cut_off_at
            timers.drop(cut_off)

    def _cut_off(self) -> None:
        if self._call is not None and not self._call.done():
            logger.warning(
                "%s.cancel() did not return within the grace period for task %s; "
                "the task is canceled without it",
                self.name,
                self.task_id,
            )
            _telemetry.step(self.span, "cancel_cut_off")
            self._call.cancel()
            # The cancel goes on now, whether or not cancel() lets itself be interrupted.
            self._returned.give()

    async def _publish(self, queue: CancelQueue) -> None:
        state = FAILED if self.failure is not None and not self.recorded else CANCELED
        if await queue.publish(state, self.message if state == CANCELED else None):
            _telemetry.step(self.span, "terminal_published", state=TaskState.Name(state))
        self.reach(Step.PUBLISHED)

    def reach(self, step: Step) -> None:
        self.step = max(self.step, step)


def _log_dropped(task_id: str, dropped: dict[str, int]) -> None:
    if dropped:
        logger.info(
            "cancel task=%s dropped=%d queued updates the SDK had not saved nor streamed (%s)",
            task_id,
            sum(dropped.values()),
            ", ".join(f"{name}={count}" for name, count in sorted(dropped.items())),
        )
