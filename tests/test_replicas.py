"""A cancel recorded by one replica reaches the run on another through the shared task store.

Here two handlers in one process share a store, as replicas share a database; the tests in
tests/test_replica_servers.py do the same with real server processes on SQLite and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import pytest
from a2a.server.agent_execution import RequestContext
from a2a.server.events import EventQueue
from a2a.server.tasks import DatabaseTaskStore, InMemoryTaskStore
from a2a.types import Artifact, Part, SendMessageRequest, Task, TaskArtifactUpdateEvent, TaskState

from a2a_cancelfix import FinalStateTaskStore, _sdk, checkpoint
from a2a_cancelfix.testing import (
    Changes,
    Gate,
    ScriptedExecutor,
    Server,
    Stream,
    caller,
    cancel,
    make_server,
    message,
    start,
    stored,
    wait_all_tasks_blocked,
    within,
)
from a2a_cancelfix.testing.waits import eventually

from .support import CompletionHeld
from .test_store import open_database

SLICE = 0.001
"""Seconds of work between two checkpoints."""
CHECKPOINTS = 100
"""How many checkpoints a run passes, at least a tenth of a second, to show it does not poll."""


class PollingExecutor(ScriptedExecutor):
    """Works in many small steps, each ending at a checkpoint, until cancelled."""

    def __init__(self) -> None:
        super().__init__()
        self.checkpoints = 0
        self.progress = Changes()  # At each checkpoint passed.

    async def _work_step(self) -> None:
        self.step.reached.set()
        while not self.released.is_set():
            await checkpoint()
            self.checkpoints += 1
            self.progress.notify()
            await asyncio.sleep(SLICE)  # Stands in for a slice of real work.

    async def passed(self, count: int) -> None:
        """Wait until the run has passed ``count`` more checkpoints."""
        target = self.checkpoints + count
        await self.progress.until(lambda: self.checkpoints >= target)


def replicas(executor: ScriptedExecutor, store=None, **options):
    """Replica A runs ``executor``; replica B shares A's store and runs nothing."""
    store = FinalStateTaskStore(InMemoryTaskStore()) if store is None else store
    a = make_server("ours", executor, store=store, **options)
    b = make_server("ours", ScriptedExecutor(), store=store, **options)
    return a, b


@pytest.mark.parametrize(
    "shared_store",
    [lambda: FinalStateTaskStore(InMemoryTaskStore()), InMemoryTaskStore],
    ids=["final-state", "bare in-memory"],
)
@pytest.mark.asyncio
async def test_a_checkpoint_notices_a_cancel_from_another_replica(shared_store) -> None:
    """The running replica's next due checkpoint raises; its cancel() runs; its stream ends CANCELED.

    Also where two handlers share a bare InMemoryTaskStore, which one handler alone never reads
    for cancels recorded elsewhere: the second one's arrival makes both look."""
    a, b = replicas(PollingExecutor(), shared_store(), replica_poll_interval=0.01)
    stream = await start(a)
    task_id = a.executor.task_id
    assert await within(cancel(b, task_id)) == "CANCELED"
    await within(a.executor.stopped.wait())
    assert a.executor.cancel_called.is_set()
    assert await within(stream.ended()) and stream.last == "CANCELED"
    assert await stored(a, task_id) == "CANCELED" and await stored(b, task_id) == "CANCELED"


@pytest.mark.asyncio
async def test_handlers_sharing_a_bare_in_memory_store_hear_each_others_cancels() -> None:
    """Two handlers given one bare InMemoryTaskStore tell each other of a cancel as replicas
    with notices do: A's run stops though nothing polls."""
    a, b = replicas(PollingExecutor(), InMemoryTaskStore(), replica_poll_interval=None)
    await start(a)
    assert await within(cancel(b, a.executor.task_id)) == "CANCELED"
    await within(a.executor.stopped.wait())
    assert a.executor.cancel_called.is_set()


@pytest.mark.asyncio
async def test_a_run_cannot_complete_a_task_another_replica_cancelled() -> None:
    """Before it publishes COMPLETED, a run reads the store: the remote CANCELED wins everywhere."""
    a, b = replicas(ScriptedExecutor(), replica_poll_interval=3600)
    stream = await start(a)
    task_id = a.executor.task_id
    assert await within(cancel(b, task_id)) == "CANCELED"
    a.executor.step.open()  # A's run now tries to complete the task.
    await within(a.executor.stopped.wait())
    assert not a.executor.completed.is_set()
    assert await within(stream.ended()) and stream.last == "CANCELED"
    assert await stored(a, task_id) == "CANCELED"


class Answering(ScriptedExecutor):
    """Streams a part of its answer once its step is let through."""

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        self.context, self.queue = context, event_queue
        await super().execute(context, event_queue)

    async def _work_step(self) -> None:
        await self.step()
        await self.queue.enqueue_event(
            TaskArtifactUpdateEvent(
                task_id=self.context.task_id or "",
                context_id=self.context.context_id or "",
                artifact=Artifact(artifact_id="answer", parts=[Part(text="part")]),
            )
        )


@pytest.mark.asyncio
async def test_an_ordinary_cancel_from_another_replica_logs_no_warning(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """Replicas over one database (SQLite). B records CANCELED; A's run, which has not looked
    at the store since (its poll an hour off), saves a part of its answer over it, the store
    refuses it, and A cancels the run. That is how a cancel reaches another replica: the
    refusal is logged at INFO, not as a WARNING (which is for what needs someone to look)."""
    async with open_database("sqlite", tmp_path) as database:
        stores = [DatabaseTaskStore(database.engine()) for _ in range(2)]
        await stores[0].initialize()
        a = make_server("ours", Answering(), store=stores[0], replica_poll_interval=3600)
        b = make_server("ours", ScriptedExecutor(), store=stores[1], replica_poll_interval=3600)
        with caplog.at_level(logging.DEBUG, logger="a2a_cancelfix"):
            stream = await start(a)
            task_id = a.executor.task_id or ""
            assert await within(cancel(b, task_id)) == "CANCELED"
            a.executor.step.open()  # A's part of the answer is saved over B's CANCELED.
            await within(a.executor.stopped.wait())
            assert await within(stream.ended()) and stream.last == "CANCELED"
        for server in (a, b):
            await within(server.handler.aclose())
    ours = [record for record in caplog.records if record.name == "a2a_cancelfix"]
    assert any("stored=TASK_STATE_CANCELED refused=TASK_STATE_WORKING" in r.getMessage() for r in ours)
    assert [r.getMessage() for r in ours if r.levelno >= logging.WARNING] == []


@pytest.mark.asyncio
async def test_a_closed_handler_leaves_no_callback_on_the_shared_store() -> None:
    """aclose() takes back the handler's callback for the store's refusals (else the store,
    which outlives it, keeps the handler and its lifecycle alive); the other replica's stays."""
    store = FinalStateTaskStore(InMemoryTaskStore())
    a = make_server("ours", ScriptedExecutor(), store=store)
    b = make_server("ours", ScriptedExecutor(), store=store)
    told = store._told_refused
    assert told == [a.handler._remote.refused, b.handler._remote.refused]
    await within(a.handler.aclose())
    assert told == [b.handler._remote.refused]
    await within(b.handler.aclose())
    assert told == []


@pytest.mark.asyncio
async def test_polling_can_be_turned_off() -> None:
    """With replica_poll_interval=None a run never reads the store for remote cancels."""
    a, b = replicas(PollingExecutor(), replica_poll_interval=None)
    await start(a)
    task_id = a.executor.task_id
    assert await within(cancel(b, task_id)) == "CANCELED"
    await a.executor.passed(CHECKPOINTS)
    assert not a.executor.stopped.is_set() and not a.executor.cancel_called.is_set()
    assert await within(cancel(a, task_id)) == "TaskNotCancelable"  # Already CANCELED in the store.
    a.executor.released.set()


@pytest.mark.asyncio
async def test_no_poll_before_the_interval_is_due() -> None:
    """A run that checkpoints in a tight loop does not read the store before the interval is due."""
    reads = 0
    a, _ = replicas(PollingExecutor(), replica_poll_interval=3600)
    original = a.handler.agent_executor.cancel_lifecycle.remote.read_for

    async def counted(context: RequestContext):
        nonlocal reads
        reads += 1
        return await original(context)

    a.handler.agent_executor.cancel_lifecycle.remote.read_for = counted
    await start(a)
    await a.executor.passed(CHECKPOINTS)
    assert reads == 0
    assert await within(cancel(a, a.executor.task_id)) == "CANCELED"


@pytest.mark.asyncio
async def test_a_store_that_fails_to_answer_does_not_fail_the_run(caplog) -> None:
    """A failed read while watching is logged; the run goes on and can still be cancelled."""
    a, _ = replicas(PollingExecutor(), replica_poll_interval=0.001)
    looks, looked = 0, Changes()

    async def broken(context: RequestContext):
        nonlocal looks
        looks += 1
        looked.notify()
        raise OSError("database unreachable")

    a.handler.agent_executor.cancel_lifecycle.remote.read_for = broken
    await start(a)
    await looked.until(lambda: looks >= 2)  # It looked, failed, and looked again ...
    assert sum("could not read task" in r.getMessage() for r in caplog.records) >= 2  # ... logging each.
    assert not a.executor.stopped.is_set()
    assert await within(cancel(a, a.executor.task_id)) == "CANCELED"


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["stock", "ours"])
async def test_a_task_parked_here_and_canceled_elsewhere_ends_canceled_here(kind: str) -> None:
    """Nothing runs on A for a task parked there; A looks at it once per poll interval, and
    its subscriber, its push config and its cancel() learn of B's CANCELED. Stock: B's cancel
    hangs up to 1.1.5; from 1.2.0 it answers, and A's subscriber stays open, parked."""
    store = FinalStateTaskStore(InMemoryTaskStore())
    options = {"replica_poll_interval": 0.01} if kind == "ours" else {}
    a = make_server(kind, ScriptedExecutor(park=True), store=store, **options)
    b = make_server(kind, ScriptedExecutor(), store=store, **options)
    await start(a, push_url="http://push.invalid/a")
    task_id = a.executor.task_id or ""
    subscriber = Stream(a.calls.subscribe(task_id, "alice"))
    await subscriber.until(lambda: bool(subscriber.events))
    answered = await outcome_within(cancel(b, task_id))
    if kind == "stock":
        assert answered == ("CANCELED" if _sdk.SDK_CANCELS_WHERE_NOT_LIVE else "HANG")
        await wait_all_tasks_blocked()
        assert not subscriber.task.done() and not a.executor.cancel_called.is_set()
        return
    assert answered == "CANCELED"
    assert await subscriber.ended() and subscriber.last == "CANCELED"
    await a.push.posted("http://push.invalid/a", "CANCELED")
    assert a.executor.cancel_called.is_set()
    assert await stored(a, task_id) == "CANCELED"


async def outcome_within(call: Awaitable[str], seconds: float = 1.0) -> str:
    try:
        return await asyncio.wait_for(call, seconds)
    except TimeoutError:
        return "HANG"


async def reads_of_one_run(kind: str) -> int:
    """How often one polling run, from its first message to COMPLETED, reads a bare
    InMemoryTaskStore that only its handler has."""
    store = InMemoryTaskStore()
    reads = 0
    read = store.get

    async def counted(*args, **kwargs):
        nonlocal reads
        reads += 1
        return await read(*args, **kwargs)

    store.get = counted  # type: ignore[method-assign]
    options = {"replica_poll_interval": 0.001} if kind == "ours" else {}
    server = make_server(kind, PollingExecutor(), store=store, **options)
    await start(server)
    await server.executor.passed(CHECKPOINTS)
    server.executor.released.set()
    await within(server.executor.stopped.wait())
    assert server.executor.completed.is_set()
    return reads


@pytest.mark.asyncio
async def test_a_store_only_this_process_has_is_not_read_for_remote_cancels() -> None:
    """One handler on a bare InMemoryTaskStore: no other replica can record a cancel there,
    so a run reads the store as often under ours, polling every millisecond, as under stock."""
    assert await reads_of_one_run("ours") == await reads_of_one_run("stock")


@pytest.mark.asyncio
async def test_a_parked_task_whose_run_closed_here_is_forgotten() -> None:
    """A parked run the SDK closes (a2a-sdk 1.3's idle timeout, a teardown) has nothing left
    here to tell: the replica stops looking at its task, which may stay parked for good."""
    a = make_server(
        "ours",
        ScriptedExecutor(park=True),
        store=FinalStateTaskStore(InMemoryTaskStore()),
        replica_poll_interval=0.01,
    )
    await start(a)
    task_id = a.executor.task_id or ""
    parked = a.handler.agent_executor.cancel_lifecycle.parked
    assert task_id in parked
    await _sdk.force_close(await _sdk.live_task(a.handler, task_id), 1.0)
    await eventually(lambda: task_id not in parked)
    assert await stored(a, task_id) == "INPUT_REQUIRED"


@pytest.mark.asyncio
async def test_a_parked_task_looked_at_before_the_store_has_it_parked_is_still_watched() -> None:
    """The run parks before the SDK has saved INPUT_REQUIRED: a look in between reads WORKING
    and must not forget the task, which B then cancels."""
    store = FinalStateTaskStore(InMemoryTaskStore())
    a = make_server("ours", ScriptedExecutor(park=True), store=store, replica_poll_interval=0.01)
    b = make_server("ours", ScriptedExecutor(), store=store, replica_poll_interval=0.01)
    held, save = Gate(), store.save
    looked, look = asyncio.Event(), a.handler._remote._end_parked_if_cancelled

    async def held_save(task, context):
        if task.status.state == TaskState.TASK_STATE_INPUT_REQUIRED:
            await held()
        await save(task, context)

    async def noted_look(task_id: str) -> None:
        await look(task_id)
        looked.set()

    store.save = held_save  # type: ignore[method-assign]
    a.handler._remote._end_parked_if_cancelled = noted_look  # type: ignore[method-assign]
    sent = Stream(a.calls.send_stream(SendMessageRequest(message=message()), "alice"))
    try:
        await within(held.reached.wait())
        await within(looked.wait())  # A looked while the store still said WORKING.
    finally:
        held.open()
    await sent.until(lambda: sent.last == "INPUT_REQUIRED")
    task_id = a.executor.task_id or ""
    subscriber = Stream(a.calls.subscribe(task_id, "alice"))
    await subscriber.until(lambda: bool(subscriber.events))
    assert await within(cancel(b, task_id)) == "CANCELED"
    assert await subscriber.ended() and subscriber.last == "CANCELED"
    assert a.executor.cancel_called.is_set()


class OrderedExecutor(PollingExecutor):
    """Notes when its ``cancel()`` is called and when its ``execute()``'s ``finally`` runs."""

    def __init__(self) -> None:
        super().__init__()
        self.order: list[str] = []

    async def execute(self, context, event_queue) -> None:
        try:
            await super().execute(context, event_queue)
        finally:
            self.order.append("finally")

    async def cancel(self, context, event_queue) -> None:
        self.order.append("cancel")
        await super().cancel(context, event_queue)


@pytest.mark.parametrize("where", ["here", "another replica"])
@pytest.mark.asyncio
async def test_cancel_runs_before_the_work_unwinds_on_every_path(where: str) -> None:
    """The README's order holds however the run learns of the cancel: ``cancel()`` is called
    before ``execute()``'s ``finally`` runs, also when a polling checkpoint finds a remote one."""
    a, b = replicas(OrderedExecutor(), replica_poll_interval=0.01)
    await start(a)
    task_id = a.executor.task_id
    assert await within(cancel(a if where == "here" else b, task_id)) == "CANCELED"
    await within(a.executor.stopped.wait())
    await eventually(lambda: "finally" in a.executor.order)
    assert a.executor.order == ["cancel", "finally"]


@pytest.mark.parametrize("end", ["canceled", "completed"])
@pytest.mark.parametrize("kind", ["stock", "ours"])
@pytest.mark.asyncio
async def test_a_subscription_where_the_task_does_not_run_ends_with_it(kind: str, end: str) -> None:
    """SubscribeToTask on replica B while A runs the task: stock sets up a run on B that nothing
    feeds, so the stream never ends and the run stays; ours serves it from the store and ends it
    on the state A stored, leaving nothing behind on B."""
    options = {"replica_poll_interval": 0.01} if kind == "ours" else {}
    store = FinalStateTaskStore(InMemoryTaskStore())
    a = make_server(kind, ScriptedExecutor(), store=store, **options)
    b = make_server(kind, ScriptedExecutor(), store=store, **options)
    await start(a)
    task_id = a.executor.task_id or ""
    subscriber = Stream(b.calls.subscribe(task_id, "alice"))
    await subscriber.until(lambda: subscriber.last == "WORKING")
    if end == "canceled":
        answer = await within(cancel(a, task_id))
        assert kind == "stock" or answer == "CANCELED"  # Stock answers WORKING up to 1.1.3.
    else:
        a.executor.step.open()
        await within(a.executor.completed.wait())
    if kind == "stock":
        await wait_all_tasks_blocked()  # Nothing of B's is waiting for a timer: it never ends.
        assert not subscriber.task.done() and await _sdk.has_run(b.handler, task_id)
        subscriber.task.cancel()
        return
    assert await subscriber.ended() and subscriber.last == end.upper(), (subscriber.events, subscriber.error)
    assert not await _sdk.has_run(b.handler, task_id)


@pytest.mark.asyncio
async def test_a_cancel_noticed_while_a_parked_task_resumes_reaches_the_resumed_run() -> None:
    """Nothing polls (as while notices are heard). A notice makes A look at its parked task;
    a follow-up resumes it while the look reads; B records CANCELED before the read returns.
    What the look found reaches the resumed run: its stream ends CANCELED, cancel() is called."""
    from .test_lifecycle import HeldStore

    store = HeldStore(FinalStateTaskStore(InMemoryTaskStore()))
    a = make_server("ours", ScriptedExecutor(park=True), store=store, replica_poll_interval=3600)
    b = make_server("ours", ScriptedExecutor(), store=store, replica_poll_interval=3600)
    await start(a)
    task_id = a.executor.task_id or ""
    held = store.hold_next_read()
    a.handler._remote.noticed(task_id)  # As a notice would.
    await within(held.reached.wait())  # The look reads the store ...
    resumed = Stream(a.calls.send_stream(SendMessageRequest(message=message("more", task_id)), "alice"))
    await within(a.executor.step.reached.wait())  # ... while a follow-up resumes the task here,
    assert await within(cancel(b, task_id)) == "CANCELED"  # ... and B cancels it.
    held.open()
    assert await resumed.ended() and resumed.last == "CANCELED"
    assert a.executor.cancel_called.is_set()


@pytest.mark.asyncio
async def test_a_completion_the_store_refused_ends_the_streams_on_what_it_holds() -> None:
    """A's run publishes COMPLETED after its look read WORKING; B's CANCELED is stored before
    A's COMPLETED is saved, which the store refuses. A's sender and subscriber then end on
    CANCELED, as the store and B's answer say, not on the COMPLETED A's run published."""
    store = CompletionHeld(FinalStateTaskStore(InMemoryTaskStore()))
    a = make_server("ours", ScriptedExecutor(), store=store, replica_poll_interval=3600)
    b = make_server("ours", ScriptedExecutor(), store=store, replica_poll_interval=3600)
    sent = await start(a)
    task_id = a.executor.task_id or ""
    subscriber = Stream(a.calls.subscribe(task_id, "alice"))
    await subscriber.until(lambda: bool(subscriber.events))
    a.executor.step.open()  # A completes: its look reads WORKING, its COMPLETED waits to be saved.
    await within(store.gate.reached.wait())
    assert await within(cancel(b, task_id)) == "CANCELED"
    store.gate.open()
    assert await sent.ended() and sent.last == "CANCELED"
    assert await subscriber.ended() and subscriber.last == "CANCELED"
    assert await stored(a, task_id) == "CANCELED"


PUSH_URL = "http://push.invalid/ends"
ENDS = ("COMPLETED", "FAILED", "CANCELED", "REJECTED")


def ends_pushed(server: Server) -> list[str]:
    return [state for state in server.push.received.get(PUSH_URL, []) if state in ENDS]


async def shared_store(where: str, tmp_path: Path, stack: contextlib.AsyncExitStack) -> Any:
    """A fresh task store on ``where``, one for each replica built on it (the database's own)."""
    if where == "memory":
        shared = FinalStateTaskStore(InMemoryTaskStore())
        return lambda: shared
    database = await stack.enter_async_context(open_database(where, tmp_path))
    await DatabaseTaskStore(database.engine()).initialize()
    return lambda: FinalStateTaskStore(DatabaseTaskStore(database.engine()))


@pytest.mark.parametrize("where", ["memory", "sqlite", "postgresql", "mysql"])
@pytest.mark.parametrize("kind", ["stock", "ours"])
@pytest.mark.asyncio
async def test_a_push_announces_the_stored_end_not_a_refused_one(
    kind: str, where: str, tmp_path: Path
) -> None:
    """Another replica stored FAILED while A's run was completing (its COMPLETED held before its
    save); the store refuses A's COMPLETED. Ours pushes the end the store holds, FAILED, once.
    Stock pushes the COMPLETED the store refused: the webhook hears an end the task never had."""
    async with contextlib.AsyncExitStack() as stack:
        made = await shared_store(where, tmp_path, stack)
        store = CompletionHeld(made())
        options = {"replica_poll_interval": 3600} if kind == "ours" else {}
        a = make_server(kind, ScriptedExecutor(), store=store, **options)
        sent = await start(a, push_url=PUSH_URL)
        task_id = a.executor.task_id or ""
        a.executor.step.open()  # A completes; its COMPLETED waits to be saved.
        await within(store.gate.reached.wait())
        other = made()  # Another replica's view of the store ends the task FAILED.
        failed = Task()
        failed.CopyFrom(await other.get(task_id, caller()))
        failed.status.state = TaskState.TASK_STATE_FAILED
        await other.wrapped.save(failed, caller())
        store.gate.open()
        await within(sent.ended())
        expected = "COMPLETED" if kind == "stock" else "FAILED"
        await a.push.posted(PUSH_URL, expected)
        if kind == "ours":
            await within(a.handler.aclose())  # Every push queued is sent.
        assert ends_pushed(a) == [expected]
        assert await stored(a, task_id) == "FAILED"


@pytest.mark.parametrize("where", ["memory", "sqlite"])
@pytest.mark.asyncio
async def test_a_push_of_a_completion_refused_over_a_remote_cancel_is_the_cancel(
    where: str, tmp_path: Path
) -> None:
    """B cancels (stores CANCELED) while A's COMPLETED waits to be saved; the store refuses it.
    A's webhook hears one end, CANCELED, as the store and B's answer say. (Stock's cancel of a
    task running on another replica: test_a_task_parked_here_and_canceled_elsewhere_ends_canceled_here.)"""
    async with contextlib.AsyncExitStack() as stack:
        made = await shared_store(where, tmp_path, stack)
        store = CompletionHeld(made())
        a = make_server("ours", ScriptedExecutor(), store=store, replica_poll_interval=3600)
        b = make_server("ours", ScriptedExecutor(), store=made(), replica_poll_interval=3600)
        sent = await start(a, push_url=PUSH_URL)
        task_id = a.executor.task_id or ""
        a.executor.step.open()
        await within(store.gate.reached.wait())
        assert await within(cancel(b, task_id)) == "CANCELED"
        store.gate.open()
        assert await within(sent.ended()) and sent.last == "CANCELED"
        await a.push.posted(PUSH_URL, "CANCELED")
        for server in (a, b):
            await within(server.handler.aclose())
        assert ends_pushed(a) == ["CANCELED"]
