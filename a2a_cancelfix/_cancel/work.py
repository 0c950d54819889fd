"""A run of the wrapped ``execute()`` (`Work`), and how a cancel stops it."""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from a2a_cancelfix._aio import Once, suspended_on
from a2a_cancelfix.checkpoints import Probe, Run, enter_run, leave_run

if TYPE_CHECKING:
    from a2a.server.agent_execution import RequestContext
    from a2a.server.context import ServerCallContext

logger = logging.getLogger("a2a_cancelfix")


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
    interrupted = False
    abandoned = False
    # The await the work was suspended at when the cancel came, not yet done (None: it was
    # running, or its await had returned and it waited in the loop's queue to resume), and
    # whether the run had ``on_cancel`` callbacks then.
    found_at: asyncio.Future[Any] | None = None
    had_callbacks = False
    _ended: Once | None = None  # Made by the first wait for the end.

    def __init__(
        self,
        task_id: str,
        context: RequestContext,
        watch: Callable[[], Awaitable[None]] | None = None,
        interval: float = math.inf,
        probe: Probe | None = None,
    ) -> None:
        Run.__init__(self, task_id, watch, interval, probe)  # Not super(): one for every message.
        self.context = context  # The request it runs.
        # Its queue carried the task's terminal state (see `RunQueue`): nothing more goes in.
        # Set here, not a default of the class: every enqueue reads it (see `Run`).
        self.task_ended = False

    @property
    def caller(self) -> ServerCallContext:
        """Who sent the message it runs: a shutdown reads its task as them."""
        return self.context.call_context

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
        cancelling = getattr(found, "cancelling", None)  # A task's: a plain future has none.
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
_FRAMEWORK = (os.path.dirname(os.path.dirname(__file__)), os.path.dirname(asyncio.__file__))


def _uncancel(task: asyncio.Task[Any]) -> None:
    if task.cancelling():
        task.uncancel()
