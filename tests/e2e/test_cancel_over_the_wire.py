"""The cancel contract over the wire: real servers on 127.0.0.1, the SDK's own client, on
JSON-RPC, REST (HTTP+JSON) and gRPC; each test runs once per transport."""

from __future__ import annotations

import asyncio

import pytest
from a2a.types import (
    CancelTaskRequest,
    GetTaskRequest,
    SubscribeToTaskRequest,
    TaskNotCancelableError,
    TaskNotFoundError,
    TaskPushNotificationConfig,
)

from a2a_cancelfix._sdk import SDK_VERSION
from a2a_cancelfix.testing import ScriptedExecutor, Stream, state_of, wait_all_tasks_blocked, within

from .clients import raw_cancel
from .harness import Wire

NOT_FOUND = {"jsonrpc": "-32001", "rest": "404", "grpc": "NOT_FOUND"}
NOT_CANCELABLE = {
    "jsonrpc": "-32002",
    "rest": "409" if SDK_VERSION == "1.0.0" else "400",  # 1.0.0 maps it to 409 Conflict.
    "grpc": "FAILED_PRECONDITION",
}
SDK_RELEASE = tuple(int(part) for part in SDK_VERSION.split(".")[:3])
HTTP_TRANSPORTS = ("jsonrpc", "rest")


async def ending(stream: Stream) -> str:
    """How a stream ended: its last event and state, its error, or that it is still open."""
    if not await stream.ended():
        return f"still open after {stream.last}"
    if stream.error is not None:
        return type(stream.error).__name__
    last = stream.events[-1] if stream.events else None
    return f"{type(last).__name__} {state_of(last)}"


@pytest.mark.asyncio
async def test_cancel_ends_every_stream_on_canceled(wire: Wire) -> None:
    """A cancel from a second client ends the sender's stream and an earlier SubscribeToTask
    stream on a CANCELED status event, and GetTask shows CANCELED."""
    agent = await wire.serve()
    sender, other = await wire.connect(agent), await wire.connect(agent)
    stream, task_id = await wire.start(sender, agent)
    subscriber = wire.watch(other.subscribe(SubscribeToTaskRequest(id=task_id)))
    await subscriber.until(lambda: subscriber.events)

    canceled = await within(other.cancel_task(CancelTaskRequest(id=task_id)))

    assert state_of(canceled) == "CANCELED"
    assert await ending(stream) == "TaskStatusUpdateEvent CANCELED"
    assert await ending(subscriber) == "TaskStatusUpdateEvent CANCELED"
    assert state_of(await within(sender.get_task(GetTaskRequest(id=task_id)))) == "CANCELED"


@pytest.mark.asyncio
async def test_stock_handler_leaves_streams_on_working(wire: Wire) -> None:
    """The SDK's own handler ends both streams on WORKING; its cancel and GetTask show WORKING
    before a2a-sdk 1.1.4 and CANCELED from 1.1.4 on."""
    agent = await wire.serve(stock=True)
    sender, other = await wire.connect(agent), await wire.connect(agent)
    stream, task_id = await wire.start(sender, agent)
    subscriber = wire.watch(other.subscribe(SubscribeToTaskRequest(id=task_id)))
    await subscriber.until(lambda: subscriber.events)

    returned = await within(other.cancel_task(CancelTaskRequest(id=task_id)))

    recorded = "CANCELED" if SDK_RELEASE >= (1, 1, 4) else "WORKING"
    assert state_of(returned) == recorded
    assert await stream.ended() and stream.last == "WORKING"
    assert await subscriber.ended() and subscriber.last == "WORKING"
    assert state_of(await within(sender.get_task(GetTaskRequest(id=task_id)))) == recorded


@pytest.mark.asyncio
async def test_cancel_of_a_parked_task_ends_canceled(wire: Wire) -> None:
    """A task parked in INPUT_REQUIRED is canceled: the cancel returns CANCELED, GetTask shows
    it, and the executor's cancel() ran."""
    agent = await wire.serve(ScriptedExecutor(park=True))
    client = await wire.connect(agent)
    _, task_id = await wire.start(client, agent)

    assert await within(raw_cancel(agent, task_id)) == "CANCELED"
    assert agent.executor.cancel_called.is_set()
    assert state_of(await within(client.get_task(GetTaskRequest(id=task_id)))) == "CANCELED"


@pytest.mark.asyncio
async def test_cancel_of_an_unknown_task_is_not_found(wire: Wire) -> None:
    """Cancelling an id the server never saw gets the transport's not-found error."""
    agent = await wire.serve()
    client = await wire.connect(agent)

    assert await within(raw_cancel(agent, "no-such-task")) == NOT_FOUND[wire.transport]
    with pytest.raises(TaskNotFoundError):
        await within(client.cancel_task(CancelTaskRequest(id="no-such-task")))


@pytest.mark.asyncio
async def test_cancel_of_a_completed_task_is_not_cancelable(wire: Wire) -> None:
    """Cancelling a COMPLETED task gets the transport's not-cancelable error and leaves it
    COMPLETED."""
    agent = await wire.serve()
    client = await wire.connect(agent)
    stream, task_id = await wire.start(client, agent)
    agent.executor.step.open()
    assert await ending(stream) == "TaskStatusUpdateEvent COMPLETED"

    assert await within(raw_cancel(agent, task_id)) == NOT_CANCELABLE[wire.transport]
    with pytest.raises(TaskNotCancelableError):
        await within(client.cancel_task(CancelTaskRequest(id=task_id)))
    assert state_of(await within(client.get_task(GetTaskRequest(id=task_id)))) == "COMPLETED"


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", HTTP_TRANSPORTS)
async def test_another_user_can_neither_cancel_nor_watch_the_task(wire: Wire) -> None:
    """Another authenticated user's cancel and subscribe get not-found, and the owner's stream
    stays open until the owner cancels, then ends on CANCELED."""
    agent = await wire.serve()
    owner, intruder = await wire.connect(agent, "alice"), await wire.connect(agent, "mallory")
    stream, task_id = await wire.start(owner, agent)

    intruding = raw_cancel(agent, task_id, user="mallory")
    assert await within(intruding) == NOT_FOUND[wire.transport]
    spy = wire.watch(intruder.subscribe(SubscribeToTaskRequest(id=task_id)))
    assert await ending(spy) == "TaskNotFoundError"
    await wait_all_tasks_blocked()  # Whatever the intruder's requests set off has run its course.
    assert not stream.task.done() and stream.last == "WORKING"
    assert not agent.executor.cancel_called.is_set() and not agent.executor.stopped.is_set()

    assert state_of(await within(owner.cancel_task(CancelTaskRequest(id=task_id)))) == "CANCELED"
    assert await ending(stream) == "TaskStatusUpdateEvent CANCELED"


@pytest.mark.asyncio
async def test_push_configs_receive_canceled(wire: Wire) -> None:
    """A push config set in SendMessage and one created afterwards both receive the CANCELED
    update."""
    receiver = await wire.push_receiver()
    agent = await wire.serve()
    client = await wire.connect(agent)
    _, task_id = await wire.start(client, agent, push_url=receiver.url + "in-request")
    created = TaskPushNotificationConfig(task_id=task_id, id="created", url=receiver.url + "created")
    await within(client.create_task_push_notification_config(created))

    await within(client.cancel_task(CancelTaskRequest(id=task_id)))

    await receiver.posted(receiver.url + "in-request", "CANCELED")
    await receiver.posted(receiver.url + "created", "CANCELED")


@pytest.mark.asyncio
async def test_a_caller_that_leaves_mid_cancel_does_not_stop_it(wire: Wire) -> None:
    """A client that disconnects while its CancelTask is in progress does not stop the cancel:
    the task ends CANCELED."""
    agent = await wire.serve(ScriptedExecutor(cancel="gate"))
    client = await wire.connect(agent)
    stream, task_id = await wire.start(client, agent)
    before = agent.callers()
    request = asyncio.ensure_future(raw_cancel(agent, task_id))
    await within(agent.executor.cancel_gate.reached.wait())  # The executor's cancel() is running.
    caller = agent.callers() - before
    assert caller

    # The caller goes away: its HTTP connection is closed, or its gRPC call cancelled...
    request.cancel()
    await within(asyncio.wait({request}))
    # ...and the server has noticed: uvicorn dropped the connection (the handler runs on: an
    # HTTP disconnect does not cancel it), or gRPC cancelled the servicer's CancelTask.
    await agent.callers_changed.until(lambda: not agent.callers() & caller)
    agent.executor.cancel_gate.open()

    assert await ending(stream) == "TaskStatusUpdateEvent CANCELED"
    assert state_of(await within(client.get_task(GetTaskRequest(id=task_id)))) == "CANCELED"
