"""One task's cancel, in one place: from the first request to the run's teardown.

A run of the wrapped ``execute()`` is a `Work`; a cancel of its task is a `Cancellation`.
Both are kept per task id in a `Lifecycle`, one per executor proxy. The handler and the
proxy reach a task's work and cancel there, and nowhere else.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

import wrapt
from a2a.server.agent_execution import RequestContext
from a2a.types import Task, TaskState, TaskStatus, TaskStatusUpdateEvent

from a2a_cancelfix import _telemetry
from a2a_cancelfix._aio import Once, deadline_in, deadlines, wait_patiently
from a2a_cancelfix._sdk import CANCELED, TERMINAL_STATES, drop_backlog, terminal_state
from a2a_cancelfix.checkpoints import Run, enter_run, leave_run

if TYPE_CHECKING:
    from a2a.server.agent_execution import AgentExecutor
    from a2a.server.events.event_queue import EventQueue

logger = logging.getLogger("a2a_cancelfix")

DEFAULT_GRACE_PERIOD = 5.0
DEFAULT_POLL_INTERVAL = 1.0
# Time past a cancel's deadline for the SDK to record its terminal state and close the run.
MARGIN = 1.0
# How far a loop's own lateness may stretch the margin (see Cancellation.settled).
LATENESS_LIMIT = 30.0
FAILED = TaskState.TASK_STATE_FAILED


def seconds(name: str, value: Any, *, optional: bool = False) -> float | None:
    """Check an option given in seconds: a finite number above 0 (or None, if ``optional``).

    Raises:
        TypeError: not a number.
        ValueError: zero, negative, NaN or infinite.
    """
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        kind = "a number of seconds, or None" if optional else "a number of seconds"
        raise TypeError(f"{name} must be {kind}, not {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number of seconds greater than 0, not {value!r}")
    return float(value)


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


class Work:
    """One run of the wrapped ``execute()``: where it runs, and whether it has ended.

    Inline, it runs in the SDK's own task for the run; apart, in a task of its own that the
    SDK's teardown of the run cannot reach (the stock handler cancels the run itself).
    """

    def __init__(self, run: Run) -> None:
        self.run = run
        self.runner: asyncio.Task[Any] | None = None
        self.ended = Once()
        self.settled: asyncio.Future[None] | None = None  # Apart: ended or abandoned.
        self.interrupted = False
        self.abandoned = False

    async def run_inline(self, work: Coroutine[Any, Any, None]) -> None:
        """Run the work in this task, inside the run's scope; a cancel of the task ends it normally."""
        self.runner = asyncio.current_task()
        token = enter_run(self.run)
        try:
            await work
        except asyncio.CancelledError:
            if not self.run.cancelled:
                raise  # Not the task's cancel: the SDK is tearing the run down.
        except Exception as error:
            if not self.run.cancelled:
                raise
            logger.debug("execute() of cancelled task %s raised", self.run.task_id, exc_info=error)
        finally:
            leave_run(token)  # Before anything else runs in this task: it is not the work.
            if self.interrupted:
                _uncancel(self.runner)  # Our interrupt is handled; the SDK's task runs on.
            self.ended.give()

    def start_apart(self, work: Coroutine[Any, Any, None]) -> None:
        """Run the work in a task of its own, inside the run's scope (the task's copy of it)."""
        token = enter_run(self.run)
        try:
            self.runner = asyncio.ensure_future(work)
        finally:
            leave_run(token)
        # A plain future for execute() to await: its cancellation (the SDK tearing the run
        # down) cancels this, never the work.
        self.settled = asyncio.get_running_loop().create_future()
        self.runner.add_done_callback(self._on_ended)

    def raise_outcome(self) -> None:
        """Mirror how the work ended, apart, unless a cancel owns the outcome."""
        work, run = self.runner, self.run
        assert work is not None
        if run.cancelled:
            if work.done() and not work.cancelled() and work.exception() is not None:
                logger.debug("execute() of cancelled task %s raised", run.task_id, exc_info=work.exception())
            return
        if work.cancelled():
            raise asyncio.CancelledError
        error = work.exception()
        if error is not None:
            raise error

    async def stop(self, deadline: float, name: str) -> None:
        """Let a shielded section finish, interrupt the work unless it already unwinds, wait.

        All by ``deadline``; past it, the work is abandoned: nothing it enqueues goes in.
        """
        if self.ended.given or self.abandoned or self.runner is None:
            return
        if self.run.shielded:
            await self.run.wait_unshielded(deadline)
        if not self.ended.given and not self.run.unwinding:
            self._interrupt()
        if not await self.ended.wait(deadline):
            self.abandoned = True
            self._settle()
            logger.warning(
                "%s.execute() ignored the cancel of task %s for the whole grace period; "
                "it is abandoned and nothing it enqueues reaches the task",
                name,
                self.run.task_id,
            )

    def _interrupt(self) -> None:
        assert self.runner is not None
        if not self.interrupted:  # Once: inline, each interrupt is one cancel to undo.
            self.interrupted = True
            self.runner.cancel()

    def _on_ended(self, _: object) -> None:
        self.ended.give()
        self._settle()

    def _settle(self) -> None:
        if self.settled is not None and not self.settled.done():
            self.settled.set_result(None)


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

    def __init__(self, lifecycle: Lifecycle, task_id: str, reason: str, span: Any) -> None:
        self.lifecycle = lifecycle
        self.span = span  # Where its steps are recorded: the request's span, or the notice's.
        self.task_id = task_id
        self.reason = reason
        self.deadline = deadline_in(lifecycle.grace_period)
        self.step = Step.REQUESTED
        self.work = lifecycle.works.get(task_id)
        self.failure: BaseException | None = None  # What the executor's cancel() raised.
        # The store holds CANCELED already (another replica recorded it): that is how the
        # task ends, even if cancel() raises here.
        self.recorded = False
        self.callers: list[asyncio.Future[Task]] = []
        self.done = Once()  # Published, or given up on: execute() may return.
        self._call: asyncio.Future[None] | None = None
        self._returned = Once()
        self._settle_by: float | None = None  # Fixed by the first wait for the SDK's part.

    @property
    def late(self) -> bool:
        """Whether the deadline has passed."""
        return asyncio.get_running_loop().time() >= self.deadline

    async def settled(self, wait: Callable[[float], Awaitable[bool]]) -> bool:
        """``wait`` for the SDK's part, asked as the work has stopped; whether it came in time.

        In time is ``MARGIN`` from now, never before the deadline's, and in the loop's own
        time: on a loop busy with thousands of cancels, the work stops past the deadline and
        every step after it runs late, and a margin that ran out while the loop was late is
        extended by the lateness (see `wait_patiently`). Only a run stuck for ``MARGIN`` of
        the loop's time is forced. Fixed by the first call: a cancel resumed after its first
        caller left waits until the same time, not a margin more.
        """
        if self._settle_by is None:
            self._settle_by = max(self.deadline, asyncio.get_running_loop().time()) + MARGIN
        return await wait_patiently(wait, self._settle_by, self._settle_by + LATENESS_LIMIT)

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
        self._reach(Step.ANSWERED)

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
            self.work.run.cancel(self.reason)
        self._reach(Step.SIGNALLED)
        _telemetry.step(self.span, "callbacks_fired", dropped=sum(dropped.values()))

    async def carry_out(
        self, context: RequestContext, queue: EventQueue, *, publish_first: bool = False
    ) -> None:
        """Do steps 2-6, each once and by the deadline; never raise for the executor.

        Args:
            publish_first: publish CANCELED before ``cancel()`` runs: for a parked task under
                the SDK's stock handler, which closes the run's queue on its own.
        """
        self.signal(queue)
        publisher = _CancelQueue(queue, context)
        if publish_first:
            await self._publish(publisher)
        await self._call_cancel(context, publisher)
        if self.work is not None:
            self._reach(Step.STOPPING)
            await self.work.stop(self.deadline, self.lifecycle.name)
            if self.step < Step.STOPPED:
                _telemetry.step(self.span, "work_stopped", abandoned=self.work.abandoned)
        self._reach(Step.STOPPED)
        await self._publish(publisher)
        self.done.give()

    async def _call_cancel(self, context: RequestContext, queue: _CancelQueue) -> None:
        if self._call is None:
            self._reach(Step.CALLING)
            self._call = asyncio.ensure_future(self._run_cancel(context, queue))
            timers = deadlines()
            cut_off = timers.at(self.deadline, self._cut_off)
            self._call.add_done_callback(lambda _: timers.drop(cut_off))
        await self._returned.wait(self.deadline)

    async def _run_cancel(self, context: RequestContext, queue: _CancelQueue) -> None:
        try:
            await self.lifecycle.executor.cancel(context, queue)
            _telemetry.step(self.span, "cancel_returned")
        except Exception as error:
            self.failure = error
            _telemetry.step(self.span, "cancel_raised", error=type(error).__name__)
            logger.warning(
                "%s.cancel() raised for task %s; the task ends FAILED",
                self.lifecycle.name,
                self.task_id,
                exc_info=error,
            )
        finally:
            self._returned.give()

    def _cut_off(self) -> None:
        if self._call is not None and not self._call.done():
            logger.warning(
                "%s.cancel() did not return within the grace period for task %s; "
                "the task is canceled without it",
                self.lifecycle.name,
                self.task_id,
            )
            _telemetry.step(self.span, "cancel_cut_off")
            self._call.cancel()

    async def _publish(self, queue: _CancelQueue) -> None:
        state = FAILED if self.failure is not None and not self.recorded else CANCELED
        if await queue.publish(state):
            _telemetry.step(self.span, "terminal_published", state=TaskState.Name(state))
        self._reach(Step.PUBLISHED)

    def _reach(self, step: Step) -> None:
        self.step = max(self.step, step)


class Lifecycle:
    """The work and the cancel in progress of each task of one executor.

    Args:
        executor: the wrapped executor, whose ``cancel()`` a cancel calls.
        grace_period: seconds a cancel gives ``cancel()`` and the work, together.
    """

    def __init__(self, executor: AgentExecutor, grace_period: float) -> None:
        self.executor = executor
        self.name = executor.__class__.__name__  # A proxy's too, as isinstance sees it.
        self.grace_period = grace_period
        self.works: dict[str, Work] = {}
        self.cancellations: dict[str, Cancellation] = {}
        # Set by our handler: how runs learn of a cancel recorded by another replica.
        self.read_stored: Callable[[RequestContext], Awaitable[Task | None]] | None = None
        self.poll_interval = DEFAULT_POLL_INTERVAL
        self.inline = False  # Our handler drives every cancel: the work runs in the SDK's task.
        # Set by a2a_cancelfix.testing's sweep: it sees each run's cancel points and holds the
        # run at one of them while the cancel lands.
        self.probe: Any = None
        # Tasks whose run returned without ending them (parked, most likely), with the caller
        # that ran them: nothing runs here to notice a cancel another replica records, so our
        # handler looks for them (``on_parked``: a task was added).
        self.parked: dict[str, Any] = {}
        self.on_parked: Callable[[], None] | None = None

    def begin(self, task_id: str, reason: str = "cancel requested", span: Any = None) -> Cancellation:
        """The cancel in progress of ``task_id``, or a new one (its deadline fixed now).

        Its steps are recorded on ``span``, by default the span current here.
        """
        cancellation = self.cancellations.get(task_id)
        if cancellation is None:
            if self.parked:
                self.parked.pop(task_id, None)  # This cancel is the one that ends it.
            span = span if span is not None else _telemetry.current_span()
            cancellation = self.cancellations[task_id] = Cancellation(self, task_id, reason, span)
        return cancellation

    def begin_recorded(self, stored: Task) -> Cancellation:
        """The cancel of a task another replica cancelled in the store, as noticed here.

        Its steps go on a span of their own (see ``_telemetry.remote_cancel_span``), which
        whoever carries it out ends; its task ends CANCELED even if ``cancel()`` raises.
        """
        status = stored.status
        stored_at = status.timestamp.ToMicroseconds() / 1e6 if status.HasField("timestamp") else None
        span = _telemetry.remote_cancel_span(stored.id, stored_at)
        cancellation = self.begin(stored.id, "canceled on another replica", span)
        cancellation.recorded = True
        return cancellation

    def end(self, cancellation: Cancellation) -> None:
        """Forget a cancel, done or given up on; a run still waiting for it stops waiting."""
        cancellation.done.give()
        cancellation._reach(Step.TORN_DOWN)
        if self.cancellations.get(cancellation.task_id) is cancellation:
            del self.cancellations[cancellation.task_id]

    def busy(self, task_id: str) -> bool:
        """Whether an ``execute()`` of ``task_id`` runs, or a cancel of it."""
        return task_id in self.works or task_id in self.cancellations


def _log_dropped(task_id: str, dropped: dict[str, int]) -> None:
    if dropped:
        logger.info(
            "cancel task=%s dropped=%d queued updates the SDK had not saved nor streamed (%s)",
            task_id,
            sum(dropped.values()),
            ", ".join(f"{name}={count}" for name, count in sorted(dropped.items())),
        )


def _uncancel(task: asyncio.Task[Any]) -> None:
    uncancel = getattr(task, "uncancel", None)  # Python 3.11+; 3.10 keeps no count.
    if uncancel is not None and task.cancelling():
        uncancel()


# The run queues that have carried a terminal state, so no later event (from a late run, or
# from a cancel) follows it: weak references, each discarded with its queue. Not a WeakSet,
# whose lookup is a Python call: every event looks here.
_ended: set[weakref.ref[Any]] = set()


def has_ended(queue: Any, context: RequestContext) -> bool:
    """Whether the run's queue carried a terminal state, or the task was stored terminal."""
    task = context.current_task
    return weakref.ref(queue) in _ended or (task is not None and task.status.state in TERMINAL_STATES)


def may_enqueue(queue: Any, event: Any, task_id: str, terminal: bool) -> bool:
    """Whether ``event`` may go in: not once the queue carried a terminal state, which is final.

    Not a coroutine that enqueues too: it runs for every event, and a frame fewer counts.
    """
    if weakref.ref(queue) in _ended:
        logger.debug("Dropped %s after task %s ended", type(event).__name__, task_id)
        return False
    if terminal:
        _ended.add(weakref.ref(queue, _ended.discard))
    return True


class _CancelQueue(wrapt.ObjectProxy):  # type: ignore[misc]
    """The queue ``cancel()`` sees: it may publish CANCELED once; a terminal state is final."""

    def __init__(self, queue: EventQueue, context: RequestContext) -> None:
        super().__init__(queue)
        self._self_context = context

    async def enqueue_event(self, event: Any) -> None:
        state = terminal_state(event)
        if state is not None and state != CANCELED:
            logger.warning(
                "cancel() of task %s published state %s; the task ends CANCELED instead",
                self._self_context.task_id,
                state,
            )
            return
        task_id = self._self_context.task_id or ""
        if may_enqueue(self.__wrapped__, event, task_id, state is not None):
            await self.__wrapped__.enqueue_event(event)

    async def publish(self, state: int) -> bool:
        """Publish the framework's terminal ``state``, unless the run already ended."""
        context = self._self_context
        if weakref.ref(self.__wrapped__) in _ended or context.current_task is None:
            return False  # Already ended, or no task stored yet that a status could update.
        status = TaskStatus(state=state)
        status.timestamp.FromNanoseconds(time.time_ns())  # GetCurrentTime() goes through datetime.
        event = TaskStatusUpdateEvent(
            task_id=context.task_id, context_id=context.context_id or "", status=status
        )
        if not may_enqueue(self.__wrapped__, event, context.task_id or "", True):
            return False
        await self.__wrapped__.enqueue_event(event)
        return True
