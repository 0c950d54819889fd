"""Every cancel of one executor's tasks, from each origin, driven to its answer and teardown.

A run of the wrapped ``execute()`` is a `Work`; a cancel of its task is a `Cancellation` (both
in ``_cancel/``). Both are kept per task id in a `Lifecycle`, built once per handler (or per
executor proxy under the SDK's stock handler). The handler and the executor proxy are
adapters between the SDK and the lifecycle's entries.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from a2a.server.agent_execution import RequestContext
from a2a.types import (
    InternalError,
    Task,
    TaskNotCancelableError,
    TaskNotFoundError,
    TaskState,
    TaskStatus,
)
from a2a.utils.errors import A2AError

from a2a_cancelfix import _sdk, _telemetry
from a2a_cancelfix._aio import Once, in_background, wait_done
from a2a_cancelfix._cancel.cancellation import FAILED, Cancellation, Step
from a2a_cancelfix._cancel.queues import CancelQueue
from a2a_cancelfix._cancel.recording import CanceledWrites
from a2a_cancelfix._cancel.settings import Settings, Timeline
from a2a_cancelfix._cancel.work import Work
from a2a_cancelfix._lease_store import LeaseStore
from a2a_cancelfix._liveness import Leases
from a2a_cancelfix._replicas import RemoteCancels
from a2a_cancelfix._sdk import CANCELED, TERMINAL_STATES
from a2a_cancelfix._unwatched import Watchers

if TYPE_CHECKING:
    from a2a.server.agent_execution import AgentExecutor
    from a2a.server.context import ServerCallContext
    from a2a.server.events.event_queue import EventQueue
    from a2a.server.request_handlers import DefaultRequestHandlerV2
    from a2a.server.tasks import PushNotificationConfigStore, PushNotificationSender

    from a2a_cancelfix.checkpoints import Probe
    from a2a_cancelfix.notices import LocalNotices

logger = logging.getLogger("a2a_cancelfix")


class Lifecycle:
    """Every cancel of one executor's tasks, from any origin, through the steps of `Step`.

    Built with the executor and the options, as the SDK's handler is given its proxy of the
    executor; our handler, once the SDK's constructor has run, hands itself over in `bind`,
    the one wiring step. Under the SDK's stock handler nothing binds it.

    Entries, one per origin, each through `Cancellation` and `_drive`:

    - `request`: a client's CancelTask here (and, if its client leaves, the same cancel
      resumed without it);
    - `noticed_parked`: a task parked here that another replica cancelled in the store;
    - `noticed_in_run`: a run here whose look found its task cancelled by another replica;
    - `requested_by_sdk`: the stock handler calling the proxy's ``cancel()``;
    - `unwatched`: a task here that nobody watched for ``cancel_unwatched_after`` seconds;
    - `shutdown`: a run still going when the handler's ``aclose()`` has let the runs finish;
    - `lease_lost`: a run here while this replica cannot renew its lease (see _liveness.py).

    Args:
        executor: the wrapped executor, whose ``cancel()`` a cancel calls.
        settings: the options, checked.
        probe: a2a_cancelfix.testing's sweep, which sees each run's cancel points.
    """

    def __init__(self, executor: AgentExecutor, settings: Settings, *, probe: Probe | None = None) -> None:
        # Until `bind`: the SDK's own cancel drives, and the work runs apart. Instance
        # attributes, not the class's defaults: every message reads some of them, and Python
        # 3.11 reads a class's default through a generic lookup, several times slower.
        self.handler: DefaultRequestHandlerV2 | None = None
        self.inline = False
        self.writes: CanceledWrites | None = None
        self.remote: RemoteCancels | None = None
        self.watchers: Watchers | None = None
        self.leases: Leases | None = None
        self.executor = executor
        self.name = executor.__class__.__name__  # A proxy's too, as isinstance sees it.
        self.settings = settings
        self.probe = probe
        self.works: dict[str, Work] = {}
        self.cancellations: dict[str, Cancellation] = {}
        # Tasks whose run returned without ending them (parked, most likely), with the caller
        # that ran them: nothing runs here to notice a cancel another replica records.
        self.parked: dict[str, ServerCallContext] = {}
        # Follow-up messages accepted for a running task that no run has taken yet, by id.
        self._follow_ups: set[str] = set()
        # Messages taken and not answered yet: a shutdown waits for them as for the runs, which
        # a message taken just before it registers only later (see `runs_ended`).
        self.senders = 0
        self._idle: Once | None = None  # Made by a shutdown's wait for the runs to end.

    def bind(
        self,
        handler: DefaultRequestHandlerV2,
        store: Any,
        push_configs: PushNotificationConfigStore | None,
        peers: LocalNotices | None,
        pushes: PushNotificationSender | None = None,
    ) -> RemoteCancels:
        """Serve our ``handler``, built: it drives every cancel, and the work runs in the SDK's
        own task. Returns its look-out for cancels recorded by other replicas.

        Args:
            handler: our handler (the SDK's class), whose registry, store and own cancel are used.
            store: the task store the handler was given.
            push_configs: the handler's push config store (a task with a config is watched).
            peers: the notices of the handlers sharing the handler's ``InMemoryTaskStore``, if
                it has one (see `RemoteCancels`).
            pushes: the handler's push sender, if it has one (a task ended here for a replica
                whose lease lapsed is pushed through it).
        """
        settings = self.settings
        self.handler = handler
        self.inline = _sdk.SUPPORTED
        self.writes = CanceledWrites(handler)
        remote = self.remote = RemoteCancels(self, handler, store, settings.replica_poll_interval, peers)
        after = settings.cancel_unwatched_after
        if after is not None:
            self.watchers = Watchers(self, after, settings.cancel_unwatched_parked, push_configs, remote)
        lease_time = settings.lease_time
        leased = None if lease_time is None else LeaseStore.of(store)
        if lease_time is not None and leased is not None:
            self.leases = Leases(self, leased, lease_time, settings.sole_replica, pushes, remote.noticed)
        return remote

    @property
    def _writes(self) -> CanceledWrites:
        """The direct writes of CANCELED: only our handler's paths (not the proxy's) reach here."""
        assert self.writes is not None
        return self.writes

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
            live = await _sdk.live_task(self._handler, task_id)
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
        cancellation = self._begin(task_id, Cancellation.requested, task_id)
        answer = cancellation.join()
        try:
            # The first caller drives the cancel itself: a task of its own would cost a
            # wake-up at each end.
            await self._drive(cancellation, task, live, caller)
        except asyncio.CancelledError:
            # Its client went away. The cancel goes on without it, from the top: every step
            # it had done is done once, every wait ends at the same deadline.
            answer.cancel()
            in_background(self._drive(cancellation, task, live, caller))
            raise
        return answer.result()

    async def noticed_parked(self, stored: Task, live: _sdk.LiveRun, caller: ServerCallContext) -> None:
        """Carry out here the cancel another replica recorded for a task parked here."""
        cancellation = self._begin(stored.id, Cancellation.recorded_elsewhere, stored)
        try:
            await self._drive(cancellation, stored, live, caller)
        finally:
            _telemetry.end(cancellation.span)

    async def noticed_in_run(self, context: RequestContext, queue: EventQueue, stored: Task) -> None:
        """Carry out here the cancel another replica recorded for a task this replica runs.

        Called by the run's look, often from a checkpoint of the run itself: the callbacks
        fire and ``cancel()`` returns before the look does, so the checkpoint raises after
        them, as on every other path; the rest goes on behind it.

        The rest starts with the signal, in a task of its own that waits for ``cancel()`` as
        a local cancel does, so that plain code (which only an interrupt stops) is interrupted
        as soon after the signal as a local cancel interrupts it. Started once the look had
        returned, it came a loop turn later than that, and work whose await had just returned
        ran on to its next await first (the sweep's "as it returns (remote)" rows). A look
        from a checkpoint of the run is not interrupted (`Work.stop` leaves a looking run
        alone): that checkpoint raises as the look returns. With no run here (it returned
        meanwhile), nothing is to be interrupted: the rest starts once ``cancel()`` returned, as
        it publishes CANCELED first.
        """
        if stored.id in self.cancellations:
            return
        cancellation = self._begin(stored.id, Cancellation.recorded_elsewhere, stored)
        here = RequestContext(
            call_context=context.call_context, task_id=stored.id, context_id=stored.context_id, task=stored
        )
        cancellation.signal(queue)
        cancellation.call_cancel(here, CancelQueue(queue, here))

        async def carry_out() -> None:
            try:
                await self._drive(cancellation, stored, None, None, on_queue=(here, queue))
            finally:
                _telemetry.end(cancellation.span)

        if cancellation.work is not None:
            in_background(carry_out())
        try:
            await cancellation.cancel_returned()
        finally:
            if cancellation.work is None:
                in_background(carry_out())

    async def unwatched(self, task: Task, live: Any, caller: ServerCallContext, after: float) -> None:
        """Cancel ``task``, whose run here is ``live``, as a client's cancel would: nobody
        watched it for ``after`` seconds (see _unwatched.py)."""
        if task.id in self.cancellations:
            return
        cancellation = self._begin(task.id, Cancellation.unwatched, task.id, after)
        await self._drive_in_span(cancellation, task, live, caller)

    async def shutdown(self, task_id: str) -> None:
        """Cancel the run here of ``task_id`` as a client's cancel would: the server shuts down.

        A task parked (its run about to return) or ended meanwhile is left as it is. A store
        that cannot be read leaves the task as it shows it, with a WARNING that names it.
        """
        work = self.works.get(task_id)
        if work is None or task_id in self.cancellations:
            return
        try:
            task = await self.read(task_id, work.caller)
            live = await _sdk.live_task(self._handler, task_id)
        except Exception:
            logger.warning(
                "task %s: could not read it to cancel it at shutdown; the store shows it as it was",
                task_id,
                exc_info=True,
            )
            return
        if task is None or task_id in self.cancellations:
            return  # Not stored yet: nothing shows it running; or being cancelled already.
        state = task.status.state
        if state in TERMINAL_STATES or state in _sdk.PARKED_STATES:
            return
        cancellation = self._begin(task_id, Cancellation.shut_down, task_id)
        await self._drive_in_span(cancellation, task, live, work.caller)

    async def lease_lost(self, task_id: str, context_id: str) -> None:
        """Cancel the run here of ``task_id`` as a client's cancel would: this replica has not
        renewed its lease for half of it, and another may soon take the task for dead.

        The store, which this replica may not reach, is not read first: the run is live here.
        """
        work = self.works.get(task_id)
        if work is None or task_id in self.cancellations:
            return
        live = await _sdk.live_task(self._handler, task_id)
        if live is None or self.works.get(task_id) is not work or task_id in self.cancellations:
            return  # Returned meanwhile; or cancelled already.
        task = Task(id=task_id, context_id=context_id, status=TaskStatus(state=TaskState.TASK_STATE_WORKING))
        cancellation = self._begin(task_id, Cancellation.lease_lost, task_id)
        await self._drive_in_span(cancellation, task, live, work.caller)

    async def runs_ended(self, deadline: float) -> bool:
        """Wait until no ``execute()`` runs here, nor is to start for a message taken, or
        until ``deadline``; whether none does."""
        if not self.works and not self.senders:
            return True
        self._idle = Once()
        return await self._idle.wait(deadline)

    def message_taken(self) -> None:
        """A message is taken: a shutdown that begins now waits for its answer (``senders``)."""
        self.senders += 1

    def message_answered(self) -> None:
        """A message taken has its answer, or failed."""
        self.senders -= 1
        if self._idle is not None and not self.works and not self.senders:
            self._idle.give()

    async def requested_by_sdk(self, context: RequestContext, queue: EventQueue) -> None:
        """Carry out the stock handler's cancel, on the queue it gives; raise what ``cancel()`` raised."""
        task_id = context.task_id or ""
        cancellation = self._begin(task_id, Cancellation.requested, task_id)
        # A parked run's queue is closed by the stock handler on its own: CANCELED first.
        await self._drive(cancellation, None, None, None, on_queue=(context, queue))
        if cancellation.failure is not None:  # FAILED is published; the SDK answers with it.
            raise cancellation.failure

    async def close_run(self, task_id: str) -> None:
        """See that the run here of a task whose end the store refused closes, as after a cancel.

        In upstream's cluster mode on a2a-sdk 1.2.0-1.2.2 such a run never closes by itself:
        its teardown waits for good for a stream to take the SDK's request marker.
        """
        live = await _sdk.run_of(self._handler, task_id)
        if live is not None:
            _tear_down(live, task_id, self.settings.timeline())

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
        """A run of ``execute()`` of ``task_id`` begins: its scope, looking for remote cancels
        if any can come."""
        if self._follow_ups and context.message is not None:
            self._follow_ups.discard(context.message.message_id)  # Taken: this run processes it.
        if self.parked:
            self.parked.pop(task_id, None)  # Running again: the run looks for itself.
        if self.watchers is not None:
            self.watchers.run_started(context)
        remote = self.remote
        if remote is not None and remote.on_lookout:
            look = functools.partial(self._look, context, queue)
            work = Work(task_id, context, look, remote.interval, self.probe)
        else:
            work = Work(task_id, context, None, math.inf, self.probe)
        self.works[task_id] = work
        return work

    def forget(self, work: Work) -> None:
        """A run of ``execute()`` has returned."""
        task_id = work.task_id
        if self.works.get(task_id) is work:
            del self.works[task_id]
            if self.leases is not None:
                self.leases.run_ended(task_id)
            if self.watchers is not None:
                self.watchers.run_ended(task_id)
            if self._idle is not None and not self.works and not self.senders:
                self._idle.give()

    def parked_here(self, task_id: str, caller: ServerCallContext) -> None:
        """A run returned without ending its task: another replica may cancel it meanwhile."""
        if self.watchers is not None:
            self.watchers.parked(task_id)
        if self.remote is not None and self.remote.on_lookout:
            self.parked[task_id] = caller
            self.remote.look_at_parked_soon()

    async def _look(self, context: RequestContext, queue: EventQueue) -> None:
        """A run's look: read the task, and carry out here a cancel another replica stored."""
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

    def _begin(self, task_id: str, origin: Callable[..., Cancellation], *args: Any) -> Cancellation:
        """The cancel in progress of ``task_id``, or a new one that ``origin`` builds (from
        ``args``, the executor, the task's run and a timeline starting now)."""
        cancellation = self.cancellations.get(task_id)
        if cancellation is None:
            if self.parked:
                self.parked.pop(task_id, None)  # This cancel is the one that ends it.
            cancellation = origin(*args, self.executor, self.works.get(task_id), self.settings.timeline())
            self.cancellations[task_id] = cancellation
        return cancellation

    async def _drive_in_span(
        self, cancellation: Cancellation, task: Task, live: Any, caller: ServerCallContext
    ) -> None:
        """Drive a cancel that no client asked for inside its span, which ends with it."""
        span = cancellation.span
        try:
            with _telemetry.current(span):
                await self._drive(cancellation, task, live, caller)
        finally:
            _telemetry.end(span)

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
        live: _sdk.LiveRun | None,
        caller: ServerCallContext | None,
        *,
        on_queue: tuple[RequestContext, EventQueue] | None = None,
    ) -> None:
        """Carry the cancel out (steps 2-6), answer every caller (7), let the run close (8).

        ``on_queue``: the run's context and queue, where the cancel is carried out on them (a
        look in the run, the stock handler's ``cancel()``); else ``task``, read by
        ``caller``, whose run here is ``live`` (None: not live here). Interrupted, it
        answers nobody and can be called again to finish.
        """
        outcome: Task | BaseException | None = None
        try:
            if on_queue is not None:
                context, queue = on_queue
                await cancellation.carry_out(context, queue, publish_first=cancellation.work is None)
            else:
                assert task is not None and caller is not None
                outcome = await self._cancel(cancellation, task, live, caller)
        except A2AError as error:
            outcome = error
        except Exception as error:  # A store that fails mid-cancel: every caller learns it.
            logger.warning("the cancel of task %s failed", cancellation.task_id, exc_info=True)
            outcome = InternalError(message=f"The cancel failed: {type(error).__name__}")
        finally:
            if on_queue is not None:  # Nothing resumes a cancel carried out on a run's queue.
                self.end(cancellation)
        if on_queue is not None:
            return
        assert outcome is not None
        cancellation.answer(outcome)
        self.end(cancellation)
        if live is not None:  # Behind the answers, so that it does not delay them.
            loop = asyncio.get_running_loop()
            loop.call_soon(_tear_down, live, cancellation.task_id, cancellation.timeline)

    async def _cancel(
        self, cancellation: Cancellation, task: Task, live: _sdk.LiveRun | None, caller: ServerCallContext
    ) -> Task:
        """Cancel ``task``, whose run here is ``live`` (None: it has none live here)."""
        started = time.monotonic()
        if live is not None:
            path = cancellation.path or ("parked" if task.status.state in _sdk.PARKED_STATES else "live")
            result = await self._cancel_live(cancellation, live, task, caller)
        elif _sdk.SUPPORTED and not _sdk.SDK_CANCELS_WHERE_NOT_LIVE:
            path, result = "not live here", await self._writes.write(cancellation, caller)
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
        self, cancellation: Cancellation, live: _sdk.LiveRun, task: Task, caller: ServerCallContext
    ) -> Task:
        """Cancel a run of this process; return the task as it ended."""
        context = RequestContext(call_context=caller, task_id=task.id, context_id=task.context_id, task=task)
        await cancellation.carry_out(context, _sdk.agent_queue(live))
        recorded = await cancellation.settled(functools.partial(_sdk.wait_finished, live))
        try:
            result = await self.read(task.id, caller)
        except InternalError:  # The store failed: the run is stopped, so CANCELED is retried.
            result = None
        if not recorded or result is None or result.status.state not in TERMINAL_STATES:
            logger.warning("task %s did not record a terminal state; CANCELED is written directly", task.id)
            _telemetry.teardown_forced(task.id)
            closed = functools.partial(_sdk.force_close, live, cancellation.timeline.timing.margin)
            return await self._writes.write(cancellation, caller, after=closed, stopped=True)
        return result

    async def _cancel_by_sdk(
        self, task_id: str, caller: ServerCallContext, cancellation: Cancellation
    ) -> Task:
        """Defer to the SDK (1.2.0+ cancels a task not live here correctly), bounded."""
        call = asyncio.ensure_future(_sdk.sdk_cancel(self._handler, task_id, caller))
        # Not wait_for, which cancels it and waits for it to unwind: a write that waits for a
        # locked row unwinds only once the lock is released.
        if not await wait_done(call, cancellation.timeline.sdk_cancel_by):
            call.add_done_callback(_retrieve)
            logger.warning("the SDK's cancel of task %s hung; CANCELED is written directly", task_id)
            written = await self._writes.write(cancellation, caller)
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

    async def drain(self, deadline: float) -> None:
        """For the handler's shutdown: each pending CANCELED write is tried once more, at once,
        and waited for until ``deadline`` (see `CanceledWrites.drain`)."""
        await self._writes.drain(deadline)

    async def end_leases(self, deadline: float) -> None:
        """For the handler's shutdown, once its runs are closed (what they end is stored):
        this replica's leases end, their rows removed by ``deadline`` (see `Leases.aclose`)."""
        if self.leases is not None:
            await self.leases.aclose(deadline)

    async def stored_end(self, task_id: str, caller: ServerCallContext) -> Task | None:
        """For a stream of ``task_id`` that ended with no terminal event: if its run was closed
        while its CANCELED was still being written, the task once the write is over (landed,
        or given up on), as stored; else None.
        """
        if not await self._writes.over(task_id):
            return None
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


def _tear_down(live: _sdk.LiveRun, task_id: str, timeline: Timeline) -> None:
    """Let the run close itself; force it closed if it does not in time."""
    span = _telemetry.current_span()  # The cancel's: the forced close is recorded under it.

    def stuck() -> None:
        logger.debug("run of task %s did not close in time; it is force-closed", task_id)
        _telemetry.teardown_forced(task_id, span)
        in_background(_sdk.force_close(live, timeline.timing.margin))

    _sdk.unless_closed_by(live, timeline.teardown_by(), stuck)


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
