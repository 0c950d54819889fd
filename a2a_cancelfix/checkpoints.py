"""Cooperative cancellation inside a run of ``execute()``: one cancellation scope per run.

The scope travels in a context variable, so every coroutine of the run, and every thread it
starts with ``asyncio.to_thread``, sees the same one. A cancel is level-triggered: once
requested, every later checkpoint raises again, so a swallowed exception cannot keep the
work going.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from typing import Any, ParamSpec, Protocol, TypeVar, cast

from a2a_cancelfix._aio import in_background, wait_set

__all__ = ["RunCancelled", "cancel_requested", "cancellable", "checkpoint", "on_cancel", "shielded"]

logger = logging.getLogger("a2a_cancelfix")

P = ParamSpec("P")
R = TypeVar("R")


class RunCancelled(asyncio.CancelledError):
    """Raised at a checkpoint of a run whose task was cancelled.

    A subclass of ``asyncio.CancelledError``, so existing ``finally`` blocks and
    ``except asyncio.CancelledError`` cleanup keep working.

    Attributes:
        reason: Why the cancel was requested.
        requested_at: When it was requested (``time.time()``).
    """

    def __init__(self, reason: str, requested_at: float) -> None:
        super().__init__(reason)
        self.reason = reason
        self.requested_at = requested_at


class Probe(Protocol):
    """What a2a_cancelfix.testing's sweep sees of each run, given to the lifecycle it probes.

    Such a lifecycle hands the probe every run to drive, and each run of it looks at every
    awaited checkpoint (the probe's ``at_checkpoint`` first) and tells the probe whenever a
    checkpoint raises.
    """

    def drive(
        self, execute: Callable[[Any, Any], Awaitable[None]], context: Any, queue: Any, run: Run
    ) -> Awaitable[None]:
        """Run ``execute(context, queue)`` as the work of ``run``."""

    async def at_checkpoint(self) -> None:
        """Called at each look of the run: an awaited checkpoint, an enqueued event, a notice."""

    def saw_cancel(self) -> None:
        """Called as a checkpoint raises `RunCancelled`: ``sys._getframe(2)`` is its caller."""


class Run:
    """The cancellation scope of one ``execute()`` call of one task.

    Args:
        task_id: the task the run works on.
        watch: called at most once per ``interval`` from an awaited checkpoint (and before
            a terminal event is enqueued) to learn of a cancel recorded elsewhere, such as
            by another replica in a shared task store; it calls ``cancel`` when it finds one.
        interval: seconds between two looks from checkpoints; the default, ``math.inf``,
            leaves the pace to ``poll_every`` (the handler passes its poll interval).
        probe: the testing kit's `Probe`: the run then looks at every checkpoint.
    """

    # Defaults until a run sets its own: every message starts a run; few are cancelled,
    # shielded, watched or probed.
    reason: str | None = None
    requested_at: float | None = None
    # The work has begun to unwind because of the cancel: interrupting it now could cut
    # its cleanup (a claim's release, say) in half.
    unwinding = False
    # Suspended in a look of its own (a checkpoint, an enqueue), after which it raises if cancelled.
    looking = False
    _shields = 0
    _unshielded: asyncio.Event | None = None  # Made by the first shielded section.
    _probe: Probe | None = None
    _callbacks: list[Callable[[], Any]] | None = None  # Made by the first on_cancel callback.
    _watch: Callable[[], Awaitable[None]] | None = None
    # When a look is next due (time.monotonic()); never without a watch, nor once cancelled.
    next_look = math.inf

    def __init__(
        self,
        task_id: str,
        watch: Callable[[], Awaitable[None]] | None = None,
        interval: float = math.inf,
        probe: Probe | None = None,
    ) -> None:
        self.task_id = task_id
        # Set here, not defaults of the class: every enqueue reads both, and Python 3.11 reads
        # a class's default through a generic lookup, several times slower. Unless watched,
        # nothing is ever recorded elsewhere to look for.
        self.cancelled = self.watched = False
        if probe is not None:
            self._probe = probe
            watch, interval = _probed(self, probe, watch), 0.0
        self._interval = interval
        if watch is not None:
            self._watch, self.watched = watch, True
            self.next_look = time.monotonic() + interval

    @property
    def shielded(self) -> bool:
        return self._shields > 0

    def cancel(self, reason: str) -> None:
        """Request the cancel once; run the registered callbacks now."""
        if self.cancelled:
            return
        self.reason, self.requested_at, self.cancelled = reason, time.time(), True
        self.next_look = math.inf
        callbacks, self._callbacks = self._callbacks or (), None
        for callback in callbacks:
            _call_safely(callback, self.task_id)

    def raise_if_cancelled(self) -> None:
        if self.cancelled and not self._shields:
            self.unwinding = True
            if self._probe is not None:
                self._probe.saw_cancel()
            raise RunCancelled(self.reason or "cancel requested", self.requested_at or 0.0)

    def add_callback(self, callback: Callable[[], Any]) -> Callable[[], None]:
        if self.cancelled:
            _call_safely(callback, self.task_id)
            return _nothing
        if self._callbacks is None:
            self._callbacks = []
        self._callbacks.append(callback)
        return functools.partial(_discard, self._callbacks, callback)

    async def wait_unshielded(self, deadline: float) -> None:
        """Wait until no shielded section runs, or the loop's clock reaches ``deadline``."""
        if self._unshielded is not None:
            await wait_set(self._unshielded, deadline)

    def poll_every(self, interval: float) -> None:
        """From now on, poll at most once per ``interval`` (``math.inf``: cancels are pushed)."""
        self._interval = interval
        if self._probe is not None:
            return  # Probed: it looks at every checkpoint.
        if self._watch is not None and not self.cancelled:
            self.next_look = time.monotonic() + interval

    async def look(self) -> None:
        """Look for a cancel recorded elsewhere now (``watch`` cancels the run if it finds one)."""
        if self._watch is not None and not self.cancelled:
            self.next_look = time.monotonic() + self._interval
            await self._watch()

    async def watch(self) -> None:
        """Look for a cancel recorded elsewhere now; raise if there is one (or was one)."""
        await self.look_in_run()
        self.raise_if_cancelled()

    async def look_in_run(self) -> None:
        """`look`, from the run's own code, which checks for the cancel once it returns."""
        self.looking = True
        try:
            await self.look()
        finally:
            self.looking = False

    def _enter_shield(self) -> None:
        self._shields += 1
        if self._unshielded is None:
            self._unshielded = asyncio.Event()
        self._unshielded.clear()

    def _exit_shield(self) -> None:
        self._shields -= 1
        if not self._shields and self._unshielded is not None:
            self._unshielded.set()


_current_run: contextvars.ContextVar[Run | None] = contextvars.ContextVar("a2a_cancelfix_run", default=None)


def _probed(
    run: Run, probe: Probe, watch: Callable[[], Awaitable[None]] | None
) -> Callable[[], Awaitable[None]]:
    async def look() -> None:
        await probe.at_checkpoint()
        if watch is not None and not run.cancelled:
            await watch()

    return look


def current_run() -> Run | None:
    """The run whose scope the caller is in (its task, or a thread it started), if any."""
    return _current_run.get()


# Bind a run to the current context (the task running the work), and unbind it: the context
# variable's own methods, as a run's start and end would pay a call of ours.
enter_run = _current_run.set
leave_run = _current_run.reset


class _Ready:
    """An awaitable that completes at once, without yielding to the loop."""

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, None]:
        return
        yield


_READY = _Ready()


class _Watch:
    """An awaitable that looks for a cancel recorded elsewhere; inert unless awaited."""

    __slots__ = ("run",)

    def __init__(self, run: Run) -> None:
        self.run = run

    def __await__(self) -> Generator[Any, None, None]:
        # A generator of this module's, not the coroutine's wrapper: whoever walks the run's
        # chain of awaits (the testing kit's probe) sees the look is the framework's.
        return (yield from self.run.watch().__await__())


def checkpoint() -> Awaitable[None]:
    """Raise `RunCancelled` if this run's task was cancelled; else return at once.

    Use ``await checkpoint()`` in coroutines: at most once per poll interval it also asks the
    task store whether another replica cancelled the task. In a thread started from the run
    with ``asyncio.to_thread``, a plain ``checkpoint()`` call raises the same way (it cannot
    ask the store). Outside a run there is nothing to cancel and it returns at once. Inside
    ``shielded()`` it never raises.

    Raises:
        RunCancelled: once the cancel was requested, at every call.
    """
    run = _current_run.get()
    if run is None:
        return _READY
    run.raise_if_cancelled()
    return _READY if time.monotonic() < run.next_look else _Watch(run)


def cancel_requested() -> bool:
    """Tell whether this run's task was cancelled, without raising (False outside a run)."""
    run = _current_run.get()
    return run is not None and run.cancelled


def on_cancel(callback: Callable[[], Any]) -> Callable[[], None]:
    """Call ``callback()`` when the cancel arrives (at once if it already has).

    For aborting what a checkpoint cannot reach: an in-flight HTTP or LLM call, a socket.
    The callback runs on the event loop's thread; a coroutine function's result is
    scheduled as a task. Its errors are logged, never raised into the cancel.

    Returns:
        A function that unregisters the callback.

    Raises:
        RuntimeError: outside a run, where the callback could never fire.
    """
    run = _current_run.get()
    if run is None:
        raise RuntimeError(
            "on_cancel() was called outside a run of an executor wrapped by "
            "a2a_cancelfix.CancellableExecutor: the callback could never fire"
        )
    return run.add_callback(callback)


@contextlib.asynccontextmanager
async def shielded() -> AsyncIterator[None]:
    """Defer the cancel while the block runs; it takes effect when the block exits.

    Neither checkpoints nor the teardown of the run interrupt the block, for at most the
    handler's grace period. Events enqueued inside it after the cancel are dropped.
    Outside a run it does nothing.

    Raises:
        RunCancelled: on exit, if the cancel arrived while the block ran.
    """
    run = _current_run.get()
    if run is None:
        yield
        return
    run._enter_shield()
    try:
        yield
    finally:
        run._exit_shield()
    run.raise_if_cancelled()


def cancellable(step: Callable[P, R]) -> Callable[P, R]:
    """Decorate a step function: a checkpoint before it runs and after it returns.

    Works on async and sync functions and methods; generators are refused, since a
    checkpoint "after it returns" has no meaning for them.

    Raises:
        TypeError: at decoration time, for a shape that cannot be checkpointed.
    """
    if inspect.isgeneratorfunction(step) or inspect.isasyncgenfunction(step):
        raise TypeError(
            f"@cancellable cannot decorate the generator {step.__qualname__}: "
            "put `await checkpoint()` inside its loop instead"
        )
    if not callable(step) or isinstance(step, type):
        raise TypeError(f"@cancellable decorates functions and methods, not {step!r}")

    if inspect.iscoroutinefunction(step):

        @functools.wraps(step)
        async def async_step(*args: P.args, **kwargs: P.kwargs) -> Any:
            await checkpoint()
            try:
                result = await step(*args, **kwargs)
            except BaseException:
                _note_unwinding()
                raise
            await checkpoint()
            return result

        # A coroutine function for a coroutine function: the same type, to the checker too.
        return cast(Callable[P, R], async_step)

    @functools.wraps(step)
    def sync_step(*args: P.args, **kwargs: P.kwargs) -> R:
        checkpoint()
        try:
            result = step(*args, **kwargs)
        except BaseException:
            _note_unwinding()
            raise
        checkpoint()
        return result

    return sync_step


def _note_unwinding() -> None:
    """A step failed after the cancel (an ``on_cancel`` callback aborted its call, say)."""
    run = _current_run.get()
    if run is not None and run.cancelled:
        run.unwinding = True


def _call_safely(callback: Callable[[], Any], task_id: str) -> None:
    try:
        result = callback()
        if inspect.isawaitable(result):
            in_background(result)
    except Exception:
        logger.exception("on_cancel callback %r failed for task %s", callback, task_id)


def _discard(callbacks: list[Callable[[], Any]], callback: Callable[[], Any]) -> None:
    with contextlib.suppress(ValueError):
        callbacks.remove(callback)


def _nothing() -> None:
    return None
