"""CancellableExecutor: a transparent proxy that makes any AgentExecutor cancel correctly.

``execute()`` runs the wrapped executor's ``execute()`` inside a cancellation scope (see
checkpoints.py). That lets a cancel stop the work at checkpoints, wait for shielded
sections, and keep the run's event queue open until CANCELED is in it. Under the stock
handler the work runs in a task of its own, which the SDK's teardown of the run cannot
reach, even where it comes before ``cancel()`` (a2a-sdk 1.0.0-1.1.3); under our handler,
which drives every cancel itself, it runs in the SDK's own task. The wrapped ``cancel()``
always runs in a task of its own, once per cancel, cut off at the grace period.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

import wrapt
from a2a.server.agent_execution import RequestContext
from a2a.types import Task, TaskStatus, TaskStatusUpdateEvent

from a2a_cancelfix._aio import wait_set
from a2a_cancelfix._sdk import CANCELED, TERMINAL_STATES
from a2a_cancelfix.checkpoints import Run, enter_run, leave_run

if TYPE_CHECKING:
    from a2a.server.agent_execution import AgentExecutor
    from a2a.server.events.event_queue import EventQueue

logger = logging.getLogger("a2a_cancelfix")

DEFAULT_GRACE_PERIOD = 5.0

# The run queues that have carried a terminal state, so no later event (from a late run, or
# from a cancel) follows it. Weak: an entry lives as long as the SDK's queue.
_ended: weakref.WeakSet[Any] = weakref.WeakSet()


class CancellableExecutor(wrapt.ObjectProxy):  # type: ignore[misc]
    """Wrap an ``AgentExecutor`` so that a cancel always ends in CANCELED, promptly.

    ``isinstance`` checks, attributes and other methods pass through to the wrapped
    executor; wrapping twice returns the same proxy.

    Args:
        executor: the executor to wrap.
        grace_period: seconds that the wrapped ``cancel()`` and the winding-down
            ``execute()`` get together, when the SDK's stock handler drives the cancel.
            `a2a_cancelfix.DefaultRequestHandler` passes its own ``cancel_grace_period``.
    """

    def __new__(cls, executor: AgentExecutor, *args: Any, **kwargs: Any) -> CancellableExecutor:
        if isinstance(executor, CancellableExecutor):
            return executor
        return super().__new__(cls)

    def __init__(
        self, executor: AgentExecutor, *, grace_period: float = DEFAULT_GRACE_PERIOD
    ) -> None:
        if executor is self:  # __new__ handed back an existing proxy: keep it as it is.
            return
        if grace_period <= 0:
            raise ValueError("grace_period must be greater than 0")
        super().__init__(executor)
        self._self_grace_period = grace_period
        self._self_executions: dict[str, _Execution] = {}
        self._self_store: Callable[[RequestContext], Awaitable[Task | None]] | None = None
        self._self_poll_interval = 1.0
        self._self_remote_cancels: set[asyncio.Future[None]] = set()
        self._self_inline = False

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        """Run the wrapped ``execute()`` inside a cancellation scope."""
        task_id = context.task_id or ""
        earlier = self._self_executions.get(task_id)
        if (earlier is not None and earlier.run.cancelled) or _has_ended(event_queue, context):
            return  # The task was cancelled or ended before this request's run began.
        watch = self._self_watcher(context, event_queue) if self._self_store is not None else None
        execution = _Execution(Run(task_id, watch, self._self_poll_interval))
        self._self_executions[task_id] = execution
        work = self._self_work(execution.run, context, _RunQueue(event_queue, execution.run))
        try:
            if self._self_inline:
                await execution.run_inline(work)
            else:
                await self._self_run_apart(execution, work)
            if execution.cancel_done is not None:
                # Returning lets the SDK close the request (and end its streams): CANCELED first.
                deadline = self._self_deadline(self._self_grace_period)
                await self._self_cancel_published(execution, deadline)
        finally:
            if self._self_executions.get(task_id) is execution and execution.cancel_done is None:
                del self._self_executions[task_id]

    async def _self_run_apart(
        self, execution: _Execution, work: Coroutine[Any, Any, None]
    ) -> None:
        """Run the work in a task of its own, which the SDK's teardown of the run cannot reach.

        The SDK's stock handler cancels the run itself: a2a-sdk 1.0.0-1.1.3 before calling
        ``cancel()``, later releases right after it, wherever the work is. Apart, the work
        still stops only at checkpoints or once a shielded section ends, and the queue stays
        open until ``cancel()`` has published CANCELED.
        """
        execution.start_apart(work)
        try:
            await execution.settled
        except asyncio.CancelledError:
            execution.run.cancel("the run was torn down")
            deadline = self._self_deadline(self._self_grace_period)
            await self._self_stop_work(execution, deadline)
            await self._self_cancel_published(execution, deadline)
            raise
        _raise_outcome(execution)

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        """Cancel the task: call the wrapped ``cancel()`` and ensure CANCELED, queue still open.

        Checkpoints raise from now on; the SDK then tears the run down, and ``execute()``
        winds the work down (shielded sections first) before it lets the queue close.
        """
        deadline = self._self_deadline(self._self_grace_period)
        try:
            await self._self_cancel(context, event_queue, deadline, tears_down=False)
        finally:  # Nothing resumes a cancel the SDK's handler gave up on.
            self._self_forget(context.task_id or "")

    def _self_running(self, task_id: str) -> bool:
        """Whether an ``execute()`` of ``task_id`` is running, or a cancel of it."""
        return task_id in self._self_executions

    def _self_drive_cancels(self) -> None:
        """Our handler drives every cancel, so the work can run in the SDK's own task.

        A task per run is what lets the work outlive the stock handler's teardown; without
        it a message costs less. Our handler interrupts the work itself, once shielded
        sections end, and answers whether or not a misbehaving ``execute()`` lets go.
        """
        self._self_inline = True

    def _self_watch_store(
        self, read: Callable[[RequestContext], Awaitable[Task | None]], interval: float
    ) -> None:
        """Let runs learn, at checkpoints, of a cancel another replica recorded in the store."""
        self._self_store, self._self_poll_interval = read, interval

    def _self_watcher(
        self, context: RequestContext, event_queue: EventQueue
    ) -> Callable[[], Awaitable[None]]:
        async def watch() -> None:
            assert self._self_store is not None
            try:
                stored = await self._self_store(context)
            except Exception:  # A store hiccup must not fail the run; the next look retries.
                logger.warning("could not read task %s to look for a remote cancel", context.task_id, exc_info=True)
                return
            if stored is not None and stored.status.state == CANCELED:
                self._self_cancel_here(context, event_queue, stored)

        return watch

    def _self_cancel_here(
        self, context: RequestContext, event_queue: EventQueue, stored: Task
    ) -> None:
        """Cancel this replica's run of a task that another replica cancelled in the store."""
        reason = "canceled on another replica"
        execution = self._self_executions.get(stored.id)
        if execution is None or execution.cancel_done is not None:
            return
        execution.begin_cancel()
        execution.run.cancel(reason)  # Now, so the checkpoint that found it raises.
        here = RequestContext(
            call_context=context.call_context,
            task_id=stored.id,
            context_id=stored.context_id,
            task=stored,
        )
        deadline = self._self_deadline(self._self_grace_period)
        cancelling = asyncio.ensure_future(
            # No handler tears this run down: stop the work here too, not only at checkpoints.
            self._self_cancel(here, event_queue, deadline, tears_down=True, reason=reason)
        )
        self._self_remote_cancels.add(cancelling)
        cancelling.add_done_callback(self._self_remote_cancels.discard)
        cancelling.add_done_callback(lambda _: self._self_forget(stored.id))

    @staticmethod
    def _self_deadline(seconds: float) -> float:
        return asyncio.get_running_loop().time() + seconds

    async def _self_work(self, run: Run, context: RequestContext, queue: EventQueue) -> None:
        token = enter_run(run)
        try:
            await self.__wrapped__.execute(context, queue)
        finally:
            leave_run(token)

    async def _self_cancel(
        self,
        context: RequestContext,
        event_queue: EventQueue,
        deadline: float,
        *,
        tears_down: bool,
        reason: str = "cancel requested",
    ) -> None:
        """Do every step of a cancel, each bounded by ``deadline``; never raise for the executor.

        Interrupted (its caller cancelled), it can be called again to finish: every step is
        done once. ``cancel_done`` is set once all are done, or once the cancel is forgotten.

        Args:
            tears_down: True when the caller (our handler) keeps the run alive until this
                returns and expects the work stopped: a parked task's ``cancel()`` then runs
                before CANCELED is published. The stock handler tears the run down itself and
                may already be closing the queue, so CANCELED goes first there, and the work
                is stopped when the SDK cancels the run (stopping it here would let the run
                reach its own teardown, where the SDK's cancel would interrupt it).
        """
        task_id = context.task_id or ""
        execution = self._self_executions.get(task_id)
        if execution is None:  # Parked, or between runs: a run that starts now stops at once.
            execution = self._self_executions[task_id] = _Execution(Run(task_id))
        cancel_done = execution.begin_cancel()
        execution.run.cancel(reason)
        publisher = _CancelQueue(event_queue, context)
        if execution.ended is None and not tears_down:
            await publisher.publish_canceled()
        await self._self_call_cancel(context, publisher, execution, deadline)
        await publisher.publish_canceled()
        if tears_down:
            await self._self_stop_work(execution, deadline)
        cancel_done.set()

    def _self_forget(self, task_id: str) -> None:
        """End the cancel of ``task_id``, done or given up on, and drop what it kept."""
        execution = self._self_executions.get(task_id)
        if execution is not None and execution.cancel_done is not None:
            execution.cancel_done.set()  # A run still waiting to close its queue stops waiting.
            del self._self_executions[task_id]

    async def _self_call_cancel(
        self, context: RequestContext, queue: _CancelQueue, execution: _Execution, deadline: float
    ) -> None:
        """Call the wrapped ``cancel()``, once per cancel, and wait for it until ``deadline``.

        It runs in a task of its own: whoever waits for it may be interrupted (a request whose
        client went away) without interrupting it, and it is cut off at ``deadline``.
        """
        if execution.cancel_returned is None:
            execution.cancel_returned = asyncio.Event()
            self._self_start_cancel(context, queue, execution.cancel_returned, deadline)
        await wait_set(execution.cancel_returned, deadline)

    def _self_start_cancel(
        self, context: RequestContext, queue: _CancelQueue, returned: asyncio.Event, deadline: float
    ) -> None:
        name, task_id = type(self.__wrapped__).__name__, context.task_id

        async def cancel_then_publish() -> None:
            try:
                try:
                    await self.__wrapped__.cancel(context, queue)
                except Exception as error:
                    logger.warning(
                        "%s.cancel() raised for task %s; the task is canceled anyway",
                        name,
                        task_id,
                        exc_info=error,
                    )
                await queue.publish_canceled()  # Now, not a wake-up later in the waiter.
            finally:
                returned.set()

        call = asyncio.ensure_future(cancel_then_publish())

        def cut_off() -> None:
            if not call.done():
                logger.warning(
                    "%s.cancel() did not return within the grace period for task %s; "
                    "the task is canceled without it",
                    name,
                    task_id,
                )
                call.cancel()

        timer = asyncio.get_running_loop().call_at(deadline, cut_off)
        call.add_done_callback(lambda _: timer.cancel())

    @staticmethod
    async def _self_cancel_published(execution: _Execution, deadline: float) -> None:
        """Wait (by ``deadline``) for a cancel in progress to publish on the still-open queue."""
        if execution.cancel_done is not None:
            await wait_set(execution.cancel_done, deadline)

    async def _self_stop_work(self, execution: _Execution, deadline: float) -> None:
        """Let a shielded section finish, interrupt the work, wait for it; all by ``deadline``."""
        ended = execution.ended
        if ended is None or ended.is_set() or execution.abandoned:
            return
        if execution.run.shielded:
            await execution.run.wait_unshielded(deadline)
        if not ended.is_set():
            execution.interrupt()
        if not await wait_set(ended, deadline):
            execution.abandon()
            logger.warning(
                "%s.execute() ignored the cancel of task %s for the whole grace period; "
                "it is abandoned and nothing it enqueues reaches the task",
                type(self.__wrapped__).__name__,
                execution.run.task_id,
            )


class _Execution:
    """What the wrapper knows of one task: its current run and any cancel in progress."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.runner: asyncio.Task[Any] | None = None  # The task the work runs in.
        self.ended: asyncio.Event | None = None  # Set once the work has ended.
        self.settled: asyncio.Future[None] | None = None  # Apart: ended or abandoned.
        self.interrupted = False
        self.abandoned = False
        self.cancel_done: asyncio.Event | None = None  # Set once a cancel has done its steps.
        self.cancel_returned: asyncio.Event | None = None  # Set once the wrapped cancel() ends.

    def begin_cancel(self) -> asyncio.Event:
        if self.cancel_done is None:
            self.cancel_done = asyncio.Event()
        return self.cancel_done

    async def run_inline(self, work: Coroutine[Any, Any, None]) -> None:
        """Run the work in this task; a cancel of the run ends it normally."""
        self.runner = asyncio.current_task()
        self.ended = asyncio.Event()
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
            if self.interrupted:
                _uncancel(self.runner)  # Our interrupt is handled; the SDK's task runs on.
            self.ended.set()

    def start_apart(self, work: Coroutine[Any, Any, None]) -> None:
        self.ended = asyncio.Event()
        self.runner = asyncio.ensure_future(work)
        # A plain future for execute() to await: its cancellation (the SDK tearing the run
        # down) cancels this, never the work.
        self.settled = asyncio.get_running_loop().create_future()
        self.runner.add_done_callback(self._on_ended)

    def interrupt(self) -> None:
        assert self.runner is not None
        if not self.interrupted:  # Once: inline, each interrupt is one cancel to undo.
            self.interrupted = True
            self.runner.cancel()

    def abandon(self) -> None:
        self.abandoned = True
        self._settle()

    def _on_ended(self, _: object) -> None:
        assert self.ended is not None
        self.ended.set()
        self._settle()

    def _settle(self) -> None:
        if self.settled is not None and not self.settled.done():
            self.settled.set_result(None)


def _uncancel(task: asyncio.Task[Any]) -> None:
    uncancel = getattr(task, "uncancel", None)  # Python 3.11+; 3.10 keeps no count.
    if uncancel is not None and task.cancelling():
        uncancel()


def _raise_outcome(execution: _Execution) -> None:
    """Mirror how the wrapped ``execute()`` ended, unless a cancel owns the outcome."""
    work, run = execution.runner, execution.run
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


def terminal_state(event: object) -> int | None:
    """The terminal state an event records, if any."""
    if isinstance(event, (Task, TaskStatusUpdateEvent)) and event.status.state in TERMINAL_STATES:
        return event.status.state
    return None


def _has_ended(queue: Any, context: RequestContext) -> bool:
    task = context.current_task
    return queue in _ended or (task is not None and task.status.state in TERMINAL_STATES)


def _may_enqueue(queue: Any, event: Any, task_id: str, terminal: bool) -> bool:
    """Whether ``event`` may go in: not once the queue carried a terminal state, which is final.

    Not a coroutine that enqueues too: it runs for every event, and a frame fewer counts.
    """
    if queue in _ended:
        logger.debug("Dropped %s after task %s ended", type(event).__name__, task_id)
        return False
    if terminal:
        _ended.add(queue)
    return True


class _RunQueue(wrapt.ObjectProxy):  # type: ignore[misc]
    """The queue ``execute()`` sees: every enqueue is a checkpoint."""

    def __init__(self, queue: EventQueue, run: Run) -> None:
        super().__init__(queue)
        self._self_run = run

    async def enqueue_event(self, event: Any) -> None:
        run = self._self_run
        terminal = terminal_state(event) is not None
        if not run.cancelled and (terminal or run.watch_due()):
            # Before ending the task above all: another replica may have cancelled it.
            await run.look()
        if run.cancelled:
            if run.shielded:
                logger.debug("Dropped %s enqueued by cancelled task %s", type(event).__name__, run.task_id)
                return
            run.raise_if_cancelled()
        if _may_enqueue(self.__wrapped__, event, run.task_id, terminal):
            await self.__wrapped__.enqueue_event(event)


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
        if _may_enqueue(self.__wrapped__, event, task_id, state is not None):
            await self.__wrapped__.enqueue_event(event)

    async def publish_canceled(self) -> None:
        context = self._self_context
        if self.__wrapped__ in _ended or context.current_task is None:
            return  # Already ended, or no task stored yet that a status could update.
        status = TaskStatus(state=CANCELED)
        status.timestamp.GetCurrentTime()
        await self.enqueue_event(
            TaskStatusUpdateEvent(
                task_id=context.task_id, context_id=context.context_id or "", status=status
            )
        )
