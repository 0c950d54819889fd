"""Servers for a scenario: the stock handler, the stock handler around our wrapper, or ours,
reached in process or over a real socket; and the calls a scenario makes on them."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any

import wrapt
from a2a.auth.user import User
from a2a.server.context import ServerCallContext
from a2a.server.request_handlers.default_request_handler_v2 import DefaultRequestHandlerV2
from a2a.server.tasks import InMemoryPushNotificationConfigStore, InMemoryTaskStore, TaskStore
from a2a.types import (
    AgentCapabilities,
    AgentCard,
    CancelTaskRequest,
    GetTaskRequest,
    Message,
    Part,
    Role,
    SendMessageConfiguration,
    SendMessageRequest,
    SubscribeToTaskRequest,
    Task,
    TaskPushNotificationConfig,
)
from a2a.utils.errors import A2AError

from a2a_cancelfix._cancel.settings import Settings
from a2a_cancelfix._executor import CancellableExecutor
from a2a_cancelfix._handler import DefaultRequestHandler
from a2a_cancelfix._own_store import used_unguarded
from a2a_cancelfix._patching import is_patched
from a2a_cancelfix._sdk import push_sender
from a2a_cancelfix.store import FinalStateTaskStore
from a2a_cancelfix.testing import _wire
from a2a_cancelfix.testing.executors import ScriptedExecutor
from a2a_cancelfix.testing.observers import PushReceiver, Stream, state_of
from a2a_cancelfix.testing.waits import Changes, within

GRACE = 0.3
"""The grace period the scenarios give our handler."""
HANDLERS = ("stock", "wrapped", "ours")
"""The SDK's handler; the SDK's handler around a CancellableExecutor; our handler."""
IN_PROCESS = "in-process"
"""Calls made straight on the handler, not over a transport (the tests' own scenarios)."""


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
    """The context of a call made straight on a handler by the user ``name``."""
    return ServerCallContext(user=NamedUser(name))


def message(text: str = "go", task_id: str = "") -> Message:
    """A user's message saying ``text``; with ``task_id``, one that continues that task."""
    return Message(role=Role.ROLE_USER, message_id=uuid.uuid4().hex, parts=[Part(text=text)], task_id=task_id)


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

    async def send_stream(self, request: SendMessageRequest, owner: str) -> AsyncIterator[Any]:
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

    async def subscribe(self, task_id: str, owner: str) -> AsyncIterator[Any]:
        async with _wire.connect(self.endpoint, owner) as client:
            async for response in client.subscribe(SubscribeToTaskRequest(id=task_id)):
                yield _payload(response)

    async def add_push_config(self, config: TaskPushNotificationConfig, owner: str) -> None:
        async with _wire.connect(self.endpoint, owner) as client:
            await client.create_task_push_notification_config(config)

    @contextlib.asynccontextmanager
    async def session(self, owner: str) -> AsyncIterator[Calls]:
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
    store: TaskStore | Any  # a VersionedTaskStore too, on a2a-sdk 1.2+
    push: PushReceiver
    calls: Calls
    """How the scenario reaches the handler: in process, or over a transport."""
    saves: Changes | None = field(default_factory=Changes)
    """Notified after each save to the store, for waits on what GetTask shows (`reached_step`):
    a `FinalStateTaskStore` tells of its saves, and `make_server` wraps any other store so
    that it does too. None: nothing listens (``make_server(told=False)``)."""

    def __post_init__(self) -> None:
        saves = self.saves
        if saves is not None and isinstance(self.store, FinalStateTaskStore):
            self.store.subscribe(saved=lambda _: saves.notify())


def make_server(
    kind: str,
    executor: ScriptedExecutor,
    *,
    store: TaskStore | None = None,
    owner: str = "alice",
    push: bool = True,
    event_stream: Any = None,
    told: bool = True,
    **options: Any,
) -> Server:
    """Build the stock handler, the stock handler around our wrapper, or ours, around ``executor``.

    ``event_stream`` (a2a-sdk 1.2+'s cluster mode, with a versioned ``store``) goes to every kind;
    ``options`` to ours only. ``told=False``: the store goes to the handler as it is, and
    nothing listens to its saves, so `reached_step` (and `start`) cannot wait on it: for a
    benchmark, which would otherwise count the listening for one handler and not the other.
    """
    given: Any = store if store is not None else InMemoryTaskStore()
    saves = Changes() if told else None
    # A guard tells of its saves (see Server); any other store is wrapped to tell of them,
    # unless ours (or the SDK's handler, patched) is to guard it: a wrapper would hide it.
    guarded = (kind == "ours" or is_patched()) and not used_unguarded(given)
    if saves is not None and not isinstance(given, FinalStateTaskStore) and not guarded:
        given = _SavesNoted(given, saves)
    receiver = PushReceiver()
    configs = InMemoryPushNotificationConfigStore()
    card = AgentCard(
        name="check",
        description="cancel scenarios",
        version="1",
        capabilities=AgentCapabilities(streaming=True, push_notifications=True),
    )
    arguments: dict[str, Any] = {"agent_executor": executor, "task_store": given, "agent_card": card}
    if event_stream is not None:
        arguments["event_stream"] = event_stream
    if push:
        arguments["push_config_store"] = configs
        arguments["push_sender"] = push_sender(receiver.client, configs, caller(owner))
    if kind == "ours":
        options.setdefault("cancel_grace_period", GRACE)
        # Settings, not the handler's keywords: they take a `Timing` too.
        handler: DefaultRequestHandlerV2 = DefaultRequestHandler._with(Settings(**options), **arguments)
    else:
        if kind == "wrapped":
            arguments["agent_executor"] = CancellableExecutor(executor, grace_period=GRACE)
        handler = DefaultRequestHandlerV2(**arguments)
    # The store the handler saves to: ours guards the one it is given.
    return Server(handler, executor, handler.task_store, receiver, Calls(handler), saves)


class _SavesNoted(wrapt.ObjectProxy):
    """A task store that notifies ``saves`` after each of its saves, as a guard tells of its own."""

    def __init__(self, store: TaskStore, saves: Changes) -> None:
        super().__init__(store)
        self._self_saves = saves

    async def save(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await self.__wrapped__.save(*args, **kwargs)
        finally:
            self._self_saves.notify()


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
    saves = server.saves
    if saves is None or not isinstance(server.store, (FinalStateTaskStore, _SavesNoted)):
        raise TypeError(
            "reached_step waits for the store's saves: build the server with make_server, or "
            f"give the Server a FinalStateTaskStore, not a {type(server.store).__name__}"
        )
    executor = server.executor
    await within(executor.ready.wait())
    if not executor.park:
        await within(executor.step.reached.wait())
    expected = "INPUT_REQUIRED" if executor.park and executor.runs == 1 else "WORKING"

    async def recorded() -> bool:
        return await stored(server, executor.task_id or "", owner) == expected

    await saves.until(recorded)


async def cancel(server: Server, task_id: str, owner: str = "alice") -> str:
    """Cancel through the handler; the returned state, or the A2A error's name."""
    return await outcome(server.calls.cancel(task_id, owner))


async def stored(server: Server, task_id: str, owner: str = "alice") -> str:
    """The task's state as GetTask shows it."""
    return await outcome(server.calls.get(task_id, owner))


async def outcome(call: Awaitable[Task | Message | None]) -> str:
    """Await ``call``: the state of the task it returns, or the name of the A2A error it raises
    (without "Error"), or ``raised`` and the name of any other exception."""
    try:
        task = await call
    except A2AError as error:
        return type(error).__name__.removesuffix("Error")
    except Exception as error:  # A stock handler may leak the executor's own exception.
        return f"raised {type(error).__name__}"
    return state_of(task) or "nothing"
