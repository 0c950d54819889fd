"""A server's shutdown (``await handler.aclose()``, then the loop ends): what waits behind the
answers (pushes to a slow webhook, a CANCELED the store failed to record) is finished within
``shutdown_drain_time``, or named in a WARNING."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import wrapt
from a2a.server.request_handlers.default_request_handler_v2 import DefaultRequestHandlerV2
from a2a.server.tasks import (
    BasePushNotificationSender,
    DatabaseTaskStore,
    InMemoryPushNotificationConfigStore,
    InMemoryTaskStore,
)
from a2a.types import SendMessageRequest, TaskState, UnsupportedOperationError
from sqlalchemy.ext.asyncio import create_async_engine

from a2a_cancelfix import DefaultRequestHandler, FinalStateTaskStore
from a2a_cancelfix._cancel.settings import Timing
from a2a_cancelfix.testing import (
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
    outcome,
    start,
    state_of,
    stored,
    wait_all_tasks_blocked,
    within,
)
from a2a_cancelfix.testing.servers import GRACE, Calls

from .support import CompletionHeld, logged

# aclose()'s bound in these tests (``shutdown_drain_time``), and what a busy loop may add to it.
DRAIN = 0.5
SLACK = 1.0
# Ours retries a CANCELED the store failed after 0.1 s, then 0.5 s, then 1 s.
BOUND_OF_RETRIES = 0.1 + 0.5 + SLACK


class SlowWebhook:
    """A push receiver that holds its answer to the first WORKING push until ``held`` opens."""

    def __init__(self) -> None:
        self.held = Gate()
        self.received: list[str] = []
        self.client = httpx.AsyncClient(transport=httpx.MockTransport(self._receive))

    async def _receive(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        state = (body.get("statusUpdate") or body.get("task") or {}).get("status", {}).get("state", "?")
        if state == "TASK_STATE_WORKING" and not self.held.reached.is_set():
            await self.held()
        self.received.append(state.removeprefix("TASK_STATE_"))
        return httpx.Response(200)


def with_webhook(kind: str, webhook: SlowWebhook) -> Server:
    """Stock's handler or ours, pushing to ``webhook``, on a store that tells of its saves."""
    executor, configs = ScriptedExecutor(), InMemoryPushNotificationConfigStore()
    arguments: dict[str, Any] = {
        "agent_executor": executor,
        "task_store": FinalStateTaskStore(InMemoryTaskStore()),
        "agent_card": make_server("stock", executor).handler._agent_card,
        "push_config_store": configs,
        "push_sender": BasePushNotificationSender(webhook.client, configs, caller()),
    }
    if kind == "ours":
        handler = DefaultRequestHandler(**arguments, cancel_grace_period=GRACE, shutdown_drain_time=DRAIN)
    else:
        handler = DefaultRequestHandlerV2(**arguments)
    return Server(handler, executor, handler.task_store, PushReceiver(), Calls(handler))


async def shut_down(
    server: Server, lifted: Callable[[], None] | None, seen: Callable[[], Any]
) -> tuple[float, Any]:
    """The server's shutdown as the README asks for it: ``aclose()`` (stock has none on 1.0.x),
    then the loop cancels every task left. ``lifted`` is called once nothing moves any more
    but what ``aclose()`` may wait for (the obstacle was slow, not dead); ``seen()`` is taken
    as ``aclose()`` returns. Returns how long ``aclose()`` took and what ``seen()`` said."""
    loop = asyncio.get_running_loop()
    aclose = getattr(server.handler, "aclose", None)

    async def closed() -> tuple[float, Any]:
        started = loop.time()
        if aclose is not None:
            await aclose()
        return loop.time() - started, seen()

    closing = asyncio.ensure_future(closed())
    if lifted is not None:
        await wait_all_tasks_blocked()
        lifted()
    took, said = await within(closing, DRAIN + SLACK)
    left = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in left:
        task.cancel()
    await within(asyncio.gather(*left, return_exceptions=True))
    return took, said


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["stock", "ours"])
async def test_a_shutdown_sends_the_pushes_queued_behind_a_slow_webhook(kind: str) -> None:
    """The webhook holds its answer to the WORKING push; the task is cancelled; the server
    shuts down, and the webhook answers meanwhile. Ours sends the CANCELED queued behind the
    WORKING before ``aclose()`` returns. Stock sends each push inline in the run, so its cancel
    waits for the webhook, and its ``aclose()`` (1.1.2+; 1.0.x has none) cuts the push in
    flight: the webhook never hears of CANCELED."""
    webhook = SlowWebhook()
    server = with_webhook(kind, webhook)
    await start(server, push_url="http://push.invalid/slow")
    await within(webhook.held.reached.wait())
    answer = asyncio.ensure_future(cancel(server, server.executor.task_id))
    if kind == "ours":
        assert await within(answer, GRACE + SLACK) == "CANCELED"
    _, seen = await shut_down(server, webhook.held.open, lambda: list(webhook.received))
    if kind == "stock":  # Its cancel, waiting for the run, was left to the shutdown.
        assert "CANCELED" not in seen, seen
        return
    assert seen[-2:] == ["WORKING", "CANCELED"], seen


@pytest.mark.asyncio
async def test_a_shutdown_gives_up_on_a_webhook_that_never_answers() -> None:
    """A webhook that never answers: ``aclose()`` waits for it, but returns within
    ``shutdown_drain_time``, with a WARNING that names the task whose pushes it dropped (WORKING, CANCELED)."""
    webhook = SlowWebhook()
    server = with_webhook("ours", webhook)
    await start(server, push_url="http://push.invalid/dead")
    await within(webhook.held.reached.wait())
    task_id = server.executor.task_id
    assert await within(cancel(server, task_id), GRACE + SLACK) == "CANCELED"
    with logged(f"task {task_id}: 2 push notification(s) not sent") as warned:
        took, seen = await shut_down(server, None, lambda: list(webhook.received))
    assert warned.is_set() and "CANCELED" not in seen
    assert DRAIN * 0.9 <= took <= DRAIN + SLACK


ENDS = (TaskState.TASK_STATE_CANCELED, TaskState.TASK_STATE_FAILED)


class RefusesCanceled(wrapt.ObjectProxy):  # type: ignore[misc]
    """A task store whose saves of CANCELED fail until ``accepting`` is set, as they do while
    its database is unreachable (``refused`` counts them); once ``hang`` is set they wait
    forever instead, as on a row that stays locked."""

    def __init__(self, store: Any) -> None:
        super().__init__(store)
        self._self_accepting = asyncio.Event()
        self._self_hang = False
        self._self_refusals = Changes()
        self._self_refused = 0

    @property
    def accepting(self) -> asyncio.Event:
        return self._self_accepting

    def hang(self) -> None:
        self._self_hang = True

    async def refused(self, times: int) -> None:
        await self._self_refusals.until(lambda: self._self_refused >= times)

    async def save(self, task: Any, *args: Any, **kwargs: Any) -> None:
        # FAILED too: 1.0.3's consumer answers its failed save of CANCELED by saving FAILED.
        if task.status.state in ENDS and not self._self_accepting.is_set():
            if self._self_hang:
                await asyncio.Event().wait()
            self._self_refused += 1
            self._self_refusals.notify()
            raise ConnectionError("the database is unreachable")
        await self.__wrapped__.save(task, *args, **kwargs)


async def refusing_server(kind: str) -> tuple[Server, RefusesCanceled]:
    """A task mid-run, cancelled while its store fails every save of CANCELED: ours answers an
    A2A error and retries the write behind the answer; wait until its retries, backing off,
    have failed too (the next comes a second later)."""
    given = FinalStateTaskStore(InMemoryTaskStore()) if kind == "ours" else InMemoryTaskStore()
    store = RefusesCanceled(given)
    options = {"shutdown_drain_time": DRAIN} if kind == "ours" else {}
    server = make_server(kind, ScriptedExecutor(), store=store, **options)
    await start(server)
    # Stock's answer is not ours to check here (WORKING on 1.0.0 and 1.1.2, the store's own
    # ConnectionError on 1.3.0), nor waited for past ours' bound.
    answer = asyncio.ensure_future(cancel(server, server.executor.task_id))
    await asyncio.wait([answer], timeout=GRACE + SLACK)
    if kind == "ours":
        assert answer.done() and answer.result() == "Internal"
        # The run's save, the direct write, then its retries after 0.1 s and 0.5 s.
        await within(store.refused(4), BOUND_OF_RETRIES)
    return server, store


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["stock", "ours"])
async def test_a_shutdown_tries_once_more_a_canceled_the_store_failed(kind: str) -> None:
    """The store is back while ours waits to retry its CANCELED write; the server shuts down
    before the retry is due. Ours tries once more in ``aclose()``: the store holds CANCELED.
    Stock's task shows WORKING after its shutdown: nothing of it retries."""
    server, store = await refusing_server(kind)
    store.accepting.set()
    await shut_down(server, None, lambda: None)
    assert await within(stored(server, server.executor.task_id)) == (
        "CANCELED" if kind == "ours" else "WORKING"
    )


@pytest.mark.asyncio
@pytest.mark.parametrize("store_then", ["refuses", "hangs"])
async def test_a_shutdown_names_a_canceled_the_store_never_recorded(store_then: str) -> None:
    """The store still refuses CANCELED, or its save now hangs: ``aclose()`` returns within
    ``shutdown_drain_time`` (at once for a refusal) with a WARNING that names the task."""
    server, store = await refusing_server("ours")
    task_id = server.executor.task_id
    if store_then == "hangs":
        store.hang()
    with logged(f"task {task_id}: the store") as warned:
        took, _ = await shut_down(server, None, lambda: None)
    assert warned.is_set()
    assert took <= DRAIN + SLACK and (store_then == "refuses" or took >= DRAIN * 0.9)
    assert await within(stored(server, task_id)) == "WORKING"


# The shutdown of runs still going: ``aclose()`` lets them finish for ``shutdown_drain_time``,
# then cancels them within their grace period; its bound is the sum, plus three margins.
MARGIN = 0.1
BOUND_OF_ACLOSE = DRAIN + GRACE + 3 * MARGIN + SLACK


def running(kind: str, executor: ScriptedExecutor | None = None, store: Any = None) -> Server:
    """Stock's handler or ours, with ``shutdown_drain_time=DRAIN`` and short margins."""
    options = {"shutdown_drain_time": DRAIN, "timing": Timing(margin=MARGIN)} if kind == "ours" else {}
    return make_server(kind, executor or ScriptedExecutor(), store=store, **options)


async def closed(server: Server) -> float:
    """Call ``aclose()`` (stock has none on 1.0.x), bounded; how long it took (inf: it has not
    returned; it goes on)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    aclose = getattr(server.handler, "aclose", None)
    if aclose is not None:
        # Not cancelled at the bound: stock's waits for an execute() that swallows the cancel.
        closing = asyncio.ensure_future(aclose())
        await asyncio.wait([closing], timeout=BOUND_OF_ACLOSE)
        if not closing.done():
            return math.inf
        closing.result()
    return loop.time() - started


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["stock", "ours"])
async def test_a_shutdown_cancels_a_run_still_going_at_the_end_of_the_drain(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A run that does not finish in ``shutdown_drain_time``: ours cancels it as a client's
    cancel would. Its ``cancel()`` is called, its ``finally`` runs, the store holds CANCELED
    with a status message saying the server shut down when ``aclose()`` returns, and its
    stream and a subscriber end on CANCELED. Stock's store keeps it WORKING."""
    server = running(kind)
    stream = await start(server)
    task_id = server.executor.task_id or ""
    subscriber = Stream(server.calls.subscribe(task_id, "alice"))
    await wait_all_tasks_blocked()
    told_at = caplog.at_level(logging.INFO, logger="a2a_cancelfix")
    with told_at, logged(f"cancel task={task_id} path=shutdown outcome=CANCELED") as told:
        took = await closed(server)
    task = await within(server.calls.get(task_id, "alice"))
    if kind == "stock":
        assert state_of(task) == "WORKING"
        assert not server.executor.cancel_called.is_set()
        return
    assert state_of(task) == "CANCELED" and "server shut down" in task.status.message.parts[0].text
    assert server.executor.cancel_called.is_set() and server.executor.stopped.is_set()
    assert await stream.ended() and stream.last == "CANCELED"
    assert await subscriber.ended() and subscriber.last == "CANCELED"
    await within(told.wait())
    assert DRAIN * 0.9 <= took <= BOUND_OF_ACLOSE


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["stock", "ours"])
async def test_a_run_that_finishes_within_the_drain_time_completes(kind: str) -> None:
    """The run finishes while ``aclose()`` waits: ours lets it complete, cancels nothing, and
    returns as it does. Stock's ``aclose()`` (1.1.2+) closes the run at once: WORKING stays."""
    server = running(kind)
    stream = await start(server)
    task_id = server.executor.task_id or ""
    closing = asyncio.ensure_future(closed(server))
    await wait_all_tasks_blocked()
    server.executor.step.open()
    took = await within(closing, BOUND_OF_ACLOSE)
    if kind == "stock":  # 1.0.x has no aclose() to compare.
        if getattr(server.handler, "aclose", None) is not None:
            assert await within(stored(server, task_id)) == "WORKING"
            assert not server.executor.completed.is_set()
        return
    state = await within(stored(server, task_id))
    assert state == "COMPLETED" and stream.last == "COMPLETED"
    assert not server.executor.cancel_called.is_set()
    assert took < DRAIN


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["stock", "ours"])
async def test_the_last_run_to_finish_shows_completed_on_its_stream(kind: str) -> None:
    """The one run going has finished, the store still saving its COMPLETED, as the shutdown
    begins: ours closes the runs only once the stream has shown it, and the store holds it.
    Stock's ``aclose()`` (1.1.2+) closes the run at once: the save is cut, the stream ends
    without COMPLETED, and the store keeps WORKING."""
    store = CompletionHeld(FinalStateTaskStore(InMemoryTaskStore()))
    server = running(kind, store=store)
    stream = await start(server)
    task_id = server.executor.task_id or ""
    server.executor.step.open()
    await within(store.gate.reached.wait())  # execute() has returned; COMPLETED is being saved.
    closing = asyncio.ensure_future(closed(server))
    await wait_all_tasks_blocked()  # aclose() goes as far as it goes while the save waits.
    store.gate.open()
    await within(closing, BOUND_OF_ACLOSE)
    assert await stream.ended()
    state = await within(stored(server, task_id))
    if kind == "stock" and getattr(server.handler, "aclose", None) is not None:
        assert stream.last == "WORKING" and state == "WORKING"
        return
    assert stream.last == "COMPLETED" and state == "COMPLETED"


@pytest.mark.asyncio
async def test_a_shutdown_leaves_a_parked_task_parked() -> None:
    """A task waiting for input runs nothing: ``aclose()`` leaves it INPUT_REQUIRED, at once."""
    server = running("ours", ScriptedExecutor(park=True))
    await start(server)
    took = await closed(server)
    assert await within(stored(server, server.executor.task_id or "")) == "INPUT_REQUIRED"
    assert not server.executor.cancel_called.is_set()
    assert took < DRAIN


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["send", "stream", "follow-up"])
async def test_a_message_sent_during_the_drain_is_refused(how: str) -> None:
    """While ``aclose()`` lets the runs finish, a new message (blocking or streamed, new task or
    follow-up) is refused with an A2A error that says why, and runs nothing."""
    executor = ScriptedExecutor(park=True)
    server = running("ours", executor)
    await start(server)
    parked = executor.task_id or ""
    held = Stream(server.calls.send_stream(SendMessageRequest(message=message()), "alice"))
    await within(executor.step.reached.wait())  # The second run works: the drain waits for it.
    closing = asyncio.ensure_future(closed(server))
    await wait_all_tasks_blocked()
    request = SendMessageRequest(message=message("again", parked if how == "follow-up" else ""))
    if how == "stream":
        refused = Stream(server.calls.send_stream(request, "alice"))
        assert await refused.ended()
        assert isinstance(refused.error, UnsupportedOperationError), refused.error
        assert "shutting down" in str(refused.error)
    else:
        assert await within(outcome(server.calls.send(request, "alice"))) == "UnsupportedOperation"
    assert executor.runs == 2
    executor.step.open()
    await within(closing, BOUND_OF_ACLOSE)
    assert await held.ended() and held.last == "COMPLETED"
    assert await within(stored(server, parked)) == "INPUT_REQUIRED"


@pytest.mark.asyncio
async def test_a_shutdown_names_a_running_task_whose_canceled_the_store_refused() -> None:
    """The store refuses every CANCELED: the run is cancelled at the end of the drain, its
    CANCELED is never recorded, and ``aclose()`` returns within its bound with a WARNING that
    names the task (it still shows WORKING)."""
    store = RefusesCanceled(FinalStateTaskStore(InMemoryTaskStore()))
    server = running("ours", store=store)
    await start(server)
    task_id = server.executor.task_id or ""
    with logged(f"task {task_id}: the store") as warned:
        took = await closed(server)
        await within(warned.wait())
    assert server.executor.cancel_called.is_set()
    assert took <= BOUND_OF_ACLOSE
    assert await within(stored(server, task_id)) == "WORKING"


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["stock", "ours"])
async def test_a_shutdown_ends_within_its_bound_a_run_that_ignores_the_cancel(kind: str) -> None:
    """An ``execute()`` that swallows every interrupt and a ``cancel()`` that never returns:
    ours still returns from ``aclose()`` within its bound, the store holding CANCELED. Stock's
    store keeps it WORKING."""
    server = running(kind, ScriptedExecutor(swallow=True, cancel="hang"))
    stream = await start(server)
    task_id = server.executor.task_id or ""
    try:
        took = await closed(server)
        state = await within(stored(server, task_id))
        if kind == "stock":  # Its aclose() (1.1.2+) waits for the run, which it cannot stop.
            assert state == "WORKING"
        else:
            assert state == "CANCELED" and await stream.ended() and stream.last == "CANCELED"
            assert DRAIN * 0.9 <= took <= BOUND_OF_ACLOSE
    finally:
        server.executor.released.set()
    await within(server.executor.stopped.wait())


@pytest.mark.asyncio
@pytest.mark.parametrize("store", ["in memory", "sqlite"])
@pytest.mark.parametrize("how", ["blocking", "non-blocking", "stream"])
@pytest.mark.parametrize("kind", ["stock", "ours"])
async def test_a_message_that_arrives_as_the_shutdown_begins_is_ended(
    kind: str, how: str, store: str, tmp_path: Path
) -> None:
    """A message reaches the handler in the loop turn ``aclose()`` is called in, just before
    it: taken, its run is one the shutdown ends as any other. Ours lets it go for the drain,
    then cancels it: ``cancel()`` is called, the sender is answered, the stream and the store
    end CANCELED. It saw no run yet and closed at once: the run registered just after, the
    SDK's close killed it, the sender was never answered, stream and store kept WORKING.
    Stock's ``aclose()`` (1.1.2+) kills the run too."""
    engine = (
        create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'tasks.db'}") if store == "sqlite" else None
    )
    task_store = None if engine is None else DatabaseTaskStore(engine)
    if task_store is not None:
        await within(task_store.initialize())
    server = running(kind, store=task_store)
    request = SendMessageRequest(message=message())
    request.configuration.return_immediately = how == "non-blocking"
    try:
        aclose = getattr(server.handler, "aclose", None)
        if aclose is None:  # Stock on 1.0.x: no shutdown to compare.
            assert kind == "stock"
            return
        if how == "stream":
            sender: Any = Stream(server.calls.send_stream(request, "alice"))
        else:
            sender = asyncio.ensure_future(outcome(server.calls.send(request, "alice")))
        loop = asyncio.get_running_loop()
        started = loop.time()
        await within(asyncio.ensure_future(aclose()), BOUND_OF_ACLOSE)  # In the same loop turn, after it.
        took = loop.time() - started
        task_id = server.executor.task_id or ""
        if kind == "stock":  # Killed as it started, if it did: never ended, cancel() never called.
            assert not task_id or await within(stored(server, task_id)) in (
                "TaskNotFound",
                "SUBMITTED",
                "WORKING",
            )
            assert not server.executor.cancel_called.is_set()
            return
        assert DRAIN * 0.9 <= took <= BOUND_OF_ACLOSE  # The run was drained, then cancelled.
        assert server.executor.cancel_called.is_set() and server.executor.stopped.is_set()
        assert await within(stored(server, task_id)) == "CANCELED"
        if how == "stream":
            assert await sender.ended() and sender.last == "CANCELED"
        else:
            answered = await within(sender)  # A non-blocking sender is answered as the run starts.
            assert answered in (("CANCELED",) if how == "blocking" else ("SUBMITTED", "WORKING"))
    finally:
        if engine is not None:
            await engine.dispose()
