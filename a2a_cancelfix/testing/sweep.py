"""`sweep`: does YOUR executor stop cleanly, wherever the cancel lands?

The sweep runs the executor once uncancelled (it must still complete), records its cancel
points (see `Point`), then runs it again once per point, origin and landing, with the cancel
landing exactly there: the run is held at the point until the cancel has reached it, so no
row depends on timing. Every run has our handler, an in-memory store, the sender's stream, a
subscriber and a push receiver; a follow-up message is a blocking sender. The ``unwatched``
origin's runs have neither subscriber nor push config: the sender's client leaves at the point,
and the handler's ``cancel_unwatched_after`` must cancel the task nobody watches any more.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import inspect
import json
import math
import os
import queue
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import wrapt
from a2a.server.agent_execution import AgentExecutor
from a2a.server.tasks import (
    InMemoryPushNotificationConfigStore,
    InMemoryTaskStore,
)
from a2a.types import (
    CancelTaskRequest,
    GetTaskRequest,
    SendMessageConfiguration,
    SendMessageRequest,
    SubscribeToTaskRequest,
    TaskPushNotificationConfig,
)

from a2a_cancelfix import _sdk, checkpoints
from a2a_cancelfix._cancel.settings import Settings, Timing
from a2a_cancelfix._executor import CancellableExecutor
from a2a_cancelfix._handler import DefaultRequestHandler
from a2a_cancelfix.notices import LocalNotices
from a2a_cancelfix.store import FinalStateTaskStore
from a2a_cancelfix.testing import _wire
from a2a_cancelfix.testing._probe import Point, Probe, _is_framework, describe, note_user, users_frame
from a2a_cancelfix.testing._table import table
from a2a_cancelfix.testing.observers import PushReceiver, Stream, state_of
from a2a_cancelfix.testing.servers import caller, message, outcome
from a2a_cancelfix.testing.waits import BOUND, answer_or_hang, in_own_loop, wait_all_tasks_blocked

ORIGINS = ("local", "remote", "client leaves")
"""Where a cancel comes from: a request to the replica running the task; a request to another
replica sharing its store; a request to the replica running it whose client goes away. The
sweep's default; ``"unwatched"`` is asked for by name (see `UNWATCHED_AFTER`)."""
EVERY_ORIGIN = (*ORIGINS, "unwatched")
UNWATCHED_AFTER = 0.2
"""The handler's ``cancel_unwatched_after`` in an ``unwatched`` row: the sender's client leaves,
nobody else watches, and the task must be cancelled (as unwatched) this long after."""

PUSH_URL = "http://push.invalid/sweep"
TERMINAL = frozenset(map(_sdk.state_name, _sdk.TERMINAL_STATES))
PARKED = frozenset(map(_sdk.state_name, _sdk.PARKED_STATES))
RUN_BOUND = 30.0
"""Seconds the uncancelled run may take, at most."""
PARKED_LOOKS = 0.02
"""How often replica A looks at a task parked there for a cancel that B recorded."""
MARGIN = Timing().margin  # What our handler gives the SDK past the grace period.

Factory = Callable[[], Any]
Released = Callable[[Any], "bool | Awaitable[bool]"]

_IN_CANCEL: contextvars.ContextVar[bool] = contextvars.ContextVar("a2a_cancelfix_in_cancel", default=False)
"""Set while the executor's ``cancel()`` runs: what it starts is the executor's too."""


@dataclass
class Row:
    """What one cancel showed: where it landed, what each observer saw, what went wrong.

    Attributes:
        point: where the cancel landed (None for the uncancelled run).
        origin: one of `ORIGINS`, or "unwatched" ("" for the uncancelled run).
        landing: for an await, "as it returns", or during it: "interrupted" (the cancel's
            interrupt lands on it) or, in a shielded section, "while pending" (the cancel must
            wait for it); for a parked task, "alone" or "follow-up racing".
        answer: what the cancel answered: a state, an A2A error's name, or "client left"
            (for "unwatched", nobody asked: the client left).
        seen: the last state each observer saw: store, stream, subscriber, push, sender.
        failures: each broken promise, in words.
    """

    point: Point | None
    origin: str
    landing: str
    answer: str = ""
    seen: dict[str, str] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    expected: dict[str, tuple[str, ...]] = field(default_factory=dict)
    scenario: str = ""
    """The scenario file that replays this row (see `play`)."""

    @property
    def ok(self) -> bool:
        return not self.failures

    def as_dict(self) -> dict[str, Any]:
        """The row for JSON."""
        return {
            "moment": self.moment,
            "point": None if self.point is None else {**vars(self.point), "where": self.point.where},
            "origin": self.origin,
            "landing": self.landing,
            "answer": self.answer,
            "seen": self.seen,
            "ok": self.ok,
            "failures": self.failures,
            "scenario": self.scenario,
        }

    @property
    def moment(self) -> str:
        if self.point is None:
            return "no cancel"
        landing = f", {self.landing}" if self.landing else ""
        return f"{self.point.index} {self.point.where}{landing}"


@dataclass
class Report:
    """A sweep's rows, the uncancelled run's first; ``str()`` is the table."""

    rows: list[Row]

    @property
    def ok(self) -> bool:
        return all(row.ok for row in self.rows)

    @property
    def failures(self) -> list[Row]:
        return [row for row in self.rows if not row.ok]

    def assert_ok(self) -> None:
        """Raise ``AssertionError`` with the table and the failing rows' scenario files."""
        if not self.ok:
            raise AssertionError(str(self))

    def __str__(self) -> str:
        columns = ("store", "stream", "subscriber", "push", "sender")
        cells: list[tuple[str, ...]] = [("moment", "origin", "answer", *columns, "")]
        for row in self.rows:
            seen = [row.seen.get(name, "-") for name in columns]
            cells.append(
                (row.moment, row.origin or "-", row.answer or "-", *seen, "ok" if row.ok else "FAILS")
            )
        lines = table(cells)
        failing = self.failures
        lines.append("")
        lines.append(f"{len(self.rows) - len(failing)} of {len(self.rows)} rows hold.")
        for row in failing:
            lines.append("")
            lines.append(f"FAILS: {row.moment} ({row.origin or 'no cancel'})")
            lines.extend(f"  - {failure}" for failure in row.failures)
            if row.scenario:
                lines.append("  Replay it: save as cancel_<name>.toml, run `a2a-cancelfix play` on it:")
                lines.extend(f"    {line}" for line in row.scenario.splitlines())
        return "\n".join(lines)


async def sweep(
    executor_factory: Factory,
    *,
    message: str | Sequence[str] = "hello",
    origins: Sequence[str] = ORIGINS,
    grace_period: float = 1.0,
    released: Released | None = None,
) -> Report:
    """Cancel a fresh executor at each of its cancel points; report what every observer saw.

    Args:
        executor_factory: makes the executor (an ``AgentExecutor``), once per run.
        message: the message that starts the task; or several, each next one answering the
            task when it parks for input (INPUT_REQUIRED, AUTH_REQUIRED).
        origins: which of `ORIGINS` to cancel from; ``"unwatched"`` too, to see that the task
            is cancelled once its sender's client leaves and nobody else watches it.
        grace_period: the handler's ``cancel_grace_period`` in these runs.
        released: ``released(executor)`` (may be async) is true once the executor has let go
            of what it holds (a claim, a lease); checked when the cancel returns.

    Raises:
        ValueError: an origin that is not one of `EVERY_ORIGIN`, a grace period that is not a
            positive number of seconds, or a factory that does not make an executor.
    """
    messages = [message] if isinstance(message, str) else list(message)
    unknown = set(origins) - set(EVERY_ORIGIN)
    if unknown or not messages:
        raise ValueError(
            f"origins must be among {EVERY_ORIGIN}, not {sorted(unknown)}; and one message at least"
        )
    check_setup(executor_factory, grace_period)
    plan = Plan(executor_factory, messages, grace_period, released, _spec(executor_factory))
    contrast, points = await asyncio.to_thread(in_own_loop, plan.contrast)
    rows = [contrast]
    if contrast.ok:
        for point in points:
            for origin in origins:
                for landing in landings_at(point, origin):
                    rows.append(await asyncio.to_thread(in_own_loop, plan.row, point, origin, landing))
    return Report(rows)


def check_setup(factory: Any, grace_period: float) -> None:
    """Refuse, before any run, what no row could say anything useful about.

    A factory that is not a class is called once, to see that it makes an executor.

    Raises:
        ValueError: naming what is wrong.
    """
    if not isinstance(grace_period, (int, float)) or not math.isfinite(grace_period) or grace_period <= 0:
        raise ValueError(f"the grace period must be a positive number of seconds, not {grace_period!r}")
    name = getattr(factory, "__qualname__", None) or repr(factory)
    if not callable(factory):
        raise ValueError(f"{name} is not an executor class nor a factory that makes one")
    try:
        inspect.signature(factory).bind()
    except TypeError as error:
        raise ValueError(
            f"{name} cannot be called without arguments ({error}): give a factory that can"
        ) from None
    except ValueError:  # No signature to read (a builtin): calling it will tell.
        pass
    if isinstance(factory, type):
        made: Any = factory
    else:
        try:
            made = factory()
        except Exception as error:
            raise ValueError(f"{name}() raised {error!r}") from error
    if not _executor_like(made):
        what = (
            made.__qualname__ if isinstance(made, type) else f"{name}() made {type(made).__qualname__}, which"
        )
        raise ValueError(f"{what} is not an AgentExecutor: it needs async execute() and cancel()")


def _executor_like(made: Any) -> bool:
    if isinstance(made, AgentExecutor) or (isinstance(made, type) and issubclass(made, AgentExecutor)):
        return True
    return all(inspect.iscoroutinefunction(getattr(made, name, None)) for name in ("execute", "cancel"))


def _spec(factory: Any) -> str:
    """``factory`` as MODULE:NAME, when it can be imported back so."""
    module, name = getattr(factory, "__module__", None), getattr(factory, "__qualname__", "")
    return f"{module}:{name}" if module and name and "<" not in name else ""


def landings_at(point: Point, origin: str) -> tuple[str, ...]:
    if origin == "unwatched" and point.kind in ("parked", "ended"):
        return ()  # Nothing runs there: a task nobody watches is left alone (by default).
    if point.kind == "await" and origin == "local":
        # During the await: the interrupt lands on it, or, shielded, must wait for it.
        return ("as it returns", "while pending" if point.shielded else "interrupted")
    if point.kind == "await":
        return ("as it returns",)
    if point.kind == "parked":
        return ("alone", "follow-up racing")
    return ("",)


@dataclass
class Plan:
    factory: Factory
    messages: list[str]
    grace_period: float
    released: Released | None
    spec: str = ""  # The executor factory as MODULE:NAME, for scenario files.
    took: float = RUN_BOUND / 2  # How long the uncancelled run took (a replay has no figure).
    expect: dict[str, tuple[str, ...]] | None = None  # A scenario file's expectations.

    async def contrast(self) -> tuple[Row, list[Point]]:
        row, world = Row(None, "", ""), None
        try:
            world = _World(self)
            await self._contrast(row, world)
        except Exception as error:  # The executor's or the SDK's: the row says so.
            row.failures.append(f"the run raised {error!r}")
        return row, [] if world is None else world.probe.points  # Those it reached, if it raised.

    async def _contrast(self, row: Row, world: _World) -> None:
        started = time.monotonic()
        async with world:
            probe = world.probe
            await world.converse(RUN_BOUND)
            self.took = time.monotonic() - started
            await world.observe(row, probe)
            _expect(row, dict.fromkeys(world.observers(), ("COMPLETED",)))
            if world.parked_stream:
                row.expected["stream"] = (world.parked_stream,)
            _compare(row)
            await world.check_released(row, "the uncancelled run ended")
            await world.check_leftovers(row, "the uncancelled run ended")

    async def row(self, point: Point, origin: str, landing: str) -> Row:
        row = Row(point, origin, landing)
        try:
            await self._row(row, point, origin, landing)
        except Exception as error:
            row.failures.append(f"the run raised {error!r}")
        return _scenario(self, row)

    async def _row(self, row: Row, point: Point, origin: str, landing: str) -> None:
        interrupt = landing == "interrupted"
        pending = landing in ("interrupted", "while pending")
        bound = self.took + self.grace_period + MARGIN + BOUND
        async with _World(self, point.key, pending, unwatched=origin == "unwatched") as world:
            probe = world.probe
            conversation = asyncio.ensure_future(world.converse(bound, race=landing == "follow-up racing"))
            reached = asyncio.ensure_future(probe.reached.wait())
            await asyncio.wait({conversation, reached}, timeout=bound, return_when=asyncio.FIRST_COMPLETED)
            if not probe.reached.is_set():
                reached.cancel()
                row.failures.append(
                    f"the run never reached {_ordinal(point.occurrence)} {point.kind} {point.path}:"
                    " it took another path"
                )
                return
            row.point = next(here for here in probe.points if here.key == point.key)  # This run's.
            await world.land(row, probe, origin, interrupt)
            await asyncio.wait({conversation}, timeout=bound)
            parked = not world.unwatched and (world.stream_parked or world.parked_stream)
            if parked and (world.stream_over or row.expected["answer"] != ("CANCELED",)):
                row.expected["stream"] = (parked,)  # Its request had ended, parked.
            elif parked:  # It had the parked state: it may end there, as its request did.
                row.expected["stream"] = (*row.expected["stream"], parked)
            await world.observe(row, probe)
            if self.expect is not None:  # A scenario file says what each must see.
                row.expected = dict(self.expect)
            _compare(row)
            await world.check_leftovers(row, "the cancel returned")


class _World:
    """One run's servers: replica A runs the task, replica B shares its store."""

    def __init__(
        self,
        plan: Plan,
        target: tuple[str, str, int] | None = None,
        pending: bool = False,
        unwatched: bool = False,
    ) -> None:
        """``target``, ``pending``: where the run's probe holds it (see `Probe`); None: nowhere."""
        self.plan = plan
        self.probe = probe = Probe(target, pending, visit=self._visit)
        self.unwatched = unwatched  # No subscriber nor push config: the sender's client leaves.
        # With notices, as docs/replicas.md asks of replicas: a run that never looks hears B's cancel.
        self.store = FinalStateTaskStore(InMemoryTaskStore(), notices=LocalNotices())
        self.configs = InMemoryPushNotificationConfigStore()
        self.push = PushReceiver()
        note_user(plan.factory)
        self.executor = plan.factory()
        if isinstance(self.executor, CancellableExecutor):  # As to_a2a's factories make them:
            self.executor = self.executor.__wrapped__  # our handler wraps it, once, itself.
        self.watched = _Watched(self.executor)
        self.a = self._handler(self.watched, probe=probe)
        self._b: DefaultRequestHandler | None = None
        self.task_id = ""
        self.sender: Stream | None = None
        self.subscriber: Stream | None = None
        self.states: dict[str, list[str]] = {}  # Each stream's states, as they arrived.
        self.followed_up: asyncio.Future[Any] | None = None
        self.stop = False  # The cancel landed on a parked task: no follow-up comes.
        self.parked_stream = ""  # Where the sender's stream ended, if the task parked first.
        self.stream_over = False  # Whether it had ended when the cancel landed,
        self.stream_parked = ""  # and the parked state it had seen by then.
        self.threads = set(threading.enumerate())
        self.pool = _TrackedPool()
        self.owned: dict[asyncio.Task[Any], str] = {}  # Each with where the executor started it.

    def _handler(
        self, executor: Any, poll: float | None = PARKED_LOOKS, probe: Probe | None = None
    ) -> DefaultRequestHandler:
        card = _wire.agent_card("jsonrpc", "http://127.0.0.1/")
        sender = _sdk.push_sender(self.push.client, self.configs, caller())
        settings = Settings(
            cancel_grace_period=self.plan.grace_period,
            replica_poll_interval=poll,  # A run looks at every point: the probe sees to it.
            cancel_unwatched_after=UNWATCHED_AFTER if self.unwatched and probe is not None else None,
        )
        return DefaultRequestHandler._with(
            settings,
            executor,
            task_store=self.store,
            agent_card=card,
            push_config_store=self.configs,
            push_sender=None if self.unwatched else sender,  # Nobody to post to (1.0.0 would try "").
            probe=probe,
        )

    @property
    def b(self) -> DefaultRequestHandler:
        if self._b is None:
            self._b = self._handler(self.plan.factory(), poll=None)
        return self._b

    async def __aenter__(self) -> _World:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(self.pool)
        loop.set_task_factory(self._task_factory)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.push.client.aclose()

    def _task_factory(self, loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        task = asyncio.Task(coro, loop=loop, **kwargs)
        if _executors_own() and not _ours(coro):  # The executor's own code started it,
            self.owned[task] = describe(users_frame(sys._getframe(1)))  # in a run or its cancel().
        return task

    # The conversation.

    async def converse(self, bound: float, race: bool = False) -> None:
        """Send the first message streamed; answer each parking with the next, blocking."""
        configuration = SendMessageConfiguration()
        if not self.unwatched:
            configuration.task_push_notification_config.CopyFrom(
                TaskPushNotificationConfig(url=PUSH_URL, id="sweep")
            )
        first = SendMessageRequest(message=message(self.plan.messages[0]), configuration=configuration)
        self.sender = self._stream("stream", self.a.on_message_send_stream(first, caller()))
        await self.sender.ended(bound)
        self.task_id = next((_task_id(event) for event in self.sender.events), self.task_id)
        for number, text in enumerate(self.plan.messages[1:], start=1):
            state = await self.stored()
            if state not in PARKED:
                return
            self.parked_stream = self.parked_stream or state
            await self.probe.point("parked", f"parked {state} after run {number}")
            if self.stop and not race:
                return
            request = SendMessageRequest(message=message(text, task_id=self.task_id))
            self.followed_up = asyncio.ensure_future(outcome(self.a.on_message_send(request, caller())))
            await asyncio.wait({self.followed_up}, timeout=bound)
            if self.stop:
                return
        if await self.stored() in TERMINAL:
            await self.probe.point("ended", f"after {await self.stored()}")

    async def _visit(self, point: Point) -> None:
        """At each point: once the task is stored, attach the subscriber (in every run alike)."""
        if self.unwatched or self.subscriber is not None or point.kind not in ("published", "parked"):
            return
        await wait_all_tasks_blocked()
        task_id = self.task_id or _run_task_id(self.probe)
        if task_id and (await self.stored(task_id)) not in ("nothing", "TaskNotFound", *TERMINAL):
            self.task_id = task_id
            request = SubscribeToTaskRequest(id=task_id)
            subscriber = self._stream("subscriber", self.a.on_subscribe_to_task(request, caller()))
            await subscriber.until(lambda: bool(subscriber.events) or subscriber.task.done())
            self.subscriber = subscriber

    def _stream(self, name: str, events: Any) -> Stream:
        """A stream, with each event's state noted as it arrives (a Task the SDK sends may be
        its live copy, which later events update)."""
        states = self.states[name] = []

        def note(event: Any) -> None:
            state = state_of(event)
            if state:
                states.append(state)

        return Stream(events, note)

    async def stored(self, task_id: str | None = None) -> str:
        task_id = task_id or self.task_id
        if not task_id:
            return "nothing"
        return await outcome(self.a.on_get_task(GetTaskRequest(id=task_id), caller()))

    # The cancel.

    async def land(self, row: Row, probe: Probe, origin: str, interrupt: bool) -> None:
        """Make the cancel at the point the run is held at; let the run go on as it lands."""
        await wait_all_tasks_blocked()
        point = row.point
        assert point is not None
        self.task_id = self.task_id or _run_task_id(probe)
        before = await self.stored()
        self.stream_over = self.sender is not None and self.sender.task.done()
        self.stream_parked = next((state for state in self.states.get("stream", []) if state in PARKED), "")
        expected = "TaskNotFound" if before in ("nothing", "TaskNotFound") else "CANCELED"
        if before in TERMINAL:
            expected = "TaskNotCancelable"
        applies = expected == "CANCELED"
        if origin == "unwatched" and before in PARKED:
            applies = False  # Stored as parked: left alone, as the option leaves it by default.
        run = probe.run if point.kind not in ("parked", "ended") else None
        # Past an await of its own (or before execute()), the run must notice before it starts
        # another: at a checkpoint or an event it publishes.
        probe.must_notice(applies and point.kind in ("await", "start"))
        if point.kind == "parked":
            self.stop = True
        answer_bound = self.plan.grace_period + MARGIN + 1.0
        started = asyncio.get_running_loop().time()
        if origin == "remote":
            heard = asyncio.Event()
            if run is not None and applies:
                run.add_callback(heard.set)  # A heard B's cancel: the run goes on as it does.
            row.answer = await answer_or_hang(self._cancel(self.b), answer_bound)
            if run is not None and applies:
                await _set_within(heard, answer_bound)
            probe.open()
        elif origin == "unwatched":  # Nobody asks: the option's clock must run out.
            if run is not None and applies:
                run.add_callback(probe.open)
            else:
                probe.open()
            row.answer = "client left"
            await self.leave(row, applies)
        else:
            request = asyncio.ensure_future(self._cancel(self.a))
            if run is not None and applies:
                if not interrupt:
                    run.add_callback(probe.open)  # The run goes on once it is signalled.
            else:
                probe.open()
            if origin == "client leaves" and applies:
                underway = asyncio.ensure_future(self.watched._self_called.wait())
                await asyncio.wait(
                    {underway, request}, timeout=answer_bound, return_when=asyncio.FIRST_COMPLETED
                )
                underway.cancel()
                request.cancel()  # The client goes away while its cancel is in progress.
                row.answer = "client left"
            else:
                row.answer = await answer_or_hang(request, answer_bound)
        took = asyncio.get_running_loop().time() - started
        row.seen["answer"] = row.answer
        final = "CANCELED" if applies else ("COMPLETED" if expected != "TaskNotCancelable" else before)
        watched = self.watched
        if watched._self_error is not None:
            error = watched._self_error
            at = _raised_in(error)
            row.failures.append(f"{self.name}.cancel() raised {type(error).__name__}: {error}{at}")
            if origin != "remote":  # The documented end of that: FAILED, the caller told so.
                expected, final = "Internal", "FAILED"
        if row.answer == "HANG":
            row.failures.append(f"the cancel did not answer within {answer_bound:.1f} s")
        elif row.answer not in (expected, "client left"):
            row.failures.append(f"the cancel answered {row.answer}, not {expected}")
            expected = row.answer  # Said once: the comparison need not say it again.
        if applies and run is not None:
            stop_by = max(answer_bound - took, 0.0) if origin != "local" else 0.0
            if origin != "unwatched" and not await _set_within(probe.finished, stop_by):
                row.failures.append("execute() still ran when the cancel returned: it ignored the cancel")
            cut = watched._self_cut
            if watched._self_called.is_set() and (cut is not None or not watched._self_returned.is_set()):
                at = cut or ""
                row.failures.append(
                    f"{self.name}.cancel() did not return within the grace period: it hangs{at}"
                )
        _expect(row, {"answer": (expected,)})
        _expect(row, {key: (final,) for key in self.observers() if key != "sender"})
        if origin == "unwatched" and not applies:
            # Nobody saw it: it parks, runs to its end, or, running on unwatched, is cancelled.
            row.expected["store"] = (final, "CANCELED", *sorted(PARKED))
        if self.followed_up is not None and not self.unwatched:
            row.expected["sender"] = (final, "UnsupportedOperation") if applies else (final,)
        if applies and row.answer != "HANG":
            await self.check_released(row, "the cancel returned")

    async def leave(self, row: Row, applies: bool) -> None:
        """The sender's client goes away (its stream's consumer, or a follow-up's blocking
        sender, is cancelled) and nobody else watches: the task must be cancelled as unwatched
        within the option's interval, the grace period and the margin."""
        self.stop = True  # Nor does a follow-up come.
        for going in (self.sender.task if self.sender is not None else None, self.followed_up):
            if going is not None and not going.done():
                going.cancel()
        bound = UNWATCHED_AFTER + self.plan.grace_period + MARGIN
        if not applies:  # The run goes on: to its end, to a parking, or to the option's cancel.
            if not await _set_within(self.probe.finished, bound + self.plan.took):
                row.failures.append(
                    f"execute() still ran {bound + self.plan.took:.1f} s after its client left: nothing stopped it"
                )
            return
        if not await _set_within(self.probe.finished, bound):
            called = self.watched._self_called.is_set()
            called_not = "" if called else f", and {self.name}.cancel() was not called"
            row.failures.append(
                f"execute() still ran {bound:g} s after its client left and nobody watched the task{called_not}"
            )
            self.probe.must_notice(False)  # No cancel came: what it does next is not late.
            self.probe.open()  # Let it go on: the row has said what went wrong.
            return
        if not self.watched._self_called.is_set():
            row.failures.append(f"the task went unwatched and {self.name}.cancel() was not called")
        else:  # Nobody waits for this cancel's answer: the row waits for its end (cut, if it hangs).
            await _set_within(self.watched._self_returned, self.plan.grace_period + MARGIN)
        await wait_all_tasks_blocked()
        task = await self.a.on_get_task(GetTaskRequest(id=self.task_id), caller())
        if task is not None and _sdk.state_name(task.status.state) == "CANCELED":
            said = " ".join(part.text for part in task.status.message.parts)
            if "nobody watched" not in said:
                row.failures.append(f"the CANCELED task's status does not say nobody watched it: {said!r}")

    def _cancel(self, handler: DefaultRequestHandler) -> Awaitable[str]:
        return outcome(handler.on_cancel_task(CancelTaskRequest(id=self.task_id), caller()))

    @property
    def name(self) -> str:
        return self.executor.__class__.__name__

    # What everyone saw.

    def observers(self) -> list[str]:
        """Who saw this run: the store, the sender's stream, push; a subscriber and a
        follow-up's blocking sender if there was one."""
        if self.unwatched:
            return ["store"]  # Its client left, and nobody else watched.
        present = ["store", "stream", "push"]
        return (
            present
            + ["subscriber"] * (self.subscriber is not None)
            + ["sender"] * (self.followed_up is not None)
        )

    async def observe(self, row: Row, probe: Probe) -> None:
        bound = self.plan.grace_period + MARGIN  # The cancel has answered: all ends by then.
        for name, stream in (("stream", self.sender), ("subscriber", self.subscriber)):
            if stream is None or self.unwatched:
                continue
            ended = await stream.ended(bound)
            states = self.states[name]
            last = type(stream.error).__name__ if stream.error else (states[-1] if states else "nothing")
            row.seen[name] = last if ended else f"open after {last}"
            ends = [index for index, state in enumerate(states) if state in TERMINAL]
            if ends and ends[0] < len(states) - 1:
                row.failures.append(
                    f"the {name} got {', '.join(states[ends[0] + 1 :])} after {states[ends[0]]}"
                )
        if self.followed_up is not None and not self.unwatched:
            await asyncio.wait({self.followed_up}, timeout=bound)
            row.seen["sender"] = self.followed_up.result() if self.followed_up.done() else "still waiting"
        await wait_all_tasks_blocked()
        row.seen["store"] = await self.stored()
        pushed = self.push.received.get(PUSH_URL, [])
        row.seen["push"] = pushed[-1] if pushed else "nothing"
        ends = [index for index, state in enumerate(pushed) if state in TERMINAL]
        if ends and ends[0] < len(pushed) - 1:
            row.failures.append(f"push got {', '.join(pushed[ends[0] + 1 :])} after {pushed[ends[0]]}")
        row.failures.extend(probe.late)
        for where in probe.cut_shields:
            row.failures.append(f"a shielded section was cut at {where}")

    async def check_released(self, row: Row, when: str) -> None:
        if self.plan.released is None:
            return
        released = self.plan.released
        try:
            held = released(self.executor)
            if inspect.isawaitable(held):
                held = await held
        except Exception as error:  # The callback's own fault, not the run's.
            name = getattr(released, "__name__", "released")
            row.failures.append(f"{name}(executor) raised {type(error).__name__}: {error}")
            return
        if not held:
            row.failures.append(f"released() was false when {when}")

    async def check_leftovers(self, row: Row, when: str) -> None:
        """The executor's own tasks and threads end within the grace period."""
        grace = self.plan.grace_period
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
        threads = [thread for thread in threads if _started_here(thread) and not self.pool.owns(thread)]
        if busy or threads:
            await asyncio.to_thread(_join, busy, threads, grace)
        if any(not work.done() for work in busy) or any(_working(thread) for thread in threads):
            stuck = [thread for thread in (*self.pool.threads(), *threads) if _working(thread)]
            running = sorted({describe(users_frame(_frame_of(thread))) for thread in stuck} - {""})
            running = running or sorted({_innermost(thread) for thread in stuck} - {""})
            in_code = f", in {' and '.join(running)}" if running else ""
            row.failures.append(f"a thread it started still ran {grace:g} s after {when}{in_code}")


def _expect(row: Row, expected: dict[str, tuple[str, ...]]) -> None:
    row.expected.update(expected)


def _compare(row: Row) -> None:
    for name, allowed in row.expected.items():
        seen = row.seen.get(name, "nothing")
        if name == "answer" and seen in ("HANG", "client left"):
            continue  # Said already, or nobody is left to answer.
        if seen not in allowed:
            row.failures.append(f"the {name} ended on {seen}, not {' or '.join(allowed)}")


class _Watched(wrapt.ObjectProxy):
    """The executor under test, as the handler sees it: its ``cancel()`` calls are noted."""

    def __init__(self, executor: Any) -> None:
        super().__init__(executor)
        self._self_called = asyncio.Event()
        self._self_returned = asyncio.Event()
        self._self_error: BaseException | None = None
        self._self_cut: str | None = None  # Once cut: where it hung, for people ("" unknown).

    async def cancel(self, context: Any, event_queue: Any) -> None:
        self._self_called.set()
        inside = _IN_CANCEL.set(True)
        try:
            await self.__wrapped__.cancel(context, event_queue)
        except asyncio.CancelledError as cut:
            self._self_cut = _raised_in(cut)  # Cut off at the grace period's end: it hung.
            raise
        except Exception as error:
            self._self_error = error
            raise
        finally:
            _IN_CANCEL.reset(inside)
            self._self_returned.set()


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


def _started_here(thread: threading.Thread) -> bool:
    """Whether ``thread`` runs and was started through `threading`, as an executor's are.

    Not a thread started below it (pytest-xdist's I/O thread, a C library's), which `threading`
    lists as a dummy from the moment it first asks for ``current_thread()``: a log call, or a
    finalizer the collector happens to run in it, mid-run. Nobody can join it.
    """
    return thread.is_alive() and not isinstance(thread, threading._DummyThread)


def _join(
    works: list[concurrent.futures.Future[Any]], threads: list[threading.Thread], seconds: float
) -> None:
    deadline = time.monotonic() + seconds
    concurrent.futures.wait(works, timeout=seconds)
    for thread in threads:
        # A pool's worker lives on, idle, after its work: waiting for that is all a join can do.
        # Nothing announces a worker going idle, so it is looked at every few milliseconds.
        while _working(thread) and time.monotonic() < deadline:
            thread.join(0.005)


# Where a pool's worker thread waits for its next work item: concurrent.futures' (and so
# asyncio's) on a SimpleQueue, in C, inside _worker; another pool's in queue.Queue.get (anyio's
# are judged by their queue, in `_working`).
_IDLE_AT = {("concurrent.futures.thread", "_worker"), ("queue", "get")}


def _frame_of(thread: threading.Thread) -> Any:
    return sys._current_frames().get(thread.ident or 0) if thread.is_alive() else None


def _innermost(thread: threading.Thread) -> str:
    """Where a thread running none of the executor's code is, for people."""
    frame = _frame_of(thread)
    if frame is None:
        return ""
    return f"{frame.f_globals.get('__name__')}.{frame.f_code.co_name} (no code of the executor's)"


def _working(thread: threading.Thread) -> bool:
    """Whether ``thread`` still runs something: alive, and not a pool worker waiting for work."""
    items = getattr(thread, "queue", None)
    if type(thread).__module__.startswith("anyio.") and isinstance(items, queue.Queue):
        # anyio's worker marks the item it took done once it has handed the result back: past
        # that it runs no work of anyone's, whatever its frames show (it may be running a
        # finalizer the collector put there).
        return thread.is_alive() and items.unfinished_tasks > 0
    frame = _frame_of(thread)
    while frame is not None and frame.f_globals.get("__name__") == "threading":
        frame = frame.f_back  # A lock or condition it waits on: what waits there tells.
    if frame is None:
        return thread.is_alive()
    return (frame.f_globals.get("__name__"), frame.f_code.co_name) not in _IDLE_AT


def _raised_in(error: BaseException) -> str:
    """Where in the user's code ``error`` was raised (or the await it cut), as ", at ..."."""
    place = ""
    traceback = error.__traceback__
    while traceback is not None:
        if users_frame(traceback.tb_frame) is traceback.tb_frame:
            code = traceback.tb_frame.f_code
            place = f"{code.co_name} ({os.path.basename(code.co_filename)}:{traceback.tb_lineno})"
        traceback = traceback.tb_next
    return f", at {place}" if place else ""


def _ours(coro: Any) -> bool:
    frame = getattr(coro, "cr_frame", None)
    return frame is not None and _is_framework(frame)


def _coro_name(task: asyncio.Task[Any]) -> str:
    coro = task.get_coro()
    return getattr(coro, "__qualname__", None) or task.get_name()


def _task_id(event: Any) -> str:
    return getattr(event, "task_id", "") or getattr(event, "id", "")


def _run_task_id(probe: Probe) -> str:
    run = probe.run
    return run.task_id if run is not None else ""


async def _set_within(event: asyncio.Event, seconds: float) -> bool:
    if not event.is_set() and seconds > 0:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(event.wait(), seconds)
    return event.is_set()


def _scenario(plan: Plan, row: Row) -> Row:
    """Give ``row`` the scenario file that replays it, expecting what the sweep expected."""
    point = row.point
    if point is None:
        return row
    lines = [
        "# One cancel moment, replayed by `a2a-cancelfix play FILE` (written by a2a-cancelfix sweep).",
        f"executor = {_string(plan.spec or '<MODULE:NAME of your executor factory>')}",
        f"messages = {json.dumps(plan.messages, ensure_ascii=False)}",
        f"grace_period = {plan.grace_period!r}",
    ]
    released = _spec(plan.released) if plan.released is not None else ""
    if released:
        lines.append(f"released = {_string(released)}")
    lines += [
        "",
        "[cancel]",
        f"kind = {_string(point.kind)}",
        f"at = {_string(point.path)}" + (f"  # {point.place}" if point.place else ""),
        f"occurrence = {point.occurrence}",
        f"shielded = {'true' if point.shielded else 'false'}",
        f"origin = {_string(row.origin)}",
        f"landing = {_string(row.landing)}",
        "",
        "[expect]",
    ]
    for name, allowed in row.expected.items():
        value = _string(allowed[0]) if len(allowed) == 1 else json.dumps(list(allowed), ensure_ascii=False)
        lines.append(f"{name} = {value}")
    row.scenario = "\n".join(lines) + "\n"
    return row


def _ordinal(number: int) -> str:
    suffix = "th" if 10 <= number % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(number % 10, "th")
    return f"{number}{suffix}"


def _string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # A TOML basic string.
