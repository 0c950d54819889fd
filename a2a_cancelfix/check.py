"""`a2a-cancelfix check`: run the cancel scenarios on the installed a2a-sdk, stock vs ours.

Every scenario runs in an event loop of its own, against a fresh handler and store, and is
bounded: a stock handler that never answers shows as HANG and never blocks the command. Its
calls go as clients make them, over a real socket (``_wire``), to servers in that same loop, so
the scenario's gates stay reachable. The test suite runs the same scenarios, so this table is
what the tests show.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
from a2a.auth.user import User
from a2a.helpers import new_task
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.context import ServerCallContext
from a2a.server.events.event_queue import EventQueue
from a2a.server.request_handlers.default_request_handler_v2 import DefaultRequestHandlerV2
from a2a.server.tasks import (
    BasePushNotificationSender,
    InMemoryPushNotificationConfigStore,
    InMemoryTaskStore,
    TaskStore,
    TaskUpdater,
)
from a2a.types import (
    AgentCapabilities,
    AgentCard,
    Artifact,
    CancelTaskRequest,
    GetTaskRequest,
    Message,
    Part,
    Role,
    SendMessageConfiguration,
    SendMessageRequest,
    SubscribeToTaskRequest,
    Task,
    TaskArtifactUpdateEvent,
    TaskPushNotificationConfig,
    TaskState,
    TaskStatusUpdateEvent,
)
from a2a.utils.errors import A2AError

from a2a_cancelfix import _wire
from a2a_cancelfix._sdk import SDK_VERSION
from a2a_cancelfix.checkpoints import shielded
from a2a_cancelfix.executor import CancellableExecutor
from a2a_cancelfix.handler import DefaultRequestHandler

GRACE = 0.3
"""The grace period the scenarios give our handler."""
BOUND = 2.5
"""A scenario still running after this many seconds is reported as HANG."""
IO_LATENCY = 0.05
"""How long the I/O of an executor's ``cancel()`` takes, in seconds."""

HANDLERS = ("stock", "wrapped", "ours")
"""The SDK's handler; the SDK's handler around a CancellableExecutor; our handler."""
IN_PROCESS = "in-process"
"""Calls made straight on the handler, not over a transport (the tests' own scenarios)."""
NOT_RUN = "NOT RUN"


class Gate:
    """Park the code under test at a known point until the test opens it."""

    def __init__(self) -> None:
        self.reached = asyncio.Event()
        self._open = asyncio.Event()

    async def __call__(self) -> None:
        self.reached.set()
        await self._open.wait()

    def open(self) -> None:
        self._open.set()


async def within(awaitable: Awaitable[Any], seconds: float = BOUND) -> Any:
    """Fail fast instead of hanging when a bug keeps something waiting forever."""
    return await asyncio.wait_for(awaitable, seconds)


class Changes:
    """Wakes whoever waits for a condition on something each time that something changes.

    The code that changes it calls ``notify()``; a waiter re-checks its condition then, and
    only then, instead of polling it.
    """

    def __init__(self) -> None:
        self._changed: asyncio.Event | None = None  # Made by the first waiter: notify() is free.

    def notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def until(self, condition: Callable[[], object], seconds: float = BOUND) -> None:
        """Wait until ``condition()`` (a value or an awaitable) holds, checked at once and at
        each change; fail fast after ``seconds``."""

        async def waiting() -> None:
            while True:
                changed = self._changed = self._changed or asyncio.Event()
                if await _holds(condition):
                    return
                await changed.wait()

        await within(waiting(), seconds)


async def wait_all_tasks_blocked(seconds: float = BOUND) -> None:
    """Wait until every other task waits on something not yet done and no callback is due.

    Then everything the code under test can do on its own has been done: what is left waits
    for a timer, a thread or the network. For checking that something did *not* happen, and
    for what the code does asynchronously that no event announces. Fails fast after
    ``seconds`` if the loop never gets there (a task that never blocks).
    """
    await within(_all_tasks_blocked(), seconds)


async def _holds(condition: Callable[[], object]) -> bool:
    value = condition()
    return bool(await value) if inspect.isawaitable(value) else bool(value)


async def _all_tasks_blocked() -> None:
    while True:
        # One turn of the loop, which also polls for I/O: the other tasks run until they block.
        await asyncio.sleep(0)
        if _others_blocked():
            return


def _others_blocked() -> bool:
    """Whether no callback is due and every other task waits on a future not yet done."""
    loop = asyncio.get_running_loop()
    if getattr(loop, "_ready", None):  # asyncio's own loop: callbacks due this turn or the next.
        return False
    this = asyncio.current_task()
    for task in asyncio.all_tasks(loop):
        waiter = getattr(task, "_fut_waiter", None)  # What the task awaits (None: runnable).
        if task is not this and (waiter is None or waiter.done()):
            return False
    return True


class NamedUser(User):
    """An authenticated user: the owner the task stores scope tasks by."""

    def __init__(self, name: str) -> None:
        self._name = name

    @property
    def is_authenticated(self) -> bool:
        return True

    @property
    def user_name(self) -> str:
        return self._name


def caller(name: str = "alice") -> ServerCallContext:
    return ServerCallContext(user=NamedUser(name))


class ScriptedExecutor(AgentExecutor):
    """An agent that works one step (held at a gate) or parks for input, then completes.

    Args:
        park: ask for input instead of working, on the first message.
        cancel: what ``cancel()`` does: "empty", "publish" (CANCELED at once), "io" (awaits
            I/O, then publishes CANCELED), "gate" (waits at ``cancel_gate``, then publishes),
            "raise" or "hang".
        swallow: ``execute()`` swallows ``CancelledError`` and keeps running until released.
        shield: the step runs in a ``shielded()`` section.
        burst: how many artifact updates (streamed tokens) it enqueues before the step.
    """

    def __init__(
        self,
        *,
        park: bool = False,
        cancel: str = "empty",
        swallow: bool = False,
        shield: bool = False,
        burst: int = 0,
    ) -> None:
        self.park, self.cancel_mode, self.swallow = park, cancel, swallow
        self.shield, self.burst = shield, burst
        self.task_id: str | None = None
        self.step = Gate()
        self.ready = asyncio.Event()
        self.cancel_called = asyncio.Event()
        self.cancel_returned = asyncio.Event()
        self.cancels = 0
        self.cancel_gate = Gate()
        self.completed = asyncio.Event()
        self.stopped = asyncio.Event()
        self.released = asyncio.Event()
        self.runs = 0

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        self.task_id, self.runs = context.task_id, self.runs + 1
        updater = TaskUpdater(event_queue, context.task_id or "", context.context_id or "")
        try:
            if context.current_task is None:
                await event_queue.enqueue_event(
                    new_task(
                        context.task_id or "",
                        context.context_id or "",
                        TaskState.TASK_STATE_SUBMITTED,
                        history=[context.message] if context.message else [],
                    )
                )
            await updater.start_work()
            if self.park and self.runs == 1:
                await updater.requires_input()
                self.ready.set()
                return
            for token in range(self.burst):
                await event_queue.enqueue_event(_token(context, token))
            self.ready.set()
            if self.shield:
                async with shielded():
                    await self._work_step()
            else:
                await self._work_step()
            await updater.complete()
            self.completed.set()
        finally:
            self.stopped.set()

    async def _work_step(self) -> None:
        if not self.swallow:
            await self.step()
            return
        self.step.reached.set()
        while not self.released.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await self.released.wait()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        self.cancel_called.set()
        self.cancels += 1
        mode = self.cancel_mode
        if mode == "raise":
            raise RuntimeError("cancel() failed")
        if mode == "hang":
            await asyncio.Event().wait()
        if mode == "io":
            await asyncio.to_thread(_io, IO_LATENCY)
        if mode == "gate":
            await self.cancel_gate()
        if mode in ("publish", "io", "gate"):
            await TaskUpdater(event_queue, context.task_id or "", context.context_id or "").cancel()
        self.cancel_returned.set()


def _token(context: RequestContext, index: int) -> TaskArtifactUpdateEvent:
    """One streamed token of the answer."""
    return TaskArtifactUpdateEvent(
        task_id=context.task_id or "",
        context_id=context.context_id or "",
        artifact=Artifact(artifact_id="answer", parts=[Part(text=f"token {index} ")]),
        append=index > 0,
    )


class FleetExecutor(AgentExecutor):
    """Many tasks at once: a message saying "park" asks for input, any other works until released."""

    def __init__(self) -> None:
        self.released = asyncio.Event()

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        task_id, context_id = context.task_id or "", context.context_id or ""
        if context.current_task is None:
            await event_queue.enqueue_event(new_task(task_id, context_id, TaskState.TASK_STATE_SUBMITTED))
        updater = TaskUpdater(event_queue, task_id, context_id)
        if context.get_user_input() == "park":
            await updater.requires_input()
            return
        await updater.start_work()
        await self.released.wait()
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        return None


async def start_fleet(server: Server, count: int) -> dict[str, Stream]:
    """Start ``count`` streamed tasks, half working and half parked; wait until all are stored so."""
    settled = asyncio.Event()
    seen: set[int] = set()

    def note(index: int) -> Callable[[Any], None]:
        def on_event(event: Any) -> None:
            if state_of(event) in ("WORKING", "INPUT_REQUIRED"):
                seen.add(index)
                if len(seen) == count:
                    settled.set()

        return on_event

    streams = [
        Stream(
            server.handler.on_message_send_stream(
                SendMessageRequest(message=message("park" if index % 2 else "work")), caller()
            ),
            note(index),
        )
        for index in range(count)
    ]
    await within(settled.wait(), BOUND + count / 20)
    return {stream.events[0].id: stream for stream in streams}


def _io(seconds: float) -> None:
    """Stand in for the network round trip of a real ``cancel()``."""
    import time

    time.sleep(seconds)


class PushReceiver:
    """Records what the SDK's push sender posts, per push-config URL."""

    def __init__(self) -> None:
        self.received: dict[str, list[str]] = {}
        self.client = httpx.AsyncClient(transport=httpx.MockTransport(self._receive))

    def _receive(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        state = _find_state(body)
        self.received.setdefault(str(request.url), []).append(state or "?")
        return httpx.Response(200)


def _find_state(body: Any) -> str | None:
    """The task state named anywhere in a push payload."""
    if isinstance(body, dict):
        for key, value in body.items():
            if key == "state" and isinstance(value, str):
                return value.removeprefix("TASK_STATE_")
            found = _find_state(value)
            if found:
                return found
    if isinstance(body, list):
        for value in body:
            found = _find_state(value)
            if found:
                return found
    return None


class Calls:
    """How a scenario reaches the handler; these are made straight on it, as ``caller(owner)``."""

    def __init__(self, handler: DefaultRequestHandlerV2) -> None:
        self.handler = handler

    def send_stream(self, request: SendMessageRequest, owner: str) -> AsyncIterator[Any]:
        return self.handler.on_message_send_stream(request, caller(owner))

    async def send(self, request: SendMessageRequest, owner: str) -> Any:
        return await self.handler.on_message_send(request, caller(owner))

    async def cancel(self, task_id: str, owner: str) -> Task:
        return await self.handler.on_cancel_task(CancelTaskRequest(id=task_id), caller(owner))

    async def get(self, task_id: str, owner: str) -> Task:
        return await self.handler.on_get_task(GetTaskRequest(id=task_id), caller(owner))

    def subscribe(self, task_id: str, owner: str) -> AsyncIterator[Any]:
        return self.handler.on_subscribe_to_task(SubscribeToTaskRequest(id=task_id), caller(owner))

    async def add_push_config(self, config: TaskPushNotificationConfig, owner: str) -> None:
        await self.handler.on_create_task_push_notification_config(config, caller(owner))

    @contextlib.asynccontextmanager
    async def session(self, owner: str) -> AsyncIterator[Calls]:
        """Calls that share one connection, as one client keeps it open between requests."""
        yield self

    def callers(self) -> frozenset[Any]:
        return frozenset()  # A cancelled call is gone at once.

    async def gone(self, callers: frozenset[Any]) -> None:
        return None


class OverTheWire(Calls):
    """A scenario's calls made by the SDK's own client, each from a connection of its own (as
    separate clients make them), authenticated as ``owner``."""

    def __init__(self, handler: DefaultRequestHandlerV2, endpoint: _wire.Endpoint) -> None:
        super().__init__(handler)
        self.endpoint = endpoint

    async def send_stream(  # type: ignore[override]
        self, request: SendMessageRequest, owner: str
    ) -> AsyncIterator[Any]:
        async with _wire.connect(self.endpoint, owner) as client:
            async for response in client.send_message(request):
                yield _payload(response)

    async def send(self, request: SendMessageRequest, owner: str) -> Any:
        async with _wire.connect(self.endpoint, owner, streaming=False) as client:
            async for response in client.send_message(request):
                return _payload(response)
        return None

    async def cancel(self, task_id: str, owner: str) -> Task:
        async with _wire.connect(self.endpoint, owner) as client:
            return await client.cancel_task(CancelTaskRequest(id=task_id))

    async def get(self, task_id: str, owner: str) -> Task:
        async with _wire.connect(self.endpoint, owner) as client:
            return await client.get_task(GetTaskRequest(id=task_id))

    async def subscribe(  # type: ignore[override]
        self, task_id: str, owner: str
    ) -> AsyncIterator[Any]:
        async with _wire.connect(self.endpoint, owner) as client:
            async for response in client.subscribe(SubscribeToTaskRequest(id=task_id)):
                yield _payload(response)

    async def add_push_config(self, config: TaskPushNotificationConfig, owner: str) -> None:
        async with _wire.connect(self.endpoint, owner) as client:
            await client.create_task_push_notification_config(config)

    @contextlib.asynccontextmanager
    async def session(self, owner: str) -> AsyncIterator[Calls]:  # type: ignore[override]
        async with _wire.connect(self.endpoint, owner, streaming=False) as client:
            yield _Session(self.handler, client)

    def callers(self) -> frozenset[Any]:
        return self.endpoint.callers()

    async def gone(self, callers: frozenset[Any]) -> None:
        await within(self.endpoint.gone(callers))


class _Session(Calls):
    """One client's calls on its one kept-alive connection (``owner`` is the client's)."""

    def __init__(self, handler: DefaultRequestHandlerV2, client: Any) -> None:
        super().__init__(handler)
        self.client = client

    async def send(self, request: SendMessageRequest, owner: str) -> Any:
        async for response in self.client.send_message(request):
            return _payload(response)
        return None

    async def cancel(self, task_id: str, owner: str) -> Task:
        return await self.client.cancel_task(CancelTaskRequest(id=task_id))


def _payload(response: Any) -> Any:
    """The Task / status update / artifact update / Message inside a client's response."""
    return getattr(response, response.WhichOneof("payload"))


@dataclass
class Server:
    """A handler with its store and push wiring, as one scenario sees it."""

    handler: DefaultRequestHandlerV2
    executor: ScriptedExecutor
    store: TaskStore
    push: PushReceiver
    calls: Calls
    """How the scenario reaches the handler: in process, or over a transport."""


def make_server(
    kind: str,
    executor: ScriptedExecutor,
    *,
    store: TaskStore | None = None,
    owner: str = "alice",
    push: bool = True,
    **options: Any,
) -> Server:
    """Build the stock handler, the stock handler around our wrapper, or ours, around ``executor``."""
    store = store if store is not None else InMemoryTaskStore()
    receiver = PushReceiver()
    configs = InMemoryPushNotificationConfigStore()
    card = AgentCard(
        name="check",
        description="cancel scenarios",
        version="1",
        capabilities=AgentCapabilities(streaming=True, push_notifications=True),
    )
    arguments: dict[str, Any] = dict(agent_executor=executor, task_store=store, agent_card=card)
    if push:
        arguments["push_config_store"] = configs
        arguments["push_sender"] = BasePushNotificationSender(receiver.client, configs, caller(owner))
    if kind == "ours":
        options.setdefault("cancel_grace_period", GRACE)
        handler: DefaultRequestHandlerV2 = DefaultRequestHandler(**arguments, **options)
    else:
        if kind == "wrapped":
            arguments["agent_executor"] = CancellableExecutor(executor, grace_period=GRACE)
        handler = DefaultRequestHandlerV2(**arguments)
    return Server(handler, executor, store, receiver, Calls(handler))


class Bench:
    """Where one scenario runs: the handler kind, the transport its calls take, and the
    servers it started, stopped when it ends."""

    def __init__(self, kind: str, transport: str) -> None:
        self.kind, self.transport = kind, transport
        self._servers = contextlib.AsyncExitStack()

    async def server(self, executor: ScriptedExecutor, **arguments: Any) -> Server:
        """A server for ``executor`` (``make_server``'s arguments), reached over the transport."""
        server = make_server(self.kind, executor, **arguments)
        if self.transport != IN_PROCESS:
            # A request the stock handler never answers is cut off at once when the scenario ends.
            serving = _wire.serve(server.handler, self.transport, shutdown_seconds=0.1, log_level="critical")
            endpoint = await self._servers.enter_async_context(serving)
            server.calls = OverTheWire(server.handler, endpoint)
        return server

    async def __aenter__(self) -> Bench:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._servers.aclose()


def message(text: str = "go", task_id: str = "") -> Message:
    return Message(
        role=Role.ROLE_USER, message_id=uuid.uuid4().hex, parts=[Part(text=text)], task_id=task_id
    )


class Stream:
    """Drain a handler's event stream in the background; remember every event."""

    def __init__(
        self, events: AsyncIterator[Any], on_event: Callable[[Any], None] | None = None
    ) -> None:
        self.events: list[Any] = []
        self.error: BaseException | None = None
        self._on_event = on_event
        self.changes = Changes()  # At each event, and when the stream ends.
        self.task = asyncio.ensure_future(self._drain(events))
        self.task.add_done_callback(lambda _: self.changes.notify())

    async def _drain(self, events: AsyncIterator[Any]) -> None:
        try:
            async for event in events:
                self.events.append(event)
                self.changes.notify()
                if self._on_event is not None:
                    self._on_event(event)
        except Exception as error:  # The stream's outcome, reported by ``last``.
            self.error = error

    async def ended(self, seconds: float = BOUND) -> bool:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.task), seconds)
        return self.task.done()

    async def until(self, condition: Callable[[], object], seconds: float = BOUND) -> None:
        """Wait until ``condition()`` holds, checked at each event and at the stream's end."""
        await self.changes.until(condition, seconds)

    @property
    def last(self) -> str:
        if self.error is not None:
            return type(self.error).__name__
        states = [state_of(event) for event in self.events if state_of(event)]
        return states[-1] if states else "nothing"


def state_of(event: Any) -> str | None:
    if isinstance(event, (Task, TaskStatusUpdateEvent)):
        return TaskState.Name(event.status.state).removeprefix("TASK_STATE_")
    return None


async def start(server: Server, *, owner: str = "alice", push_url: str | None = None) -> Stream:
    """Send a streaming message and wait until the executor is mid-step (or parked)."""
    configuration = SendMessageConfiguration()
    if push_url:
        configuration.task_push_notification_config.CopyFrom(
            TaskPushNotificationConfig(url=push_url, id=uuid.uuid4().hex)
        )
    request = SendMessageRequest(message=message(), configuration=configuration)
    stream = Stream(server.calls.send_stream(request, owner))
    await reached_step(server, owner)
    return stream


async def reached_step(server: Server, owner: str = "alice") -> None:
    """Wait until the executor is mid-step (or parked) and the store shows it.

    Call it before the request's first step runs (right after starting it): it looks at
    GetTask after each save to the store from then on, so it returns as soon as it shows it.
    """
    executor, saved = server.executor, Changes()
    with _saves_noted(server.store, saved):
        await within(executor.ready.wait())
        if not executor.park:
            await within(executor.step.reached.wait())
        expected = "INPUT_REQUIRED" if executor.park and executor.runs == 1 else "WORKING"

        async def recorded() -> bool:
            return await stored(server, executor.task_id or "", owner) == expected

        await saved.until(recorded)


@contextlib.contextmanager
def _saves_noted(store: TaskStore, changes: Changes) -> Iterator[None]:
    """Notify ``changes`` after each save to ``store`` while the block runs."""
    earlier = vars(store).get("save")  # An outer block's, if any.
    save = store.save

    async def noted(*args: Any, **kwargs: Any) -> Any:
        try:
            return await save(*args, **kwargs)
        finally:
            changes.notify()

    store.save = noted  # type: ignore[method-assign]
    try:
        yield
    finally:
        if earlier is None:
            del store.save
        else:
            store.save = earlier  # type: ignore[method-assign]


async def cancel(server: Server, task_id: str, owner: str = "alice") -> str:
    """Cancel through the handler; the returned state, or the A2A error's name."""
    return await _outcome(server.calls.cancel(task_id, owner))


async def stored(server: Server, task_id: str, owner: str = "alice") -> str:
    """The task's state as GetTask shows it."""
    return await _outcome(server.calls.get(task_id, owner))


async def _outcome(call: Awaitable[Task | None]) -> str:
    try:
        task = await call
    except A2AError as error:
        return type(error).__name__.removesuffix("Error")
    except Exception as error:  # A stock handler may leak the executor's own exception.
        return f"raised {type(error).__name__}"
    return state_of(task) or "nothing"


async def _settled(server: Server, task_id: str) -> str:
    """The stored state once the cancel has run its course (what GetTask shows a moment later).

    A run that closes itself is gone by then; one that a timer closes, or nothing, is not.
    """
    await wait_all_tasks_blocked()
    return await stored(server, task_id)


# The scenarios. Each returns a short outcome; ``expected`` is what our handler must show.


async def mid_run(bench: Bench) -> str:
    server = await bench.server(ScriptedExecutor())
    await start(server)
    returned = await cancel(server, server.executor.task_id or "")
    return f"{returned} / {await _settled(server, server.executor.task_id or '')}"


async def mid_run_blocking_sender(bench: Bench) -> str:
    server = await bench.server(ScriptedExecutor())
    sender = asyncio.ensure_future(server.calls.send(SendMessageRequest(message=message()), "alice"))
    await reached_step(server)
    canceller = asyncio.ensure_future(cancel(server, server.executor.task_id or ""))
    done, _ = await asyncio.wait({sender}, timeout=BOUND)
    canceller.cancel()
    if not done:
        return "sender still waiting"
    try:
        return f"sender got {state_of(sender.result())}"
    except A2AError as error:
        return f"sender got {type(error).__name__}"


async def mid_run_stream(bench: Bench) -> str:
    server = await bench.server(ScriptedExecutor())
    stream = await start(server)
    canceller = asyncio.ensure_future(cancel(server, server.executor.task_id or ""))
    ended = await stream.ended()
    canceller.cancel()
    return f"stream ends on {stream.last}" if ended else f"stream open after {stream.last}"


async def mid_run_subscriber(bench: Bench) -> str:
    server = await bench.server(ScriptedExecutor())
    await start(server)
    task_id = server.executor.task_id or ""
    subscriber = Stream(server.calls.subscribe(task_id, "alice"))
    await subscriber.until(lambda: bool(subscriber.events) or subscriber.task.done())
    canceller = asyncio.ensure_future(cancel(server, task_id))
    ended = await subscriber.ended()
    canceller.cancel()
    return f"stream ends on {subscriber.last}" if ended else f"stream open after {subscriber.last}"


async def mid_run_push(bench: Bench) -> str:
    server = await bench.server(ScriptedExecutor())
    urls = ("http://push.invalid/a", "http://push.invalid/b")
    await start(server, push_url=urls[0])
    task_id = server.executor.task_id or ""
    created = TaskPushNotificationConfig(task_id=task_id, url=urls[1], id="b")
    await server.calls.add_push_config(created, "alice")
    await cancel(server, task_id)
    await _settled(server, task_id)
    last = {url.rsplit("/", 1)[-1]: (server.push.received.get(url) or ["nothing"])[-1] for url in urls}
    return ", ".join(f"{name} got {state}" for name, state in sorted(last.items()))


async def retried(bench: Bench) -> str:
    server = await bench.server(ScriptedExecutor())
    await start(server)
    task_id = server.executor.task_id or ""
    first = asyncio.ensure_future(cancel(server, task_id))
    await asyncio.wait({first}, timeout=BOUND)
    if not first.done():
        first.cancel()
        return "first HANG"
    await _settled(server, task_id)
    return f"{first.result()}, then {await cancel(server, task_id)}"


async def parked(bench: Bench) -> str:
    server = await bench.server(ScriptedExecutor(park=True))
    await start(server)
    task_id = server.executor.task_id or ""
    returned = await cancel(server, task_id)
    called = "cancel() called" if server.executor.cancel_called.is_set() else "cancel() not called"
    return f"{returned} / {await _settled(server, task_id)}, {called}"


async def not_live_here(bench: Bench) -> str:
    first = await bench.server(ScriptedExecutor(park=True))
    await start(first)
    task_id = first.executor.task_id or ""
    replica = await bench.server(ScriptedExecutor(park=True), store=first.store)
    returned = await cancel(replica, task_id)
    return f"{returned} / {await stored(replica, task_id)}"


async def _cancel_mode(bench: Bench, mode: str) -> str:
    server = await bench.server(ScriptedExecutor(cancel=mode))
    await start(server)
    task_id = server.executor.task_id or ""
    returned = await cancel(server, task_id)
    return f"{returned} / {await _settled(server, task_id)}"


async def cancel_publishes(bench: Bench) -> str:
    return await _cancel_mode(bench, "publish")


async def cancel_awaits_io(bench: Bench) -> str:
    return await _cancel_mode(bench, "io")


async def cancel_raises(bench: Bench) -> str:
    return await _cancel_mode(bench, "raise")


async def cancel_hangs(bench: Bench) -> str:
    return await _cancel_mode(bench, "hang")


async def execute_swallows(bench: Bench) -> str:
    server = await bench.server(ScriptedExecutor(swallow=True))
    try:
        await start(server)
        task_id = server.executor.task_id or ""
        returned = await cancel(server, task_id)
        return f"{returned} / {await stored(server, task_id)}"
    finally:
        server.executor.released.set()


async def foreign_cancel(bench: Bench) -> str:
    server = await bench.server(ScriptedExecutor())
    await start(server)
    task_id = server.executor.task_id or ""
    returned = await cancel(server, task_id, owner="mallory")
    await wait_all_tasks_blocked()  # A stock cancel kills the run asynchronously.
    owner_view = await stored(server, task_id)
    run = "run killed" if server.executor.stopped.is_set() else "run untouched"
    return f"{returned}, owner sees {owner_view}, {run}"


async def foreign_subscribe(bench: Bench) -> str:
    server = await bench.server(ScriptedExecutor())
    await start(server)
    task_id = server.executor.task_id or ""
    spy = Stream(server.calls.subscribe(task_id, "mallory"))
    await spy.until(lambda: bool(spy.events) or spy.task.done())
    spy.task.cancel()
    return f"got {spy.last}"


async def unknown_id(bench: Bench) -> str:
    server = await bench.server(ScriptedExecutor())
    return await cancel(server, "no-such-task")


async def completed(bench: Bench) -> str:
    server = await bench.server(ScriptedExecutor())
    stream = await start(server)
    server.executor.step.open()
    await stream.ended()
    return await cancel(server, server.executor.task_id or "")


async def client_leaves_mid_cancel(bench: Bench) -> str:
    server = await bench.server(ScriptedExecutor(cancel="io"))
    await start(server)
    task_id = server.executor.task_id or ""
    before = server.calls.callers()
    request = asyncio.ensure_future(cancel(server, task_id))
    await within(server.executor.cancel_called.wait())
    leaving = server.calls.callers() - before
    request.cancel()  # The client goes away while its cancel is in progress...
    with contextlib.suppress(asyncio.CancelledError):
        await request
    await server.calls.gone(leaving)  # ...and the server has noticed.
    await within(server.executor.stopped.wait())
    return f"task ends {await _settled(server, task_id)}"


async def concurrent_cancels(bench: Bench) -> str:
    server = await bench.server(ScriptedExecutor(cancel="io"))
    await start(server)
    task_id = server.executor.task_id or ""
    results = await asyncio.gather(cancel(server, task_id), cancel(server, task_id))
    return " and ".join(results)


async def two_clients_cancel(bench: Bench) -> str:
    """The client that started a task with ``returnImmediately`` cancels it on its kept-alive
    connection while a second client cancels it on a new one; ``cancel()`` is empty.

    The second request reaches the handler a few event-loop turns after the first (its
    connection must be accepted first), as it does between real clients; in-process calls made
    together reach it in the same turn.
    """
    server = await bench.server(ScriptedExecutor())
    async with server.calls.session("alice") as starter:
        request = SendMessageRequest(
            message=message(), configuration=SendMessageConfiguration(return_immediately=True)
        )
        await starter.send(request, "alice")
        await within(server.executor.step.reached.wait())
        task_id = server.executor.task_id or ""
        answers = [
            asyncio.ensure_future(_outcome(starter.cancel(task_id, "alice"))),
            asyncio.ensure_future(cancel(server, task_id)),
        ]
        return f"{await _answers(answers)}, task {await stored(server, task_id)}"


class SlowCancelSave(InMemoryTaskStore):
    """A store whose write of a CANCELED task waits at ``gate``, as a database write takes a while."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = Gate()
        self.read = asyncio.Event()
        """Set at each read: every handler reads the task before it cancels it."""

    async def get(self, *args: Any, **kwargs: Any) -> Task | None:
        self.read.set()
        return await super().get(*args, **kwargs)

    async def save(self, task: Task, *args: Any, **kwargs: Any) -> None:
        if task.status.state == TaskState.TASK_STATE_CANCELED:
            await self.gate()
        await super().save(task, *args, **kwargs)


async def cancel_during_cancel(bench: Bench) -> str:
    """A second client cancels a task started with ``returnImmediately`` while the first
    client's cancel is saving CANCELED: the run has stopped, the store still says WORKING.

    A store write that takes a while, as a database's does, holds open the moment in which a
    second client's request, a little behind the first, lands.
    """
    store = SlowCancelSave()
    server = await bench.server(ScriptedExecutor(), store=store)
    configuration = SendMessageConfiguration(return_immediately=True)
    started = SendMessageRequest(message=message(), configuration=configuration)
    await server.calls.send(started, "alice")
    await reached_step(server)
    task_id = server.executor.task_id or ""
    first = asyncio.ensure_future(cancel(server, task_id))
    saving = asyncio.ensure_future(store.gate.reached.wait())
    await within(asyncio.wait({first, saving}, return_when=asyncio.FIRST_COMPLETED))
    saving.cancel()
    store.read.clear()
    second = asyncio.ensure_future(cancel(server, task_id))
    await within(store.read.wait())  # The second cancel has reached the handler...
    await wait_all_tasks_blocked()  # ...and got as far as it can.
    store.gate.open()  # Now the first one's CANCELED is saved.
    return f"{await _answers([first, second])}, task {await stored(server, task_id)}"


async def _answers(cancels: list[asyncio.Future[str]]) -> str:
    """What concurrent cancels answered, HANG for one with no answer within half the bound."""
    await asyncio.wait(cancels, timeout=BOUND / 2)
    return " and ".join(cancel.result() if cancel.done() else "HANG" for cancel in cancels)


@dataclass(frozen=True)
class Scenario:
    name: str
    run: Callable[[Bench], Awaitable[str]]
    expected: str
    transport: str = "jsonrpc"
    """How the scenario's client reaches the server: as clients meet it, a real socket."""


SCENARIOS = (
    Scenario("mid-run, cancel() empty", mid_run, "CANCELED / CANCELED"),
    Scenario("mid-run, blocking sender in flight", mid_run_blocking_sender, "sender got CANCELED"),
    Scenario("mid-run, sender's stream", mid_run_stream, "stream ends on CANCELED"),
    Scenario("mid-run, SubscribeToTask stream", mid_run_subscriber, "stream ends on CANCELED"),
    Scenario("mid-run, two push configs", mid_run_push, "a got CANCELED, b got CANCELED"),
    Scenario("cancel retried", retried, "CANCELED, then TaskNotCancelable"),
    Scenario("parked INPUT_REQUIRED", parked, "CANCELED / CANCELED, cancel() called"),
    Scenario("no live run here (restart, other replica)", not_live_here, "CANCELED / CANCELED"),
    Scenario("cancel() publishes CANCELED", cancel_publishes, "CANCELED / CANCELED"),
    Scenario("cancel() awaits I/O, then publishes", cancel_awaits_io, "CANCELED / CANCELED"),
    Scenario("cancel() raises", cancel_raises, "Internal / FAILED"),
    Scenario("cancel() hangs", cancel_hangs, "CANCELED / CANCELED"),
    Scenario("execute() swallows CancelledError", execute_swallows, "CANCELED / CANCELED"),
    Scenario(
        "another user cancels",
        foreign_cancel,
        "TaskNotFound, owner sees WORKING, run untouched",
    ),
    Scenario("another user subscribes", foreign_subscribe, "got TaskNotFoundError"),
    Scenario("unknown task id", unknown_id, "TaskNotFound"),
    Scenario("completed task", completed, "TaskNotCancelable"),
    Scenario("client leaves mid-cancel, JSON-RPC", client_leaves_mid_cancel, "task ends CANCELED"),
    Scenario("client leaves mid-cancel, gRPC", client_leaves_mid_cancel, "task ends CANCELED", "grpc"),
    Scenario("two concurrent cancels", concurrent_cancels, "CANCELED and CANCELED"),
    Scenario("two clients cancel at once", two_clients_cancel, "CANCELED and CANCELED, task CANCELED"),
    Scenario(
        "second cancel while the first saves CANCELED",
        cancel_during_cancel,
        "CANCELED and CANCELED, task CANCELED",
    ),
)


def run_scenario(scenario: Scenario, kind: str, transport: str | None = None) -> str:
    """Run one scenario in a fresh event loop, over its transport unless told otherwise;
    HANG if it outlives ``BOUND``; NOT RUN if the transport's packages are missing."""
    transport = transport or scenario.transport
    install = _wire.missing(transport) if transport != IN_PROCESS else None
    if install:
        return f"{NOT_RUN} ({install})"
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(_bounded(scenario, kind, transport))
    finally:
        _shut_down(loop)


async def _bounded(scenario: Scenario, kind: str, transport: str) -> str:
    async with Bench(kind, transport) as bench:
        try:
            return await asyncio.wait_for(scenario.run(bench), BOUND)
        except asyncio.TimeoutError:
            return "HANG"
        except Exception as error:  # A stock handler may leak an internal exception.
            return f"raised {type(error).__name__}"


def _shut_down(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what the scenario left running, without waiting on anything forever."""
    pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.wait(pending, timeout=1.0))
    for task in pending:
        if task.done() and not task.cancelled():
            task.exception()
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


@dataclass
class Row:
    scenario: str
    outcomes: dict[str, str]
    expected: str

    @property
    def ran(self) -> bool:
        return not self.outcomes["ours"].startswith(NOT_RUN)

    @property
    def holds(self) -> bool:
        return not self.ran or self.outcomes["ours"] == self.expected

    @property
    def stock_holds(self) -> bool:
        """Whether a client of the stock handler sees what the contract says (a row not run
        shows nothing either way)."""
        return not self.ran or self.outcomes["stock"] == self.expected


WORKERS = 4
"""Scenarios run at once, each in its own thread and event loop: a HANG is mostly waiting."""


def run_all() -> list[Row]:
    runs = [(scenario, kind) for scenario in SCENARIOS for kind in HANDLERS]
    with concurrent.futures.ThreadPoolExecutor(WORKERS) as pool:
        outcomes = dict(zip(runs, pool.map(lambda run: run_scenario(*run), runs)))
    return [
        Row(s.name, {kind: outcomes[s, kind] for kind in HANDLERS}, s.expected) for s in SCENARIOS
    ]


def verdict(rows: list[Row]) -> str:
    if not all(row.holds for row in rows):
        return f"a2a-cancelfix does NOT fix every scenario on a2a-sdk {SDK_VERSION}: please report it."
    failing = [row.scenario for row in rows if not row.stock_holds]
    ran = [row for row in rows if row.ran]
    if failing:
        return (
            f"a2a-sdk {SDK_VERSION} still needs a2a-cancelfix: the stock handler fails "
            f"{len(failing)} of {len(ran)} scenarios."
        )
    if len(ran) < len(rows):
        not_run = [row.outcomes["ours"] for row in rows if not row.ran]
        hints = sorted({outcome.removeprefix(NOT_RUN).strip(" ()") for outcome in not_run})
        return (
            f"a2a-sdk {SDK_VERSION} passes the {len(ran)} scenarios that ran; run the other "
            f"{len(rows) - len(ran)} before removing a2a-cancelfix: {'; '.join(hints)}."
        )
    return f"a2a-sdk {SDK_VERSION} passes every scenario on its own: you can remove a2a-cancelfix."


_TITLES = {
    "stock": f"stock a2a-sdk {SDK_VERSION}",
    "wrapped": "stock + CancellableExecutor",
    "ours": "a2a-cancelfix handler",
}


def render(rows: list[Row]) -> str:
    table = [("scenario", *(_TITLES[kind] for kind in HANDLERS))]
    for row in rows:
        cells = [row.outcomes[kind] for kind in HANDLERS]
        if not row.holds:
            cells[-1] += "  (FAILS)"
        table.append((row.scenario, *cells))
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in table]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines + ["", verdict(rows)])


def as_json(rows: list[Row]) -> str:
    return json.dumps(
        {
            "a2a_sdk": SDK_VERSION,
            "scenarios": [
                {"scenario": row.scenario, **row.outcomes, "expected": row.expected, "holds": row.holds}
                for row in rows
            ],
            "needed": any(not row.stock_holds for row in rows),
            "verdict": verdict(rows),
        },
        indent=2,
    )
