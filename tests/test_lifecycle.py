"""A cancel's lifecycle under adversity: slow and failing stores, callers that leave or join,
cleanup in progress, shielded sections, strangers, bad options and bad requests."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import time
import weakref

import pytest
import wrapt
from a2a.server.request_handlers import DefaultRequestHandlerV2
from a2a.server.tasks import InMemoryTaskStore
from a2a.types import (
    AgentCapabilities,
    AgentCard,
    CancelTaskRequest,
    SendMessageRequest,
    SubscribeToTaskRequest,
    Task,
    TaskState,
)
from a2a.utils.errors import InvalidParamsError, TaskNotFoundError, UnsupportedOperationError

from a2a_cancelfix import (
    CancellableExecutor,
    DefaultRequestHandler,
    FinalStateTaskStore,
    _sdk,
    cancellable,
    on_cancel,
)
from a2a_cancelfix._cancel.cancellation import Cancellation
from a2a_cancelfix._cancel.settings import Settings, Timing
from a2a_cancelfix.testing import (
    Gate,
    ScriptedExecutor,
    Stream,
    caller,
    cancel,
    make_server,
    message,
    start,
    state_of,
    stored,
    wait_all_tasks_blocked,
    within,
)
from a2a_cancelfix.testing.servers import GRACE
from a2a_cancelfix.testing.waits import eventually

from .expected import COLUMNS, column

SLACK = 1.5


class HeldStore(wrapt.ObjectProxy):  # type: ignore[misc]
    """A task store whose next read can be held at a gate, or made to fail."""

    def __init__(self, store) -> None:
        super().__init__(store)
        self._self_hold: Gate | None = None
        self._self_fail = False

    def hold_next_read(self) -> Gate:
        self._self_hold = Gate()
        return self._self_hold

    def fail_reads(self, fail: bool = True) -> None:
        self._self_fail = fail

    async def get(self, *args, **kwargs):
        if self._self_fail:
            raise ConnectionError("the database went away")
        gate, self._self_hold = self._self_hold, None
        if gate is not None:
            await gate()
        return await self.__wrapped__.get(*args, **kwargs)


def lifecycle_of(server):
    return server.handler.agent_executor.cancel_lifecycle


# Options and requests


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (math.nan, ValueError),
        (math.inf, ValueError),
        (0, ValueError),
        (-1.0, ValueError),
        ("5", TypeError),
        (True, TypeError),
    ],
    ids=["nan", "inf", "zero", "negative", "string", "bool"],
)
def test_seconds_options_refuse_anything_but_a_finite_positive_number(value, error) -> None:
    """NaN, infinity, zero and non-numbers are refused with a clear error at construction."""
    builds = {
        "cancel_grace_period": lambda: make_server("ours", ScriptedExecutor(), cancel_grace_period=value),
        "replica_poll_interval": lambda: make_server("ours", ScriptedExecutor(), replica_poll_interval=value),
        "grace_period": lambda: CancellableExecutor(ScriptedExecutor(), grace_period=value),
    }
    for name, build in builds.items():
        with pytest.raises(error, match=name):
            build()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["stock", "ours"])
async def test_requests_are_validated_as_the_sdk_does(kind: str) -> None:
    """A cancel or a subscribe with an empty id is invalid params, as the stock handler says."""
    server = make_server(kind, ScriptedExecutor())
    with pytest.raises(InvalidParamsError):
        await within(server.handler.on_cancel_task(CancelTaskRequest(id=""), caller()))
    with pytest.raises(InvalidParamsError):
        await within(_first(server.handler.on_subscribe_to_task(SubscribeToTaskRequest(id=""), caller())))


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["stock", "ours"])
async def test_messages_are_validated_as_the_sdk_does(kind: str) -> None:
    """A message without one is invalid params, sent or streamed; a stream the card refuses is
    unsupported, with the SDK's message. Ours checks them itself, once: the SDK's check is left out."""
    server = make_server(kind, ScriptedExecutor())
    with pytest.raises(InvalidParamsError):
        await within(server.handler.on_message_send(SendMessageRequest(), caller()))
    with pytest.raises(InvalidParamsError):
        await within(_first(server.handler.on_message_send_stream(SendMessageRequest(), caller())))
    kind_of = DefaultRequestHandler if kind == "ours" else DefaultRequestHandlerV2
    card = AgentCard(name="quiet", capabilities=AgentCapabilities(streaming=False))
    handler = kind_of(agent_executor=ScriptedExecutor(), task_store=InMemoryTaskStore(), agent_card=card)
    with pytest.raises(UnsupportedOperationError, match="Streaming is not supported by the agent"):
        await within(_first(handler.on_message_send_stream(SendMessageRequest(message=message()), caller())))
    for name in ("on_message_send", "on_message_send_stream"):
        method = vars(DefaultRequestHandlerV2)[name]
        method = getattr(method, "sdk", method)  # Once patched, the SDK's own is in patch()'s dispatch.
        untraced = _sdk.untraced(method)
        assert _sdk.unchecked(untraced) is untraced.__wrapped__


async def _first(events):
    async for event in events:
        return event


# Joining, leaving, strangers


@pytest.mark.asyncio
async def test_a_cancel_joined_during_a_slow_read_shares_the_outcome() -> None:
    """A second cancel whose store read is slow still joins the first: both CANCELED."""
    store = HeldStore(InMemoryTaskStore())
    server = make_server("ours", ScriptedExecutor(cancel="gate"), store=store)
    await start(server)
    task_id = server.executor.task_id
    first = asyncio.ensure_future(cancel(server, task_id))
    await within(server.executor.cancel_gate.reached.wait())
    slow_read = store.hold_next_read()
    second = asyncio.ensure_future(cancel(server, task_id))
    await within(slow_read.reached.wait())
    server.executor.cancel_gate.open()
    assert await within(first, GRACE + SLACK) == "CANCELED"
    slow_read.open()  # The first cancel has ended: only a join made before the read holds.
    assert await within(second, GRACE + SLACK) == "CANCELED"


@pytest.mark.asyncio
async def test_the_deadline_is_fixed_by_the_first_request() -> None:
    """When the caller driving a cancel leaves, the cancel goes on to the same deadline."""
    server = make_server("ours", ScriptedExecutor(cancel="hang"))
    await start(server)
    task_id = server.executor.task_id
    loop = asyncio.get_running_loop()
    driver = asyncio.ensure_future(cancel(server, task_id))
    await within(server.executor.cancel_called.wait())
    cancellation = lifecycle_of(server).cancellations[task_id]
    deadline = cancellation.deadline
    joined = asyncio.ensure_future(cancel(server, task_id))
    await wait_all_tasks_blocked()
    driver.cancel()  # Its client went away.
    assert await within(joined, GRACE + SLACK) == "CANCELED"
    assert cancellation.deadline == deadline
    assert loop.time() < deadline + Timing().margin


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["ours", "wrapped"])
async def test_a_cancel_that_answered_is_not_kept(kind: str) -> None:
    """Once answered, nothing holds a cancel: not the deadline that would have cut its
    ``cancel()`` off (a burst of thousands would be kept for the grace period)."""
    server = make_server(kind, ScriptedExecutor(cancel="gate"))
    await start(server)
    task_id = server.executor.task_id
    call = asyncio.ensure_future(cancel(server, task_id))
    await within(server.executor.cancel_called.wait())
    held = weakref.ref(lifecycle_of(server).cancellations[task_id])
    server.executor.cancel_gate.open()
    assert await within(call) == "CANCELED"
    await eventually(lambda: task_id not in lifecycle_of(server).cancellations)
    gc.collect()
    assert held() is None


@pytest.mark.asyncio
async def test_the_sdks_margin_is_fixed_by_the_first_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cancel resumed after its first caller left waits for the SDK until the same time:
    the margin counts once, from when the work first stopped, not again from each wait."""
    clock = [100.0]
    monkeypatch.setattr(asyncio.get_running_loop(), "time", lambda: clock[0])
    timeline = Settings(cancel_grace_period=1.0).timeline()  # Deadline 101.
    cancellation = Cancellation.requested("task", ScriptedExecutor(), None, timeline)
    asked: list[float] = []

    async def wait(deadline: float) -> bool:
        asked.append(deadline)
        return True

    clock[0] = 102.0  # The work stopped past the deadline: the margin counts from now.
    assert await cancellation.settled(wait) is True
    clock[0] = 102.5  # The first caller left; the resumed drive waits again.
    assert await cancellation.settled(wait) is True
    assert asked == [102.0 + Timing().margin] * 2


@pytest.mark.asyncio
async def test_a_stranger_learns_nothing_of_a_task_being_canceled() -> None:
    """While the owner's cancel runs, another user's message to the task is TaskNotFound."""
    server = make_server("ours", ScriptedExecutor(park=True, cancel="gate"))
    await start(server)
    task_id = server.executor.task_id
    cancelling = asyncio.ensure_future(cancel(server, task_id))
    await within(server.executor.cancel_gate.reached.wait())
    request = SendMessageRequest(message=message("more", task_id=task_id))
    with pytest.raises(TaskNotFoundError):
        await within(server.handler.on_message_send(request, caller("mallory")))
    server.executor.cancel_gate.open()
    assert await within(cancelling, GRACE + SLACK) == "CANCELED"


# The order of effects


class ReportAgent(ScriptedExecutor):
    """The README's shape: a claim held by ``async with``, released with an await on exit, and
    a step whose in-flight call an ``on_cancel`` callback aborts."""

    def __init__(self) -> None:
        super().__init__(cancel="gate")
        self.release = Gate()
        self.log: list[str] = []

    @contextlib.asynccontextmanager
    async def claim(self):
        self.log.append("claimed")
        try:
            yield
        finally:
            try:
                await self.release()  # The claim's release: I/O.
            except asyncio.CancelledError:
                self.log.append("release interrupted")
                raise
            self.log.append("released")

    async def _work_step(self) -> None:
        async with self.claim():
            await self.orchestrate()

    async def cancel(self, context, event_queue) -> None:
        self.cancel_called.set()
        await self.cancel_gate()  # Its own I/O; it leaves CANCELED to the framework.
        self.cancel_returned.set()

    @cancellable
    async def orchestrate(self) -> None:
        call = asyncio.get_running_loop().create_future()
        unregister = on_cancel(call.cancel)
        try:
            self.step.reached.set()
            await call
        finally:
            unregister()


class WokenByItsCancel(ScriptedExecutor):
    """Plain asyncio, no checkpoint: its model call returns while ``cancel()`` runs (the run's
    await completes as the cancel comes), and it goes on to the next call."""

    def __init__(self) -> None:
        super().__init__()
        self.next_call = Gate()
        self.log: list[str] = []

    async def _work_step(self) -> None:
        try:
            await self.step()
        except asyncio.CancelledError:
            self.log.append("step interrupted")
            raise
        self.log.append("step returned")
        try:
            await self.next_call()
        except asyncio.CancelledError:
            self.log.append("next call interrupted")
            raise
        self.log.append("next call returned")

    async def cancel(self, context, event_queue) -> None:
        self.step.open()
        await super().cancel(context, event_queue)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["stock", "ours"])
async def test_a_run_woken_as_the_cancel_comes_stops_at_its_next_await(kind: str) -> None:
    """A plain run whose await returns as the cancel comes is interrupted at its next await, as
    the SDK's own cancel does (1.1.4+; before, it kills the run before ``cancel()``), not left
    running until the grace period ends."""
    agent = WokenByItsCancel()
    server = make_server(kind, agent, cancel_grace_period=30.0)
    await start(server)
    cancelling = asyncio.ensure_future(cancel(server, agent.task_id))
    await within(agent.stopped.wait())
    assert "next call returned" not in agent.log
    if kind == "stock":
        assert agent.log in (["step interrupted"], ["step returned", "next call interrupted"])
        cancelling.cancel()
        return
    assert agent.log == ["step returned", "next call interrupted"]
    assert await within(cancelling) == "CANCELED"


@pytest.mark.asyncio
async def test_cleanup_under_way_is_not_interrupted() -> None:
    """The callback aborts the call, the claim's release begins; cancel() returning later does
    not interrupt that release, and the answer comes once the claim is released."""
    server = make_server("ours", ReportAgent())
    stream = await start(server)
    agent = server.executor
    task_id = agent.task_id
    cancelling = asyncio.ensure_future(cancel(server, task_id))
    await within(agent.release.reached.wait())  # Unwinding: the release is in progress.
    await within(agent.cancel_gate.reached.wait())
    agent.cancel_gate.open()  # cancel() returns while the release is still in progress.
    await wait_all_tasks_blocked()
    assert agent.log == ["claimed"]
    assert not cancelling.done() and stream.last == "WORKING"
    agent.release.open()
    assert await within(cancelling, GRACE + SLACK) == "CANCELED"
    assert agent.log == ["claimed", "released"]
    assert await stream.ended() and stream.last == "CANCELED"


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["stock", "ours"])
async def test_nobody_sees_canceled_while_a_shielded_section_writes(kind: str) -> None:
    """Stream and GetTask show CANCELED only once the shielded section has ended (ours);
    the stock handler records CANCELED while the run is killed mid-write."""
    from .test_checkpoints import WritingExecutor

    server = make_server(kind, WritingExecutor())
    stream = await start(server)
    executor = server.executor
    await within(executor.write.reached.wait())
    cancelling = asyncio.ensure_future(cancel(server, executor.task_id))
    await within(executor.cancel_called.wait())
    await wait_all_tasks_blocked()
    if kind == "stock":
        assert executor.log[-1] == "released"  # Killed mid-write; the claim went with it.
        executor.write.open()
        await within(cancelling, GRACE + SLACK)
        return
    assert executor.log[-1] == "write started"
    assert await stored(server, executor.task_id) == "WORKING"
    assert stream.last == "WORKING" and not stream.task.done()
    executor.write.open()
    assert await within(cancelling, GRACE + SLACK) == "CANCELED"
    assert executor.log[-2:] == ["write finished", "released"]
    assert await stream.ended() and stream.last == "CANCELED"


# Stores that fail or race


@pytest.mark.asyncio
async def test_a_store_failing_mid_cancel_is_an_a2a_error_and_nothing_is_kept() -> None:
    """A transient store error reaches every caller as InternalError; no entry stays behind."""
    store = HeldStore(InMemoryTaskStore())
    server = make_server("ours", ScriptedExecutor(cancel="gate"), store=store)
    await start(server)
    task_id = server.executor.task_id
    calls = [asyncio.ensure_future(cancel(server, task_id)) for _ in range(2)]
    await within(server.executor.cancel_gate.reached.wait())
    await wait_all_tasks_blocked()
    store.fail_reads()
    server.executor.cancel_gate.open()
    assert await within(asyncio.gather(*calls), GRACE + SLACK) == ["Internal", "Internal"]
    store.fail_reads(False)
    lifecycle = lifecycle_of(server)
    assert lifecycle.cancellations == {}
    await within(_run_gone(server, task_id), GRACE + SLACK)
    assert lifecycle.works == {}


async def _run_gone(server, task_id: str) -> None:
    async def gone() -> bool:
        return not await _sdk.has_run(server.handler, task_id)

    await eventually(gone)


class CompletionLandsFirst(wrapt.ObjectProxy):  # type: ignore[misc]
    """A store where the run's COMPLETED lands just before a CANCELED write reaches it."""

    async def save(self, task: Task, *args, **kwargs) -> None:
        if task.status.state == _sdk.CANCELED:
            completed = Task()
            completed.CopyFrom(task)
            completed.status.state = TaskState.TASK_STATE_COMPLETED
            await self.__wrapped__.save(completed, *args, **kwargs)
        await self.__wrapped__.save(task, *args, **kwargs)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["stock", "ours"])
async def test_a_cancel_with_no_run_here_answers_what_the_store_holds(kind: str) -> None:
    """On a replica with no run, a COMPLETED landing between read and write wins, and the
    answer says so (ours); the stock handler answers CANCELED over the stored COMPLETED (1.2+),
    or never (up to 1.1.5)."""
    running = make_server("ours", ScriptedExecutor(park=True), store=FinalStateTaskStore(InMemoryTaskStore()))
    await start(running)
    task_id = running.executor.task_id
    replica = make_server(kind, ScriptedExecutor(), store=CompletionLandsFirst(running.store))
    if kind == "stock" and not _sdk.SDK_CANCELS_WHERE_NOT_LIVE:  # Up to 1.1.5 it never answers.
        hanging = asyncio.ensure_future(cancel(replica, task_id))
        done, _ = await asyncio.wait({hanging}, timeout=GRACE + SLACK)
        hanging.cancel()
        assert not done
        return
    answer = await within(cancel(replica, task_id), GRACE + SLACK)
    assert await stored(replica, task_id) == "COMPLETED"
    if kind == "ours":
        assert answer == "TaskNotCancelable"
    else:
        assert answer == "CANCELED"


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["stock", "ours"])
async def test_a_follow_up_racing_a_cancel_sees_canceled(kind: str) -> None:
    """A follow-up message to a parked task, then at once a cancel whose cancel() awaits I/O:
    the follow-up's blocking sender gets CANCELED and its stream ends on CANCELED (ours);
    the stock handler up to a2a-sdk 1.1.3 answers all three with a task that is not canceled."""
    server = make_server(kind, ScriptedExecutor(park=True, cancel="gate"))
    parked = await start(server)
    assert await parked.ended() and parked.last == "INPUT_REQUIRED"
    task_id, context_id = server.executor.task_id, parked.events[0].context_id

    def follow_up() -> SendMessageRequest:
        more = message("more", task_id=task_id)
        more.context_id = context_id
        return SendMessageRequest(message=more)

    async def send() -> str | None:
        # The state as answered: the SDK may hand out an object that later changes in place.
        return state_of(await server.handler.on_message_send(follow_up(), caller()))

    stream = Stream(server.handler.on_message_send_stream(follow_up(), caller()))
    sender = asyncio.ensure_future(send())
    cancelling = asyncio.ensure_future(cancel(server, task_id))
    await within(server.executor.cancel_gate.reached.wait())
    await wait_all_tasks_blocked()
    server.executor.cancel_gate.open()  # Its I/O is done.
    answer = await within(cancelling, GRACE + SLACK)
    assert await stream.ended()
    outcomes = (answer, await within(sender), stream.last)
    if kind == "ours" or column() >= COLUMNS.index("1.1.5"):  # 1.1.4+ awaits cancel() first.
        assert outcomes == ("CANCELED", "CANCELED", "CANCELED")
    else:
        assert "CANCELED" not in outcomes


class SlowStore(wrapt.ObjectProxy):  # type: ignore[misc]
    """A task store whose every save takes a few milliseconds of I/O, as a remote database's."""

    async def save(self, *args, **kwargs) -> None:
        await asyncio.to_thread(time.sleep, 0.005)
        await self.__wrapped__.save(*args, **kwargs)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["ours", "wrapped"])
async def test_a_backlog_of_tokens_neither_delays_nor_truncates_the_cancel(kind: str, caplog) -> None:
    """Hundreds of streamed tokens queued ahead of a slow store: the cancel answers in time,
    every stream ends on CANCELED, and what was dropped is counted in the log; under our
    handler and under the SDK's around the wrapper alike."""
    server = make_server(kind, ScriptedExecutor(burst=400), store=SlowStore(InMemoryTaskStore()))
    stream = await start(server)
    task_id = server.executor.task_id
    subscriber = Stream(server.handler.on_subscribe_to_task(SubscribeToTaskRequest(id=task_id), caller()))
    with caplog.at_level(logging.INFO, logger="a2a_cancelfix"):
        assert await within(cancel(server, task_id), GRACE + SLACK) == "CANCELED"
    assert await stream.ended() and stream.last == "CANCELED"
    assert await subscriber.ended() and subscriber.last == "CANCELED"
    assert await stored(server, task_id) == "CANCELED"
    dropped = [r.getMessage() for r in caplog.records if "dropped=" in r.getMessage()]
    assert len(dropped) == 1 and "TaskArtifactUpdateEvent=" in dropped[0]
