"""Every cancel, in one place: from the first request to the run's teardown, from any origin.

A run of the wrapped ``execute()`` is a `Work`; a cancel of its task is a `Cancellation`.
Both are kept per task id in a `Lifecycle`, built once per handler (or per executor proxy
under the SDK's stock handler) with its `Settings` and collaborators. docs/behaviour.md's steps
1-8 are `Lifecycle._drive` and `Cancellation.carry_out`; the handler and the executor proxy are
adapters between the SDK and the lifecycle's entries.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import functools
import logging
import math
import os
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, Literal

from a2a.server.agent_execution import RequestContext
from a2a.types import (
    InternalError,
    Message,
    Part,
    Role,
    Task,
    TaskNotCancelableError,
    TaskNotFoundError,
    TaskState,
    TaskStatus,
    TaskStatusUpdateEvent,
)
from a2a.utils.errors import A2AError

from a2a_cancelfix import _sdk, _telemetry
from a2a_cancelfix._aio import (
    Deadlines,
    Once,
    checked_seconds,
    deadline_in,
    deadlines,
    keep,
    suspended_on,
    wait_done,
    wait_patiently,
)
from a2a_cancelfix._sdk import CANCELED, STATUS_EVENTS, TERMINAL_STATES, drop_backlog, terminal_state
from a2a_cancelfix.checkpoints import Probe, Run, enter_run, leave_run
from a2a_cancelfix.replicas import DEFAULT_POLL_INTERVAL, RemoteCancels
from a2a_cancelfix.unwatched import Watchers

if TYPE_CHECKING:
    from a2a.server.agent_execution import AgentExecutor
    from a2a.server.context import ServerCallContext
    from a2a.server.events.event_queue import EventQueue
    from a2a.server.request_handlers import DefaultRequestHandlerV2
    from a2a.server.tasks import PushNotificationConfigStore

logger = logging.getLogger("a2a_cancelfix")

DEFAULT_GRACE_PERIOD = 5.0
# How long a handler's aclose() may take: pushes sent, pending CANCELED writes tried once more.
DEFAULT_DRAIN_TIME = 5.0
# Time past a cancel's deadline for the SDK to record its terminal state and close the run.
MARGIN = 1.0
# How far a loop's own lateness may stretch the margin (see Cancellation.settled).
LATENESS_LIMIT = 30.0
# How long, after the answer, a run that can close itself gets to do so before it is forced.
PATIENCE = 30.0
# When a stopped run's CANCELED that the store failed to record is tried again: about 10 minutes.
_RECORD_RETRIES = (0.1, 0.5, 1.0, 2.0) + (5.0,) * 120
FAILED = TaskState.TASK_STATE_FAILED

if TYPE_CHECKING:
    AQueue = EventQueue  # What a `QueueProxy` is to the checker, as it is to ``isinstance``.
else:
    AQueue = object


@dataclasses.dataclass(frozen=True)
class Settings:
    """A lifecycle's options, checked once, here (the handler's keywords of the same names).

    Raises:
        TypeError: a number of seconds that is not a number.
        ValueError: zero, negative, NaN or infinite seconds; an unknown policy.
    """

    cancel_grace_period: float = DEFAULT_GRACE_PERIOD
    replica_poll_interval: float | None = DEFAULT_POLL_INTERVAL
    on_parked: Literal["cancel", "refuse"] = "cancel"
    on_canceled: Literal["raise", "return"] = "raise"
    cancel_unwatched_after: float | None = None
    cancel_unwatched_parked: bool = False
    shutdown_drain_time: float = DEFAULT_DRAIN_TIME

    def __post_init__(self) -> None:
        set_checked = functools.partial(object.__setattr__, self)
        set_checked("cancel_grace_period", checked_seconds("cancel_grace_period", self.cancel_grace_period))
        set_checked("shutdown_drain_time", checked_seconds("shutdown_drain_time", self.shutdown_drain_time))
        if self.replica_poll_interval is not None:
            set_checked(
                "replica_poll_interval", checked_seconds("replica_poll_interval", self.replica_poll_interval)
            )
        if self.cancel_unwatched_after is not None:
            set_checked(
                "cancel_unwatched_after",
                checked_seconds("cancel_unwatched_after", self.cancel_unwatched_after),
            )
        if not isinstance(self.cancel_unwatched_parked, bool):
            raise TypeError(
                f"cancel_unwatched_parked must be True or False, not {self.cancel_unwatched_parked!r}"
            )
        if self.cancel_unwatched_parked and self.cancel_unwatched_after is None:
            raise ValueError("cancel_unwatched_parked needs cancel_unwatched_after")
        if self.on_parked not in ("cancel", "refuse"):
            raise ValueError(f"on_parked must be 'cancel' or 'refuse', not {self.on_parked!r}")
        if self.on_canceled not in ("raise", "return"):
            raise ValueError(f"on_canceled must be 'raise' or 'return', not {self.on_canceled!r}")


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


class Work(Run):
    """One run of the wrapped ``execute()``: its cancellation scope (a `Run`), where the work
    runs, and whether it has ended.

    Inline, it runs in the SDK's own task for the run; apart, in a task of its own that the
    SDK's teardown of the run cannot reach (the stock handler cancels the run itself).
    """

    # Defaults, until a run sets its own: every message builds a Work, few cancel it.
    runner: asyncio.Task[Any] | None = None
    settled: asyncio.Future[None] | None = None  # Apart: ended or abandoned.
    ended = False
    # Its queue carried the task's terminal state (see `RunQueue`): nothing more goes in.
    task_ended = False
    interrupted = False
    abandoned = False
    # The await the work was suspended at when the cancel came, not yet done (None: it was
    # running, or its await had returned and it waited in the loop's queue to resume), and
    # whether the run had ``on_cancel`` callbacks then.
    found_at: asyncio.Future[Any] | None = None
    had_callbacks = False
    _ended: Once | None = None  # Made by the first wait for the end.

    def signalled(self) -> None:
        """The cancel has come, its callbacks not fired yet: note where the work waits."""
        if self.runner is not None:
            waiting: Any = suspended_on(self.runner)
            self.found_at = None if waiting is None or waiting.done() else waiting
            self.had_callbacks = bool(self._callbacks)

    @property
    def aborted_by_callback(self) -> bool:
        """Whether an ``on_cancel`` callback of the run aborted the await the cancel found it
        at: the work unwinds from that, and may be releasing what it holds.

        An await that returned normally, or on its own, moved nothing of ours: such work is
        interrupted at its next suspension, as the SDK's own cancel does.
        """
        found = self.found_at
        if found is None or not self.had_callbacks:
            return False
        cancelling = getattr(found, "cancelling", None)  # A task's, from Python 3.11.
        if cancelling is not None and cancelling():  # A task still unwinding.
            return True
        return found.done() and (found.cancelled() or found.exception() is not None)

    async def run_inline(self, work: Awaitable[None]) -> None:
        """Run the work in this task, inside the run's scope; a cancel of the task ends it normally."""
        self.runner = asyncio.current_task()
        token = enter_run(self)
        try:
            await work
        except asyncio.CancelledError:
            if not self.cancelled:
                raise  # Not the task's cancel: the SDK is tearing the run down.
        except Exception as error:
            if not self.cancelled:
                raise
            logger.debug("execute() of cancelled task %s raised", self.task_id, exc_info=error)
        finally:
            leave_run(token)  # Before anything else runs in this task: it is not the work.
            if self.interrupted and self.runner is not None:
                _uncancel(self.runner)  # Our interrupt is handled; the SDK's task runs on.
            self._end()

    def start_apart(self, work: Awaitable[None]) -> None:
        """Run the work in a task of its own, inside the run's scope (the task's copy of it)."""
        token = enter_run(self)
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
        work = self.runner
        assert work is not None
        if self.cancelled:
            if work.done() and not work.cancelled() and work.exception() is not None:
                logger.debug("execute() of cancelled task %s raised", self.task_id, exc_info=work.exception())
            return
        if work.cancelled():
            raise asyncio.CancelledError
        error = work.exception()
        if error is not None:
            raise error

    async def stop(self, deadline: float, name: str) -> None:
        """Let a shielded section finish, interrupt the work unless it already unwinds, wait.

        Work is interrupted at once unless it unwinds from the cancel already (a checkpoint
        raised in it, a ``@cancellable`` step failed, an ``on_cancel`` callback aborted its
        call) or is about to (a checkpoint's look, which raises as it returns): such work may
        be releasing what it holds, and is interrupted only at ``deadline``. Past it, the
        work is abandoned: nothing it enqueues goes in.
        """
        if self.ended or self.abandoned or self.runner is None:
            return
        if self.shielded:
            await self.wait_unshielded(deadline)
            if self.shielded:
                logger.warning(
                    "%s.execute() of task %s was still in a shielded section at the end of the "
                    "grace period; it is cut at %s",
                    name,
                    self.task_id,
                    _where(self.runner),
                )
        if not (self.ended or self.unwinding or self.looking or self.aborted_by_callback):
            self._interrupt()
        if not await self._wait_ended(deadline) and not self.interrupted:
            self._interrupt()  # Its cleanup has not ended within the grace period.
            await self._wait_ended(deadline)  # The one loop turn it gets to end in.
        if not self.ended:
            self.abandoned = True
            self._settle()
            logger.warning(
                "%s.execute() ignored the cancel of task %s for the whole grace period; "
                "it is abandoned and nothing it enqueues reaches the task",
                name,
                self.task_id,
            )

    def _interrupt(self) -> None:
        assert self.runner is not None
        if not self.interrupted:  # Once: inline, each interrupt is one cancel to undo.
            self.interrupted = True
            self.runner.cancel()

    def _end(self) -> None:
        self.ended = True
        if self._ended is not None:
            self._ended.give()

    async def _wait_ended(self, deadline: float) -> bool:
        """Wait until the work ends or the loop's clock reaches ``deadline``; whether it ended."""
        if self._ended is None:
            if self.ended:
                return True
            self._ended = Once()
        return await self._ended.wait(deadline)

    def _on_ended(self, _: object) -> None:
        self._end()
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
        self.deadline = deadline_in(lifecycle.settings.cancel_grace_period)
        self.step = Step.REQUESTED
        self.work = lifecycle.works.get(task_id)
        self.failure: BaseException | None = None  # What the executor's cancel() raised.
        # The store holds CANCELED already (another replica recorded it): that is how the
        # task ends, even if cancel() raises here.
        self.recorded = False
        self.callers: list[asyncio.Future[Task]] = []
        # Said in the log, telemetry and the CANCELED status of a cancel with an origin of its
        # own (nobody watched the task): the path, and the status message's text.
        self.path: str | None = None
        self.message: str | None = None
        self.done = Once()  # Published, or given up on: execute() may return.
        self._call: asyncio.Future[None] | None = None
        self._cut_off_at: tuple[Deadlines, list[Any]]  # Set as the call starts: its deadline's entry.
        self._returned = Once()
        self._settle_by: float | None = None  # Fixed by the first wait for the SDK's part.
        # The direct CANCELED write's first attempt (the task as it ends up, or what the store
        # raised), and the time the answer waits for it until: both fixed as it starts.
        self.writing: asyncio.Future[Task | Exception | None] | None = None
        self.write_by: float | None = None
        self.write_outlived = False  # The answer came first: the write goes on behind it.

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
        publisher = _CancelQueue(queue, context)
        if publish_first:
            self.signal(queue)
            await self._publish(publisher)
        self.call_cancel(context, publisher)
        await self.cancel_returned()
        if self.work is not None:
            self.reach(Step.STOPPING)
            await self.work.stop(self.deadline, self.lifecycle.name)
            if self.step < Step.STOPPED:
                _telemetry.step(self.span, "work_stopped", abandoned=self.work.abandoned)
        self.reach(Step.STOPPED)
        await self._publish(publisher)
        self.done.give()

    def call_cancel(self, context: RequestContext, queue: _CancelQueue) -> None:
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

    async def _run_cancel(self, context: RequestContext, queue: _CancelQueue) -> None:
        self.signal(queue.__wrapped__)
        self.reach(Step.CALLING)
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
            timers, cut_off = self._cut_off_at
            timers.drop(cut_off)

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
            # The cancel goes on now, whether or not cancel() lets itself be interrupted.
            self._returned.give()

    async def _publish(self, queue: _CancelQueue) -> None:
        state = FAILED if self.failure is not None and not self.recorded else CANCELED
        if await queue.publish(state, self.message if state == CANCELED else None):
            _telemetry.step(self.span, "terminal_published", state=TaskState.Name(state))
        self.reach(Step.PUBLISHED)

    def reach(self, step: Step) -> None:
        self.step = max(self.step, step)


class Lifecycle:
    """Every cancel of one executor's tasks, from any origin, in docs/behaviour.md's order (steps 1-8).

    Built once, with all it needs: by our handler (``handler``: the SDK's handler whose
    registry, store and own cancel it uses; ``store``: the task store the handler was given),
    or by a `CancellableExecutor` under the SDK's stock handler (neither). Nothing configures
    it afterwards.

    Entries, one per origin, each through `Cancellation` and `_drive`:

    - `request`: a client's CancelTask here (and, if its client leaves, the same cancel
      resumed without it);
    - `noticed_parked`: a task parked here that another replica cancelled in the store;
    - `noticed_in_run`: a run here whose look found its task cancelled by another replica;
    - `requested_by_sdk`: the stock handler calling the proxy's ``cancel()``;
    - `unwatched`: a task here that nobody watched for ``cancel_unwatched_after`` seconds.

    Args:
        executor: the wrapped executor, whose ``cancel()`` a cancel calls.
        settings: the options, checked.
        handler: our handler (the SDK's class), or None under the stock handler.
        store: the task store given to ``handler``.
        solo: the bare ``InMemoryTaskStore`` the user gave, if so (see `RemoteCancels`).
        push_configs: the handler's push config store (a task with a config is watched).
        probe: a2a_cancelfix.testing's sweep, which sees each run's cancel points.
    """

    def __init__(
        self,
        executor: AgentExecutor,
        settings: Settings,
        *,
        handler: DefaultRequestHandlerV2 | None = None,
        store: Any = None,
        solo: Any = None,
        push_configs: PushNotificationConfigStore | None = None,
        probe: Probe | None = None,
    ) -> None:
        self.executor = executor
        self.name = executor.__class__.__name__  # A proxy's too, as isinstance sees it.
        self.settings = settings
        self.probe = probe
        self.handler = handler
        # Under our handler, which drives every cancel, the work runs in the SDK's own task;
        # else the SDK's own cancel drives, and the work runs apart.
        self.inline = handler is not None and _sdk.SUPPORTED
        self.works: dict[str, Work] = {}
        self.cancellations: dict[str, Cancellation] = {}
        # Tasks whose run returned without ending them (parked, most likely), with the caller
        # that ran them: nothing runs here to notice a cancel another replica records.
        self.parked: dict[str, ServerCallContext] = {}
        # Follow-up messages accepted for a running task that no run has taken yet, by id.
        self._follow_ups: set[str] = set()
        # Direct CANCELED writes in progress, retries included, by task: a stream whose run
        # was closed before its end was recorded waits for it (see `stored_end`).
        self.recording: dict[str, asyncio.Future[None]] = {}
        self._closing = Once()  # The handler's aclose(): pending writes try once more, then stop.
        self.remote = (
            None
            if handler is None
            else RemoteCancels(self, handler, store, settings.replica_poll_interval, solo)
        )
        after = settings.cancel_unwatched_after
        self.watchers = (
            None
            if self.remote is None or after is None
            else Watchers(self, after, settings.cancel_unwatched_parked, store, push_configs, self.remote)
        )

    @property
    def _handler(self) -> DefaultRequestHandlerV2:
        """The handler this lifecycle was built for: only its paths (not the proxy's) reach here."""
        assert self.handler is not None
        return self.handler

    # The origins.

    async def request(self, task_id: str, caller: ServerCallContext) -> Task:
        """Carry out a client's cancel of ``task_id``; the task CANCELED, or an A2A error.

        Raises:
            TaskNotFoundError, TaskNotCancelableError, InternalError: see the handler.
        """
        cancellations = self.cancellations
        # A cancel in progress is joined before any await: its outcome is this one's too.
        joined = cancellations.get(task_id)
        answer = None if joined is None else joined.join()
        try:
            task = await self.read(task_id, caller)  # Owner-scoped: joining needs it too.
            if task is None:
                _log_cancel(task_id, "unknown task", "TaskNotFound", 0.0, False)
                raise TaskNotFoundError
            # Looked up once, so that a cancel resumed without its caller takes the same path.
            active = await _sdk.live_task(self._handler, task_id)
        except BaseException:
            if answer is not None:
                answer.cancel()
            raise
        joined = cancellations.get(task_id)  # One may have begun during those awaits.
        if answer is None and joined is not None:
            answer = joined.join()
        if answer is not None:
            return await _joined(task_id, answer)
        self._refuse_unless_cancelable(task)
        if task.status.state == CANCELED:  # on_canceled="return"
            _log_cancel(task.id, "already canceled", "CANCELED", 0.0, False)
            return task
        cancellation = self.begin(task_id)
        answer = cancellation.join()
        try:
            # The first caller drives the cancel itself: a task of its own would cost a
            # wake-up at each end, a tenth of a fast cancel.
            await self._drive(cancellation, task, active, caller)
        except asyncio.CancelledError:
            # Its client went away. The cancel goes on without it, from the top: every step
            # it had done is done once, every wait ends at the same deadline.
            answer.cancel()
            keep(self._drive(cancellation, task, active, caller))
            raise
        return answer.result()

    async def noticed_parked(self, stored: Task, active: _sdk.LiveRun, caller: ServerCallContext) -> None:
        """Carry out here the cancel another replica recorded for a task parked here."""
        cancellation = self.begin_recorded(stored)
        try:
            await self._drive(cancellation, stored, active, caller)
        finally:
            _telemetry.end(cancellation.span)

    async def noticed_in_run(self, context: RequestContext, queue: EventQueue, stored: Task) -> None:
        """Carry out here the cancel another replica recorded for a task this replica runs.

        Called by the run's look, often from a checkpoint of the run itself: the callbacks
        fire and ``cancel()`` returns before the look does, so the checkpoint raises after
        them, as on every other path; the rest goes on behind it.
        """
        if stored.id in self.cancellations:
            return
        cancellation = self.begin_recorded(stored)
        here = RequestContext(
            call_context=context.call_context, task_id=stored.id, context_id=stored.context_id, task=stored
        )
        cancellation.signal(queue)
        cancellation.call_cancel(here, _CancelQueue(queue, here))

        async def carry_out() -> None:
            try:
                await self._drive(cancellation, stored, None, None, here=(here, queue))
            finally:
                _telemetry.end(cancellation.span)

        try:
            await cancellation.cancel_returned()
        finally:  # Started only now: the checkpoint that looked raises before it stops the work.
            keep(carry_out())

    async def unwatched(self, task: Task, active: Any, caller: ServerCallContext, after: float) -> None:
        """Cancel ``task``, whose run here is ``active``, as a client's cancel would: nobody
        watched it for ``after`` seconds (see unwatched.py)."""
        if task.id in self.cancellations:
            return
        why = f"Canceled: nobody watched the task for {after:g} s (no stream, blocking sender or push config)"
        span = _telemetry.unwatched_span(task.id, after)
        cancellation = self.begin(task.id, why, span)
        cancellation.path, cancellation.message = "unwatched", why
        try:
            with _telemetry.current(span):
                await self._drive(cancellation, task, active, caller)
        finally:
            _telemetry.end(span)

    async def requested_by_sdk(self, context: RequestContext, queue: EventQueue) -> None:
        """Carry out the stock handler's cancel, on the queue it gives; raise what ``cancel()`` raised."""
        cancellation = self.begin(context.task_id or "")
        # A parked run's queue is closed by the stock handler on its own: CANCELED first.
        await self._drive(cancellation, None, None, None, here=(context, queue))
        if cancellation.failure is not None:  # FAILED is published; the SDK answers with it.
            raise cancellation.failure

    async def close_run(self, task_id: str) -> None:
        """See that the run here of a task whose end the store refused closes, as after a cancel.

        In upstream's cluster mode on a2a-sdk 1.2.0-1.2.2 such a run never closes by itself:
        its teardown waits for good for a stream to take the SDK's request marker.
        """
        active = await _sdk.run_of(self._handler, task_id)
        if active is not None:
            _tear_down(active, task_id)

    # The runs.

    def follow_up_accepted(self, message_id: str) -> None:
        """A message to an existing task is handed to the SDK: it waits for a run to take it."""
        self._follow_ups.add(message_id)

    def follow_up_unprocessed(self, message_id: str) -> bool:
        """Forget a follow-up; whether no run has taken it (its task ended first)."""
        if message_id in self._follow_ups:
            self._follow_ups.discard(message_id)
            return True
        return False

    def start(self, task_id: str, context: RequestContext, queue: EventQueue) -> Work:
        """A run of ``execute()`` of ``task_id`` begins: its scope, watching for remote cancels
        if any can come."""
        if self._follow_ups and context.message is not None:
            self._follow_ups.discard(context.message.message_id)  # Taken: this run processes it.
        if self.parked:
            self.parked.pop(task_id, None)  # Running again: the run looks for itself.
        if self.watchers is not None:
            self.watchers.run_started(context)
        remote = self.remote
        if remote is not None and remote.watching:
            look = functools.partial(self._look, context, queue)
            work = Work(task_id, look, remote.interval, self.probe)
        else:
            work = Work(task_id, None, math.inf, self.probe)
        self.works[task_id] = work
        return work

    def forget(self, work: Work) -> None:
        """A run of ``execute()`` has returned."""
        task_id = work.task_id
        if self.works.get(task_id) is work:
            del self.works[task_id]
            if self.watchers is not None:
                self.watchers.run_ended(task_id)

    def parked_here(self, task_id: str, caller: ServerCallContext) -> None:
        """A run returned without ending its task: another replica may cancel it meanwhile."""
        if self.watchers is not None:
            self.watchers.parked(task_id)
        if self.remote is not None and self.remote.watching:
            self.parked[task_id] = caller
            self.remote.look_at_parked_soon()

    async def _look(self, context: RequestContext, queue: EventQueue) -> None:
        """A run's watch: read the task, and carry out here a cancel another replica stored."""
        assert self.remote is not None
        try:
            stored = await self.remote.read_for(context)
        except Exception:  # A store hiccup must not fail the run; the next look retries.
            logger.warning(
                "could not read task %s to look for a remote cancel", context.task_id, exc_info=True
            )
            return
        if stored is not None and stored.status.state == CANCELED:
            await self.noticed_in_run(context, queue, stored)

    # Steps 1 (begin) and 8 (end).

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
        cancellation.reach(Step.TORN_DOWN)
        if self.cancellations.get(cancellation.task_id) is cancellation:
            del self.cancellations[cancellation.task_id]

    def busy(self, task_id: str) -> bool:
        """Whether an ``execute()`` of ``task_id`` runs, or a cancel of it."""
        return task_id in self.works or task_id in self.cancellations

    async def read(self, task_id: str, caller: ServerCallContext) -> Task | None:
        """The task as the caller may see it; a failing store is an A2A error."""
        try:
            return await _sdk.read_task(self._handler, task_id, caller)
        except A2AError:
            raise
        except Exception as error:
            logger.warning("could not read task %s from the task store", task_id, exc_info=True)
            raise InternalError(message=f"The task store failed: {type(error).__name__}") from error

    # Steps 2-8, on every path.

    async def _drive(
        self,
        cancellation: Cancellation,
        task: Task | None,
        active: _sdk.LiveRun | None,
        caller: ServerCallContext | None,
        *,
        here: tuple[RequestContext, EventQueue] | None = None,
    ) -> None:
        """Carry the cancel out (steps 2-6), answer every caller (7), let the run close (8).

        ``here``: the run's context and queue, where the cancel is carried out on them (a
        look in the run, the stock handler's ``cancel()``); else ``task``, read by
        ``caller``, whose run here is ``active`` (None: not live here). Interrupted, it
        answers nobody and can be called again to finish.
        """
        outcome: Task | BaseException | None = None
        try:
            if here is not None:
                context, queue = here
                await cancellation.carry_out(context, queue, publish_first=cancellation.work is None)
            else:
                assert task is not None and caller is not None
                outcome = await self._cancel(cancellation, task, active, caller)
        except A2AError as error:
            outcome = error
        except Exception as error:  # A store that fails mid-cancel: every caller learns it.
            logger.warning("the cancel of task %s failed", cancellation.task_id, exc_info=True)
            outcome = InternalError(message=f"The cancel failed: {type(error).__name__}")
        finally:
            if here is not None:  # Nothing resumes a cancel carried out on a run's queue.
                self.end(cancellation)
        if here is not None:
            return
        assert outcome is not None
        cancellation.answer(outcome)
        self.end(cancellation)
        if active is not None:  # Behind the answers, so that it does not delay them.
            asyncio.get_running_loop().call_soon(_tear_down, active, cancellation.task_id)

    async def _cancel(
        self, cancellation: Cancellation, task: Task, active: _sdk.LiveRun | None, caller: ServerCallContext
    ) -> Task:
        """Cancel ``task``, whose run here is ``active`` (None: it has none live here)."""
        started = time.monotonic()
        if active is not None:
            path = "parked" if task.status.state in _sdk.PARKED_STATES else "live"
            path = "parked, canceled elsewhere" if cancellation.recorded else path
            path = cancellation.path or path
            result = await self._cancel_live(cancellation, active, task, caller)
        elif _sdk.SUPPORTED and not _sdk.SDK_CANCELS_WHERE_NOT_LIVE:
            path, result = "not live here", await self._write_canceled(cancellation, task.id, caller)
        else:
            path, result = "not live here (SDK)", await self._cancel_by_sdk(task.id, caller, cancellation)
        state = result.status.state
        _log_cancel(task.id, path, _state_name(result), time.monotonic() - started, cancellation.late)
        if state == CANCELED:
            return result
        if state == FAILED and cancellation.failure is not None:
            raise InternalError(message=f"The agent failed to cancel task {task.id}; the task has FAILED")
        raise TaskNotCancelableError(
            message=f"Task {task.id} reached {_state_name(result)} before the cancel"
        )

    async def _cancel_live(
        self, cancellation: Cancellation, active: _sdk.LiveRun, task: Task, caller: ServerCallContext
    ) -> Task:
        """Cancel a run of this process; return the task as it ended."""
        context = RequestContext(call_context=caller, task_id=task.id, context_id=task.context_id, task=task)
        await cancellation.carry_out(context, _sdk.agent_queue(active))
        recorded = await cancellation.settled(functools.partial(_sdk.wait_finished, active))
        result = await self.read(task.id, caller)
        if not recorded or result is None or result.status.state not in TERMINAL_STATES:
            logger.warning("task %s did not record a terminal state; CANCELED is written directly", task.id)
            _telemetry.teardown_forced(task.id)
            closed = functools.partial(_sdk.force_close, active, MARGIN)
            return await self._write_canceled(cancellation, task.id, caller, after=closed, stopped=True)
        return result

    async def _cancel_by_sdk(
        self, task_id: str, caller: ServerCallContext, cancellation: Cancellation
    ) -> Task:
        """Defer to the SDK (1.2.0+ cancels a task not live here correctly), bounded."""
        call = asyncio.ensure_future(_sdk.sdk_cancel(self._handler, task_id, caller))
        # Not wait_for, which cancels it and waits for it to unwind: a write that waits for a
        # locked row unwinds only once the lock is released.
        if not await wait_done(call, cancellation.deadline + MARGIN):
            call.add_done_callback(_retrieve)
            logger.warning("the SDK's cancel of task %s hung; CANCELED is written directly", task_id)
            written = await self._write_canceled(cancellation, task_id, caller)
            # Moot now. Left alone while the write waits: both may wait for the same lock, and
            # a store interrupted mid-statement can leave its connection stuck (aiosqlite).
            call.cancel()
            return written
        # TaskNotCancelable: another cancel, or the run's own end, came first: the store says which.
        with contextlib.suppress(TaskNotCancelableError):
            call.result()
        # Read back: the SDK answers with its own copy, even where a guarded store refused it.
        stored = await self.read(task_id, caller)
        if stored is None:
            raise TaskNotFoundError
        return stored

    async def _write_canceled(
        self,
        cancellation: Cancellation,
        task_id: str,
        caller: ServerCallContext,
        *,
        after: Callable[[], Awaitable[None]] | None = None,
        stopped: bool = False,
    ) -> Task:
        """Record CANCELED directly in the store (``after`` the run is closed, if given); the
        task as it ends up, within one margin, never past it.

        The write runs in a task of its own. One that waits longer (for a row another
        transaction holds locked, say) goes on behind an `InternalError` that says so, and
        lands, or is retried until it does. ``stopped``: the run here has been stopped, so a
        write that fails is retried too, so that the task never stays WORKING with nothing
        running anywhere.
        """
        if cancellation.writing is None:
            loop = asyncio.get_running_loop()
            cancellation.write_by = max(cancellation.deadline, loop.time()) + MARGIN
            cancellation.writing = loop.create_future()
            self.recording[task_id] = keep(self._record(cancellation, task_id, caller, after, stopped))
        writing, write_by = cancellation.writing, cancellation.write_by
        assert write_by is not None
        if not await wait_patiently(
            functools.partial(wait_done, writing), write_by, write_by + LATENESS_LIMIT
        ):
            cancellation.write_outlived = True
            logger.warning("task %s: the store has not recorded CANCELED in time; the write goes on", task_id)
            raise InternalError(
                message=f"The task store has not recorded CANCELED yet for task {task_id}; the write "
                "goes on behind this answer (read the task to see it land)"
            )
        result = writing.result()
        if isinstance(result, Exception):
            if stopped:
                raise InternalError(
                    message=f"The task store failed to record CANCELED for task {task_id} "
                    f"({type(result).__name__}); it is retried behind this answer"
                ) from result
            raise result
        if result is None:
            raise TaskNotFoundError
        return result

    async def _record(
        self,
        cancellation: Cancellation,
        task_id: str,
        caller: ServerCallContext,
        after: Callable[[], Awaitable[None]] | None,
        stopped: bool,
    ) -> None:
        """The direct write: its first attempt's outcome goes to ``cancellation.writing``.

        A failure after the run here was stopped, or after the answer promised that the write
        goes on, is retried behind the answer (0.1 s, then up to every 5 s, about 10 minutes).
        """
        first = cancellation.writing
        assert first is not None
        try:
            if after is not None:
                await after()
            try:
                first.set_result(await _sdk.write_canceled(self._handler, task_id, caller))
                return
            except Exception as error:
                logger.warning("could not record CANCELED of task %s: %r", task_id, error)
                first.set_result(error)
            if stopped or cancellation.write_outlived:
                await self._record_later(task_id, caller)
        finally:
            if not first.done():
                first.cancel()
            if self.recording.get(task_id) is asyncio.current_task():
                del self.recording[task_id]

    async def _record_later(self, task_id: str, caller: ServerCallContext) -> None:
        """Retry recording the CANCELED of a task, backing off, until the store takes it; once
        the handler closes, once more at once, and no more."""
        for delay in _RECORD_RETRIES:
            closing = await self._closing.wait(deadline_in(delay))
            try:
                await _sdk.write_canceled(self._handler, task_id, caller)
            except Exception as error:
                if closing:
                    logger.warning(
                        "task %s: the store did not record CANCELED before the shutdown (%r); "
                        "it still shows the task as it was",
                        task_id,
                        error,
                    )
                    return
                logger.debug("recording CANCELED of task %s failed again: %r", task_id, error)
                continue
            logger.info("cancel task=%s recorded CANCELED after the store failed at first", task_id)
            return
        logger.error("cancel task=%s: the store never recorded CANCELED; the task shows WORKING", task_id)

    async def drain(self, deadline: float) -> None:
        """For the handler's shutdown: each pending CANCELED write is tried once more, at once,
        and waited for until ``deadline``. One that has not ended by then is named in a WARNING
        and left to land if it can: a store cut off mid-statement can keep its connection stuck.
        """
        self._closing.give()
        pending = list(self.recording.items())
        for _, writing in pending:
            await wait_done(writing, deadline)
        for task_id, writing in pending:
            if not writing.done():
                logger.warning(
                    "task %s: the store had not recorded CANCELED by the end of shutdown_drain_time",
                    task_id,
                )

    async def stored_end(self, task_id: str, caller: ServerCallContext) -> Task | None:
        """For a stream of ``task_id`` that ended with no terminal event: if its run was closed
        while its CANCELED was still being written, the task once the write is over (landed,
        or given up on), as stored; else None.
        """
        recording = self.recording.get(task_id)
        if recording is None:
            return None
        await asyncio.wait([recording])  # Not cancelled with this stream: others wait for it too.
        return await self.read(task_id, caller)

    def _refuse_unless_cancelable(self, task: Task) -> None:
        state = task.status.state
        if state in TERMINAL_STATES:
            if state == CANCELED and self.settings.on_canceled == "return":
                return
            _log_cancel(task.id, "already terminal", "TaskNotCancelable", 0.0, False)
            raise TaskNotCancelableError(message=f"Task {task.id} is already in a terminal state")
        if state in _sdk.PARKED_STATES and self.settings.on_parked == "refuse":
            _log_cancel(task.id, "parked, refused", "TaskNotCancelable", 0.0, False)
            raise TaskNotCancelableError(
                message=f"Task {task.id} is waiting for input and this server keeps such tasks"
            )


def _retrieve(call: asyncio.Future[Any]) -> None:
    """Take the outcome of a call left behind, so that asyncio does not report it."""
    if not call.cancelled():
        call.exception()


def _tear_down(active: _sdk.LiveRun, task_id: str) -> None:
    """Let the run close itself; force it closed if it does not in time."""
    # Up to a2a-sdk 1.2.2 no run closes itself (see _sdk.RUNS_CLOSE_THEMSELVES): the margin
    # is only a courtesy there. Later, a run gets long enough to close on a loop busy with
    # thousands of cancels; only one held by an execute() that swallows the cancel needs it.
    settle_by = deadline_in(PATIENCE if _sdk.RUNS_CLOSE_THEMSELVES else MARGIN)
    span = _telemetry.current_span()  # The cancel's: the forced close is recorded under it.

    def stuck() -> None:
        logger.debug("run of task %s did not close in time; it is force-closed", task_id)
        _telemetry.teardown_forced(task_id, span)
        keep(_sdk.force_close(active, MARGIN))

    _sdk.unless_closed_by(active, settle_by, stuck)


async def _joined(task_id: str, answer: asyncio.Future[Task]) -> Task:
    """The answer of the cancel in progress that this request joined."""
    started = time.monotonic()
    try:
        task = await answer
    except A2AError as error:
        _telemetry.cancel_answered(task_id, "joined", type(error).__name__.removesuffix("Error"), 0.0, False)
        raise
    _telemetry.cancel_answered(task_id, "joined", _state_name(task), time.monotonic() - started, False)
    return task


def _log_cancel(task_id: str, path: str, outcome: str, took: float, late: bool) -> None:
    logger.info(
        "cancel task=%s path=%s outcome=%s took=%.3fs grace_exhausted=%s",
        task_id,
        path,
        outcome,
        took,
        late,
    )
    _telemetry.cancel_answered(task_id, path, outcome, took, late)


def _state_name(task: Task) -> str:
    return _sdk.state_name(task.status.state)


def _log_dropped(task_id: str, dropped: dict[str, int]) -> None:
    if dropped:
        logger.info(
            "cancel task=%s dropped=%d queued updates the SDK had not saved nor streamed (%s)",
            task_id,
            sum(dropped.values()),
            ", ".join(f"{name}={count}" for name, count in sorted(dropped.items())),
        )


def _where(task: asyncio.Task[Any]) -> str:
    """Where a task's work is suspended: its innermost await outside this package and asyncio."""
    place = "an unknown point"
    link: Any = task.get_coro()  # Then what each one awaits: a coroutine, a generator, a future.
    while link is not None:
        frame = getattr(link, "cr_frame", None) or getattr(link, "gi_frame", None)
        if frame is None:
            break
        if not frame.f_code.co_filename.startswith(_FRAMEWORK):
            place = f"{frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})"
        link = getattr(link, "cr_await", None) or getattr(link, "gi_yieldfrom", None)
    return place


# This package's frames, and asyncio's: the await that was cut is the one that called them.
_FRAMEWORK = (os.path.dirname(__file__), os.path.dirname(asyncio.__file__))


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
    if _ended and weakref.ref(queue) in _ended:  # Often empty: no weak reference made then.
        return True
    task = context.current_task
    return task is not None and task.status.state in TERMINAL_STATES


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


class QueueProxy(AQueue):
    """A run's queue as ``execute()`` or ``cancel()`` sees it: what they may call of a queue is
    ``enqueue_event``, which a subclass checks; anything else is the real queue's, and to
    ``isinstance`` this is one.

    Not a wrapt proxy: every message builds one and sends each of its events through it, and
    a subclass of wrapt's C proxy reads each of its own attributes through CPython's generic
    ``__getattr__`` hook, with a type lookup each time (a fifth of the instructions a message
    costs ours over stock, BENCHMARKS.md, 2026-12-05); slots are read through the
    interpreter's own caches.
    """

    __slots__ = ("__wrapped__",)

    def __init__(self, queue: EventQueue) -> None:
        self.__wrapped__ = queue

    @property  # type: ignore[misc]  # `isinstance(queue, EventQueue)` holds, as for the real one.
    def __class__(self) -> type:
        return type(self.__wrapped__)

    def __getattr__(self, name: str) -> Any:
        if name == "__wrapped__":  # Not set (a copy made without __init__): no recursion.
            raise AttributeError(name)
        return getattr(self.__wrapped__, name)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} of {self.__wrapped__!r}>"


class RunQueue(QueueProxy):
    """The queue ``execute()`` sees: every enqueue is a checkpoint; a terminal state is final."""

    __slots__ = ("_run",)

    def __init__(self, queue: EventQueue, run: Work) -> None:
        self.__wrapped__ = queue  # Not super().__init__(): one is built for every message.
        self._run = run

    def enqueue_event(self, event: Any) -> Coroutine[Any, Any, None]:
        """Enqueue ``event`` unless the run was cancelled (then raise) or the task has ended.

        Not a coroutine function: every event of every run comes through here, and a run
        with nothing to look for and no cancel hands back the queue's own coroutine, a frame
        fewer for each event.
        """
        run = self._run
        # Only a cancel (which cancels the run first) or the run's own end can end its queue
        # while it runs: until then, `_ended` need not be asked.
        if run.cancelled or run.watched or run.task_ended:
            return self._enqueue_looked(event)
        queue = self.__wrapped__
        if type(event) in STATUS_EVENTS and event.status.state in TERMINAL_STATES:
            run.task_ended = True
            _ended.add(weakref.ref(queue, _ended.discard))
        return queue.enqueue_event(event)

    async def _enqueue_looked(self, event: Any) -> None:
        run = self._run
        terminal = terminal_state(event) is not None
        if not run.cancelled and (terminal or time.monotonic() >= run.next_look):
            # Before ending the task above all: another replica may have cancelled it.
            await run.look_in_run()
        if run.cancelled:
            if run.shielded:
                logger.debug("Dropped %s enqueued by cancelled task %s", type(event).__name__, run.task_id)
                return
            run.raise_if_cancelled()
        if may_enqueue(self.__wrapped__, event, run.task_id, terminal):
            run.task_ended = run.task_ended or terminal
            await self.__wrapped__.enqueue_event(event)


class _CancelQueue(QueueProxy):
    """The queue ``cancel()`` sees: it may publish CANCELED once; a terminal state is final."""

    __slots__ = ("_context",)

    def __init__(self, queue: EventQueue, context: RequestContext) -> None:
        super().__init__(queue)
        self._context = context

    async def enqueue_event(self, event: Any) -> None:
        state = terminal_state(event)
        if state is not None and state != CANCELED:
            logger.warning(
                "cancel() of task %s published state %s; the task ends CANCELED instead",
                self._context.task_id,
                state,
            )
            return
        task_id = self._context.task_id or ""
        if may_enqueue(self.__wrapped__, event, task_id, state is not None):
            await self.__wrapped__.enqueue_event(event)

    async def publish(self, state: TaskState, why: str | None = None) -> bool:
        """Publish the framework's terminal ``state``, unless the run already ended; ``why``
        is its status message's text."""
        context = self._context
        if weakref.ref(self.__wrapped__) in _ended or context.current_task is None:
            return False  # Already ended, or no task stored yet that a status could update.
        status = TaskStatus(state=state)
        if why is not None:
            status.message.CopyFrom(
                Message(
                    role=Role.ROLE_AGENT,
                    message_id=f"{context.task_id}-canceled",
                    task_id=context.task_id or "",
                    context_id=context.context_id or "",
                    parts=[Part(text=why)],
                )
            )
        status.timestamp.FromNanoseconds(time.time_ns())  # GetCurrentTime() goes through datetime.
        event = TaskStatusUpdateEvent(
            task_id=context.task_id, context_id=context.context_id or "", status=status
        )
        if not may_enqueue(self.__wrapped__, event, context.task_id or "", True):
            return False
        await self.__wrapped__.enqueue_event(event)
        return True
