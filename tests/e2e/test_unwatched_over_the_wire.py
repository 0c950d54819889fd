"""``cancel_unwatched_after`` over JSON-RPC on a real socket: the client really closes its
connection, and the server notices that on its own."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from a2a.types import GetTaskRequest

from a2a_cancelfix.testing import ScriptedExecutor, state_of, within
from a2a_cancelfix.testing.waits import eventually

from ..support import set_within
from .clients import connect
from .harness import Wire

AFTER = 0.3
QUIET = 3 * AFTER


async def leave_mid_run(wire: Wire, **options: float) -> tuple[ScriptedExecutor, str, float, object]:
    """Serve with ``options``, stream a message, then close the client's connection mid-run.

    Returns the executor, the task, when the client began to leave, and the agent.
    """
    executor = ScriptedExecutor()
    agent = await wire.serve(executor, **options)
    before = agent.callers()
    async with connect(agent) as client:
        stream, task_id = await wire.start(client, agent)
        streaming = agent.callers() - before
        assert streaming
        left_at = asyncio.get_running_loop().time()  # No clock can start before.
        stream.task.cancel()  # The client stops reading and closes its connection.
        await within(asyncio.wait({stream.task}))
    await agent.callers_changed.until(lambda: not agent.callers() & streaming)
    return executor, task_id, left_at, agent


@pytest.mark.asyncio
async def test_a_client_that_closes_its_connection_and_never_comes_back() -> None:
    """Nobody comes back: CANCELED after the interval, cancel() called, the work stopped, and
    a client that reads the task later is told why."""
    wire = Wire("jsonrpc")
    try:
        executor, task_id, left_at, agent = await leave_mid_run(wire, cancel_unwatched_after=AFTER)
        await within(executor.cancel_called.wait(), AFTER + 2.0)
        assert asyncio.get_running_loop().time() - left_at >= AFTER
        await within(executor.stopped.wait())
        assert not executor.completed.is_set()
        async with connect(agent) as client:  # type: ignore[arg-type]
            seen: list[Any] = []

            async def recorded() -> bool:  # Once the work stopped: within the grace bound.
                seen.append(await client.get_task(GetTaskRequest(id=task_id)))
                return state_of(seen[-1]) == "CANCELED"

            await eventually(recorded)
        assert "nobody watched the task" in seen[-1].status.message.parts[0].text
    finally:
        await wire.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("stock", [False, True], ids=["ours, option off", "stock"])
async def test_without_the_option_the_task_runs_on(stock: bool) -> None:
    """Off (the default), as under the SDK's own handler: the task runs on with nobody watching."""
    wire = Wire("jsonrpc")
    try:
        executor = ScriptedExecutor()
        agent = await wire.serve(executor, stock=stock)
        before = agent.callers()
        async with connect(agent) as client:
            stream, task_id = await wire.start(client, agent)
            streaming = agent.callers() - before
            stream.task.cancel()
            await within(asyncio.wait({stream.task}))
        await agent.callers_changed.until(lambda: not agent.callers() & streaming)
        assert not await set_within(executor.cancel_called, QUIET)
        async with connect(agent) as client:
            assert state_of(await within(client.get_task(GetTaskRequest(id=task_id)))) == "WORKING"
        executor.step.open()
        await within(executor.completed.wait())
    finally:
        await wire.aclose()
