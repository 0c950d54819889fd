"""How the sweep sees a run of ``execute()``: its cancel points, in order, and holds it at one.

A run's cancel points are the moments a cancel can land on it: each await of its own code that
suspends it (the only moments another request can run, on one event loop), each checkpoint,
each event it publishes, and the start of a run that follows up a parked task. The probe drives
the run's coroutine itself, one suspension at a time, so it sees every await without a timer or
a patched loop, and names each point by the code that awaits there. It drives so the tasks that
the run's own code starts (``asyncio.TaskGroup``, ``create_task``, ``gather``) too: their
awaits are points, named by the child's own code.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import inspect
import os
import sys
import sysconfig
import types
from collections.abc import Awaitable, Callable, Coroutine, Generator
from dataclasses import dataclass
from typing import Any

import a2a

import a2a_cancelfix
from a2a_cancelfix import checkpoints
from a2a_cancelfix._sdk import state_name, terminal_state
from a2a_cancelfix.checkpoints import Run, RunCancelled

# An await that suspends inside a2a-sdk or us is the framework's, no point of the user's; one
# inside the standard library or an installed package is named by what the user's code called.
_FRAMEWORK = tuple(os.path.dirname(module.__file__ or "") + os.sep for module in (a2a, a2a_cancelfix))
_LIBRARIES = tuple({sysconfig.get_paths()[name] + os.sep for name in ("stdlib", "purelib", "platlib")})
# Executors of ours that the sweep treats as a user's: the demo agent and the examples.
_OURS_AS_USERS = (
    os.path.join(_FRAMEWORK[1], "tools", "demo.py"),
    os.path.join(_FRAMEWORK[1], "testing", "examples.py"),
)
_STEP_WRAPPERS = ("async_step", "sync_step")  # @cancellable's: transparent.
_SHIELD_EXIT = checkpoints.shielded.__wrapped__.__code__  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Point:
    """One moment a cancel can land on the runs of a conversation.

    A point is found again in another run by its kind, its path and its occurrence, never by
    a line number: an edit that does not change the path to it leaves it the same point.

    Attributes:
        index: its place among the conversation's points, in order.
        kind: ``await`` (the run's own code awaits something), ``checkpoint``, ``publish`` (as
            the run enqueues an event), ``published`` (once that event is stored), ``start``
            (a follow-up run, before its ``execute()`` runs), ``parked`` (the task waits for
            input) or ``ended`` (after the terminal event).
        path: what it names: the awaited thing and the user's functions down to it, a step,
            an event or a state.
        place: the file and line of the user's code there, if any (the innermost await's).
        occurrence: how many points of this kind and path the conversation had up to this one.
        shielded: whether the run is inside a ``shielded()`` section there.
        stack: the file and line of each frame of the user's code there, outermost first: the
            points of one stack repeat one code path (a loop's iterations).
    """

    index: int
    kind: str
    path: str
    place: str = ""
    occurrence: int = 1
    shielded: bool = False
    stack: tuple[str, ...] = ()

    @property
    def where(self) -> str:
        """The point for people: its path, and its place in the user's code."""
        return f"{self.path} ({self.place})" if self.place else self.path

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.kind, self.path, self.occurrence)


class Probe:
    """Records a conversation's points; in a replay, holds the run at the ``target`` one.

    Each point is awaited in the run's own task: at the target, the probe sets ``reached`` and
    waits until the sweep opens ``gate`` (or, for an interrupted await, until the cancel's
    interrupt arrives there).
    """

    def __init__(
        self,
        target: tuple[str, str, int] | None = None,
        pending: bool = False,
        visit: Callable[[Point], Awaitable[None]] | None = None,
    ) -> None:
        self.points: list[Point] = []
        self.target = target  # A point's key.
        self.pending = pending  # At an await target: hold while it is pending, not as it returns.
        self.reached = asyncio.Event()
        self.gate = asyncio.get_running_loop().create_future()
        self.runs = 0
        self.run: Run | None = None
        self.landed = False  # The cancel applies to the run and was made: it must notice.
        self.observed: str | None = None  # Where the run first saw the cancel,
        self.seen_as = ""  # and as what: CancelledError, RunCancelled.
        self.late: list[str] = []  # What the run did after the cancel that it should not have.
        self.cut_shields: list[str] = []
        self.finished = asyncio.Event()  # The last run's execute() has returned or raised.
        self.raised = ""  # What execute() raised, other than a cancel, for people.
        self.last_event_from = ""  # The user's code that enqueued the run's last event.
        self.visit = visit  # Awaited at each point.
        self._in_enqueue = False
        # The tasks of the run that saw the cancel: each child of the run sees it on its own.
        self._noticed: set[asyncio.Task[Any] | None] = set()  # None: outside any task.

    # The points.

    def next_point(self, kind: str, path: str, place: str = "", stack: tuple[str, ...] = ()) -> Point:
        """The point that ``kind`` at ``path`` would be, next."""
        run = self.run
        shielded = bool(run is not None and run.shielded and kind not in ("parked", "ended"))
        occurrence = 1 + sum(1 for point in self.points if (point.kind, point.path) == (kind, path))
        return Point(len(self.points), kind, path, place, occurrence, shielded, stack)

    async def point(
        self, kind: str, path: str, place: str = "", stack: tuple[str, ...] | None = None
    ) -> None:
        """Note a point (its stack, unless given, is the caller's); hold here if it is the target."""
        stack = _users_stack(sys._getframe(1)) if stack is None else stack
        here = self.next_point(kind, path, place, stack)
        self.points.append(here)
        await self.hold(here)

    async def hold(self, here: Point) -> None:
        """At a point noted: hold here if it is the target."""
        if self.visit is not None:
            await self.visit(here)
        if here.key == self.target:
            self.reached.set()
            await asyncio.shield(self.gate)

    def enqueued_from(self, where: str) -> None:
        self.last_event_from = where

    def execute_raised(self, error: Exception) -> None:
        self.raised = f"{type(error).__name__}: {error}{raised_in(error)}"

    def open(self) -> None:
        if not self.gate.done():
            self.gate.set_result(None)

    def must_notice(self, landed: bool) -> None:
        """Whether a cancel that applies to the run was made: from now, the run must notice it
        before it goes on to another await of its own."""
        self.landed = landed

    # What the run does, seen from inside it.

    def drive(
        self,
        execute: Callable[[Any, Any], Awaitable[None]],
        context: Any,
        queue: Any,
        run: Run,
    ) -> Awaitable[None]:
        """Run ``execute`` on a queue that reports its events, one suspension at a time."""
        self.run, self.runs = run, self.runs + 1
        self.finished.clear()
        return _Driven(self, execute(context, _ReportingQueue(queue, self)), run)

    def child(self, coro: types.CoroutineType[Any, Any, Any], run: Run) -> Coroutine[Any, Any, Any]:
        """The coroutine of a task that ``run``'s own code starts, driven so that its awaits
        are points too; it goes on under its own name."""

        async def child() -> Any:
            return await _Driven(self, coro, run, child=True)

        driven: Any = child()  # A coroutine object: its names can be set.
        driven.__name__, driven.__qualname__ = coro.__name__, coro.__qualname__
        return driven

    async def at_checkpoint(self) -> None:
        """Every checkpoint is a point (the run looks at each: see `checkpoints.Probe`)."""
        if not self._in_enqueue:
            await self.point("checkpoint", *_where_called())

    def saw_cancel(self) -> None:
        handling = sys.exc_info()[1]  # What the run's code is handling, if anything.
        self._saw_cancel(_where_raised(), sys._getframe(2).f_code is _SHIELD_EXIT, handling)

    def _saw_cancel(self, where: str, shield_exit: bool, handling: BaseException | None) -> None:
        if self._first_in_its_task():
            if self.observed is None:
                self.observed, self.seen_as = where, "RunCancelled"
        elif shield_exit:  # A shielded clean-up that ends raises again, as it should.
            pass
        elif isinstance(handling, asyncio.CancelledError):  # Cleaning up, the cancel in hand.
            self.late.append(f"the run reached {where} after it had seen the cancel at {self.observed}")
        else:  # Nothing in hand: the run caught the cancel and did not raise it again.
            name = self.seen_as if self.seen_as == "CancelledError" else f"{self.seen_as} (a CancelledError)"
            self.late.append(
                f"the run swallowed the {name} it got at {self.observed}, and went on to {where}"
            )

    def _interrupted(self, run: Run, where: str, thrown: BaseException) -> None:
        if run.shielded:
            self.cut_shields.append(where)
        self._first_in_its_task()
        if self.observed is None:
            self.observed, self.seen_as = f"{where} (interrupted)", type(thrown).__name__

    def _first_in_its_task(self) -> bool:
        """Whether the task running (the run's, or a child's) sees the cancel for the first time."""
        try:
            task = asyncio.current_task()
        except RuntimeError:  # A thread of the run's (a checkpoint in it): it sees it as the run.
            return self.observed is None
        first = task not in self._noticed
        self._noticed.add(task)
        return first

    def _suspends(self, run: Run, where: str) -> None:
        """The run's own code awaits at ``where``, with the cancel made and not yet seen."""
        if self.landed and self.observed is None and not run.shielded:
            self.late.append(f"the run went on to {where} after the cancel, before it noticed it")


class _ReportingQueue:
    """The run's queue as its code sees it: each event is two points, before and after."""

    def __init__(self, queue: Any, probe: Probe) -> None:
        self._queue, self._probe = queue, probe

    def __getattr__(self, name: str) -> Any:
        return getattr(self._queue, name)

    async def enqueue_event(self, event: Any) -> None:
        probe, name = self._probe, _event_name(event)
        stack = _users_stack(sys._getframe(1))
        probe.enqueued_from(describe(users_frame(sys._getframe(1))))
        await probe.point("publish", f"publishes {name}", stack=stack)
        probe._in_enqueue = True
        try:
            await self._queue.enqueue_event(event)
        finally:
            probe._in_enqueue = False
        if terminal_state(event) is None:
            await probe.point("published", f"{name} is stored", stack=stack)


class _Driven:
    """The run's coroutine, driven one suspension at a time.

    At each suspension in the user's own code (not in a2a-sdk's, ours or asyncio's), the probe
    notes an ``await`` point; at the target it holds there: after the awaited thing completed
    (the cancel lands as the await returns), or before, to be interrupted by the cancel. An
    await that suspends again (one call into a library that suspends several times) is still
    the same await: no new point, nothing new the user's code started.
    """

    def __init__(self, probe: Probe, coro: Any, run: Run, child: bool = False) -> None:
        self.probe, self.coro, self.run = probe, coro, run
        self.child = child  # A task the run's code started: its siblings go on meanwhile.

    def __await__(self) -> Generator[Any, None, None]:
        probe, coro, run, child = self.probe, self.coro, self.run, self.child
        value: Any = None
        error: BaseException | None = None
        if probe.runs > 1 and not child:  # A follow-up: the cancel may come before execute() does anything.
            start = f"before run {probe.runs}'s execute()"
            try:
                yield from probe.point("start", start).__await__()
            except BaseException as thrown:  # Interrupted there: execute() raises it at once.
                error = _thrown(probe, run, thrown, start)
        last: tuple[Any, Any] = (None, None)  # The user's frame and what it awaits, last time.
        try:
            while True:
                try:
                    awaited = coro.send(value) if error is None else coro.throw(error)
                except StopIteration as stop:
                    return stop.value
                except Exception as raised:
                    if not child:  # A child's goes to whoever awaits it.
                        probe.execute_raised(raised)
                    raise
                value, error = None, None
                found = _users_await(coro) if awaited is not None else None
                same = found is not None and found[1] is last[0] and found[2] is last[1]
                if found is None or same:
                    where = found[0].where if found else "an await of the framework's"
                    try:
                        value = yield awaited
                    except BaseException as thrown:
                        error = _thrown(probe, run, thrown, where)
                    continue
                point, last = found[0], (found[1], found[2])
                where = point.where
                if not child:  # A child runs on beside the point held until the cancel reaches it.
                    probe._suspends(run, where)
                # Numbered as it suspends: the same in every run, though the run's children
                # (awaiting at once, one path) return in another order than they suspended.
                here = probe.next_point("await", point.path, point.place, point.stack)
                probe.points.append(here)
                if here.key == probe.target and probe.pending:
                    # Held while the await is still pending: the cancel lands during it.
                    probe.reached.set()
                    try:
                        yield from asyncio.shield(probe.gate).__await__()
                    except BaseException as thrown:
                        awaited.cancel()
                        error = _thrown(probe, run, thrown, where)
                        continue
                    # Opened without an interrupt: the await goes on as it would have.
                    try:
                        value = yield awaited
                    except BaseException as thrown:
                        error = _thrown(probe, run, thrown, where)
                    continue
                try:
                    value = yield awaited
                except BaseException as thrown:
                    error = _thrown(probe, run, thrown, where)
                    continue
                try:  # The cancel lands as the await returns.
                    yield from probe.hold(here).__await__()
                except BaseException as thrown:
                    error = _thrown(probe, run, thrown, where)
        except GeneratorExit:
            coro.close()
            raise
        finally:
            if not child:
                probe.finished.set()


def _thrown(probe: Probe, run: Run, thrown: BaseException, where: str) -> BaseException:
    """What to throw into the run: the cancel's interrupt, noted as seen there."""
    if isinstance(thrown, GeneratorExit):
        raise thrown  # Closed: the driver closes the run's coroutine on its way out.
    if isinstance(thrown, asyncio.CancelledError) and not isinstance(thrown, RunCancelled):
        probe._interrupted(run, where, thrown)
    return thrown


def _users_await(coro: Any) -> tuple[Point, types.FrameType, Any] | None:
    """Where the user's code awaits, when the chain of awaits from ``coro`` suspends in it.

    None when it suspends inside the framework: a checkpoint, an enqueue, a store read. The
    point (not yet numbered) is named by the user's functions on the way down and what the
    innermost called, placed at the innermost's line; with it, that frame and the very
    awaitable it awaits, which stay the same while one await suspends several times.
    """
    frames: list[types.FrameType] = []
    links: list[Any] = []
    link: Any = coro
    while link is not None:
        frame = getattr(link, "cr_frame", None) or getattr(link, "gi_frame", None) or _agen_frame(link)
        if frame is None:
            break
        if _is_framework(frame) and frame.f_code.co_name not in _STEP_WRAPPERS:
            return None
        frames.append(frame)
        link = _awaited(link)
        links.append(link)
    users = [
        index for index, frame in enumerate(frames) if not _is_framework(frame) and not _is_library(frame)
    ]
    if not users:
        return None
    innermost = users[-1]
    below = frames[innermost + 1 :]
    called = _library_name(below[0]) if below else _awaited_name(link)
    names = " > ".join(frames[index].f_code.co_name for index in users)
    stack = tuple(_place(frames[index]) for index in users)
    point = Point(-1, "await", f"await {called} in {names}", _place(frames[innermost]), stack=stack)
    return point, frames[innermost], links[innermost]


def _library_name(frame: types.FrameType) -> str:
    module = str(frame.f_globals.get("__name__", "?"))
    module = "asyncio" if module.startswith("asyncio.") else module  # Its public name.
    return f"{module}.{frame.f_code.co_name}"


def _awaited(link: Any) -> Any:
    agen = _asend_of(link)
    if agen is not None:
        return agen.ag_await
    return getattr(link, "cr_await", None) or getattr(link, "gi_yieldfrom", None)


def _asend_of(link: Any) -> Any:
    """The async generator an ``async for`` step (``__anext__``/``asend``) runs, if it is one.

    Such a step does not expose its generator (CPython 3.10-3.13); the collector's view of
    what it references does.
    """
    if type(link).__name__ not in ("async_generator_asend", "async_generator_athrow"):
        return None
    return next((each for each in gc.get_referents(link) if inspect.isasyncgen(each)), None)


def _agen_frame(link: Any) -> types.FrameType | None:
    agen = _asend_of(link)
    return agen.ag_frame if agen is not None else None


def _awaited_name(link: Any) -> str:
    code = getattr(link, "cr_code", None) or getattr(link, "gi_code", None)
    if code is not None:
        return code.co_name
    return type(link).__name__ if link is not None else "something"


def users_frame(frame: types.FrameType | None) -> types.FrameType | None:
    """The innermost frame of the user's code from ``frame`` outwards, if any."""
    while frame is not None and (_is_framework(frame) or _is_library(frame)):
        frame = frame.f_back
    return frame


def _users_stack(frame: types.FrameType | None) -> tuple[str, ...]:
    """The place of each frame of the user's code from ``frame`` outwards, outermost first."""
    places = []
    while frame is not None:
        if not _is_framework(frame) and not _is_library(frame):
            places.append(_place(frame))
        frame = frame.f_back
    return tuple(reversed(places))


def raised_in(error: BaseException) -> str:
    """Where in the user's code ``error`` was raised (or the await it cut), as ", at ..."."""
    place = ""
    traceback = error.__traceback__
    while traceback is not None:
        if users_frame(traceback.tb_frame) is traceback.tb_frame:
            code = traceback.tb_frame.f_code
            place = f"{code.co_name} ({os.path.basename(code.co_filename)}:{traceback.tb_lineno})"
        traceback = traceback.tb_next
    return f", at {place}" if place else ""


def describe(frame: types.FrameType | None) -> str:
    """A frame of the user's code, for people: its function and place."""
    return f"{frame.f_code.co_name} ({_place(frame)})" if frame is not None else ""


def _where_called() -> tuple[str, str]:
    """The user's code that reached the checkpoint being looked at: its path and place."""
    frame = sys._getframe(2)
    while frame is not None and (_is_framework(frame) or _is_library(frame)):
        if frame.f_code.co_name in _STEP_WRAPPERS:
            step = frame.f_locals.get("step")
            return f"step {getattr(step, '__qualname__', step)}", ""
        frame = frame.f_back  # type: ignore[assignment]
    return (f"checkpoint in {frame.f_code.co_name}", _place(frame)) if frame else ("a checkpoint", "")


def _where_raised() -> str:
    """What raised ``RunCancelled``: a step, a checkpoint or an enqueue of the user's."""
    frame = sys._getframe(2)
    enqueue = None
    while frame is not None and (_is_framework(frame) or _is_library(frame)):
        name = frame.f_code.co_name
        if name in _STEP_WRAPPERS:
            step = frame.f_locals.get("step")
            return f"step {getattr(step, '__qualname__', step)}"
        if name == "enqueue_event" and "event" in frame.f_locals:
            enqueue = _event_name(frame.f_locals["event"])
        frame = frame.f_back  # type: ignore[assignment]
    place = f"in {frame.f_code.co_name} ({_place(frame)})" if frame else ""
    return f"publishing {enqueue} {place}".strip() if enqueue else f"checkpoint {place}".strip()


def _is_framework(frame: types.FrameType) -> bool:
    filename = frame.f_code.co_filename
    return filename.startswith(_FRAMEWORK) and not filename.startswith(_OURS_AS_USERS)


def _is_library(frame: types.FrameType) -> bool:
    """The standard library, or an installed package other than the executor's own."""
    module = str(frame.f_globals.get("__name__", ""))
    if module in _USERS or module.partition(".")[0] in _USERS:
        return False
    return frame.f_code.co_filename.startswith(_LIBRARIES)


# The packages of the executor factories swept (just the module, for ours): code of theirs is
# the user's wherever it is installed. A framework's executor (ADK's, a2a-adapter's) made by
# the user's factory stays library code: the user's is what the factory and its module define.
_USERS: set[str] = set()


def note_user(factory: object) -> None:
    """Count the package ``factory`` comes from as the user's code."""
    while isinstance(factory, functools.partial):
        factory = factory.func
    module = getattr(factory, "__module__", None) or type(factory).__module__
    _USERS.add(module if module.startswith("a2a_cancelfix.") else module.partition(".")[0])


def _place(frame: types.FrameType) -> str:
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def _event_name(event: Any) -> str:
    state = getattr(getattr(event, "status", None), "state", None)
    if state is not None:
        return state_name(state)
    return type(event).__name__
