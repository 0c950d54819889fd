"""``cancel_unwatched_after``: a task nobody watches any more is cancelled, through the same
lifecycle as a client's cancel; one somebody still watches, anywhere, is not.

An agent calls a fake model in a loop until it is cancelled; every call is counted, so work
that went on after the cancel shows as calls. "Not cancelled" is checked for three intervals.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from a2a.helpers import new_task
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events.event_queue import EventQueue
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types import (
    DeleteTaskPushNotificationConfigRequest,
    GetTaskRequest,
    SendMessageConfiguration,
    SendMessageRequest,
    TaskNotFoundError,
    TaskState,
)

from a2a_cancelfix import FinalStateTaskStore, _aio, _sdk, _unwatched, cancellable, on_cancel
from a2a_cancelfix._cancel.settings import Settings
from a2a_cancelfix._unwatched import Watchers
from a2a_cancelfix.notices import CancelNotices
from a2a_cancelfix.testing import Gate, Stream, caller, make_server, message, stored, within
from a2a_cancelfix.testing.servers import Server
from a2a_cancelfix.testing.waits import eventually

from .support import logged, set_within
from .test_notices import Replicas, replicas  # noqa: F401 - the fixture

AFTER = 0.2
# Long enough that a clock that should not run out surely would have: three intervals.
QUIET = 3 * AFTER


class ModelAgent(AgentExecutor):
    """Calls a fake model (a ``@cancellable`` step of 10 ms) until cancelled or told to finish."""

    def __init__(self) -> None:
        self.calls = 0
        self.calls_at_cancel: int | None = None
        self.cancelled_at = 0.0  # The loop's time as the cancel began (its callbacks fire first).
        self.busy = asyncio.Event()  # Three calls made.
        self.finish = asyncio.Event()
        self.stopped = asyncio.Event()
        self.cancel_called = asyncio.Event()
        self.task_id = ""
        self.step = Gate()  # As a ScriptedExecutor's: the replicas fixture opens it as it ends.

    @cancellable
    async def model(self) -> None:
        self.calls += 1
        if self.calls >= 3:
            self.busy.set()
        await asyncio.sleep(0.01)  # The model's latency (work, not synchronisation).

    def cancelled(self) -> None:
        self.calls_at_cancel = self.calls
        self.cancelled_at = asyncio.get_running_loop().time()

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        self.task_id = context.task_id or ""
        updater = TaskUpdater(event_queue, self.task_id, context.context_id or "")
        unregister = on_cancel(self.cancelled)
        try:
            if context.current_task is None:
                await event_queue.enqueue_event(
                    new_task(self.task_id, context.context_id or "", TaskState.TASK_STATE_SUBMITTED)
                )
            await updater.start_work()
            while not self.finish.is_set():
                await self.model()
            await updater.complete()
        finally:
            unregister()
            self.stopped.set()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        self.cancel_called.set()


def server(**options: Any) -> Server:
    return make_server("ours", ModelAgent(), **options)  # type: ignore[arg-type]


def agent(server: Server) -> ModelAgent:
    return server.executor  # type: ignore[return-value]


async def streamed(server: Server) -> Stream:
    """Send a streaming message; return its stream once the model is being called."""
    stream = Stream(server.handler.on_message_send_stream(SendMessageRequest(message=message()), caller()))
    await within(agent(server).busy.wait())
    return stream


async def leave(stream: Stream) -> float:
    """The client goes away: its stream is cut. The loop's time as it began to leave (no clock
    can start before)."""
    left_at = asyncio.get_running_loop().time()
    stream.task.cancel()
    await asyncio.wait({stream.task}, timeout=2.0)
    return left_at


async def assert_canceled_unwatched(server: Server, left_at: float, after: float = AFTER) -> None:
    """CANCELED, no sooner than the interval after the client left, the work stopped at once."""
    executor = agent(server)
    await within(executor.cancel_called.wait(), 2 * after + 2.0)
    assert executor.cancelled_at - left_at >= after
    await within(executor.stopped.wait())
    assert executor.calls == executor.calls_at_cancel  # Not one model call after the cancel.

    async def recorded() -> bool:
        return await stored(server, executor.task_id) == "CANCELED"

    await eventually(recorded)
    task = await server.handler.on_get_task(GetTaskRequest(id=executor.task_id), caller())
    assert task is not None and task.status.state == TaskState.TASK_STATE_CANCELED
    assert "nobody watched the task" in task.status.message.parts[0].text


async def assert_still_working(server: Server, quiet: float = QUIET) -> None:
    executor = agent(server)
    assert not await set_within(executor.cancel_called, quiet)
    assert await stored(server, executor.task_id) == "WORKING"


@pytest.mark.asyncio
async def test_a_task_nobody_comes_back_to_is_cancelled(caplog: pytest.LogCaptureFixture) -> None:
    """The stream closes, nobody comes back: CANCELED after the interval, through the
    lifecycle (callbacks, cancel(), the work stopped), logged as path=unwatched."""
    a = server(cancel_unwatched_after=AFTER)
    stream = await streamed(a)
    with caplog.at_level(logging.INFO, "a2a_cancelfix"), logged("path=unwatched") as said:
        left_at = await leave(stream)
        await assert_canceled_unwatched(a, left_at)
        await within(said.wait())
    assert "outcome=CANCELED" in caplog.text


@pytest.mark.asyncio
async def test_option_off_leaves_the_task_running() -> None:
    """By default (as stock), a task whose client left runs on to its end."""
    a = server()
    left_at = await leave(await streamed(a))
    assert left_at
    await assert_still_working(a)
    agent(a).finish.set()
    await within(agent(a).stopped.wait())

    async def completed() -> bool:
        return await stored(a, agent(a).task_id) == "COMPLETED"

    await eventually(completed)  # The SDK's consumer saves it after the run (test_patch.py says why).


@pytest.mark.asyncio
async def test_a_subscriber_in_time_stops_the_clock() -> None:
    """A SubscribeToTask before the interval runs out: not cancelled while it stays; once it
    leaves too, the clock starts again from then."""
    a = server(cancel_unwatched_after=AFTER)
    await leave(await streamed(a))
    subscriber = Stream(a.calls.subscribe(agent(a).task_id, "alice"))
    await assert_still_working(a)
    left_at = await leave(subscriber)
    await assert_canceled_unwatched(a, left_at)


@pytest.mark.asyncio
async def test_get_task_starts_the_clock_again() -> None:
    """A client that polls GetTask watches the task: each read starts the clock again."""
    a = server(cancel_unwatched_after=AFTER)
    await leave(await streamed(a))
    executor = agent(a)
    for _ in range(int(QUIET / (AFTER / 2))):
        assert not await set_within(executor.cancel_called, AFTER / 2)
        left_at = asyncio.get_running_loop().time()  # The clock starts again during this read.
        assert await stored(a, executor.task_id) == "WORKING"
    await assert_canceled_unwatched(a, left_at)


async def streamed_with_push(server: Server) -> Stream:
    """`streamed`, with a push config ("a") set by the message."""
    configuration = SendMessageConfiguration()
    configuration.task_push_notification_config.url = "http://push.invalid/a"
    configuration.task_push_notification_config.id = "a"
    request = SendMessageRequest(message=message(), configuration=configuration)
    stream = Stream(server.handler.on_message_send_stream(request, caller()))
    await within(agent(server).busy.wait())
    return stream


@pytest.mark.asyncio
async def test_a_push_config_watches_the_task() -> None:
    """A task with a push config is watched by its webhook: not cancelled."""
    a = server(cancel_unwatched_after=AFTER)
    await leave(await streamed_with_push(a))
    await assert_still_working(a)


@pytest.mark.asyncio
async def test_deleting_the_last_push_config_starts_the_clock() -> None:
    """The stream closed, the push config kept the task for three intervals; its owner deletes
    the config: the task is cancelled, no sooner than the interval after the deletion (the
    clock the stream's close started, which kept running out and starting again while the
    config was there, is not the one that counts)."""
    a = server(cancel_unwatched_after=AFTER)
    await leave(await streamed_with_push(a))
    # Not read (a GetTask starts the clock); deleted half-way through one of its intervals.
    assert not await set_within(agent(a).cancel_called, QUIET + AFTER / 2)
    deleted_at = asyncio.get_running_loop().time()
    request = DeleteTaskPushNotificationConfigRequest(task_id=agent(a).task_id, id="a")
    await within(a.handler.on_delete_task_push_notification_config(request, caller()))
    await assert_canceled_unwatched(a, deleted_at)


@pytest.mark.asyncio
async def test_a_non_blocking_sender_leaves_at_once() -> None:
    """A non-blocking SendMessage is answered at once: nobody watches from then on."""
    a = server(cancel_unwatched_after=AFTER)
    request = SendMessageRequest(message=message())
    request.configuration.return_immediately = True
    left_at = asyncio.get_running_loop().time()
    await within(a.handler.on_message_send(request, caller()))
    await within(agent(a).busy.wait())
    await assert_canceled_unwatched(a, left_at)


async def strangers_messages(server: Server, executor: ModelAgent) -> float:
    """Another user sends messages naming ``executor``'s task, a blocking one and a streamed
    one in turn, each an eighth of the interval after the last, until the task's cancel
    begins; each is refused as naming an unknown task. The loop's time of the last one."""

    async def streamed(request: SendMessageRequest) -> None:
        async for _ in server.handler.on_message_send_stream(request, caller("mallory")):
            pass

    sent, last = 0, 0.0
    while not await set_within(executor.cancel_called, AFTER / 8):
        request = SendMessageRequest(message=message("mine now", executor.task_id))
        last = asyncio.get_running_loop().time()
        with pytest.raises(TaskNotFoundError):
            if sent % 2:
                await within(server.handler.on_message_send(request, caller("mallory")))
            else:
                await within(streamed(request))
        sent += 1
    return last


@pytest.mark.asyncio
@pytest.mark.parametrize("replica", ["same", "other"])
async def test_a_strangers_messages_do_not_keep_the_task(replica: str) -> None:
    """Alice's stream closes; Mallory keeps sending messages naming her task, to the replica
    that runs it or to another one (sharing its InMemoryTaskStore). Each is refused as naming
    an unknown task, and counts as no observer: the task is cancelled on time."""
    store = InMemoryTaskStore()
    a = server(cancel_unwatched_after=AFTER, store=FinalStateTaskStore(store))
    b = server(cancel_unwatched_after=AFTER, store=FinalStateTaskStore(store))
    left_at = await leave(await streamed(a))
    last = await within(strangers_messages(a if replica == "same" else b, agent(a)), 2 * AFTER + 2.0)
    assert last - left_at >= AFTER / 2  # Mallory sent all along the interval.
    await assert_canceled_unwatched(a, left_at)


@pytest.mark.asyncio
@pytest.mark.parametrize("parked_too", [False, True])
async def test_a_parked_task_is_left_alone_unless_asked(parked_too: bool) -> None:
    """A parked task runs nothing: kept by default; ``cancel_unwatched_parked`` cancels it."""
    from a2a_cancelfix.testing import ScriptedExecutor, start

    a = make_server(
        "ours", ScriptedExecutor(park=True), cancel_unwatched_after=AFTER, cancel_unwatched_parked=parked_too
    )
    stream = await start(a)
    assert await within(stream.ended())  # The sender's stream ends as the task parks.
    called = await set_within(a.executor.cancel_called, QUIET)
    assert called is parked_too
    expected = "CANCELED" if parked_too else "INPUT_REQUIRED"

    async def shown() -> bool:
        return await stored(a, a.executor.task_id or "") == expected

    await eventually(shown)


@pytest.mark.asyncio
async def test_the_observer_on_another_replica_in_process() -> None:
    """Two handlers share an InMemoryTaskStore: a subscriber on B keeps A's task; once it
    leaves, A cancels it."""
    store = InMemoryTaskStore()
    a = server(cancel_unwatched_after=AFTER, store=FinalStateTaskStore(store))
    b = make_server(
        "ours",
        ModelAgent(),
        store=FinalStateTaskStore(store),  # type: ignore[arg-type]
        cancel_unwatched_after=AFTER,
    )
    await leave(await streamed(a))
    subscriber = Stream(b.calls.subscribe(agent(a).task_id, "alice"))
    await within(subscriber.until(lambda: bool(subscriber.events)))
    await assert_still_working(a)
    left_at = await leave(subscriber)
    await assert_canceled_unwatched(a, left_at)


@pytest.mark.asyncio
async def test_the_observer_on_another_replica_with_notices(replicas: Replicas) -> None:  # noqa: F811
    """Replicas over a database with notices: B's subscriber (served from the store) is
    announced to A, which does not cancel; once it leaves, A does."""
    # A longer interval: each announcement is a database transaction or a Redis round trip,
    # on a machine that may be busy.
    after = 1.0
    a, b = replicas.pair(ModelAgent(), cancel_unwatched_after=after)  # type: ignore[arg-type]
    await leave(await streamed(a))
    await within(replicas.listening[0].heard())
    b.handler._remote.listen()  # B hears (and B announces) from its first request on.
    subscriber = Stream(b.calls.subscribe(agent(a).task_id, "alice"))
    await within(subscriber.until(lambda: bool(subscriber.events)))
    await assert_still_working(a, 3 * after)
    left_at = await leave(subscriber)
    await assert_canceled_unwatched(a, left_at, after)


@pytest.mark.asyncio
async def test_without_notices_a_shared_store_cancels_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A store shared without notices cannot tell what other replicas watch: nothing is
    cancelled as unwatched, and the handler says so once, when it is built."""
    from a2a.server.tasks import DatabaseTaskStore

    from .test_store import open_database

    async with open_database("sqlite", tmp_path) as database:
        with caplog.at_level(logging.WARNING, "a2a_cancelfix"):
            a = server(
                cancel_unwatched_after=AFTER, store=FinalStateTaskStore(DatabaseTaskStore(database.engine()))
            )
        assert "needs the store's notices" in caplog.text
        await leave(await streamed(a))
        await assert_still_working(a)
        agent(a).finish.set()

        async def completed() -> bool:
            return await stored(a, agent(a).task_id) == "COMPLETED"

        await eventually(completed)

        async def closed() -> bool:
            return not await _sdk.has_run(a.handler, agent(a).task_id)

        await eventually(closed)  # Closed before the database.
        await within(a.handler.aclose())


class InProcessNotices(CancelNotices):
    """Notices between the replicas of this process, whose hearing a test cuts and slows.

    Args:
        everyone: every replica's notices; these join them.
    """

    def __init__(self, everyone: list[InProcessNotices]) -> None:
        super().__init__()
        self.everyone = everyone
        everyone.append(self)
        self.arriving = asyncio.Event()  # Cleared, what is told here waits until it is set.
        self.arriving.set()
        self._heard: asyncio.Queue[str | BaseException] | None = None  # While listening.

    async def _send(self, notice: str) -> None:
        for notices in self.everyone:
            if notices is not self and notices._heard is not None:
                notices._heard.put_nowait(notice)

    @contextlib.asynccontextmanager
    async def listen(self) -> AsyncIterator[AsyncIterator[str | None]]:
        heard = self._heard = asyncio.Queue()
        try:
            yield self._ids(heard)
        finally:
            if self._heard is heard:
                self._heard = None

    async def _ids(self, heard: asyncio.Queue[str | BaseException]) -> AsyncIterator[str | None]:
        yield None
        while True:
            item = await heard.get()
            if isinstance(item, BaseException):
                raise item
            await self.arriving.wait()
            yield item

    def cut(self) -> None:
        """The listening connection is lost: what is told until the next one is lost too."""
        assert self._heard is not None
        self._heard.put_nowait(ConnectionError("cut"))
        self._heard = None


@pytest.mark.asyncio
async def test_a_replica_hearing_again_waits_an_interval_before_judging(tmp_path: Path) -> None:
    """Replicas A and B share a SQL store, with notices; a subscriber on B watches A's task
    all along. A stops hearing the notices for three intervals (B's announcements meanwhile are
    lost): nothing is cancelled. A hears them again, but B's announcements take half an interval
    to come: still nothing (A does not take what it missed for nobody watching). Once the
    subscriber leaves, A cancels the task, no sooner than the interval after."""
    from a2a.server.tasks import DatabaseTaskStore

    from .test_notices import HOUR, Listening
    from .test_store import open_database

    async with open_database("sqlite", tmp_path) as database:
        everyone: list[InProcessNotices] = []
        a_notices, b_notices = InProcessNotices(everyone), InProcessNotices(everyone)
        listening = Listening(a_notices)
        a, b = (
            server(
                cancel_unwatched_after=AFTER,
                replica_poll_interval=HOUR,
                store=FinalStateTaskStore(DatabaseTaskStore(database.engine()), notices=notices),
            )
            for notices in (a_notices, b_notices)
        )
        executor = agent(a)
        try:
            stream = await streamed(a)
            await within(listening.heard())
            subscriber = Stream(b.calls.subscribe(executor.task_id, "alice"))
            await within(subscriber.until(lambda: bool(subscriber.events)))
            await leave(stream)
            listening.hold()
            a_notices.cut()
            await listening.retrying()
            assert not await set_within(executor.cancel_called, QUIET)  # Deaf: nothing is judged.
            a_notices.arriving.clear()
            listening.reconnect.open()
            await within(listening.heard(2))
            assert not await set_within(executor.cancel_called, AFTER / 2)
            a_notices.arriving.set()
            assert not await set_within(executor.cancel_called, QUIET)
            left_at = await leave(subscriber)
            await assert_canceled_unwatched(a, left_at)
        finally:
            listening.reconnect.open()
            a_notices.arriving.set()
            executor.finish.set()
            await within(executor.stopped.wait())

            async def closed() -> bool:
                return not await _sdk.has_run(a.handler, executor.task_id)

            await eventually(closed)  # Closed before the database.
            for replica in (a, b):
                await within(replica.handler.aclose())


def test_the_options_are_checked() -> None:
    """Seconds as every other option; the parked option only with the interval."""
    with pytest.raises(ValueError):
        Settings(cancel_unwatched_after=0)
    with pytest.raises(TypeError):
        Settings(cancel_unwatched_after="30")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Settings(cancel_unwatched_parked=True)


class ResumedQuietly(ModelAgent):
    """Parks at once; the follow-up's run calls the model before it publishes WORKING, until
    ``publish`` opens."""

    def __init__(self) -> None:
        super().__init__()
        self.runs = 0
        self.publish = asyncio.Event()

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        self.runs += 1
        self.task_id = context.task_id or ""
        updater = TaskUpdater(event_queue, self.task_id, context.context_id or "")
        if self.runs == 1:
            await event_queue.enqueue_event(
                new_task(self.task_id, context.context_id or "", TaskState.TASK_STATE_SUBMITTED)
            )
            await updater.requires_input()
            return
        unregister = on_cancel(self.cancelled)
        try:
            while not self.publish.is_set():  # Working, though the store still says INPUT_REQUIRED.
                await self.model()
            await updater.start_work()
            while True:
                await self.model()
        finally:
            unregister()
            self.stopped.set()


@pytest.mark.asyncio
async def test_a_follow_up_run_that_publishes_late_is_still_watched_for() -> None:
    """The clock runs out while the follow-up's run works but the store still says
    INPUT_REQUIRED: the task is looked at again, and cancelled once it shows WORKING.

    The store is read directly: the owner's GetTask would start the clock again."""
    agent_ = ResumedQuietly()
    a = make_server("ours", agent_, push=False, cancel_unwatched_after=AFTER)

    async def state() -> str:
        task = await a.store.get(agent_.task_id, caller())
        return "nothing" if task is None else _sdk.state_name(task.status.state)

    first = Stream(a.handler.on_message_send_stream(SendMessageRequest(message=message()), caller()))
    assert await within(first.ended())  # Parked.
    follow_up = SendMessageRequest(message=message("more", agent_.task_id))
    follow_up.configuration.return_immediately = True
    await within(a.handler.on_message_send(follow_up, caller()))
    await within(agent_.busy.wait())
    # Three intervals with the run working and the store parked: the clock ran out meanwhile.
    assert not await set_within(agent_.cancel_called, QUIET)
    assert await state() == "INPUT_REQUIRED"
    agent_.publish.set()
    await within(agent_.cancel_called.wait(), 2 * AFTER + 2.0)
    await within(agent_.stopped.wait())

    async def recorded() -> bool:
        return await state() == "CANCELED"

    await eventually(recorded)


class Untouchable:
    """A lifecycle none of whose parts a let-go task may reach."""

    def __init__(self) -> None:
        self.cancellations: dict[str, object] = {}
        self.handler = None

    def busy(self, task_id: str) -> bool:
        raise AssertionError(f"{task_id} was looked at after its run ended")

    async def read(self, task_id: str, caller: Any) -> Any:
        raise AssertionError(f"{task_id} was read after its run ended")

    async def unwatched(self, task: Any, live: Any, caller: Any, after: float) -> None:
        raise AssertionError("a task whose run ended was cancelled as unwatched")


@pytest.mark.asyncio
async def test_a_run_that_ends_as_its_clock_runs_out_is_let_go(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The clock runs out and, in the same loop turn, the run ends, before the look at the task
    starts: the task is let go. The look read the run's caller regardless (a KeyError, logged at
    ERROR as background work that failed)."""
    remote = SimpleNamespace(notices=None, peers=object(), hearing=True, heard_since=0.0)
    watchers = Watchers(Untouchable(), AFTER, False, None, remote)
    looks: list[asyncio.Future[None]] = []
    looking = asyncio.Event()

    def run_ends_first(work: Any) -> asyncio.Future[None]:
        watchers.run_ended("t")  # In the turn the clock ran out in, before the look starts.
        looks.append(_aio.in_background(work))
        looking.set()
        return looks[-1]

    monkeypatch.setattr(_unwatched, "in_background", run_ends_first)
    with caplog.at_level(logging.ERROR, logger="a2a_cancelfix"):
        watchers.run_started(SimpleNamespace(task_id="t", call_context=caller(), message=None))  # type: ignore[arg-type]
        await within(looking.wait())  # The clock ran out.
        await within(looks[0])
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR]
