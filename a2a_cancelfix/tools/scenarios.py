"""The cancel scenarios: what each does to a handler, what our handler must show, and how one runs.

Every scenario runs in an event loop of its own, against a fresh handler and store, and is
bounded: a stock handler that never answers shows as HANG and never blocks the run. Its
calls go as clients make them, over a real socket (``_wire``), to servers in that same loop, so
the scenario's gates stay reachable. ``a2a-cancelfix check`` and the test suite run the same
scenarios, so the command's table is what the tests show.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from a2a.server.tasks import InMemoryTaskStore
from a2a.types import (
    SendMessageConfiguration,
    SendMessageRequest,
    Task,
    TaskPushNotificationConfig,
    TaskState,
)
from a2a.utils.errors import A2AError

from a2a_cancelfix import _sdk
from a2a_cancelfix._aio import bounded
from a2a_cancelfix.testing import _wire
from a2a_cancelfix.testing.executors import ScriptedExecutor
from a2a_cancelfix.testing.observers import Stream, state_of
from a2a_cancelfix.testing.servers import (
    HANDLERS,
    IN_PROCESS,
    Bench,
    Server,
    cancel,
    message,
    outcome,
    reached_step,
    start,
    stored,
)
from a2a_cancelfix.testing.waits import (
    BOUND,
    Gate,
    answer_or_hang,
    eventually,
    in_own_loop,
    wait_all_tasks_blocked,
    within,
)

NOT_RUN = "NOT RUN"
"""What a scenario shows instead of its outcome when its transport's packages are missing."""
WORKERS = 4
"""Scenarios run at once, each in its own thread and event loop: a HANG is mostly waiting."""


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
    """A task that completed, its run gone from the SDK's registry when the cancel comes.

    Sent blocking, not streamed: over gRPC, stock 1.1.x at times never drops the run of a
    stream that ended (see *completed, execute() still returning*).
    """
    server = await bench.server(ScriptedExecutor())
    server.executor.step.open()
    await server.calls.send(SendMessageRequest(message=message()), "alice")
    task_id = server.executor.task_id or ""
    await eventually(lambda: _gone(server, task_id))
    return await cancel(server, task_id)


async def _gone(server: Server, task_id: str) -> bool:
    return not await _sdk.has_run(server.handler, task_id)


async def completing(bench: Bench) -> str:
    """The run has published COMPLETED, and the store holds it, while ``execute()`` is still
    returning when the cancel comes: the run is live, its task is not."""
    server = await bench.server(ScriptedExecutor(linger=True))
    await start(server)
    server.executor.step.open()
    await within(server.executor.finish.reached.wait())
    await wait_all_tasks_blocked()  # The SDK has saved the COMPLETED.
    returned = await cancel(server, server.executor.task_id or "")
    server.executor.finish.open()
    return f"{returned} / {await _settled(server, server.executor.task_id or '')}"


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
            asyncio.ensure_future(outcome(starter.cancel(task_id, "alice"))),
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


UNWATCHED_AFTER = 0.3
"""The ``cancel_unwatched_after`` of *client leaves, nobody comes back*."""


async def nobody_comes_back(bench: Bench) -> str:
    """The client streams a message, then closes its connection mid-run; nobody subscribes,
    reads or has a push config. Ours has ``cancel_unwatched_after`` (the SDK has no such option)."""
    executor = ScriptedExecutor()
    server = await bench.server(executor, push=False, cancel_unwatched_after=UNWATCHED_AFTER)
    stream = await start(server)
    stream.task.cancel()  # The client goes away.
    await asyncio.wait({stream.task})
    called = executor.cancel_called
    with contextlib.suppress(asyncio.TimeoutError):  # Three intervals: plenty, were it coming.
        await bounded(called.wait(), 3 * UNWATCHED_AFTER)
    task_id = executor.task_id or ""
    if called.is_set():
        await within(executor.stopped.wait())
        await eventually(lambda: _recorded(server, task_id))
    return f"task {await stored(server, task_id)}, cancel() {'called' if called.is_set() else 'not called'}"


async def _recorded(server: Server, task_id: str) -> bool:
    return await stored(server, task_id) != "WORKING"


async def _answers(cancels: Sequence[asyncio.Future[str]]) -> str:
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
    opt_in: str = ""
    """The option of ours the scenario shows, if any: no a2a-sdk has it, so it is no defect of
    the SDK's, and the row never makes the package needed (nor has a script to report)."""
    script: str = ""
    """Its part of the script ``check --repro`` writes: a module of ``tools/repro_scripts/``
    (every scenario but an opt-in one has one)."""


SCENARIOS = (
    Scenario("mid-run, cancel() empty", mid_run, "CANCELED / CANCELED", script="mid_run"),
    Scenario(
        "mid-run, blocking sender in flight",
        mid_run_blocking_sender,
        "sender got CANCELED",
        script="mid_run_blocking_sender",
    ),
    Scenario("mid-run, sender's stream", mid_run_stream, "stream ends on CANCELED", script="mid_run_stream"),
    Scenario(
        "mid-run, SubscribeToTask stream",
        mid_run_subscriber,
        "stream ends on CANCELED",
        script="mid_run_subscriber",
    ),
    Scenario(
        "mid-run, two push configs", mid_run_push, "a got CANCELED, b got CANCELED", script="mid_run_push"
    ),
    Scenario("cancel retried", retried, "CANCELED, then TaskNotCancelable", script="retried"),
    Scenario("parked INPUT_REQUIRED", parked, "CANCELED / CANCELED, cancel() called", script="parked"),
    Scenario(
        "no live run here (restart, other replica)",
        not_live_here,
        "CANCELED / CANCELED",
        script="not_live_here",
    ),
    Scenario(
        "cancel() publishes CANCELED", cancel_publishes, "CANCELED / CANCELED", script="cancel_publishes"
    ),
    Scenario(
        "cancel() awaits I/O, then publishes",
        cancel_awaits_io,
        "CANCELED / CANCELED",
        script="cancel_awaits_io",
    ),
    Scenario("cancel() raises", cancel_raises, "Internal / FAILED", script="cancel_raises"),
    Scenario("cancel() hangs", cancel_hangs, "CANCELED / CANCELED", script="cancel_hangs"),
    Scenario(
        "execute() swallows CancelledError",
        execute_swallows,
        "CANCELED / CANCELED",
        script="execute_swallows",
    ),
    Scenario(
        "another user cancels",
        foreign_cancel,
        "TaskNotFound, owner sees WORKING, run untouched",
        script="foreign_cancel",
    ),
    Scenario(
        "another user subscribes", foreign_subscribe, "got TaskNotFoundError", script="foreign_subscribe"
    ),
    Scenario("unknown task id", unknown_id, "TaskNotFound", script="unknown_id"),
    Scenario("completed task", completed, "TaskNotCancelable", script="completed"),
    Scenario(
        "completed, execute() still returning",
        completing,
        "TaskNotCancelable / COMPLETED",
        script="completing",
    ),
    Scenario(
        "client leaves mid-cancel, JSON-RPC",
        client_leaves_mid_cancel,
        "task ends CANCELED",
        script="client_leaves_jsonrpc",
    ),
    Scenario(
        "client leaves mid-cancel, gRPC",
        client_leaves_mid_cancel,
        "task ends CANCELED",
        "grpc",
        script="client_leaves_grpc",
    ),
    Scenario(
        "two concurrent cancels", concurrent_cancels, "CANCELED and CANCELED", script="concurrent_cancels"
    ),
    Scenario(
        "two clients cancel at once",
        two_clients_cancel,
        "CANCELED and CANCELED, task CANCELED",
        script="two_clients_cancel",
    ),
    Scenario(
        "second cancel while the first saves CANCELED",
        cancel_during_cancel,
        "CANCELED and CANCELED, task CANCELED",
        script="cancel_during_cancel",
    ),
    Scenario(
        "client leaves, nobody comes back",
        nobody_comes_back,
        "task CANCELED, cancel() called",
        opt_in="cancel_unwatched_after",
    ),
)


def run_scenario(scenario: Scenario, kind: str, transport: str | None = None) -> str:
    """Run one scenario in a fresh event loop, over its transport unless told otherwise;
    HANG if it outlives ``BOUND``; NOT RUN if the transport's packages are missing."""
    transport = transport or scenario.transport
    install = _wire.missing(transport) if transport != IN_PROCESS else None
    if install:
        return f"{NOT_RUN} ({install})"
    return in_own_loop(_on_bench, scenario, kind, transport)


async def _on_bench(scenario: Scenario, kind: str, transport: str) -> str:
    async with Bench(kind, transport) as bench:
        try:
            return await answer_or_hang(scenario.run(bench), BOUND)
        except Exception as error:  # A stock handler may leak an internal exception.
            return f"raised {type(error).__name__}"


def run_all() -> list[tuple[Scenario, dict[str, str]]]:
    """Run every scenario against every handler kind, ``WORKERS`` at a time: each scenario
    with its outcome per kind."""
    runs = [(scenario, kind) for scenario in SCENARIOS for kind in HANDLERS]
    with concurrent.futures.ThreadPoolExecutor(WORKERS) as pool:
        outcomes = dict(zip(runs, pool.map(lambda run: run_scenario(*run), runs), strict=True))
    return [(scenario, {kind: outcomes[scenario, kind] for kind in HANDLERS}) for scenario in SCENARIOS]
