"""CancellableExecutor: a transparent proxy that makes any AgentExecutor cancel correctly.

``execute()`` runs the wrapped executor's ``execute()`` inside a cancellation scope (see
checkpoints.py), as a `Work` of the executor's `Lifecycle`; ``cancel()`` carries out a
`Cancellation` there (see _lifecycle.py). Under the stock handler the work runs in a task of
its own, which the SDK's teardown of the run cannot reach, even where it comes before
``cancel()`` (a2a-sdk 1.0.0-1.1.3); under our handler, which drives every cancel itself, it
runs in the SDK's own task.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

import wrapt
from a2a.server.agent_execution import AgentExecutor, RequestContext

from a2a_cancelfix._aio import checked_seconds, deadline_in
from a2a_cancelfix._cancel.queues import RunQueue, has_ended
from a2a_cancelfix._cancel.settings import DEFAULT_GRACE_PERIOD, Settings
from a2a_cancelfix._cancel.work import Work
from a2a_cancelfix._lifecycle import Lifecycle

if TYPE_CHECKING:
    from a2a.server.events.event_queue import EventQueue

    class _ExecutorProxy(wrapt.ObjectProxy[AgentExecutor], AgentExecutor):
        """To the checker the proxy is an executor, as it is to ``isinstance``."""

else:  # wrapt 1.x proxies take no type arguments
    _ExecutorProxy = wrapt.ObjectProxy


class CancellableExecutor(_ExecutorProxy):
    """Wrap an ``AgentExecutor`` so that a cancel always ends in CANCELED, promptly.

    ``isinstance`` checks, attributes and other methods pass through to the wrapped
    executor; wrapping twice returns the same proxy.

    Args:
        executor: the executor to wrap.
        grace_period: seconds that the wrapped ``cancel()`` and the winding-down
            ``execute()`` get together, when the SDK's stock handler drives the cancel.
            `a2a_cancelfix.DefaultRequestHandler` passes its own ``cancel_grace_period``.

    Raises:
        TypeError: ``executor`` is not an executor.
        TypeError, ValueError: a grace period that is not a finite number above 0.
    """

    _self_lifecycle: Lifecycle

    def __new__(cls, executor: AgentExecutor, *args: Any, **kwargs: Any) -> CancellableExecutor:
        if isinstance(executor, CancellableExecutor):
            return executor
        return super().__new__(cls)

    def __init__(self, executor: AgentExecutor, *, grace_period: float = DEFAULT_GRACE_PERIOD) -> None:
        if executor is self:  # __new__ handed back an existing proxy: keep it as it is.
            return
        require_executor("executor", executor)
        settings = Settings(cancel_grace_period=checked_seconds("grace_period", grace_period))
        super().__init__(executor)
        self._self_lifecycle = Lifecycle(executor, settings)

    @classmethod
    def _of(cls, lifecycle: Lifecycle) -> CancellableExecutor:
        """The proxy of ``lifecycle.executor`` through which the SDK reaches our handler's lifecycle."""
        proxy: CancellableExecutor = super().__new__(cls)
        wrapt.ObjectProxy.__init__(proxy, lifecycle.executor)
        proxy._self_lifecycle = lifecycle
        return proxy

    @property
    def cancel_lifecycle(self) -> Lifecycle:
        """Each task's work and cancel in progress: what our handler drives cancels through."""
        return self._self_lifecycle

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        """Run the wrapped ``execute()`` inside a cancellation scope."""
        lifecycle = self._self_lifecycle
        task_id, cancellations = context.task_id or "", lifecycle.cancellations
        if task_id in cancellations:
            # Nothing to run for a task being cancelled; but returning ends this request in
            # the SDK, and with it its sender's wait and its stream: CANCELED first.
            await cancellations[task_id].published()
            return
        if has_ended(event_queue, context):
            return  # The task ended before this request's run began.
        work = lifecycle.start(task_id, context, event_queue)
        # The wrapped executor as the lifecycle holds it: this proxy's own attributes (such as
        # __wrapped__) are read through wrapt's slower hook, on every message.
        probe, wrapped = lifecycle.probe, lifecycle.executor
        queue = RunQueue(event_queue, work)
        try:
            if lifecycle.leases is not None:  # Leased before it starts: see _liveness.py.
                await lifecycle.leases.run_started(task_id, context)
            body: Awaitable[None]
            if probe is None:
                body = wrapped.execute(context, queue)
            else:
                body = probe.drive(wrapped.execute, context, queue, work)
            if lifecycle.inline:
                await work.run_inline(body)
            else:
                await self._self_run_apart(work, body)
            if task_id in cancellations:
                # Returning lets the SDK close the request (and end its streams): CANCELED first.
                await cancellations[task_id].published()
            elif not work.task_ended and not has_ended(event_queue, context):
                lifecycle.parked_here(task_id, context.call_context)
        finally:
            lifecycle.forget(work)

    async def _self_run_apart(self, work: Work, body: Awaitable[None]) -> None:
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
            cancellation = lifecycle.cancellations.get(work.task_id)
            if cancellation is None:
                deadline = deadline_in(lifecycle.settings.cancel_grace_period)
            else:  # It stops the work, then publishes CANCELED: the queue stays open for it.
                deadline = cancellation.deadline
                await cancellation.published()
            # Torn down with no cancel, or with one the SDK gave up on: stop the work anyway.
            work.cancel("the run was torn down")
            await work.stop(deadline, lifecycle.name)
            raise
        work.raise_outcome()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        """Cancel the task in the lifecycle's order, within the grace period.

        Checkpoints raise, the wrapped ``cancel()`` runs, the work stops, and then CANCELED is
        published on the queue, which ``execute()`` keeps open until it is.
        """
        await self._self_lifecycle.requested_by_sdk(context, event_queue)


def require_executor(name: str, value: object) -> None:
    """Refuse, where it is given, what is not an executor: it would fail at the first request.

    Raises:
        TypeError: naming ``name``.
    """
    if isinstance(value, AgentExecutor):
        return
    if isinstance(value, type):
        raise TypeError(f"{name} must be an executor, not the class {value.__qualname__}: give an instance")
    if not all(callable(getattr(value, method, None)) for method in ("execute", "cancel")):
        raise TypeError(
            f"{name} must be an AgentExecutor (with execute() and cancel()), not {type(value).__qualname__}"
        )


def raised_by_execute(error: BaseException) -> bool:
    """Whether ``error`` came out of a run of the wrapped ``execute()``: the SDK hands it to each
    caller as it was raised, its traceback still through the proxy's ``execute()``. An error of
    the task store or of the SDK's own run never passes there."""
    traceback = error.__traceback__
    while traceback is not None:
        if traceback.tb_frame.f_code is _EXECUTE:
            return True
        traceback = traceback.tb_next
    return False


_EXECUTE = CancellableExecutor.execute.__code__
