"""DefaultRequestHandler: the SDK's handler, with a cancel that always ends."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Coroutine
from typing import Any, Literal

from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.context import ServerCallContext
from a2a.server.request_handlers.default_request_handler_v2 import DefaultRequestHandlerV2
from a2a.types import (
    CancelTaskRequest,
    Message,
    SendMessageRequest,
    SubscribeToTaskRequest,
    Task,
    TaskNotCancelableError,
    TaskNotFoundError,
    TaskState,
    UnsupportedOperationError,
)

from a2a_cancelfix import _sdk
from a2a_cancelfix.executor import CancellableExecutor, terminal_state

logger = logging.getLogger("a2a_cancelfix")

# Time past the grace period for the SDK to record the terminal state and close the run.
_MARGIN = 1.0
# How long, after the answer, a run that can close itself gets to do so before it is forced.
_PATIENCE = 30.0


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
            recorded there; ``None`` turns it off. A run also reads it before it publishes a
            terminal state.
    """

    def __init__(
        self,
        agent_executor: AgentExecutor,
        *args: Any,
        cancel_grace_period: float = 5.0,
        on_parked: Literal["cancel", "refuse"] = "cancel",
        on_canceled: Literal["raise", "return"] = "raise",
        replica_poll_interval: float | None = 1.0,
        **kwargs: Any,
    ) -> None:
        if cancel_grace_period <= 0:
            raise ValueError("cancel_grace_period must be greater than 0")
        if replica_poll_interval is not None and replica_poll_interval <= 0:
            raise ValueError("replica_poll_interval must be greater than 0, or None")
        if on_parked not in ("cancel", "refuse"):
            raise ValueError(f"on_parked must be 'cancel' or 'refuse', not {on_parked!r}")
        if on_canceled not in ("raise", "return"):
            raise ValueError(f"on_canceled must be 'raise' or 'return', not {on_canceled!r}")
        _sdk.warn_if_unsupported()
        executor = CancellableExecutor(agent_executor, grace_period=cancel_grace_period)
        if _sdk.SUPPORTED:  # Otherwise the SDK's own cancel drives, as under its handler.
            executor._self_drive_cancels()
        super().__init__(executor, *args, **kwargs)
        if replica_poll_interval is not None:
            executor._self_watch_store(self._stored_for_run, replica_poll_interval)
        self.cancel_grace_period = cancel_grace_period
        self.on_parked = on_parked
        self.on_canceled = on_canceled
        self._cancels: dict[str, list[asyncio.Future[Task]]] = {}  # Callers of each cancel.
        self._background: set[asyncio.Future[None]] = set()

    async def on_cancel_task(  # type: ignore[override]
        self, params: CancelTaskRequest, context: ServerCallContext
    ) -> Task:
        """Cancel a task; return it CANCELED or raise an A2A error, within the grace bound.

        Raises:
            TaskNotFoundError: unknown id, or a task the caller does not own.
            TaskNotCancelableError: already terminal, or parked under ``on_parked="refuse"``.
        """
        task_id = params.id
        task = await _sdk.read_task(self, task_id, context)
        if task is None:
            raise TaskNotFoundError
        # Looked up once, so that a cancel resumed without its caller takes the same path.
        active = await _sdk.live_task(self, task_id)
        answer: asyncio.Future[Task] = asyncio.get_running_loop().create_future()
        answers = self._cancels.get(task_id)
        if answers is not None:  # Being cancelled: that cancel's answer is this one's too.
            answers.append(answer)
            return await answer
        try:
            self._refuse_unless_cancelable(task)
        except TaskNotCancelableError:
            terminal = task.status.state in _sdk.TERMINAL_STATES
            path = "already terminal" if terminal else "parked, refused"
            _log_cancel(task, path, "TaskNotCancelable", 0.0, False)
            raise
        answers = self._cancels[task_id] = [answer]
        try:
            # The first caller drives the cancel itself: a task of its own would cost a
            # wake-up at each end, a tenth of a fast cancel.
            await self._cancel_for_all(params, task, active, context, answers)
        except asyncio.CancelledError:
            # Its client went away. The cancel goes on without it, from the top: every step
            # it had done is done once, every wait is waited again.
            answer.cancel()
            self._in_background(self._cancel_for_all(params, task, active, context, answers))
            raise
        return answer.result()

    async def _stored_for_run(self, context: RequestContext) -> Task | None:
        """The task as stored, read as the run's caller (a run checks it for remote cancels)."""
        return await _sdk.read_task(self, context.task_id or "", context.call_context)

    def _refuse_unless_cancelable(self, task: Task) -> None:
        state = task.status.state
        if state in _sdk.TERMINAL_STATES:
            if state == _sdk.CANCELED and self.on_canceled == "return":
                return
            raise TaskNotCancelableError(message=f"Task {task.id} is already in a terminal state")
        if state in _sdk.PARKED_STATES and self.on_parked == "refuse":
            raise TaskNotCancelableError(
                message=f"Task {task.id} is waiting for input and this server keeps such tasks"
            )

    async def _cancel_for_all(
        self,
        params: CancelTaskRequest,
        task: Task,
        active: Any,
        context: ServerCallContext,
        answers: list[asyncio.Future[Task]],
    ) -> None:
        """Cancel ``task``, answer every caller waiting for it, then let the run close.

        Interrupted, it answers nobody and can be called again to finish.
        """
        teardown: list[Coroutine[Any, Any, None]] = []
        try:
            result = await self._cancel(params, task, active, context, teardown)
        except Exception as error:  # noqa: BLE001 - every caller gets it, as if it were its own.
            for answer in answers:
                if not answer.done():
                    answer.set_exception(error)
        else:
            for answer in answers:
                if not answer.done():
                    answer.set_result(result)
        del self._cancels[task.id]
        for step in teardown:  # After the answers, so that it does not delay them.
            self._in_background(step)

    async def _cancel(
        self,
        params: CancelTaskRequest,
        task: Task,
        active: Any,
        context: ServerCallContext,
        teardown: list[Coroutine[Any, Any, None]],
    ) -> Task:
        """Cancel ``task``, whose run here is ``active`` (None: it has none live here)."""
        started = time.monotonic()
        if task.status.state == _sdk.CANCELED:
            _log_cancel(task, "already canceled", "CANCELED", 0.0, False)
            return task
        late = False
        if active is not None:
            path = "parked" if task.status.state in _sdk.PARKED_STATES else "live"
            result, late = await self._cancel_live(active, task, context, teardown)
        elif _sdk.SUPPORTED and not _sdk.SDK_CANCELS_WHERE_NOT_LIVE:
            path, result = "not live here", await self._write_canceled(task.id, context)
        else:
            path, result = "not live here (SDK)", await self._cancel_by_sdk(params, context)
        _log_cancel(task, path, _state_name(result), time.monotonic() - started, late)
        if result.status.state != _sdk.CANCELED:
            raise TaskNotCancelableError(
                message=f"Task {task.id} reached {_state_name(result)} before the cancel"
            )
        return result

    async def _cancel_by_sdk(self, params: CancelTaskRequest, context: ServerCallContext) -> Task:
        """Defer to the SDK (1.2.0+ cancels a task not live here correctly), bounded."""
        try:
            return await asyncio.wait_for(
                super().on_cancel_task(params, context), self.cancel_grace_period + _MARGIN
            )
        except asyncio.TimeoutError:
            logger.warning("the SDK's cancel of task %s hung; CANCELED is written directly", params.id)
            return await self._write_canceled(params.id, context)

    async def _write_canceled(self, task_id: str, context: ServerCallContext) -> Task:
        result = await _sdk.write_canceled(self, task_id, context)
        if result is None:
            raise TaskNotFoundError
        return result

    async def _cancel_live(
        self,
        active: Any,
        task: Task,
        context: ServerCallContext,
        teardown: list[Coroutine[Any, Any, None]],
    ) -> tuple[Task, bool]:
        """Cancel a run of this process; return the task as it ended and whether time ran out.

        What is left of closing the run goes into ``teardown``, to run after the answer.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cancel_grace_period
        request_context = RequestContext(
            call_context=context, task_id=task.id, context_id=task.context_id, task=task
        )
        executor: CancellableExecutor = self.agent_executor  # type: ignore[assignment]
        await executor._self_cancel(request_context, _sdk.agent_queue(active), deadline, tears_down=True)
        late = loop.time() >= deadline
        recorded = await _sdk.wait_finished(active, _MARGIN)
        result = await _sdk.read_task(self, task.id, context)
        if not recorded or result is None or result.status.state not in _sdk.TERMINAL_STATES:
            logger.warning("task %s did not record a terminal state; CANCELED is written directly", task.id)
            await _sdk.force_close(active, _MARGIN)
            executor._self_forget(task.id)
            return await self._write_canceled(task.id, context), True
        teardown.append(self._tear_down(active, task.id))
        return result, late

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` after the answer, holding a reference so that it is not lost."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _tear_down(self, active: Any, task_id: str) -> None:
        """Let the run close itself; force it closed if it does not in time."""
        loop = asyncio.get_running_loop()
        # Up to a2a-sdk 1.2.2 no run closes itself (see _sdk.RUNS_CLOSE_THEMSELVES): the margin
        # is only a courtesy there. Later, a run gets long enough to close on a loop busy with
        # thousands of cancels; only one held by an execute() that swallows the cancel needs it.
        settle_by = loop.time() + (_PATIENCE if _sdk.RUNS_CLOSE_THEMSELVES else _MARGIN)
        stopped = await _sdk.producer_stopped(active, settle_by - loop.time())
        if not (stopped and await _sdk.wait_consumer(active, settle_by - loop.time())):
            logger.debug("run of task %s did not close in time; it is force-closed", task_id)
            await _sdk.force_close(active, _MARGIN)
        self.agent_executor._self_forget(task_id)

    async def on_message_send(  # type: ignore[override]
        self, params: SendMessageRequest, context: ServerCallContext
    ) -> Message | Task:
        """Send a message, as the SDK does; a task that ended or is being canceled refuses it."""
        await self._refuse_if_ended(params, context)
        try:
            return await super().on_message_send(params, context)
        except _sdk.QueueShutDown as error:
            raise _ended(params) from error

    async def on_message_send_stream(  # type: ignore[override]
        self, params: SendMessageRequest, context: ServerCallContext
    ) -> AsyncGenerator[Any, None]:
        """Stream a message, as the SDK does; a task that ended or is being canceled refuses it."""
        await self._refuse_if_ended(params, context)
        events = super().on_message_send_stream(params, context)
        drained = False
        try:
            async for event in events:
                yield event
                if terminal_state(event) is None:
                    continue
                # The spec ends the stream here. The SDK's own stream ends as the run closes:
                # it is read to there (closing it instead would leave its inner stream to the
                # garbage collector's finalizer, a cost on every message), at once if the run
                # has returned, else in the background.
                drained = True
                if self.agent_executor._self_running(_task_id_of(event)):
                    self._in_background(_drain(events))
                else:
                    await _drain(events)
                return
        except _sdk.QueueShutDown as error:
            raise _ended(params) from error
        finally:
            if not drained:
                await events.aclose()

    async def on_subscribe_to_task(  # type: ignore[override]
        self, params: SubscribeToTaskRequest, context: ServerCallContext
    ) -> AsyncGenerator[Any, None]:
        """Subscribe to a task the caller owns; anyone else gets ``TaskNotFoundError``.

        A terminal task has nothing more to stream: ``UnsupportedOperationError``, as the SDK
        says from 1.2.0, checked before the SDK would set up (and leak) a run for it.
        """
        task = await _sdk.read_task(self, params.id, context)
        if task is None:
            raise TaskNotFoundError
        if task.status.state in _sdk.TERMINAL_STATES:
            raise UnsupportedOperationError(
                message=f"Task {task.id} is in terminal state {_state_name(task)}"
            )
        async for event in _until_terminal(super().on_subscribe_to_task(params, context)):
            yield event

    async def _refuse_if_ended(self, params: SendMessageRequest, context: ServerCallContext) -> None:
        """Refuse a message to a task being canceled or already terminal, as the spec says.

        Checked before the SDK sees the message: for a terminal task it would set up a run
        whose queues it never closes (1.0.0-1.3.0 leak two asyncio tasks per such message).
        """
        task_id = params.message.task_id
        if not task_id:
            return
        if task_id in self._cancels:
            raise _ended(params)
        task = await _sdk.read_task(self, task_id, context)
        if task is not None and task.status.state in _sdk.TERMINAL_STATES:
            raise _ended(params)


async def _until_terminal(events: AsyncGenerator[Any, None]) -> AsyncGenerator[Any, None]:
    """Yield a stream's events and end it right after a terminal one, as the spec says.

    Ending here, rather than when the SDK closes the run's queues, also keeps a subscriber
    from taking the SDK's end-of-request marker, which a2a-sdk up to 1.2.x never marks done:
    the run's teardown would then wait for it forever.
    """
    async with contextlib.aclosing(events):
        async for event in events:
            yield event
            if terminal_state(event) is not None:
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


def _log_cancel(task: Task, path: str, outcome: str, took: float, late: bool) -> None:
    logger.info(
        "cancel task=%s path=%s outcome=%s took=%.3fs grace_exhausted=%s",
        task.id,
        path,
        outcome,
        took,
        late,
    )


def _state_name(task: Task) -> str:
    return TaskState.Name(task.status.state).removeprefix("TASK_STATE_")
