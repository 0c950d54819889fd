"""The world one run of a sweep builds from its `Plan`: replica A runs the task, replica B
shares its store; the client (the sender's stream, a subscriber, a blocking sender for each
follow-up) and the push receiver watch it."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

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

from a2a_cancelfix import _sdk
from a2a_cancelfix._cancel.settings import Settings, Timing
from a2a_cancelfix._executor import CancellableExecutor
from a2a_cancelfix._handler import DefaultRequestHandler
from a2a_cancelfix.notices import LocalNotices
from a2a_cancelfix.store import FinalStateTaskStore
from a2a_cancelfix.testing import _wire
from a2a_cancelfix.testing._leftovers import Leftovers, NotedExecutor
from a2a_cancelfix.testing._probe import Point, Probe, note_user
from a2a_cancelfix.testing._report import Row
from a2a_cancelfix.testing.observers import PushReceiver, Stream, state_of
from a2a_cancelfix.testing.servers import caller, message, outcome
from a2a_cancelfix.testing.waits import wait_all_tasks_blocked

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


@dataclass(frozen=True)
class Plan:
    """What every run of a sweep shares."""

    factory: Factory
    messages: list[str]
    grace_period: float
    released: Released | None
    spec: str = ""  # The executor factory as MODULE:NAME, for scenario files.
    took: float = RUN_BOUND / 2  # How long the uncancelled run took (a replay has no figure).
    expect: dict[str, tuple[str, ...]] | None = None  # A scenario file's expectations.


class World:
    """One run's servers and who watches them; ``async with`` it in the run's own loop."""

    def __init__(
        self,
        plan: Plan,
        target: tuple[str, str, int] | None = None,
        pending: bool = False,
        unwatched_after: float | None = None,
    ) -> None:
        """``target``, ``pending``: where the run's probe holds it (see `Probe`); None: nowhere.
        ``unwatched_after``: A's ``cancel_unwatched_after``, for a run that no subscriber nor
        push config watches, whose sender's client leaves; None: the client stays."""
        self.plan = plan
        self.watched = unwatched_after is None
        self.probe = Probe(target, pending, visit=self._visit)
        # With notices, as docs/replicas.md asks of replicas: a run that never looks hears B's cancel.
        self.store = FinalStateTaskStore(InMemoryTaskStore(), notices=LocalNotices())
        self.configs = InMemoryPushNotificationConfigStore()
        self.push = PushReceiver()
        note_user(plan.factory)
        executor = plan.factory()
        if isinstance(executor, CancellableExecutor):  # As to_a2a's factories make them:
            executor = executor.__wrapped__  # our handler wraps it, once, itself.
        self.executor = NotedExecutor(executor)
        self.a = self._handler(self.executor, PARKED_LOOKS, self.probe, unwatched_after)
        self._b: DefaultRequestHandler | None = None
        self.client = Client(self.a, self.probe, plan.messages, self.watched)
        self.leftovers = Leftovers(self.probe)

    def _handler(
        self,
        executor: Any,
        poll: float | None,
        probe: Probe | None = None,
        unwatched_after: float | None = None,
    ) -> DefaultRequestHandler:
        card = _wire.agent_card("jsonrpc", "http://127.0.0.1/")
        sender = _sdk.push_sender(self.push.client, self.configs, caller())
        settings = Settings(
            cancel_grace_period=self.plan.grace_period,
            replica_poll_interval=poll,  # A run looks at every point: the probe sees to it.
            cancel_unwatched_after=unwatched_after,
        )
        return DefaultRequestHandler._with(
            settings,
            executor,
            task_store=self.store,
            agent_card=card,
            push_config_store=self.configs,
            push_sender=sender if self.watched else None,  # Nobody to post to (1.0.0 would try "").
            probe=probe,
        )

    @property
    def b(self) -> DefaultRequestHandler:
        """Replica B, sharing A's store, built when first asked for."""
        if self._b is None:
            self._b = self._handler(self.plan.factory(), poll=None)
        return self._b

    @property
    def name(self) -> str:
        """The executor's class, for people."""
        return type(self.executor.__wrapped__).__name__

    async def __aenter__(self) -> World:
        self.leftovers.install(asyncio.get_running_loop())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.push.client.aclose()

    async def _visit(self, point: Point) -> None:
        await self.client.visit(point)

    # What everyone saw.

    def observers(self) -> list[str]:
        """Who saw this run: the store, the sender's stream, push; a subscriber and a
        follow-up's blocking sender if there was one."""
        if not self.watched:
            return ["store"]  # Its client left, and nobody else watched.
        client = self.client
        return (
            ["store", "stream", "push"]
            + ["subscriber"] * (client.subscriber is not None)
            + ["sender"] * (client.followed_up is not None)
        )

    async def observe(self, row: Row) -> None:
        """Note in ``row`` what each observer saw last, and what the run did wrong."""
        bound = self.plan.grace_period + MARGIN  # The cancel has answered: all ends by then.
        if self.watched:
            await self.client.observe(row, bound)
        await wait_all_tasks_blocked()
        row.seen["store"] = await self.client.stored()
        pushed = self.push.received.get(PUSH_URL, [])
        row.seen["push"] = pushed[-1] if pushed else "nothing"
        ends = [index for index, state in enumerate(pushed) if state in TERMINAL]
        if ends and ends[0] < len(pushed) - 1:
            row.failures.append(f"push got {', '.join(pushed[ends[0] + 1 :])} after {pushed[ends[0]]}")
        probe = self.probe
        if probe.raised:
            row.failures.append(f"execute() raised {probe.raised}")
        row.failures.extend(probe.late)
        for where in probe.cut_shields:
            row.failures.append(f"a shielded section was cut at {where}")

    async def check_released(self, row: Row, when: str) -> None:
        released = self.plan.released
        if released is None:
            return
        try:
            held = released(self.executor.__wrapped__)
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
        await self.leftovers.judge(row, when, self.plan.grace_period)


class Client:
    """The client's side of a run on replica A: the first message streamed, a subscriber once
    the task is stored (when the run is watched), a blocking sender for each follow-up."""

    def __init__(
        self, handler: DefaultRequestHandler, probe: Probe, messages: list[str], watched: bool
    ) -> None:
        self.handler, self.probe, self.messages, self.watched = handler, probe, messages, watched
        self.task_id = ""
        self.sender: Stream | None = None
        self.subscriber: Stream | None = None
        self.states: dict[str, list[str]] = {}  # Each stream's states, as they arrived.
        self.followed_up: asyncio.Future[Any] | None = None
        self.stopped = False  # No follow-up comes: the cancel landed on a parked task, or we left.
        self.parked_stream = ""  # Where the sender's stream ended, if the task parked first.

    async def converse(self, bound: float, race: bool = False) -> None:
        """Send the first message streamed; answer each parking with the next, blocking."""
        configuration = SendMessageConfiguration()
        if self.watched:
            configuration.task_push_notification_config.CopyFrom(
                TaskPushNotificationConfig(url=PUSH_URL, id="sweep")
            )
        first = SendMessageRequest(message=message(self.messages[0]), configuration=configuration)
        self.sender = self._stream("stream", self.handler.on_message_send_stream(first, caller()))
        await self.sender.ended(bound)
        self.task_id = next((_task_id(event) for event in self.sender.events), self.task_id)
        for number, text in enumerate(self.messages[1:], start=1):
            state = await self.stored()
            if state not in PARKED:
                return
            self.parked_stream = self.parked_stream or state
            await self.probe.point("parked", f"parked {state} after run {number}")
            if self.stopped and not race:
                return
            request = SendMessageRequest(message=message(text, task_id=self.task_id))
            self.followed_up = asyncio.ensure_future(outcome(self.handler.on_message_send(request, caller())))
            await asyncio.wait({self.followed_up}, timeout=bound)
            if self.stopped:
                return
        if await self.stored() in TERMINAL:
            await self.probe.point("ended", f"after {await self.stored()}")

    async def visit(self, point: Point) -> None:
        """At each point: once the task is stored, attach the subscriber (in every run alike)."""
        if not self.watched or self.subscriber is not None or point.kind not in ("published", "parked"):
            return
        await wait_all_tasks_blocked()
        task_id = self.task_id or _run_task_id(self.probe)
        if task_id and (await self.stored(task_id)) not in ("nothing", "TaskNotFound", *TERMINAL):
            self.task_id = task_id
            request = SubscribeToTaskRequest(id=task_id)
            subscriber = self._stream("subscriber", self.handler.on_subscribe_to_task(request, caller()))
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

    def find_task(self) -> None:
        """Know the task's id from its run, if no event has said it yet."""
        self.task_id = self.task_id or _run_task_id(self.probe)

    async def stored(self, task_id: str | None = None) -> str:
        task_id = task_id or self.task_id
        if not task_id:
            return "nothing"
        return await outcome(self.handler.on_get_task(GetTaskRequest(id=task_id), caller()))

    def stream_so_far(self) -> tuple[bool, str]:
        """Whether the sender's stream has ended, and the parked state it has seen, if any."""
        over = self.sender is not None and self.sender.task.done()
        return over, next((state for state in self.states.get("stream", []) if state in PARKED), "")

    def cancel(self, handler: DefaultRequestHandler) -> Awaitable[str]:
        """Ask ``handler`` to cancel the task; what it answers."""
        return outcome(handler.on_cancel_task(CancelTaskRequest(id=self.task_id), caller()))

    def stop(self) -> None:
        """Send no follow-up."""
        self.stopped = True

    def leave(self) -> None:
        """Go away: the sender's stream's consumer and a follow-up's blocking sender are
        cancelled, and no follow-up comes."""
        self.stop()
        for going in (self.sender.task if self.sender is not None else None, self.followed_up):
            if going is not None and not going.done():
                going.cancel()

    async def observe(self, row: Row, bound: float) -> None:
        """Note in ``row`` how each stream and the blocking sender ended, within ``bound``."""
        for name, stream in (("stream", self.sender), ("subscriber", self.subscriber)):
            if stream is None:
                continue
            ended = await stream.ended(bound)
            states = self.states[name]
            last = type(stream.error).__name__ if stream.error else (states[-1] if states else "nothing")
            row.seen[name] = last if ended else f"open after {last}"
            if stream.error and str(stream.error):
                came = self.probe.last_event_from
                row.said[name] = (
                    f"{stream.error}; the run's last event came from {came}" if came else str(stream.error)
                )
            ends = [index for index, state in enumerate(states) if state in TERMINAL]
            if ends and ends[0] < len(states) - 1:
                row.failures.append(
                    f"the {name} got {', '.join(states[ends[0] + 1 :])} after {states[ends[0]]}"
                )
        if self.followed_up is not None:
            await asyncio.wait({self.followed_up}, timeout=bound)
            row.seen["sender"] = self.followed_up.result() if self.followed_up.done() else "still waiting"


def _task_id(event: Any) -> str:
    return getattr(event, "task_id", "") or getattr(event, "id", "")


def _run_task_id(probe: Probe) -> str:
    run = probe.run
    return run.task_id if run is not None else ""
