"""A server's shutdown (``await handler.aclose()``, then the loop ends): what waits behind the
answers (pushes to a slow webhook, a CANCELED the store failed to record) is finished within
``shutdown_drain_time``, or named in a WARNING."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import wrapt
from a2a.server.request_handlers.default_request_handler_v2 import DefaultRequestHandlerV2
from a2a.server.tasks import (
    BasePushNotificationSender,
    InMemoryPushNotificationConfigStore,
    InMemoryTaskStore,
)
from a2a.types import TaskState

from a2a_cancelfix import DefaultRequestHandler, FinalStateTaskStore
from a2a_cancelfix.testing import (
    Changes,
    Gate,
    PushReceiver,
    ScriptedExecutor,
    Server,
    caller,
    cancel,
    make_server,
    start,
    stored,
    wait_all_tasks_blocked,
    within,
)
from a2a_cancelfix.testing.servers import GRACE, Calls

from .support import logged

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
