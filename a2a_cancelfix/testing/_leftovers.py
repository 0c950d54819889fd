"""The executor under test, watched from outside: its ``cancel()`` calls, and the tasks and
threads it starts in a run, which must be gone within the grace period once it stopped."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import inspect
import sys
import threading
from typing import Any

import wrapt

from a2a_cancelfix import checkpoints
from a2a_cancelfix.testing._clock import frame_of, join, started_here, working
from a2a_cancelfix.testing._probe import Probe, _is_framework, describe, raised_in, users_frame
from a2a_cancelfix.testing._report import Row

_IN_CANCEL: contextvars.ContextVar[bool] = contextvars.ContextVar("a2a_cancelfix_in_cancel", default=False)
"""Set while the executor's ``cancel()`` runs: what it starts is the executor's too."""


class NotedExecutor(wrapt.ObjectProxy):
    """The executor under test, as the handler sees it: its ``cancel()`` calls are noted."""

    def __init__(self, executor: Any) -> None:
        super().__init__(executor)
        self._self_called = asyncio.Event()
        self._self_returned = asyncio.Event()
        self._self_error: BaseException | None = None
        self._self_cut: str | None = None  # Once cut: where it hung, for people ("" unknown).

    @property
    def called(self) -> asyncio.Event:
        """Set once its ``cancel()`` is called."""
        return self._self_called

    @property
    def returned(self) -> asyncio.Event:
        """Set once that call has returned, raised or been cut off."""
        return self._self_returned

    @property
    def error(self) -> BaseException | None:
        """What its ``cancel()`` raised, if anything."""
        return self._self_error

    @property
    def cut(self) -> str | None:
        """Where its ``cancel()`` hung when it was cut off ("" unknown); None if it was not."""
        return self._self_cut

    async def cancel(self, context: Any, event_queue: Any) -> None:
        self._self_called.set()
        inside = _IN_CANCEL.set(True)
        try:
            await self.__wrapped__.cancel(context, event_queue)
        except asyncio.CancelledError as cut:
            self._self_cut = raised_in(cut)  # Cut off at the grace period's end: it hung.
            raise
        except Exception as error:
            self._self_error = error
            raise
        finally:
            _IN_CANCEL.reset(inside)
            self._self_returned.set()


class Leftovers:
    """What the executor starts in one run's loop (tasks, threads, work for the loop's pool),
    installed on that loop with `install`; `judge` says what still runs. With a probe, the
    tasks a run's own code starts are driven by it: their awaits are points of the run's."""

    def __init__(self, probe: Probe | None = None) -> None:
        self.threads = set(threading.enumerate())  # Those that ran before: not the executor's.
        self.pool = _TrackedPool()
        self.owned: dict[asyncio.Task[Any], str] = {}  # Each with where the executor started it.
        self.probe = probe

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.set_default_executor(self.pool)
        loop.set_task_factory(self._task_factory)

    def _task_factory(self, loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        owned = _executors_own() and not _ours(coro)  # The executor's own code started it,
        run = checkpoints.current_run()
        users = inspect.iscoroutine(coro) and _started_by_users_code(sys._getframe(1))
        if owned and self.probe is not None and run is not None and users:
            coro = self.probe.child(coro, run)  # Not a framework's task, whose awaits are its own.
        task = asyncio.Task(coro, loop=loop, **kwargs)
        if owned:
            self.owned[task] = describe(users_frame(sys._getframe(1)))  # in a run or its cancel().
        return task

    async def judge(self, row: Row, when: str, grace: float) -> None:
        """The executor's own tasks and threads end within ``grace`` seconds after ``when``."""
        tasks = {task for task in self.owned if not task.done()}
        if tasks:
            await asyncio.wait(tasks, timeout=grace)
        for task in sorted(tasks, key=lambda task: task.get_name()):
            if not task.done():
                started = f", started in {self.owned[task]}" if self.owned[task] else ""
                row.failures.append(
                    f"a task it started ({_coro_name(task)}{started}) still ran {grace:g} s after {when}"
                )
        busy = [work for work in self.pool.works if not work.done()]
        threads = [thread for thread in threading.enumerate() if thread not in self.threads]
        threads = [thread for thread in threads if started_here(thread) and not self.pool.owns(thread)]
        if busy or threads:
            await asyncio.to_thread(join, busy, threads, grace)
        if any(not work.done() for work in busy) or any(working(thread) for thread in threads):
            stuck = [thread for thread in (*self.pool.threads(), *threads) if working(thread)]
            running = sorted({describe(users_frame(frame_of(thread))) for thread in stuck} - {""})
            running = running or sorted({_innermost(thread) for thread in stuck} - {""})
            in_code = f", in {' and '.join(running)}" if running else ""
            row.failures.append(f"a thread it started still ran {grace:g} s after {when}{in_code}")


class _TrackedPool(concurrent.futures.ThreadPoolExecutor):
    """The loop's default executor (``asyncio.to_thread``): what a run submits is noted."""

    def __init__(self) -> None:
        super().__init__(thread_name_prefix="a2a-cancelfix-sweep")
        self.works: list[concurrent.futures.Future[Any]] = []

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        work = super().submit(fn, *args, **kwargs)
        if _executors_own():
            self.works.append(work)
        return work

    def owns(self, thread: threading.Thread) -> bool:
        return thread in self._threads

    def threads(self) -> list[threading.Thread]:
        return list(self._threads)


def _executors_own() -> bool:
    """Whether what starts here is the executor's: inside a run, or inside its ``cancel()``."""
    return checkpoints.current_run() is not None or _IN_CANCEL.get()


def _innermost(thread: threading.Thread) -> str:
    """Where a thread running none of the executor's code is, for people."""
    frame = frame_of(thread)
    if frame is None:
        return ""
    return f"{frame.f_globals.get('__name__')}.{frame.f_code.co_name} (no code of the executor's)"


def _started_by_users_code(frame: Any) -> bool:
    """Whether the code that starts a task, past asyncio's own (a TaskGroup, gather), is the user's."""
    while frame is not None and str(frame.f_globals.get("__name__", "")).partition(".")[0] == "asyncio":
        frame = frame.f_back
    return frame is not None and users_frame(frame) is frame


def _ours(coro: Any) -> bool:
    frame = getattr(coro, "cr_frame", None)
    return frame is not None and _is_framework(frame)


def _coro_name(task: asyncio.Task[Any]) -> str:
    coro = task.get_coro()
    return getattr(coro, "__qualname__", None) or task.get_name()
