"""What every script starts with: an agent it holds at known points, the SDK's own handler
around it, and bounded waits.

A script is this file without its docstring, then its scenario's file without its imports (which
this file makes), then the lines that run it (``repro._script``). So that the script needs only
a2a-sdk, nothing here imports a2a_cancelfix.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
import uuid
from importlib.metadata import version

import httpx  # a2a-sdk's own dependency: its push sender posts with it
from a2a.auth.user import User
from a2a.helpers import new_task
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.context import ServerCallContext
from a2a.server.events.event_queue import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.tasks import (
    BasePushNotificationSender,
    InMemoryPushNotificationConfigStore,
    InMemoryTaskStore,
    TaskUpdater,
)
from a2a.types import (
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    AgentSkill,
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
    TaskState,
    TaskStatusUpdateEvent,
)
from a2a.utils.errors import A2AError

BOUND = 2.5
"""Seconds any wait may take; a call with no answer by then is reported, not awaited forever."""
NO_ANSWER = f"no answer within {BOUND} s"


class Named(User):
    def __init__(self, name: str) -> None:
        self._name = name

    @property
    def is_authenticated(self) -> bool:
        return True

    @property
    def user_name(self) -> str:
        return self._name


def as_user(name: str) -> ServerCallContext:
    """The context of a call by ``name``: the owner the task store scopes tasks by."""
    return ServerCallContext(user=Named(name))


def state_of(event: object) -> str | None:
    if isinstance(event, (Task, TaskStatusUpdateEvent)):
        return TaskState.Name(event.status.state).removeprefix("TASK_STATE_")
    return None


class Agent(AgentExecutor):
    """Works one step until released, then completes; or asks for input (``park``).

    ``cancel``: what cancel() does: "empty", "publish" (CANCELED), "io" (awaits a 50 ms network
    call, then publishes CANCELED), "raise" or "hang". ``swallow``: execute() swallows
    CancelledError. ``linger``: execute() waits at ``finish`` after publishing COMPLETED.
    """

    def __init__(
        self, cancel: str = "empty", park: bool = False, swallow: bool = False, linger: bool = False
    ):
        self.cancel_mode, self.park, self.swallow, self.linger = cancel, park, swallow, linger
        self.task_id = ""
        self.working = asyncio.Event()  # mid-step, or parked
        self.release = asyncio.Event()
        self.completed = asyncio.Event()
        self.finish = asyncio.Event()
        self.stopped = asyncio.Event()
        self.cancel_called = asyncio.Event()

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        self.task_id = context.task_id or ""
        updater = TaskUpdater(event_queue, context.task_id or "", context.context_id or "")
        try:
            if context.current_task is None:
                submitted = TaskState.TASK_STATE_SUBMITTED
                history = [context.message] if context.message else []
                await event_queue.enqueue_event(
                    new_task(self.task_id, context.context_id or "", submitted, history=history)
                )
            await updater.start_work()
            if self.park:
                await updater.requires_input()
                self.working.set()
                return
            self.working.set()
            while not self.release.is_set():
                try:
                    await self.release.wait()
                except asyncio.CancelledError:
                    if not self.swallow:
                        raise
            await updater.complete()
            self.completed.set()
            if self.linger:
                await self.finish.wait()
        finally:
            self.stopped.set()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        self.cancel_called.set()
        if self.cancel_mode == "raise":
            raise RuntimeError("cancel() failed")
        if self.cancel_mode == "hang":
            await asyncio.Event().wait()
        if self.cancel_mode == "io":
            await asyncio.to_thread(time.sleep, 0.05)
        if self.cancel_mode in ("publish", "io"):
            await TaskUpdater(event_queue, context.task_id or "", context.context_id or "").cancel()


class Changes:
    """Wakes waiters each time something they watch changes."""

    def __init__(self) -> None:
        self._changed = asyncio.Event()

    def notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def until(self, condition, seconds: float = BOUND) -> bool:
        """Wait up to ``seconds`` for ``condition()``; whether it holds."""

        async def waiting() -> None:
            while not condition():
                await self._changed.wait()

        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(waiting(), seconds)
        return bool(condition())


class Store(InMemoryTaskStore):
    """The SDK's in-memory store, noting the state each save wrote."""

    def __init__(self) -> None:
        super().__init__()
        self.saved: dict[str, str] = {}
        self.changes = Changes()

    async def save(self, task: Task, *args, **kwargs) -> None:
        await super().save(task, *args, **kwargs)
        self.saved[task.id] = state_of(task) or ""
        self.changes.notify()


class Stream:
    """Drain a stream of events in the background; remember the last state it showed."""

    def __init__(self, events) -> None:
        self.states: list[str] = []
        self.error: BaseException | None = None
        self.changes = Changes()
        self.task = asyncio.ensure_future(self._drain(events))
        self.task.add_done_callback(lambda _: self.changes.notify())

    async def _drain(self, events) -> None:
        try:
            async for event in events:
                self.states.append(state_of(event) or "")
                self.changes.notify()
        except Exception as error:
            self.error = error

    async def ended(self) -> bool:
        """Wait up to BOUND for the stream to end; whether it has."""
        await asyncio.wait({self.task}, timeout=BOUND)
        return self.task.done()

    @property
    def last(self) -> str:
        if self.error is not None:
            return type(self.error).__name__
        states = [state for state in self.states if state]
        return states[-1] if states else "nothing"


class PushReceiver:
    """Record the state of each push notification, per URL, through an httpx mock transport."""

    def __init__(self) -> None:
        self.received: dict[str, list[str]] = {}
        self.changes = Changes()
        self.client = httpx.AsyncClient(transport=httpx.MockTransport(self._receive))

    def _receive(self, request: httpx.Request) -> httpx.Response:
        body = request.content.decode()
        state = next((name for name, _ in TaskState.items() if f'"{name}"' in body), "?")
        self.received.setdefault(str(request.url), []).append(state.removeprefix("TASK_STATE_"))
        self.changes.notify()
        return httpx.Response(200)


def message(text: str = "go", task_id: str = "") -> Message:
    return Message(role=Role.ROLE_USER, message_id=uuid.uuid4().hex, parts=[Part(text=text)], task_id=task_id)


class Server:
    """The SDK's own DefaultRequestHandler around ``agent``, with push, called in process."""

    def __init__(self, agent: Agent, store: Store | None = None) -> None:
        self.agent, self.store, self.push = agent, store or Store(), PushReceiver()
        configs = InMemoryPushNotificationConfigStore()
        card = AgentCard(
            name="repro",
            description="cancel scenarios",
            version="1",
            supported_interfaces=[
                AgentInterface(protocol_binding="JSONRPC", url="http://127.0.0.1/", protocol_version="1.0")
            ],
            capabilities=AgentCapabilities(streaming=True, push_notifications=True),
            default_input_modes=["text/plain"],
            default_output_modes=["text/plain"],
            skills=[AgentSkill(id="work", name="work", description="works until cancelled", tags=["cancel"])],
        )
        # a2a-sdk 1.0.0-1.0.1 read push configs under this context; later releases log that it is deprecated.
        context = inspect.signature(BasePushNotificationSender).parameters["context"]
        owner = (as_user("alice"),) if context.default is inspect.Parameter.empty else ()
        sender = BasePushNotificationSender(self.push.client, configs, *owner)
        self.handler = DefaultRequestHandler(
            agent_executor=agent,
            task_store=self.store,
            agent_card=card,
            push_config_store=configs,
            push_sender=sender,
        )

    async def start(self, push_url: str | None = None, **configuration) -> Stream:
        """Send a streaming message; return once the agent is mid-step (or parked) and the
        store says so."""
        config = SendMessageConfiguration(**configuration)
        if push_url:
            config.task_push_notification_config.CopyFrom(TaskPushNotificationConfig(url=push_url, id="a"))
        request = SendMessageRequest(message=message(), configuration=config)
        stream = Stream(self.handler.on_message_send_stream(request, as_user("alice")))
        await self.working()
        return stream

    async def working(self) -> None:
        """Wait until the agent is mid-step (or parked) and the store shows it."""
        await within(self.agent.working.wait(), "execute() never started work")
        await self.saved("INPUT_REQUIRED" if self.agent.park else "WORKING")

    async def saved(self, state: str) -> None:
        """Wait until the store holds the task in ``state``."""
        if not await self.store.changes.until(lambda: self.store.saved.get(self.agent.task_id) == state):
            raise AssertionError(f"the store never showed {state}: {NO_ANSWER}")

    async def send(self) -> str:
        """A blocking SendMessage: "sender got" the state it answered."""
        request = SendMessageRequest(message=message())
        return f"sender got {await outcome(self.handler.on_message_send(request, as_user('alice')))}"

    def subscribe(self, user: str = "alice") -> Stream:
        """A SubscribeToTask stream of the agent's task, read in the background."""
        request = SubscribeToTaskRequest(id=self.agent.task_id)
        return Stream(self.handler.on_subscribe_to_task(request, as_user(user)))

    async def cancel(self, task_id: str | None = None, user: str = "alice") -> str:
        request = CancelTaskRequest(id=self.agent.task_id if task_id is None else task_id)
        return await outcome(self.handler.on_cancel_task(request, as_user(user)))

    async def stored(self, task_id: str | None = None) -> str:
        request = GetTaskRequest(id=self.agent.task_id if task_id is None else task_id)
        return await outcome(self.handler.on_get_task(request, as_user("alice")))


async def outcome(call) -> str:
    """The state of the task ``call`` returns, or the A2A error it raises (without "Error"),
    or NO_ANSWER."""
    try:
        answer = await asyncio.wait_for(call, BOUND)
    except asyncio.TimeoutError:  # noqa: UP041 - a script runs wherever a2a-sdk does: 3.10 too.
        return NO_ANSWER
    except A2AError as error:
        return type(error).__name__.removesuffix("Error")
    except Exception as error:
        return f"raised {type(error).__name__}"
    return state_of(answer) or "nothing"


async def settle() -> None:
    """Return once every other task waits on something not done and no callback is due: what
    the handler does on its own after an answer has been done (bounded by BOUND)."""
    loop = asyncio.get_running_loop()

    def blocked(task: asyncio.Task) -> bool:
        waiter = getattr(task, "_fut_waiter", None)  # asyncio's: what the task awaits
        return task is asyncio.current_task() or (waiter is not None and not waiter.done())

    async def idle() -> None:
        while True:
            await asyncio.sleep(0)  # One turn of the loop: the others run until they block.
            if not getattr(loop, "_ready", None) and all(blocked(task) for task in asyncio.all_tasks()):
                return

    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(idle(), BOUND)


async def within(awaitable, what: str):
    """Await ``awaitable`` for up to BOUND; past that, fail saying ``what`` did not happen."""
    try:
        return await asyncio.wait_for(awaitable, BOUND)
    except asyncio.TimeoutError:  # noqa: UP041 - as above: not the builtin on 3.10.
        raise AssertionError(f"{what}: {NO_ANSWER}") from None


def run(main) -> str:
    """Run ``main()`` in a loop of its own; cancel what it left running, waiting at most 1 s."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(main())
    finally:
        pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.wait(pending, timeout=1.0))
        loop.close()


TRIES = 5
"""Runs of the scenario: a defect that shows in some interleavings only shows within a few."""


def reproduce(scenario, expected: str) -> None:
    """Run ``scenario`` up to TRIES times, printing what each run shows; fail on the first run
    that does not show ``expected``."""
    for _ in range(TRIES):
        seen = run(scenario)
        print(f"a2a-sdk {version('a2a-sdk')}: {seen}")
        assert seen == expected, f"expected {expected!r}, got {seen!r}"
