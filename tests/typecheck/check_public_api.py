"""The public API as a user's type checker sees it: checked by mypy (`nox -s typecheck`), never run.

Each `assert_type` states a type the API promises. Each ``type: ignore[...]`` marks a call the
checker must refuse: mypy's ``warn_unused_ignores`` fails the check if it stops refusing it
(a decorator that lost the signature would accept anything).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, assert_type

from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events.event_queue import EventQueue
from a2a.server.request_handlers import DefaultRequestHandlerV2
from a2a.server.tasks import InMemoryTaskStore, TaskStore
from a2a.types import AgentCard, Task

from a2a_cancelfix import (
    CancellableExecutor,
    DefaultRequestHandler,
    FinalStateTaskStore,
    RunCancelled,
    cancel_requested,
    cancellable,
    checkpoint,
    on_cancel,
    patch,
    shielded,
    unpatch,
)


class Agent(AgentExecutor):
    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        await checkpoint()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        return None

    @cancellable
    async def step(self, number: int) -> str:
        return str(number)


# @cancellable keeps the decorated function's parameters and its result, async or not, and binds
# as a method.
@cancellable
async def fetch(url: str, *, retries: int = 3) -> bytes:
    return url.encode() * retries


@cancellable
def parse(data: bytes) -> dict[str, int]:
    return {"size": len(data)}


async def decorated() -> None:
    assert_type(fetch("https://example.com", retries=2), Coroutine[Any, Any, bytes]).close()
    assert_type(await fetch("https://example.com"), bytes)
    assert_type(parse(b"x"), dict[str, int])
    assert_type(await Agent().step(1), str)
    await asyncio.create_task(fetch("https://example.com"))  # A coroutine still, not just an awaitable.
    await fetch(1)  # type: ignore[arg-type]
    await fetch("https://example.com", tries=2)  # type: ignore[call-arg]
    parse("x")  # type: ignore[arg-type]
    await Agent().step("one")  # type: ignore[arg-type]


# The calls inside a run.
async def inside_a_run() -> None:
    assert_type(checkpoint(), Awaitable[None])
    assert_type(await checkpoint(), None)
    assert_type(cancel_requested(), bool)
    unregister = on_cancel(lambda: None)
    assert_type(unregister, Callable[[], None])
    async with shielded() as nothing:
        assert_type(nothing, None)
    try:
        await checkpoint()
    except RunCancelled as cancelled:
        assert_type(cancelled.reason, str)
        assert_type(cancelled.requested_at, float)
        assert isinstance(cancelled, asyncio.CancelledError)


# The handler takes the SDK's constructor arguments and is the SDK's handler; its own options
# are checked. The proxy is an AgentExecutor, the guarded store a TaskStore.
def wiring(card: AgentCard) -> None:
    store = FinalStateTaskStore(InMemoryTaskStore())
    assert_type(store, FinalStateTaskStore)
    guarded: TaskStore = store
    handler: DefaultRequestHandlerV2 = DefaultRequestHandler(
        Agent(), guarded, card, cancel_grace_period=2.0, on_parked="refuse", on_canceled="return"
    )
    DefaultRequestHandler(Agent(), guarded, card, on_parked="later")  # type: ignore[arg-type]
    DefaultRequestHandler(Agent(), guarded, card, cancel_grace_period="2s")  # type: ignore[arg-type]
    executor: AgentExecutor = CancellableExecutor(Agent(), grace_period=2.0)
    DefaultRequestHandlerV2(executor, InMemoryTaskStore(), card)
    CancellableExecutor(Agent(), grace_period="2s")  # type: ignore[arg-type]
    assert_type(patch(cancel_grace_period=2.0), None)
    assert_type(unpatch(), None)
    del handler


async def answered(handler: DefaultRequestHandler, request: Any, context: Any) -> None:
    assert_type(await handler.on_cancel_task(request, context), Task)
