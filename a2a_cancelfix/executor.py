"""CancellableExecutor: a transparent proxy that makes any AgentExecutor cancel correctly.

``execute()`` runs the wrapped executor's ``execute()`` inside a cancellation scope (see
checkpoints.py), as a `Work` of the executor's `Lifecycle`; ``cancel()`` carries out a
`Cancellation` there (see lifecycle.py). Under the stock handler the work runs in a task of
its own, which the SDK's teardown of the run cannot reach, even where it comes before
``cancel()`` (a2a-sdk 1.0.0-1.1.3); under our handler, which drives every cancel itself, it
runs in the SDK's own task.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import wrapt
from a2a.server.agent_execution import RequestContext
from a2a.types import Task

from a2a_cancelfix import _telemetry
from a2a_cancelfix._aio import deadline_in, keep
from a2a_cancelfix._sdk import CANCELED, terminal_state
from a2a_cancelfix.checkpoints import Run
from a2a_cancelfix.lifecycle import (
    DEFAULT_GRACE_PERIOD,
    Lifecycle,
    Work,
    has_ended,
    logger,
    may_enqueue,
    seconds,
)

if TYPE_CHECKING:
    from a2a.server.agent_execution import AgentExecutor
    from a2a.server.events.event_queue import EventQueue


class CancellableExecutor(wrapt.ObjectProxy):  # type: ignore[misc]
    """Wrap an ``AgentExecutor`` so that a cancel always ends in CANCELED, promptly.

    ``isinstance`` checks, attributes and other methods pass through to the wrapped
    executor; wrapping twice returns the same proxy.

    Args:
        executor: the executor to wrap.
        grace_period: seconds that the wrapped ``cancel()`` and the winding-down
            ``execute()`` get together, when the SDK's stock handler drives the cancel.
            `a2a_cancelfix.DefaultRequestHandler` passes its own ``cancel_grace_period``.

    Raises:
        TypeError, ValueError: a grace period that is not a finite number above 0.
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
        grace = seconds("grace_period", grace_period)
        super().__init__(executor)
        self._self_lifecycle = Lifecycle(executor, grace)

    @property
    def cancel_lifecycle(self) -> Lifecycle:
        """Each task's work and cancel in progress: what our handler drives cancels through."""
        return self._self_lifecycle

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        """Run the wrapped ``execute()`` inside a cancellation scope."""
        lifecycle = self._self_lifecycle
        task_id = context.task_id or ""
        cancellation = lifecycle.cancellations.get(task_id)
        if cancellation is not None:
            # Nothing to run for a task being cancelled; but returning ends this request in
            # the SDK, and with it its sender's wait and its stream: CANCELED first.
            await cancellation.published()
            return
        if has_ended(event_queue, context):
            return  # The task ended before this request's run began.
        if lifecycle.parked:
            lifecycle.parked.pop(task_id, None)  # Running again: the run looks for itself.
        watch = None if lifecycle.read_stored is None else functools.partial(self._self_look, context, event_queue)
        run = Run(task_id, watch, lifecycle.poll_interval)
        work = lifecycle.works[task_id] = Work(run)
        queue, probe = _RunQueue(event_queue, run), lifecycle.probe
        try:
            if probe is None:
                body = self.__wrapped__.execute(context, queue)
            else:
                body = probe.drive(self.__wrapped__.execute, context, queue, run)
            if lifecycle.inline:
                await work.run_inline(body)
            else:
                await self._self_run_apart(work, body)
            cancellation = lifecycle.cancellations.get(task_id)
            if cancellation is not None:
                # Returning lets the SDK close the request (and end its streams): CANCELED first.
                await cancellation.published()
            elif lifecycle.on_parked is not None and not has_ended(event_queue, context):
                lifecycle.parked[task_id] = context.call_context
                lifecycle.on_parked()
        finally:
            if lifecycle.works.get(task_id) is work:
                del lifecycle.works[task_id]

    async def _self_run_apart(self, work: Work, body: Coroutine[Any, Any, None]) -> None:
        """Run the work in a task of its own, which the SDK's teardown of the run cannot reach.

        The SDK's stock handler cancels the run itself: a2a-sdk 1.0.0-1.1.3 before calling
        ``cancel()``, later releases right after it, wherever the work is. Apart, the work
        still stops only at checkpoints or once a shielded section ends, and the queue stays
        open until the cancel has published CANCELED.
        """
        work.start_apart(body)
        try:
            await work.settled  # type: ignore[misc]
        except asyncio.CancelledError:
            lifecycle = self._self_lifecycle
            cancellation = lifecycle.cancellations.get(work.run.task_id)
            if cancellation is None:
                deadline = deadline_in(lifecycle.grace_period)
            else:  # It stops the work, then publishes CANCELED: the queue stays open for it.
                deadline = cancellation.deadline
                await cancellation.published()
            # Torn down with no cancel, or with one the SDK gave up on: stop the work anyway.
            work.run.cancel("the run was torn down")
            await work.stop(deadline, lifecycle.name)
            raise
        work.raise_outcome()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        """Cancel the task in the lifecycle's order, within the grace period.

        Checkpoints raise, the wrapped ``cancel()`` runs, the work stops, and then CANCELED is
        published on the queue, which ``execute()`` keeps open until it is.
        """
        lifecycle = self._self_lifecycle
        cancellation = lifecycle.begin(context.task_id or "")
        try:
            # A parked run's queue is closed by the stock handler on its own: CANCELED first.
            await cancellation.carry_out(context, event_queue, publish_first=cancellation.work is None)
        finally:  # Nothing resumes a cancel the SDK's handler gave up on.
            lifecycle.end(cancellation)
        if cancellation.failure is not None:  # FAILED is published; the SDK answers with it.
            raise cancellation.failure

    async def _self_look(self, context: RequestContext, event_queue: EventQueue) -> None:
        """A run's watch: read the task, and carry out here a cancel another replica stored."""
        read_stored = self._self_lifecycle.read_stored
        assert read_stored is not None
        try:
            stored = await read_stored(context)
        except Exception:  # A store hiccup must not fail the run; the next look retries.
            logger.warning("could not read task %s to look for a remote cancel", context.task_id, exc_info=True)
            return
        if stored is not None and stored.status.state == CANCELED:
            self._self_cancel_here(context, event_queue, stored)

    def _self_cancel_here(self, context: RequestContext, event_queue: EventQueue, stored: Task) -> None:
        """Cancel this replica's run of a task that another replica cancelled in the store."""
        lifecycle = self._self_lifecycle
        if stored.id in lifecycle.cancellations:
            return
        cancellation = lifecycle.begin_recorded(stored)
        cancellation.signal(event_queue)  # Now, so that the checkpoint that found it raises.
        here = RequestContext(
            call_context=context.call_context, task_id=stored.id, context_id=stored.context_id, task=stored
        )

        async def carry_out() -> None:
            try:
                await cancellation.carry_out(here, event_queue)
            finally:
                lifecycle.end(cancellation)
                _telemetry.end(cancellation.span)

        keep(carry_out())


class _RunQueue(wrapt.ObjectProxy):  # type: ignore[misc]
    """The queue ``execute()`` sees: every enqueue is a checkpoint."""

    def __init__(self, queue: EventQueue, run: Run) -> None:
        super().__init__(queue)
        self._self_run = run

    async def enqueue_event(self, event: Any) -> None:
        run = self._self_run
        terminal = terminal_state(event) is not None
        if run.watched and not run.cancelled and (terminal or time.monotonic() >= run.next_look):
            # Before ending the task above all: another replica may have cancelled it.
            await run.look()
        if run.cancelled:
            if run.shielded:
                logger.debug("Dropped %s enqueued by cancelled task %s", type(event).__name__, run.task_id)
                return
            run.raise_if_cancelled()
        if may_enqueue(self.__wrapped__, event, run.task_id, terminal):
            await self.__wrapped__.enqueue_event(event)
