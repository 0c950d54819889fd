"""CANCELED written straight to the store, where the SDK will not write it: bounded for the
answer, retried behind it until the store takes it."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from a2a.types import InternalError, Task, TaskNotFoundError

from a2a_cancelfix import _sdk
from a2a_cancelfix._aio import Once, deadline_in, in_background, wait_done, wait_patiently
from a2a_cancelfix._cancel.cancellation import CanceledWrite

if TYPE_CHECKING:
    from a2a.server.context import ServerCallContext
    from a2a.server.request_handlers import DefaultRequestHandlerV2

    from a2a_cancelfix._cancel.cancellation import Cancellation

logger = logging.getLogger("a2a_cancelfix")


class CanceledWrites:
    """One handler's direct writes of CANCELED in progress, retries included, by task.

    Args:
        handler: the SDK's handler whose store is written (read only once a cancel writes).
    """

    def __init__(self, handler: DefaultRequestHandlerV2) -> None:
        self._handler = handler
        # By task: a stream whose run was closed before its end was recorded waits for it.
        self.recording: dict[str, asyncio.Future[None]] = {}
        self._closing = Once()  # The handler's aclose(): pending writes try once more, then stop.

    async def write(
        self,
        cancellation: Cancellation,
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
        write that fails is retried too: the task never stays WORKING with nothing running.
        """
        task_id = cancellation.task_id

        def start() -> CanceledWrite:
            started = CanceledWrite(cancellation.timeline.margin_from_now())
            retries = cancellation.timeline.timing.retries
            self.recording[task_id] = in_background(
                self._record(started, task_id, caller, after, stopped, retries)
            )
            return started

        write = cancellation.write(start)
        if not await wait_patiently(functools.partial(wait_done, write.first), *write.by):
            write.outlive()
            logger.warning("task %s: the store has not recorded CANCELED in time; the write goes on", task_id)
            raise InternalError(
                message=f"The task store has not recorded CANCELED yet for task {task_id}; the write "
                "goes on behind this answer (read the task to see it land)"
            )
        result = write.first.result()
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
        write: CanceledWrite,
        task_id: str,
        caller: ServerCallContext,
        after: Callable[[], Awaitable[None]] | None,
        stopped: bool,
        retries: tuple[float, ...],
    ) -> None:
        """The write: its first attempt's outcome goes to ``write.first``; a failure after the
        run here was stopped, or after the answer promised the write goes on, is retried."""
        first = write.first
        try:
            if after is not None:
                await after()
            try:
                first.set_result(await _sdk.write_canceled(self._handler, task_id, caller))
                return
            except Exception as error:
                logger.warning("could not record CANCELED of task %s: %r", task_id, error)
                first.set_result(error)
            if stopped or write.outlived:
                await self._record_later(task_id, caller, retries)
        finally:
            if not first.done():
                first.cancel()
            if self.recording.get(task_id) is asyncio.current_task():
                del self.recording[task_id]

    async def _record_later(
        self, task_id: str, caller: ServerCallContext, retries: tuple[float, ...]
    ) -> None:
        """Retry recording the CANCELED of a task, backing off, until the store takes it; once
        the handler closes, once more at once, and no more."""
        for delay in retries:
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
        """For the handler's shutdown: each pending write is tried once more, at once, and
        waited for until ``deadline``. One that has not ended by then is named in a WARNING and
        left to land if it can: a store cut off mid-statement can keep its connection stuck.
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

    async def over(self, task_id: str) -> bool:
        """Wait until the write of ``task_id`` in progress, if any, is over; whether there was one."""
        recording = self.recording.get(task_id)
        if recording is None:
            return False
        await asyncio.wait([recording])  # Not cancelled with its waiter: others wait for it too.
        return True
