"""``a2a-cancelfix check --repro``: a script to attach to an upstream bug report.

For a scenario the installed stock a2a-sdk fails, a standalone script (a2a-sdk and the standard
library only) that makes the scenario's calls straight on the SDK's own ``DefaultRequestHandler``
and asserts what the scenario expects, so it fails while the defect is there. Every wait in it
is bounded: a call that never answers fails the assertion as "no answer within 2.5 s".
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from a2a_cancelfix._sdk import SDK_VERSION
from a2a_cancelfix.testing.waits import BOUND
from a2a_cancelfix.tools import scenarios
from a2a_cancelfix.tools.scenarios import NOT_RUN, Scenario

__all__ = ["NoRepro", "script_for"]


class NoRepro(Exception):
    """Why there is no script for a scenario on the installed a2a-sdk."""


def script_for(name: str) -> str:
    """Run scenario ``name`` on the stock handler; return its script if stock fails it.

    Raises:
        NoRepro: the name is unknown, the scenario could not run here, or stock passes it.
    """
    scenario = next((scenario for scenario in scenarios.SCENARIOS if scenario.name == name), None)
    if scenario is None:
        names = "\n".join(f"  {scenario.name}" for scenario in scenarios.SCENARIOS)
        raise NoRepro(f"no scenario is named {name!r}; the scenarios are:\n{names}")
    if scenario.opt_in:
        raise NoRepro(
            f"{name!r} shows a2a-cancelfix's {scenario.opt_in}, not a defect of a2a-sdk: nothing to report"
        )
    stock = scenarios.run_scenario(scenario, "stock")
    if stock.startswith(NOT_RUN):
        raise NoRepro(f"{name!r} cannot run here: {stock}")
    if stock == scenario.expected:
        raise NoRepro(f"stock a2a-sdk {SDK_VERSION} passes {name!r} ({stock}): there is nothing to reproduce")
    script = _script(scenario, stock)
    # The script makes the calls in process: one that does not fail on stock here proves nothing.
    if not _fails(script):
        raise NoRepro(
            f"stock a2a-sdk {SDK_VERSION} fails {name!r} over {_TRANSPORTS[scenario.transport]} "
            f"({stock}), but its standalone script, whose calls are made in process, does not "
            "reproduce it here: report what `a2a-cancelfix check` shows instead"
        )
    return script


def _fails(script: str) -> bool:
    """Whether ``script``, run on its own, ends on its assertion (it shows the defect)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "repro.py"
        path.write_text(script)
        try:
            ran = subprocess.run(
                [sys.executable, str(path)], capture_output=True, text=True, timeout=_SCRIPT_BOUND
            )
        except subprocess.TimeoutExpired:
            return False
    lines = ran.stderr.strip().splitlines()
    return ran.returncode == 1 and bool(lines) and lines[-1].startswith("AssertionError")


# A script runs its scenario up to TRIES times, each bounded by BOUND, plus its imports.
_SCRIPT_BOUND = 5 * BOUND + 60


def _script(scenario: Scenario, stock: str) -> str:
    """The script for ``scenario``, whose stock outcome here is ``stock``."""
    transport = _TRANSPORTS[scenario.transport]
    header = f'''"""{scenario.name}: a cancel on a2a-sdk's DefaultRequestHandler.

Expected: {scenario.expected}
a2a-sdk {SDK_VERSION}, as `a2a-cancelfix check` saw it over {transport}: {stock}

Made by `a2a-cancelfix check --repro "{scenario.name}"`; needs only a2a-sdk. The calls are
made straight on the handler, in one process, as the SDK's {transport} server code makes them.
Every wait is bounded ({BOUND} s; HANG above is no answer within it). Run: python this_file.py
(it exits with an AssertionError while the defect is there).
"""
'''
    footer = f"""

EXPECTED = {scenario.expected!r}

TRIES = 5  # A defect that shows in some interleavings only shows within a few tries.

if __name__ == "__main__":
    for _ in range(TRIES):
        seen = run(scenario)
        print(f"a2a-sdk {{version('a2a-sdk')}}: {{seen}}")
        assert seen == EXPECTED, f"expected {{EXPECTED!r}}, got {{seen!r}}"
"""
    return header + _PRELUDE.replace("__BOUND__", repr(BOUND)) + _BODIES[scenario.name] + footer


_TRANSPORTS = {"jsonrpc": "JSON-RPC", "rest": "REST", "grpc": "gRPC"}

_PRELUDE = '''
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

BOUND = __BOUND__
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

    def __init__(self, cancel: str = "empty", park: bool = False, swallow: bool = False, linger: bool = False):
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
                await event_queue.enqueue_event(
                    new_task(self.task_id, context.context_id or "", submitted, history=[context.message])
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
        state = next((s for s in TaskState.keys() if f'"{s}"' in body), "?")
        self.received.setdefault(str(request.url), []).append(state.removeprefix("TASK_STATE_"))
        self.changes.notify()
        return httpx.Response(200)


def message(text: str = "go", task_id: str = "") -> Message:
    return Message(role=Role.ROLE_USER, message_id=uuid.uuid4().hex, parts=[Part(text=text)], task_id=task_id)


class Server:
    """The SDK's own DefaultRequestHandler around ``agent``, with push, called in process."""

    def __init__(self, agent: Agent, store: InMemoryTaskStore | None = None) -> None:
        self.agent, self.store, self.push = agent, store or Store(), PushReceiver()
        configs = InMemoryPushNotificationConfigStore()
        card = AgentCard(
            name="repro",
            description="cancel scenarios",
            version="1",
            supported_interfaces=[AgentInterface(protocol_binding="JSONRPC", url="http://127.0.0.1/", protocol_version="1.0")],
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
            agent_executor=agent, task_store=self.store, agent_card=card, push_config_store=configs, push_sender=sender
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
    except asyncio.TimeoutError:
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
    except asyncio.TimeoutError:
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

'''

_MID_RUN = '''
async def scenario() -> str:
    """Cancel a task mid-run; cancel() is empty, as for an agent with nothing to stop."""
    server = Server(Agent())
    await server.start()
    returned = await server.cancel()
    await settle()
    return f"{returned} / {await server.stored()}"
'''

_BLOCKING_SENDER = '''
async def scenario() -> str:
    """Cancel a task while its blocking SendMessage waits for the answer."""
    server = Server(Agent())
    sender = asyncio.ensure_future(server.send())
    await server.working()
    canceller = asyncio.ensure_future(server.cancel())
    await asyncio.wait({sender}, timeout=BOUND)
    canceller.cancel()
    return sender.result() if sender.done() else f"sender: {NO_ANSWER}"
'''

_SENDER_STREAM = '''
async def scenario() -> str:
    """Cancel a task while its sender reads the SendStreamingMessage stream."""
    server = Server(Agent())
    stream = await server.start()
    canceller = asyncio.ensure_future(server.cancel())
    ended = await stream.ended()
    canceller.cancel()
    return f"stream ends on {stream.last}" if ended else f"stream open after {stream.last}: {NO_ANSWER}"
'''

_SUBSCRIBER = '''
async def scenario() -> str:
    """Cancel a task while a SubscribeToTask stream of it is open."""
    server = Server(Agent())
    await server.start()
    subscriber = server.subscribe()
    await subscriber.changes.until(lambda: subscriber.states or subscriber.task.done())
    canceller = asyncio.ensure_future(server.cancel())
    ended = await subscriber.ended()
    canceller.cancel()
    return f"stream ends on {subscriber.last}" if ended else f"stream open after {subscriber.last}: {NO_ANSWER}"
'''

_PUSH = '''
async def scenario() -> str:
    """Cancel a task with two push configs: one given with the message, one added later."""
    server = Server(Agent())
    urls = {"a": "http://push.invalid/a", "b": "http://push.invalid/b"}
    await server.start(push_url=urls["a"])
    config = TaskPushNotificationConfig(task_id=server.agent.task_id, url=urls["b"], id="b")
    await server.handler.on_create_task_push_notification_config(config, as_user("alice"))
    await server.cancel()

    def last(url: str) -> str:
        return (server.push.received.get(url) or ["nothing"])[-1]

    await server.push.changes.until(lambda: all(last(url) == "CANCELED" for url in urls.values()))
    return ", ".join(f"{name} got {last(url)}" for name, url in urls.items())
'''

_RETRIED = '''
async def scenario() -> str:
    """Cancel a task mid-run, and once that has run its course, cancel it again."""
    server = Server(Agent())
    await server.start()
    first = await server.cancel()
    await settle()
    return f"{first}, then {await server.cancel()}"
'''

_PARKED = '''
async def scenario() -> str:
    """Cancel a task parked in INPUT_REQUIRED (its execute() has returned)."""
    server = Server(Agent(park=True))
    await server.start()
    returned = await server.cancel()
    called = "cancel() called" if server.agent.cancel_called.is_set() else "cancel() not called"
    await settle()
    return f"{returned} / {await server.stored()}, {called}"
'''

_NOT_LIVE_HERE = '''
async def scenario() -> str:
    """Cancel a task on a second handler sharing the store, with no run of it (another replica,
    or the same server after a restart)."""
    first = Server(Agent(park=True))
    await first.start()
    replica = Server(Agent(park=True), store=first.store)
    task_id = first.agent.task_id
    returned = await replica.cancel(task_id)
    return f"{returned} / {await replica.stored(task_id)}"
'''


def _cancel_mode(mode: str, what: str) -> str:
    return f'''
async def scenario() -> str:
    """Cancel a task mid-run; {what}."""
    server = Server(Agent(cancel={mode!r}))
    await server.start()
    returned = await server.cancel()
    await settle()
    return f"{{returned}} / {{await server.stored()}}"
'''


_SWALLOWS = '''
async def scenario() -> str:
    """Cancel a task whose execute() swallows CancelledError (as a broad `except` does)."""
    server = Server(Agent(swallow=True))
    try:
        await server.start()
        returned = await server.cancel()
        return f"{returned} / {await server.stored()}"
    finally:
        server.agent.release.set()
'''

_FOREIGN_CANCEL = '''
async def scenario() -> str:
    """Another user (mallory) cancels alice's task."""
    server = Server(Agent())
    await server.start()
    returned = await server.cancel(user="mallory")
    await settle()
    run = "run killed" if server.agent.stopped.is_set() else "run untouched"
    return f"{returned}, owner sees {await server.stored()}, {run}"
'''

_FOREIGN_SUBSCRIBE = '''
async def scenario() -> str:
    """Another user (mallory) subscribes to alice's task."""
    server = Server(Agent())
    await server.start()
    spy = server.subscribe("mallory")
    await spy.changes.until(lambda: spy.states or spy.task.done())
    spy.task.cancel()
    return f"got {spy.last}"
'''

_COMPLETING = '''
async def scenario() -> str:
    """Cancel a task the store holds COMPLETED while its execute() is still returning."""
    server = Server(Agent(linger=True))
    await server.start()
    server.agent.release.set()
    await within(server.agent.completed.wait(), "execute() never completed")
    await server.saved("COMPLETED")
    returned = await server.cancel()
    server.agent.finish.set()
    await settle()
    return f"{returned} / {await server.stored()}"
'''


def _client_leaves(cancelled: bool) -> str:
    if cancelled:
        leaves = """    request.cancel()  # The client goes away: a gRPC server cancels the handler's call.
    with contextlib.suppress(asyncio.CancelledError):
        await request
"""
    else:
        leaves = """    # The client goes away: a JSON-RPC server behind uvicorn lets the handler's call run on.
    await asyncio.wait({request}, timeout=BOUND)
"""
    return f'''
async def scenario() -> str:
    """The client that cancels goes away while cancel() awaits I/O."""
    server = Server(Agent(cancel="io"))
    await server.start()
    request = asyncio.ensure_future(server.cancel())
    await within(server.agent.cancel_called.wait(), "cancel() was never called")
{leaves}    await asyncio.wait({{asyncio.ensure_future(server.agent.stopped.wait())}}, timeout=BOUND)
    if not server.agent.stopped.is_set():
        return f"run still going: {{NO_ANSWER}}"
    await settle()
    return f"task ends {{await server.stored()}}"
'''


_CONCURRENT = '''
async def scenario() -> str:
    """Two cancels of one task at once; cancel() awaits I/O."""
    server = Server(Agent(cancel="io"))
    await server.start()
    return " and ".join(await asyncio.gather(server.cancel(), server.cancel()))
'''

_TWO_CLIENTS = '''
async def scenario() -> str:
    """Two clients cancel a task started with returnImmediately; cancel() is empty. The second
    request reaches the handler a little after the first (its connection is accepted first):
    here, once the first has ended the run."""
    server = Server(Agent())
    request = SendMessageRequest(message=message(), configuration=SendMessageConfiguration(return_immediately=True))
    await outcome(server.handler.on_message_send(request, as_user("alice")))
    await server.working()
    first = asyncio.ensure_future(server.cancel())
    await asyncio.wait({first, asyncio.ensure_future(server.agent.stopped.wait())}, timeout=BOUND,
                       return_when=asyncio.FIRST_COMPLETED)
    second = asyncio.ensure_future(server.cancel())
    answers = await asyncio.gather(first, second)
    return f"{' and '.join(answers)}, task {await server.stored()}"
'''

_CANCEL_DURING_CANCEL = '''
class SlowCancelSave(Store):
    """A store whose write of a CANCELED task waits until ``go`` is set, as a database write
    takes a while."""

    def __init__(self) -> None:
        super().__init__()
        self.saving, self.go, self.read = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def get(self, *args, **kwargs):
        self.read.set()
        return await super().get(*args, **kwargs)

    async def save(self, task: Task, *args, **kwargs) -> None:
        if task.status.state == TaskState.TASK_STATE_CANCELED:
            self.saving.set()
            await self.go.wait()
        await super().save(task, *args, **kwargs)


async def scenario() -> str:
    """A second client cancels a task (started with returnImmediately) while the first client's
    cancel is saving CANCELED: the run has stopped, the store still says WORKING."""
    store = SlowCancelSave()
    server = Server(Agent(), store=store)
    request = SendMessageRequest(message=message(), configuration=SendMessageConfiguration(return_immediately=True))
    await outcome(server.handler.on_message_send(request, as_user("alice")))
    await server.working()
    first = asyncio.ensure_future(server.cancel())
    await asyncio.wait({first, asyncio.ensure_future(store.saving.wait())}, timeout=BOUND,
                       return_when=asyncio.FIRST_COMPLETED)
    store.read.clear()
    second = asyncio.ensure_future(server.cancel())
    read = asyncio.ensure_future(store.read.wait())  # The second cancel has reached the handler...
    await asyncio.wait({second, read}, timeout=BOUND, return_when=asyncio.FIRST_COMPLETED)
    await settle()  # ...and got as far as it can.
    store.go.set()  # Now the first one's CANCELED is saved.
    answers = await asyncio.gather(first, second)
    return f"{' and '.join(answers)}, task {await server.stored()}"
'''

_BODIES = {
    "mid-run, cancel() empty": _MID_RUN,
    "mid-run, blocking sender in flight": _BLOCKING_SENDER,
    "mid-run, sender's stream": _SENDER_STREAM,
    "mid-run, SubscribeToTask stream": _SUBSCRIBER,
    "mid-run, two push configs": _PUSH,
    "cancel retried": _RETRIED,
    "parked INPUT_REQUIRED": _PARKED,
    "no live run here (restart, other replica)": _NOT_LIVE_HERE,
    "cancel() publishes CANCELED": _cancel_mode("publish", "cancel() publishes CANCELED"),
    "cancel() awaits I/O, then publishes": _cancel_mode("io", "cancel() awaits I/O, then publishes CANCELED"),
    "cancel() raises": _cancel_mode("raise", "cancel() raises"),
    "cancel() hangs": _cancel_mode("hang", "cancel() never returns"),
    "execute() swallows CancelledError": _SWALLOWS,
    "another user cancels": _FOREIGN_CANCEL,
    "another user subscribes": _FOREIGN_SUBSCRIBE,
    "unknown task id": '''
async def scenario() -> str:
    """Cancel a task id nobody has."""
    return await Server(Agent()).cancel("no-such-task")
''',
    "completed task": '''
async def scenario() -> str:
    """Cancel a task that has completed."""
    server = Server(Agent())
    server.agent.release.set()
    await outcome(server.handler.on_message_send(SendMessageRequest(message=message()), as_user("alice")))
    await settle()
    return await server.cancel()
''',
    "completed, execute() still returning": _COMPLETING,
    "client leaves mid-cancel, JSON-RPC": _client_leaves(cancelled=False),
    "client leaves mid-cancel, gRPC": _client_leaves(cancelled=True),
    "two concurrent cancels": _CONCURRENT,
    "two clients cancel at once": _TWO_CLIENTS,
    "second cancel while the first saves CANCELED": _CANCEL_DURING_CANCEL,
}
