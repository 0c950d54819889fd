"""DefaultRequestHandler: the SDK's handler, with a cancel that always ends."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import warnings
from collections.abc import AsyncGenerator
from typing import Any, Literal

from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.context import ServerCallContext
from a2a.server.request_handlers import DefaultRequestHandlerV2
from a2a.types import (
    CancelTaskRequest,
    InternalError,
    Message,
    SendMessageRequest,
    SubscribeToTaskRequest,
    Task,
    TaskNotCancelableError,
    TaskNotFoundError,
    TaskState,
    UnsupportedOperationError,
)
from a2a.utils.errors import A2AError

from a2a_cancelfix import _sdk, _telemetry
from a2a_cancelfix._aio import deadline_in, keep
from a2a_cancelfix.executor import CancellableExecutor
from a2a_cancelfix.lifecycle import (
    DEFAULT_GRACE_PERIOD,
    FAILED,
    MARGIN,
    Cancellation,
    seconds,
)
from a2a_cancelfix.replicas import RemoteCancels

logger = logging.getLogger("a2a_cancelfix")

# How long, after the answer, a run that can close itself gets to do so before it is forced.
_PATIENCE = 30.0

# The SDK's methods without their spans: our overrides carry them. A message's request is
# checked by our overrides, first: the SDK's own check is left out.
_sdk_cancel = _sdk.untraced(DefaultRequestHandlerV2.on_cancel_task)
_sdk_send = _sdk.unchecked(_sdk.untraced(DefaultRequestHandlerV2.on_message_send))
_sdk_stream = _sdk.unchecked(_sdk.untraced(DefaultRequestHandlerV2.on_message_send_stream))
_sdk_subscribe = _sdk.untraced(DefaultRequestHandlerV2.on_subscribe_to_task)


class DefaultRequestHandler(DefaultRequestHandlerV2):
    """``a2a.server.request_handlers.DefaultRequestHandler`` whose cancel always ends.

    Takes exactly the SDK's constructor arguments, plus these keyword-only options.

    Args:
        cancel_grace_period: seconds that the executor's ``cancel()`` and the running
            ``execute()`` get, together, to wind down before the run is torn down and
            CANCELED is written by the framework. A cancel returns within this plus about
            one second.
        on_parked: ``"cancel"`` (default) cancels a task parked in INPUT_REQUIRED or
            AUTH_REQUIRED; ``"refuse"`` raises ``TaskNotCancelableError`` for it.
        on_canceled: ``"raise"`` (default, as the SDK does) raises
            ``TaskNotCancelableError`` when the task is already CANCELED; ``"return"``
            returns the CANCELED task (the spec calls cancel idempotent).
        replica_poll_interval: at most this often (seconds), a run's awaited checkpoints and
            enqueued events read the task store to learn of a cancel that another replica
            recorded there, and so often the tasks parked here are read for one; ``None``
            turns both off. A run also reads it before it publishes a terminal state. While
            the store's ``notices`` are heard (see `FinalStateTaskStore`), nothing polls; on
            a bare ``InMemoryTaskStore`` that no other handler shares, nothing is ever read.

    Raises:
        TypeError, ValueError: an option outside its documented values.
    """

    def __init__(
        self,
        agent_executor: AgentExecutor,
        *args: Any,
        cancel_grace_period: float = DEFAULT_GRACE_PERIOD,
        on_parked: Literal["cancel", "refuse"] = "cancel",
        on_canceled: Literal["raise", "return"] = "raise",
        replica_poll_interval: float | None = 1.0,
        **kwargs: Any,
    ) -> None:
        grace = seconds("cancel_grace_period", cancel_grace_period)
        poll = seconds("replica_poll_interval", replica_poll_interval, optional=True)
        if on_parked not in ("cancel", "refuse"):
            raise ValueError(f"on_parked must be 'cancel' or 'refuse', not {on_parked!r}")
        if on_canceled not in ("raise", "return"):
            raise ValueError(f"on_canceled must be 'raise' or 'return', not {on_canceled!r}")
        _sdk.warn_if_unsupported()
        executor = CancellableExecutor(agent_executor, grace_period=grace)
        # What the SDK warns of here (no event_stream, a queue_manager) is about the caller's
        # arguments: said again at the caller's line, not at this one.
        with warnings.catch_warnings(record=True) as raised:
            warnings.simplefilter("always")
            super().__init__(executor, *args, **kwargs)
        for warning in raised:
            warnings.warn(warning.message, warning.category, stacklevel=2)
        lifecycle = self._lifecycle = executor.cancel_lifecycle
        lifecycle.grace_period = grace
        # Otherwise the SDK's own cancel drives, as under its handler, and the work runs apart.
        lifecycle.inline = _sdk.SUPPORTED
        self._replicas = RemoteCancels(self, lifecycle, poll, self._cancel_noticed)
        self.cancel_grace_period = grace
        self.on_parked = on_parked
        self.on_canceled = on_canceled

    @_telemetry.traced_as_sdk
    @_sdk.validate_request_params
    async def on_cancel_task(  # type: ignore[override]
        self, params: CancelTaskRequest, context: ServerCallContext
    ) -> Task:
        """Cancel a task; return it CANCELED or raise an A2A error, within the grace bound.

        Raises:
            TaskNotFoundError: unknown id, or a task the caller does not own.
            TaskNotCancelableError: already terminal, or parked under ``on_parked="refuse"``.
            InternalError: the executor's ``cancel()`` raised (the task ends FAILED), or the
                task store failed.
        """
        task_id, cancellations = params.id, self._lifecycle.cancellations
        # A cancel in progress is joined before any await: its outcome is this one's too.
        joined = cancellations.get(task_id)
        answer = None if joined is None else joined.join()
        try:
            task = await self._read(task_id, context)  # Owner-scoped: joining needs it too.
            if task is None:
                _log_cancel(task_id, "unknown task", "TaskNotFound", 0.0, False)
                raise TaskNotFoundError
            # Looked up once, so that a cancel resumed without its caller takes the same path.
            active = await _sdk.live_task(self, task_id)
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
        if task.status.state == _sdk.CANCELED:  # on_canceled="return"
            _log_cancel(task.id, "already canceled", "CANCELED", 0.0, False)
            return task
        cancellation = self._lifecycle.begin(task_id)
        answer = cancellation.join()
        try:
            # The first caller drives the cancel itself: a task of its own would cost a
            # wake-up at each end, a tenth of a fast cancel.
            await self._drive(cancellation, params, task, active, context)
        except asyncio.CancelledError:
            # Its client went away. The cancel goes on without it, from the top: every step
            # it had done is done once, every wait ends at the same deadline.
            answer.cancel()
            keep(self._drive(cancellation, params, task, active, context))
            raise
        return answer.result()

    async def aclose(self) -> None:
        """Stop hearing notices; on a2a-sdk 1.3+, then shut down as the SDK does."""
        await self._replicas.aclose()
        sdk_close = getattr(super(), "aclose", None)  # 1.3.0
        if sdk_close is not None:
            await sdk_close()

    async def _cancel_noticed(self, stored: Task, active: Any, caller: ServerCallContext) -> None:
        """Carry out here the cancel another replica recorded for a task parked here."""
        cancellation = self._lifecycle.begin_recorded(stored)
        try:
            await self._drive(cancellation, CancelTaskRequest(id=stored.id), stored, active, caller)
        finally:
            _telemetry.end(cancellation.span)

    async def _read(self, task_id: str, context: ServerCallContext) -> Task | None:
        """The task as the caller may see it; a failing store is an A2A error."""
        try:
            return await _sdk.read_task(self, task_id, context)
        except A2AError:
            raise
        except Exception as error:
            logger.warning("could not read task %s from the task store", task_id, exc_info=True)
            raise InternalError(message=f"The task store failed: {type(error).__name__}") from error

    def _refuse_unless_cancelable(self, task: Task) -> None:
        state = task.status.state
        if state in _sdk.TERMINAL_STATES:
            if state == _sdk.CANCELED and self.on_canceled == "return":
                return
            _log_cancel(task.id, "already terminal", "TaskNotCancelable", 0.0, False)
            raise TaskNotCancelableError(message=f"Task {task.id} is already in a terminal state")
        if state in _sdk.PARKED_STATES and self.on_parked == "refuse":
            _log_cancel(task.id, "parked, refused", "TaskNotCancelable", 0.0, False)
            raise TaskNotCancelableError(
                message=f"Task {task.id} is waiting for input and this server keeps such tasks"
            )

    async def _drive(
        self,
        cancellation: Cancellation,
        params: CancelTaskRequest,
        task: Task,
        active: Any,
        context: ServerCallContext,
    ) -> None:
        """Carry the cancel out, answer every caller, then let the run close (steps 2-8).

        Interrupted, it answers nobody and can be called again to finish.
        """
        outcome: Task | BaseException
        try:
            outcome = await self._cancel(cancellation, params, task, active, context)
        except A2AError as error:
            outcome = error
        except Exception as error:  # A store that fails mid-cancel: every caller learns it.
            logger.warning("the cancel of task %s failed", task.id, exc_info=True)
            outcome = InternalError(message=f"The cancel failed: {type(error).__name__}")
        cancellation.answer(outcome)
        self._lifecycle.end(cancellation)
        if active is not None:  # After the answers, so that it does not delay them.
            _tear_down(active, task.id)

    async def _cancel(
        self,
        cancellation: Cancellation,
        params: CancelTaskRequest,
        task: Task,
        active: Any,
        context: ServerCallContext,
    ) -> Task:
        """Cancel ``task``, whose run here is ``active`` (None: it has none live here)."""
        started = time.monotonic()
        if active is not None:
            path = "parked" if task.status.state in _sdk.PARKED_STATES else "live"
            path = "parked, canceled elsewhere" if cancellation.recorded else path
            result = await self._cancel_live(cancellation, active, task, context)
        elif _sdk.SUPPORTED and not _sdk.SDK_CANCELS_WHERE_NOT_LIVE:
            path, result = "not live here", await self._write_canceled(task.id, context)
        else:
            path, result = "not live here (SDK)", await self._cancel_by_sdk(params, context, cancellation)
        state = result.status.state
        _log_cancel(task.id, path, _state_name(result), time.monotonic() - started, cancellation.late)
        if state == _sdk.CANCELED:
            return result
        if state == FAILED and cancellation.failure is not None:
            raise InternalError(message=f"The agent failed to cancel task {task.id}; the task has FAILED")
        raise TaskNotCancelableError(message=f"Task {task.id} reached {_state_name(result)} before the cancel")

    async def _cancel_by_sdk(
        self, params: CancelTaskRequest, context: ServerCallContext, cancellation: Cancellation
    ) -> Task:
        """Defer to the SDK (1.2.0+ cancels a task not live here correctly), bounded."""
        timeout = max(cancellation.deadline + MARGIN - asyncio.get_running_loop().time(), 0)
        try:
            await asyncio.wait_for(_sdk_cancel(self, params, context), timeout)
        except asyncio.TimeoutError:
            logger.warning("the SDK's cancel of task %s hung; CANCELED is written directly", params.id)
            return await self._write_canceled(params.id, context)
        except TaskNotCancelableError:
            pass  # Another cancel, or the run's own end, came first: the store says which.
        # Read back: the SDK answers with its own copy, even where a guarded store refused it.
        stored = await self._read(params.id, context)
        if stored is None:
            raise TaskNotFoundError
        return stored

    async def _write_canceled(self, task_id: str, context: ServerCallContext) -> Task:
        result = await _sdk.write_canceled(self, task_id, context)
        if result is None:
            raise TaskNotFoundError
        return result

    async def _cancel_live(
        self, cancellation: Cancellation, active: Any, task: Task, context: ServerCallContext
    ) -> Task:
        """Cancel a run of this process; return the task as it ended."""
        request_context = RequestContext(
            call_context=context, task_id=task.id, context_id=task.context_id, task=task
        )
        await cancellation.carry_out(request_context, _sdk.agent_queue(active))
        recorded = await cancellation.settled(functools.partial(_sdk.wait_finished, active))
        result = await self._read(task.id, context)
        if not recorded or result is None or result.status.state not in _sdk.TERMINAL_STATES:
            logger.warning("task %s did not record a terminal state; CANCELED is written directly", task.id)
            _telemetry.teardown_forced(task.id)
            await _sdk.force_close(active, MARGIN)
            return await self._write_canceled(task.id, context)
        return result

    @_telemetry.traced_as_sdk
    async def on_message_send(  # type: ignore[override]
        self, params: SendMessageRequest, context: ServerCallContext
    ) -> Message | Task:
        """Send a message, as the SDK does; a task that ended or is being canceled refuses it."""
        _sdk.check_required_fields(params)
        if self._replicas.must_listen:
            self._replicas.listen()
        if params.message.task_id:
            await self._refuse_if_ended(params, context)
        try:
            return await _sdk_send(self, params, context)
        except _sdk.QueueShutDown as error:
            raise _ended(params) from error

    @_telemetry.traced_as_sdk
    async def on_message_send_stream(  # type: ignore[override]
        self, params: SendMessageRequest, context: ServerCallContext
    ) -> AsyncGenerator[Any, None]:
        """Stream a message, as the SDK does; a task that ended or is being canceled refuses it."""
        _sdk.check_required_fields(params)
        _sdk.check_streaming(self)
        if self._replicas.must_listen:
            self._replicas.listen()
        if params.message.task_id:
            await self._refuse_if_ended(params, context)
        events = _sdk_stream(self, params, context)
        drained = False
        try:
            async for event in events:
                yield event
                if _sdk.terminal_state(event) is None:
                    continue
                # The spec ends the stream here. The SDK's own stream ends as the run closes:
                # it is read to there (closing it instead would leave its inner stream to the
                # garbage collector's finalizer, a cost on every message), at once if the run
                # has returned, else in the background.
                drained = True
                if self._lifecycle.busy(_task_id_of(event)):
                    keep(_drain(events))
                else:
                    await _drain(events)
                return
        except _sdk.QueueShutDown as error:
            raise _ended(params) from error
        finally:
            if not drained:
                await events.aclose()

    @_telemetry.traced_as_sdk
    @_sdk.validate_request_params
    async def on_subscribe_to_task(  # type: ignore[override]
        self, params: SubscribeToTaskRequest, context: ServerCallContext
    ) -> AsyncGenerator[Any, None]:
        """Subscribe to a task the caller owns; anyone else gets ``TaskNotFoundError``.

        A terminal task has nothing more to stream: ``UnsupportedOperationError``, as the SDK
        says from 1.2.0, checked before the SDK would set up (and leak) a run for it.
        """
        _sdk.check_streaming(self)
        task = await self._read(params.id, context)
        if task is None:
            raise TaskNotFoundError
        if task.status.state in _sdk.TERMINAL_STATES:
            raise UnsupportedOperationError(
                message=f"Task {task.id} is in terminal state {_state_name(task)}"
            )
        async for event in _until_terminal(_sdk_subscribe(self, params, context)):
            yield event

    async def _refuse_if_ended(self, params: SendMessageRequest, context: ServerCallContext) -> None:
        """Refuse a message to a task being canceled or already terminal, as the spec says.

        Checked before the SDK sees the message: for a terminal task it would set up a run
        whose queues it never closes (1.0.0-1.3.0 leak two asyncio tasks per such message).
        Read first, as the caller: a task that is not the caller's is none of its business.
        """
        task_id = params.message.task_id
        task = await self._read(task_id, context)
        if task is None:
            return  # The SDK answers TaskNotFoundError its own way.
        if task_id in self._lifecycle.cancellations or task.status.state in _sdk.TERMINAL_STATES:
            raise _ended(params)


def _tear_down(active: Any, task_id: str) -> None:
    """Let the run close itself; force it closed if it does not in time."""
    # Up to a2a-sdk 1.2.2 no run closes itself (see _sdk.RUNS_CLOSE_THEMSELVES): the margin
    # is only a courtesy there. Later, a run gets long enough to close on a loop busy with
    # thousands of cancels; only one held by an execute() that swallows the cancel needs it.
    settle_by = deadline_in(_PATIENCE if _sdk.RUNS_CLOSE_THEMSELVES else MARGIN)
    span = _telemetry.current_span()  # The cancel's: the forced close is recorded under it.

    def stuck() -> None:
        logger.debug("run of task %s did not close in time; it is force-closed", task_id)
        _telemetry.teardown_forced(task_id, span)
        keep(_sdk.force_close(active, MARGIN))

    _sdk.unless_closed_by(active, settle_by, stuck)


async def _until_terminal(events: AsyncGenerator[Any, None]) -> AsyncGenerator[Any, None]:
    """Yield a stream's events and end it right after a terminal one, as the spec says.

    Ending here, rather than when the SDK closes the run's queues, also keeps a subscriber
    from taking the SDK's end-of-request marker, which a2a-sdk up to 1.2.x never marks done:
    the run's teardown would then wait for it forever.
    """
    async with contextlib.aclosing(events):
        async for event in events:
            yield event
            if _sdk.terminal_state(event) is not None:
                return


async def _drain(events: AsyncGenerator[Any, None]) -> None:
    """Read the SDK's stream to its end, for nobody: what follows a terminal event is not news."""
    try:
        async for _ in events:
            pass
    except Exception:
        logger.debug("a stream raised after its terminal event", exc_info=True)
    finally:
        await events.aclose()


def _task_id_of(event: Any) -> str:
    return event.id if isinstance(event, Task) else event.task_id


def _ended(params: SendMessageRequest) -> UnsupportedOperationError:
    return UnsupportedOperationError(
        message=f"Task {params.message.task_id} has ended or is being canceled"
    )


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
    return TaskState.Name(task.status.state).removeprefix("TASK_STATE_")
