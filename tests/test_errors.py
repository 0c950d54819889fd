"""What a client gets when a request fails: the error the executor's ``execute()`` raised, as
the SDK's handler passes it on; an A2A error for what the task store raised.

Ported from a2a-python's own tests: tests/integration/test_scenarios.py's scenarios 9, 12/13
and 15, and tests/server/request_handlers' ``test_on_message_send_error_does_not_hang``.
"""

from __future__ import annotations

import asyncio

import pytest
import wrapt
from a2a.helpers import new_task
from a2a.server.tasks import InMemoryTaskStore
from a2a.types import SendMessageRequest, TaskState
from a2a.utils.errors import InternalError

from a2a_cancelfix.testing import Bench, ScriptedExecutor, Stream, make_server, message, stored, within

ERROR = "TEST_ERROR_IN_EXECUTE"
BEFORE_ANY_EVENT, MID_TASK = "before any event", "mid-task"


class Fails(ScriptedExecutor):
    """Raises ``ValueError(ERROR)`` from ``execute()``: before any event, or mid-task (the task
    WORKING) once ``step`` opens."""

    def __init__(self, moment: str) -> None:
        super().__init__()
        self.moment = moment

    async def execute(self, context, event_queue) -> None:
        self.task_id = context.task_id
        if self.moment == MID_TASK:
            working = new_task(
                context.task_id or "",
                context.context_id or "",
                TaskState.TASK_STATE_WORKING,
                history=[context.message] if context.message else [],
            )
            await event_queue.enqueue_event(working)
            await self.step()
        raise ValueError(ERROR)


def described(error: BaseException | None) -> str:
    return "no error" if error is None else f"{type(error).__name__}: {error}"


async def failure(kind: str, transport: str, call: str, moment: str) -> tuple[str, str]:
    """Send a message to ``Fails(moment)`` on ``kind``'s handler over ``transport``; the error
    ``call`` (the blocking sender, the sender's stream, or a subscriber) ends with, and the
    task's state in the store then."""
    async with Bench(kind, transport) as bench:
        executor = Fails(moment)
        server = await bench.server(executor)
        request = SendMessageRequest(message=message())
        if call == "blocking":
            answer = asyncio.ensure_future(server.calls.send(request, "alice"))
            if moment == MID_TASK:
                await within(executor.step.reached.wait())
            executor.step.open()
            try:
                await within(answer)
                error = None
            except Exception as raised:
                error = raised
        else:
            sent = Stream(server.calls.send_stream(request, "alice"))
            ending = sent
            if moment == MID_TASK:
                await sent.until(lambda: sent.last == "WORKING")
                if call == "subscribed":
                    ending = Stream(server.calls.subscribe(executor.task_id or "", "alice"))
                    await ending.until(lambda: ending.events)  # Attached: it has the task.
            executor.step.open()
            assert await ending.ended()
            error = ending.error
        return described(error), await stored(server, executor.task_id or "")


CALLS = [
    ("blocking", BEFORE_ANY_EVENT),
    ("blocking", MID_TASK),
    ("streamed", BEFORE_ANY_EVENT),
    ("streamed", MID_TASK),
    ("subscribed", MID_TASK),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(("call", "moment"), CALLS, ids=[f"{call}, {moment}" for call, moment in CALLS])
@pytest.mark.parametrize("transport", ["in-process", "jsonrpc", "grpc"])
async def test_the_error_execute_raised_reaches_the_client_as_stock_passes_it_on(
    transport: str, call: str, moment: str
) -> None:
    """``execute()`` raises ``ValueError``: stock hands that very exception to its caller, in
    process, and the transport makes its error of it (JSON-RPC an ``InternalError`` with its
    message, gRPC UNKNOWN naming it); the task ends FAILED. Ours does the same, where it said
    "The request failed: ValueError"."""
    stock = await failure("stock", transport, call, moment)
    assert ERROR in stock[0], stock
    if transport == "in-process":
        assert stock[0] == f"ValueError: {ERROR}"
    assert await failure("ours", transport, call, moment) == stock


class FailingSaves(wrapt.ObjectProxy):  # type: ignore[misc]
    """A task store whose every save fails, as a broken driver's would."""

    async def save(self, *args, **kwargs) -> None:
        raise RuntimeError("This is an Error!")


@pytest.mark.asyncio
@pytest.mark.parametrize("streamed", [False, True], ids=["blocking", "streamed"])
@pytest.mark.parametrize("kind", ["stock", "ours"])
async def test_what_the_task_store_raised_reaches_the_client_as_an_a2a_error(
    kind: str, streamed: bool
) -> None:
    """The store's every save raises: stock hands the driver's ``RuntimeError`` to its caller,
    at once (upstream's test: the request does not hang); ours an ``InternalError``, as soon."""
    executor = ScriptedExecutor()
    executor.step.open()
    server = make_server(kind, executor, store=FailingSaves(InMemoryTaskStore()))
    request = SendMessageRequest(message=message())
    expected = RuntimeError if kind == "stock" else InternalError
    if streamed:
        sent = Stream(server.calls.send_stream(request, "alice"))
        assert await sent.ended()
        assert isinstance(sent.error, expected), repr(sent.error)
    else:
        with pytest.raises(expected):
            await within(server.calls.send(request, "alice"))
