"""The handler's contract beyond the scenario table: options, bounds, races, leftovers, logs."""

from __future__ import annotations

import asyncio
import json
import logging
import sys

import httpx
import pytest
import wrapt
from a2a.server.events import EventQueue
from a2a.server.request_handlers.default_request_handler_v2 import DefaultRequestHandlerV2
from a2a.server.tasks import (
    BasePushNotificationSender,
    InMemoryPushNotificationConfigStore,
    InMemoryTaskStore,
)
from a2a.types import (
    CancelTaskRequest,
    SendMessageRequest,
    TaskNotCancelableError,
    TaskState,
    TaskStatus,
    TaskStatusUpdateEvent,
    UnsupportedOperationError,
)
from a2a.utils.errors import A2AError

from a2a_cancelfix import CancellableExecutor, DefaultRequestHandler, FinalStateTaskStore, _sdk
from a2a_cancelfix._cancel.queues import CancelQueue
from a2a_cancelfix._cancel.settings import Timing
from a2a_cancelfix.testing import (
    BOUND,
    Changes,
    Gate,
    PushReceiver,
    ScriptedExecutor,
    Server,
    Stream,
    caller,
    cancel,
    make_server,
    message,
    reached_step,
    start,
    state_of,
    stored,
    wait_all_tasks_blocked,
    within,
)
from a2a_cancelfix.testing.servers import GRACE, Calls
from a2a_cancelfix.testing.waits import eventually

from . import expected
from .support import CompletionHeld, logged, set_within, tasks_since

# A cancel must return within the grace period plus this.
SLACK = 1.5
MARGIN = Timing().margin


async def cancel_task(server: Server, task_id: str) -> object:
    return await server.handler.on_cancel_task(CancelTaskRequest(id=task_id), caller())


def test_takes_the_sdk_arguments_and_wraps_the_executor() -> None:
    """Positional SDK arguments work, and the executor is wrapped exactly once."""
    server = make_server("stock", ScriptedExecutor())
    executor = ScriptedExecutor()
    handler = DefaultRequestHandler(executor, server.store, server.handler._agent_card)
    assert isinstance(handler, DefaultRequestHandlerV2)
    assert isinstance(handler.agent_executor, CancellableExecutor)
    assert handler.agent_executor.__wrapped__ is executor
    wrapped = CancellableExecutor(executor)
    again = DefaultRequestHandler(wrapped, server.store, server.handler._agent_card)
    assert again.agent_executor.__wrapped__ is executor  # Its own proxy of the executor inside.


@pytest.mark.parametrize("given", [object(), ScriptedExecutor], ids=["object", "a-class"])
def test_refuses_what_is_not_an_executor_at_construction(given: object) -> None:
    """Something that is not an executor (or an executor's class, not one) is a TypeError
    naming ``agent_executor`` when the handler is built; it was accepted, and every request
    then failed with "The request failed: AttributeError". The SDK's own handler accepts it."""
    server = make_server("stock", ScriptedExecutor())
    with pytest.raises(TypeError, match="agent_executor"):
        DefaultRequestHandler(given, server.store, server.handler._agent_card)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="executor"):
        CancellableExecutor(given)  # type: ignore[arg-type]
    DefaultRequestHandlerV2(given, server.store, server.handler._agent_card)  # type: ignore[arg-type]


def test_what_the_handler_hands_itself_to_is_built_once_the_sdks_constructor_has_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The watch for remote cancels, which reads the handler's store and runs, is given a
    handler the SDK has built (its ``task_store`` set), never a half-built one."""
    from a2a_cancelfix import _lifecycle

    built, seen = _lifecycle.RemoteCancels, []

    def recording(lifecycle, handler, *args):  # type: ignore[no-untyped-def]
        seen.append(hasattr(handler, "task_store"))
        return built(lifecycle, handler, *args)

    monkeypatch.setattr(_lifecycle, "RemoteCancels", recording)
    make_server("ours", ScriptedExecutor())
    assert seen == [True]


@pytest.mark.asyncio
async def test_handlers_sharing_a_wrapped_executor_each_keep_their_grace_period() -> None:
    """One CancellableExecutor given to two handlers: a cancel through each is bounded by that
    handler's own grace period, not the other's (a cancel() that hangs uses all of it)."""
    shared = CancellableExecutor(ScriptedExecutor(cancel="hang"), grace_period=4.0)
    quick = make_server("ours", shared, cancel_grace_period=0.2)
    slow = make_server("ours", shared, cancel_grace_period=4.0)
    assert quick.handler.cancel_grace_period == 0.2 and slow.handler.cancel_grace_period == 4.0
    sent = Stream(quick.calls.send_stream(SendMessageRequest(message=message()), "alice"))
    await sent.until(lambda: sent.last == "WORKING")
    # Within its own 0.2 s and the SDK's margin: the slow handler's 4 s would fail here.
    assert await within(cancel(quick, quick.executor.task_id), 0.2 + MARGIN + 1.0) == "CANCELED"


@pytest.mark.parametrize(
    "options",
    [
        {"cancel_grace_period": 0},
        {"on_parked": "ignore"},
        {"on_canceled": "maybe"},
        {"shutdown_drain_time": -1},
    ],
    ids=["grace", "on_parked", "on_canceled", "drain"],
)
def test_rejects_bad_options(options: dict) -> None:
    """An option outside its documented values is a ValueError at construction."""
    with pytest.raises(ValueError):
        make_server("ours", ScriptedExecutor(), **options)


@pytest.mark.asyncio
async def test_refuse_policy_keeps_a_parked_task() -> None:
    """With on_parked="refuse", a parked task is not cancelable and stays untouched."""
    server = make_server("ours", ScriptedExecutor(park=True), on_parked="refuse")
    await start(server)
    task_id = server.executor.task_id
    with pytest.raises(TaskNotCancelableError):
        await within(cancel_task(server, task_id))
    assert await within(stored(server, task_id)) == "INPUT_REQUIRED"
    assert not server.executor.cancel_called.is_set()


@pytest.mark.asyncio
async def test_return_policy_makes_cancel_idempotent() -> None:
    """With on_canceled="return", cancelling a CANCELED task returns it again."""
    server = make_server("ours", ScriptedExecutor(), on_canceled="return")
    await start(server)
    task_id = server.executor.task_id
    assert await within(cancel(server, task_id)) == "CANCELED"
    assert await within(cancel(server, task_id)) == "CANCELED"


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("mode", "answer", "state"), [("hang", "CANCELED", "CANCELED"), ("raise", "Internal", "FAILED")]
)
async def test_misbehaving_cancel_is_bounded_and_named(mode: str, answer: str, state: str, caplog) -> None:
    """A hanging cancel() ends CANCELED in time, a raising one FAILED (as upstream) with an A2A
    error; the stream sees it, and a warning names the executor."""
    server = make_server("ours", ScriptedExecutor(cancel=mode))
    stream = await start(server)
    task_id = server.executor.task_id
    with caplog.at_level(logging.WARNING, logger="a2a_cancelfix"):
        assert await within(cancel(server, task_id), GRACE + SLACK) == answer
    assert await stream.ended() and stream.last == state
    assert await stored(server, task_id) == state
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("ScriptedExecutor.cancel()" in w and task_id in w for w in warnings)


class StubbornCancel(ScriptedExecutor):
    """Its cancel() swallows every CancelledError and waits until the test releases it."""

    def __init__(self) -> None:
        super().__init__()
        self.cancel_released = asyncio.Event()
        self.cancel_interrupted = asyncio.Event()

    async def cancel(self, context, event_queue) -> None:
        self.cancel_called.set()
        while not self.cancel_released.is_set():
            try:
                await self.cancel_released.wait()
            except asyncio.CancelledError:
                self.cancel_interrupted.set()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["stock", "ours"])
async def test_a_cancel_that_swallows_its_cut_off_is_bounded(kind: str) -> None:
    """cancel() outlives the grace period and swallows the CancelledError that cuts it off:
    stock's cancel waits for it forever; ours answers CANCELED in time, and the stream and the
    store say so, while that cancel() is still running."""
    executor = StubbornCancel()
    server = make_server(kind, executor)
    stream = await start(server)
    task_id = server.executor.task_id
    call = asyncio.ensure_future(cancel(server, task_id))
    try:
        await within(executor.cancel_called.wait())
        done, _ = await asyncio.wait([call], timeout=GRACE + SLACK)
        if kind == "stock":
            assert not done  # Still waiting for cancel().
            return
        assert done and call.result() == "CANCELED"
        assert executor.cancel_interrupted.is_set() and not executor.cancel_released.is_set()
        assert await stream.ended() and stream.last == "CANCELED"
        assert await stored(server, task_id) == "CANCELED"
    finally:
        executor.cancel_released.set()
        executor.step.open()
        await within(asyncio.wait([call]))


@pytest.mark.asyncio
async def test_a_client_leaving_mid_cancel_neither_interrupts_nor_repeats_cancel() -> None:
    """The first caller drives the cancel; when its client leaves, the cancel goes on.

    The executor's cancel() runs on, once, and a caller that joined gets the answer.
    """
    server = make_server("ours", ScriptedExecutor(cancel="gate"))
    stream = await start(server)
    task_id = server.executor.task_id
    first = asyncio.ensure_future(cancel_task(server, task_id))
    await within(server.executor.cancel_gate.reached.wait())
    first.cancel()  # Its client went away.
    await asyncio.wait({first}, timeout=GRACE)
    assert first.cancelled()
    second = asyncio.ensure_future(cancel(server, task_id))
    server.executor.cancel_gate.open()
    assert await within(second, GRACE + SLACK) == "CANCELED"
    assert server.executor.cancel_returned.is_set()
    assert server.executor.cancels == 1
    assert await within(stream.ended()) and stream.last == "CANCELED"


@pytest.mark.asyncio
async def test_swallowing_execute_cannot_change_the_task_later(caplog) -> None:
    """An execute() that swallows the cancel is abandoned; what it does afterwards is dropped.

    The SDK's run waits for the work (it runs in the run's task), so it goes when the work does.
    """
    server = make_server("ours", ScriptedExecutor(swallow=True))
    before = asyncio.all_tasks()
    await start(server)
    task_id = server.executor.task_id
    try:
        with caplog.at_level(logging.WARNING, logger="a2a_cancelfix"):
            assert await within(cancel(server, task_id), GRACE + SLACK) == "CANCELED"
        assert any("ScriptedExecutor.execute() ignored" in r.getMessage() for r in caplog.records)
    finally:
        server.executor.released.set()  # It now tries to complete the task.
    await within(server.executor.stopped.wait())
    await eventually(lambda: _gone(server, task_id, before))
    assert await within(stored(server, task_id)) == "CANCELED"


@pytest.mark.asyncio
async def test_a_run_that_can_close_itself_is_not_forced_after_the_margin(caplog) -> None:
    """After the answer, a run that closes itself slowly (a busy loop) is left to close.

    Up to a2a-sdk 1.2.2 no run closes itself after a cancel, so it is forced after the margin.
    """
    server = make_server("ours", ScriptedExecutor())
    await start(server)
    task_id = server.executor.task_id
    active = await within(server.handler._active_task_registry.get(task_id))
    queue, closing = _sdk.agent_queue(active), Gate()
    close = queue.close

    async def slow_close(*args, **kwargs):
        await closing()
        await close(*args, **kwargs)

    queue.close = slow_close

    async def run_gone() -> bool:
        return not await _sdk.has_run(server.handler, task_id)

    with caplog.at_level(logging.DEBUG, logger="a2a_cancelfix"), logged("force-closed") as force_closed:
        assert await within(cancel(server, task_id)) == "CANCELED"
        # The passing of time is under test: the margin's timer forces the run closed up to
        # a2a-sdk 1.2.2, so the force-close is waited for; from 1.2.3 nothing may force it
        # for that long, so the whole margin passes.
        forced = await set_within(force_closed, MARGIN + 0.3)
        closing.open()
        await eventually(run_gone)
    if _sdk.RUNS_CLOSE_THEMSELVES:
        assert closing.reached.is_set() and not forced
    else:
        assert forced


@pytest.mark.asyncio
async def test_logs_one_info_line_per_cancel(caplog) -> None:
    """Each cancel logs its task, path, outcome, duration and whether the grace ran out."""
    server = make_server("ours", ScriptedExecutor(park=True))
    await start(server)
    task_id = server.executor.task_id
    with caplog.at_level(logging.INFO, logger="a2a_cancelfix"):
        await within(cancel(server, task_id))
        await within(cancel(server, task_id))
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(lines) == 2
    assert f"task={task_id} path=parked outcome=CANCELED" in lines[0]
    assert "grace_exhausted=False" in lines[0]
    assert f"task={task_id} path=already terminal outcome=TaskNotCancelable" in lines[1]


@pytest.mark.asyncio
async def test_message_to_a_task_being_canceled_gets_an_a2a_error() -> None:
    """A message racing a cancel of its parked task loses with an A2A error; CANCELED stays."""
    server = make_server("ours", ScriptedExecutor(park=True, cancel="gate"))
    await start(server)
    task_id = server.executor.task_id
    cancelling = asyncio.ensure_future(cancel(server, task_id))
    await within(server.executor.cancel_gate.reached.wait())
    resume = SendMessageRequest(message=message("more", task_id=task_id))
    with pytest.raises(A2AError):
        await within(server.handler.on_message_send(resume, caller()))
    server.executor.cancel_gate.open()
    assert await within(cancelling) == "CANCELED"
    with pytest.raises(A2AError):
        await within(server.handler.on_message_send(resume, caller()))
    assert await within(stored(server, task_id)) == "CANCELED"
    assert server.executor.runs == 1


@pytest.mark.asyncio
async def test_cancel_after_a_resuming_message_cancels_the_new_run() -> None:
    """When the message wins, the cancel ends the resumed run; its blocking sender sees CANCELED.

    The message comes once the parked request has answered. (One that races that answer gets
    the parked task at once from a2a-sdk 1.0.0, in a window a loop turn wide.)
    """
    server = make_server("ours", ScriptedExecutor(park=True))
    parked = await start(server)
    assert await parked.ended() and parked.last == "INPUT_REQUIRED"
    task_id = server.executor.task_id
    server.executor.step = type(server.executor.step)()
    resume = SendMessageRequest(message=message("more", task_id=task_id))

    async def send() -> str | None:
        # The state as answered: the SDK may hand out an object that later changes in place.
        return state_of(await server.handler.on_message_send(resume, caller()))

    sender = asyncio.ensure_future(send())
    await reached_step(server)
    await wait_all_tasks_blocked()
    assert not sender.done()
    assert await within(cancel(server, task_id)) == "CANCELED"
    assert await within(sender) == "CANCELED"


@pytest.mark.asyncio
@pytest.mark.parametrize("landing", ["after the COMPLETED event was enqueued", "after it was recorded"])
async def test_completion_that_wins_is_kept(landing: str) -> None:
    """A cancel landing after the run published COMPLETED is refused; COMPLETED stays."""
    server = make_server("ours", ScriptedExecutor())
    stream = await start(server)
    task_id = server.executor.task_id
    server.executor.step.open()
    await within(server.executor.completed.wait())
    if landing == "after it was recorded":
        await within(stream.ended())
    assert await within(cancel(server, task_id)) == "TaskNotCancelable"
    await within(stream.ended())
    assert stream.last == "COMPLETED"
    assert await within(stored(server, task_id)) == "COMPLETED"


@pytest.mark.asyncio
async def test_cancel_that_wins_stops_the_completion() -> None:
    """Once the cancel is in, the run's own COMPLETED never reaches the task."""
    server = make_server("ours", ScriptedExecutor(cancel="gate"))
    stream = await start(server)
    task_id = server.executor.task_id
    cancelling = asyncio.ensure_future(cancel(server, task_id))
    await within(server.executor.cancel_gate.reached.wait())
    server.executor.step.open()  # The run tries to complete while cancel() is still running.
    await within(server.executor.stopped.wait())
    server.executor.cancel_gate.open()
    assert await within(cancelling) == "CANCELED"
    assert not server.executor.completed.is_set()
    await within(stream.ended())
    assert stream.last == "CANCELED"


@pytest.mark.asyncio
@pytest.mark.parametrize("executor", ["mid-run", "parked", "cancel() hangs", "swallows"])
async def test_nothing_is_left_behind(executor: str) -> None:
    """After the cancel, no asyncio task, registry entry, queue or bookkeeping of the task remains."""
    before = asyncio.all_tasks()
    scripted = {
        "mid-run": ScriptedExecutor(),
        "parked": ScriptedExecutor(park=True),
        "cancel() hangs": ScriptedExecutor(cancel="hang"),
        "swallows": ScriptedExecutor(swallow=True),
    }[executor]
    server = make_server("ours", scripted)
    stream = await start(server)
    task_id = scripted.task_id
    subscriber = Stream(server.handler.on_subscribe_to_task(_subscribe(task_id), caller()))
    assert await within(cancel(server, task_id), GRACE + SLACK) == "CANCELED"
    scripted.released.set()
    assert await stream.ended() and await subscriber.ended()
    await eventually(lambda: _gone(server, task_id, before))
    lifecycle = server.handler.agent_executor.cancel_lifecycle
    assert lifecycle.cancellations == {} and lifecycle.works == {}


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["stock", "ours"])
async def test_a_shutdown_while_a_run_saves_its_end_leaves_nothing_running(kind: str) -> None:
    """The server shuts down while the run's consumer is saving COMPLETED (the store does not
    answer) with events queued behind it: its ``aclose()``, where it has one, then the loop
    cancels every task left, as ``asyncio.run`` does at its end.

    Ours closes the run in ``aclose()`` on every release, as the SDK's own does from 1.1.2 on
    Python 3.11, so every task then ends. Stock has no ``aclose()`` on 1.0.x: on 1.0.3 the
    cancelled producer waits for good for queues its cancelled consumer no longer drains; the
    process never exits. (1.0.0's ends. From 1.0.3 on, stock's run and ours meet that end too
    if nothing calls ``aclose()``.)

    On Python 3.13, stock's own ``aclose()`` (1.1.2 on), begun at once, does not return
    either: its first step wakes the producer, whose ``finally`` closes the run's queue
    gracefully and takes its sink before ``aclose()`` removes it, then waits in the sink's
    ``join()`` for the event the cut consumer took and never marked done. The SDK's queue is
    ``asyncio.Queue`` there (culsans' below 3.13), whose ``shutdown(immediate=True)`` wakes
    ``join()`` only once every item taken was marked done; culsans' wakes it whatever is left
    unfinished. (Begun a loop turn later, as ``asyncio.wait_for`` up to 3.11 began what it
    awaited, ``aclose()`` removes the sink first and returns.)
    """
    store = CompletionHeld(InMemoryTaskStore())
    # Ours' aclose() lets the stream wait for COMPLETED as long as it lets the runs finish.
    server = make_server(kind, ScriptedExecutor(), store=store, shutdown_drain_time=0.5)
    await start(server)
    server.executor.step.open()
    await within(store.gate.reached.wait())
    aclose = getattr(server.handler, "aclose", None)
    if aclose is not None and kind == "stock" and sys.version_info >= (3, 13):
        # Begun at once, in this loop turn, as an inline call or a lifespan's would be.
        closing = asyncio.eager_task_factory(asyncio.get_running_loop(), aclose())
        await wait_all_tasks_blocked()  # All it can do on its own is done: no timer ends it.
        assert not closing.done()
        assert any(task.get_name().startswith("producer") for task in asyncio.all_tasks())
    elif aclose is not None:
        await within(aclose())  # The save still waits.
        await within(aclose())  # Again, with nothing left to close: as the SDK's, harmless.
    left = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in left:
        task.cancel()
    if kind == "stock" and aclose is None and expected.column() > 0:
        await wait_all_tasks_blocked()
        assert {task.get_name().split(":")[0] for task in left if not task.done()} >= {"producer"}
        # Free them for the next test: cancel what the producer's close started since.
        for task in asyncio.all_tasks() - {asyncio.current_task()}:
            task.cancel()
    await within(asyncio.gather(*left, return_exceptions=True))


async def _gone(server: Server, task_id: str, before: set[asyncio.Task]) -> bool:
    """Whether the run of ``task_id`` has left the registry and every task since ``before`` ended."""
    return not await _sdk.has_run(server.handler, task_id) and not tasks_since(before)


def _subscribe(task_id: str):
    from a2a.types import SubscribeToTaskRequest

    return SubscribeToTaskRequest(id=task_id)


@pytest.mark.asyncio
async def test_unknown_sdk_release_warns_once_and_still_cancels(monkeypatch) -> None:
    """A release whose internals we do not find gets one warning and a bounded SDK cancel."""
    monkeypatch.setattr(_sdk, "SUPPORTED", False)
    monkeypatch.setattr(_sdk, "MISSING", ["ActiveTask._is_finished"])
    monkeypatch.setattr(_sdk, "_warned", False)
    with pytest.warns(RuntimeWarning, match="does not know a2a-sdk"):
        server = make_server("ours", ScriptedExecutor())
    make_server("ours", ScriptedExecutor())  # No second warning: it would raise here.
    await start(server)
    assert await within(cancel(server, server.executor.task_id), GRACE + SLACK) == "CANCELED"


@pytest.mark.asyncio
async def test_internal_queue_errors_become_a2a_errors(monkeypatch) -> None:
    """A queue shut down under a message (the run just ended) reaches the client as an A2A error."""

    async def shut(*args, **kwargs):
        raise _sdk.QueueShutDown

    async def shut_stream(*args, **kwargs):
        raise _sdk.QueueShutDown
        yield

    monkeypatch.setattr(DefaultRequestHandlerV2, "on_message_send", shut)
    monkeypatch.setattr(DefaultRequestHandlerV2, "on_message_send_stream", shut_stream)
    server = make_server("ours", ScriptedExecutor())
    request = SendMessageRequest(message=message(task_id="t-1"))
    with pytest.raises(A2AError):
        await within(server.handler.on_message_send(request, caller()))
    with pytest.raises(A2AError):
        await within(_read_to_end(server.handler.on_message_send_stream(request, caller())))


async def _read_to_end(events) -> None:
    async for _ in events:
        pass


@pytest.mark.asyncio
async def test_a_loop_running_late_does_not_force_a_run_the_sdk_is_recording(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The SDK's margin to record CANCELED counts the loop's time: a loop held up past it (as
    by thousands of cancels at once) must not make the cancel write CANCELED around the run
    and force it closed, which would take the event from the streams waiting for it."""
    server = make_server("ours", ScriptedExecutor(), timing=Timing(margin=0.05))
    stream = await start(server)
    loop, saving = asyncio.get_running_loop(), Gate()
    save, publish = server.store.save, CancelQueue.publish

    async def held_save(task, *args, **kwargs):  # The SDK's save of CANCELED waits for the hold.
        if task.status.state == _sdk.CANCELED:
            await saving()
        return await save(task, *args, **kwargs)

    def hold_the_loop() -> None:  # One long callback: the loop is late for everything after it.
        import time

        time.sleep(GRACE + 0.5)
        # The save goes on after the overdue timers have run, as it would behind a busy loop.
        loop.call_later(0.01, saving.open)

    async def publish_then_hold(self, state, *why):
        published = await publish(self, state, *why)
        loop.call_soon(hold_the_loop)
        return published

    monkeypatch.setattr(server.store, "save", held_save)
    monkeypatch.setattr(CancelQueue, "publish", publish_then_hold)
    with caplog.at_level(logging.WARNING, logger="a2a_cancelfix"):
        assert await within(cancel(server, server.executor.task_id or "")) == "CANCELED"
    assert saving.reached.is_set()
    assert await within(stream.ended()) and stream.last == "CANCELED"
    assert not [r for r in caplog.records if "did not record a terminal state" in r.getMessage()]


@pytest.mark.parametrize("streamed", [False, True], ids=["blocking", "streamed"])
@pytest.mark.parametrize("kind", ["stock", "ours"])
@pytest.mark.asyncio
async def test_a_follow_up_the_task_ended_before_processing_is_refused_not_dropped(
    kind: str, streamed: bool
) -> None:
    """A follow-up accepted while the task works, whose task then completes: stock runs
    ``execute()`` again on the COMPLETED task; ours never reports success for a message nobody
    processed: its sender gets UnsupportedOperationError, and the task stays COMPLETED."""
    server = make_server(kind, ScriptedExecutor())
    first = await start(server)
    executor = server.executor
    request = SendMessageRequest(message=message("and then?", executor.task_id))
    if streamed:
        follow_up = Stream(server.calls.send_stream(request, "alice"))
    else:
        answer = asyncio.ensure_future(server.calls.send(request, "alice"))
    await wait_all_tasks_blocked()  # Accepted, and queued behind the run.
    executor.step.open()
    await within(first.ended())
    if kind == "stock":
        if streamed:
            await within(follow_up.ended())
        else:
            await within(answer)
        assert executor.runs == 2  # Its execute() ran for a task that had completed.
        return
    with pytest.raises(UnsupportedOperationError, match="before this message was processed"):
        if streamed:
            await within(follow_up.ended())
            raise follow_up.error  # type: ignore[misc]
        await within(answer)
    assert executor.runs == 1
    assert await stored(server, executor.task_id) == "COMPLETED"


class EndsTwice(ScriptedExecutor):
    """Completes its task, then enqueues FAILED after that end, as a careless agent might."""

    def __init__(self) -> None:
        super().__init__()
        self.late_sent = asyncio.Event()

    async def execute(self, context, event_queue) -> None:
        await super().execute(context, event_queue)
        late = TaskStatusUpdateEvent(
            task_id=context.task_id or "",
            context_id=context.context_id or "",
            status=TaskStatus(state=TaskState.TASK_STATE_FAILED),
        )
        await event_queue.enqueue_event(late)
        self.late_sent.set()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["stock", "ours"])
async def test_what_execute_enqueues_after_its_own_end_goes_nowhere(kind: str) -> None:
    """execute() enqueues FAILED after its COMPLETED: stock stores it and pushes it (a terminal
    state changed); ours drops it, so the store, the stream and the webhook keep COMPLETED."""
    executor = EndsTwice()
    server = make_server(kind, executor)
    before = asyncio.all_tasks()
    url = "http://push.invalid/ends-twice"
    sent = await start(server, push_url=url)
    executor.step.open()
    await within(executor.late_sent.wait())
    if kind == "stock":
        assert await sent.ended() and sent.last == "FAILED"
        await server.push.posted(url, "FAILED")
        assert await stored(server, executor.task_id) == "FAILED"
        return
    assert await sent.ended() and sent.last == "COMPLETED"
    await eventually(lambda: _gone(server, executor.task_id, before))  # Every event handled.
    assert server.push.received[url][-1] == "COMPLETED" and "FAILED" not in server.push.received[url]
    assert await stored(server, executor.task_id) == "COMPLETED"


class LooksAtItsQueue(ScriptedExecutor):
    """Notes what its queue is, as an agent that checks its argument or uses more of it would."""

    seen: tuple[bool, bool] | None = None

    async def execute(self, context, event_queue) -> None:
        self.seen = (isinstance(event_queue, EventQueue), event_queue.is_closed())
        await super().execute(context, event_queue)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["stock", "ours"])
async def test_execute_is_handed_a_queue(kind: str) -> None:
    """What execute() gets passes for the SDK's queue: ``isinstance`` holds, and the queue's
    other methods answer (ours hands a proxy that checks each enqueue)."""
    executor = LooksAtItsQueue()
    server = make_server(kind, executor)
    sent = await start(server)
    executor.step.open()
    assert await sent.ended() and sent.last == "COMPLETED"
    assert executor.seen is not None
    assert executor.seen == (True, False)  # A queue, and open.


class SlowWebhook:
    """A push receiver that holds its answer to the first WORKING push until the test opens it."""

    def __init__(self) -> None:
        self.held = Gate()
        self.received: list[str] = []
        self.changes = Changes()
        self.client = httpx.AsyncClient(transport=httpx.MockTransport(self._receive))

    async def _receive(self, request: httpx.Request) -> httpx.Response:
        state = (
            json.loads(request.content)["statusUpdate"]["status"]["state"]
            if b"statusUpdate" in request.content
            else "?"
        )
        if state == "TASK_STATE_WORKING" and not self.held.reached.is_set():
            await self.held()
        self.received.append(state.removeprefix("TASK_STATE_"))
        self.changes.notify()
        return httpx.Response(200)


@pytest.mark.asyncio
async def test_a_slow_push_receiver_delays_only_its_own_pushes() -> None:
    """A webhook that holds its answer to the WORKING push past the grace period: the cancel
    still answers in bound, the sender's stream and a subscriber end on CANCELED, and the
    webhook gets CANCELED after its WORKING once it answers."""
    executor, webhook = ScriptedExecutor(), SlowWebhook()
    configs = InMemoryPushNotificationConfigStore()
    card = make_server("stock", executor).handler._agent_card
    handler = DefaultRequestHandler(
        executor,
        InMemoryTaskStore(),
        card,
        push_config_store=configs,
        push_sender=BasePushNotificationSender(webhook.client, configs, caller()),
        cancel_grace_period=GRACE,
    )
    server = Server(handler, executor, handler.task_store, PushReceiver(), Calls(handler))
    sent = await start(server, push_url="http://push.invalid/slow")
    subscriber = Stream(server.calls.subscribe(executor.task_id, "alice"))
    await subscriber.until(lambda: bool(subscriber.events))
    await within(webhook.held.reached.wait())  # The WORKING push is in flight, and stays so.
    assert await within(cancel(server, executor.task_id), GRACE + SLACK) == "CANCELED"
    assert await sent.ended() and sent.last == "CANCELED"
    assert await subscriber.ended() and subscriber.last == "CANCELED"
    webhook.held.open()
    await webhook.changes.until(lambda: "CANCELED" in webhook.received)
    assert webhook.received[-1] == "CANCELED" and "WORKING" in webhook.received


class FailingCancels(wrapt.ObjectProxy):  # type: ignore[misc]
    """A guarded store whose next ``failures`` saves of CANCELED fail, as a killed connection's do."""

    def __init__(self, store, failures: int) -> None:
        super().__init__(store)
        self._self_failures = failures

    async def save(self, task, context) -> None:
        if task.status.state == TaskState.TASK_STATE_CANCELED and self._self_failures:
            self._self_failures -= 1
            raise ConnectionError("the connection was killed mid-save")
        await self.__wrapped__.save(task, context)


@pytest.mark.asyncio
async def test_a_canceled_the_store_failed_to_record_is_recorded_once_it_recovers() -> None:
    """The store fails the run's CANCELED and the direct write that follows: the caller gets an
    A2A error in bound, the sender's stream ends on an A2A error (never the driver's), and the
    CANCELED is recorded behind the answer as soon as the store takes it (or, where the SDK
    records FAILED for a failed save, that end stands): never WORKING with nothing running."""
    store = FailingCancels(FinalStateTaskStore(InMemoryTaskStore()), failures=3)
    server = make_server("ours", ScriptedExecutor(), store=store)
    sent = await start(server)
    task_id = server.executor.task_id
    with pytest.raises(A2AError):
        await within(server.calls.cancel(task_id, "alice"), GRACE + 2 * MARGIN + SLACK)
    assert await sent.ended()
    assert sent.error is None or isinstance(sent.error, A2AError), repr(sent.error)
    assert server.executor.stopped.is_set()
    # The retries are 0.1 s, then 0.5 s apart: the third failure, then the write that lands.
    # (Up to 1.0.3 the SDK itself records FAILED when its save of CANCELED fails: an end too.)
    await eventually(lambda: _stored_in(server, task_id, ("CANCELED", "FAILED")), seconds=BOUND)


async def _stored_in(server: Server, task_id: str, states: tuple[str, ...]) -> bool:
    return await stored(server, task_id) in states


@pytest.mark.asyncio
async def test_reached_step_refuses_a_store_that_cannot_tell_of_its_saves() -> None:
    """A Server built by hand around the SDK's handler on a bare store: reached_step says what
    it needs at once, rather than wait out its bound for saves nobody reports."""
    executor = ScriptedExecutor()
    card = make_server("stock", executor).handler._agent_card
    handler = DefaultRequestHandlerV2(
        agent_executor=executor, task_store=InMemoryTaskStore(), agent_card=card
    )
    server = Server(handler, executor, handler.task_store, PushReceiver(), Calls(handler))
    with pytest.raises(TypeError, match="make_server"):
        await within(reached_step(server))
