"""Many live tasks, running and parked, cancelled at once: all end, and nothing is left behind."""

import asyncio
import gc
import tracemalloc

import pytest
from a2a.server.agent_execution.active_task import ActiveTask

from a2a_cancelfix import _sdk
from a2a_cancelfix.checkpoints import Run
from a2a_cancelfix.testing import caller, cancel, make_server, within
from a2a_cancelfix.testing.waits import eventually

from .fleet import FleetExecutor, start_fleet
from .support import tasks_since

COUNT = 200
# Rounds under tracemalloc cost seconds of CPU each. Two: the bound is per cancel, and the
# tables' noise (below) does not grow with the rounds.
ROUNDS = 2

# The event loop's own tables (its task and async-generator weak sets) keep the size they grew
# to, and rehash at their own pace: noise, not a leak. Leaked tasks are counted separately.
LOOP_TABLES = [
    tracemalloc.Filter(False, "*/asyncio/*"),
    tracemalloc.Filter(False, "*/_weakrefset.py"),
    tracemalloc.Filter(False, "*/weakref.py"),
]


@pytest.mark.asyncio
async def test_mass_cancel_ends_everything_and_leaks_nothing() -> None:
    """Every task ends CANCELED, every stream ends, and tasks, registry and memory return to before."""
    server = make_server("ours", FleetExecutor(), push=False)
    await _round(server, COUNT)  # Warms caches, so the memory check sees only what a round keeps.
    await _forget_stored_tasks(server)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot().filter_traces(LOOP_TABLES)
        runs_before = _live(ActiveTask)
        for _ in range(ROUNDS):
            assert await _round(server, COUNT) == {"CANCELED"}
            await _forget_stored_tasks(server)
        gc.collect()
        after = tracemalloc.take_snapshot().filter_traces(LOOP_TABLES)
    finally:
        tracemalloc.stop()
    # Dict tables reallocate as keys come and go: tens of kB, whatever the number of rounds.
    # A run left behind (its queues, tasks and Task) costs several kB per task.
    kept = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    assert kept < 512 * COUNT * ROUNDS, f"{kept} bytes kept after {COUNT * ROUNDS} cancels"
    assert _live(ActiveTask) == runs_before and _live(Run) == 0
    assert (
        server.handler.agent_executor.cancel_lifecycle.cancellations == {}
        and server.handler.agent_executor.cancel_lifecycle.works == {}
    )


async def _round(server, count: int) -> set[str]:
    """Cancel ``count`` tasks at once; return once no run nor task of theirs is left."""
    before = asyncio.all_tasks()
    streams = await start_fleet(server, count)
    outcomes = await within(asyncio.gather(*(cancel(server, task_id) for task_id in streams)), 30)
    for stream in streams.values():
        assert await stream.ended(10)
        assert stream.last in ("CANCELED", "INPUT_REQUIRED")  # A parked sender's stream ended earlier.

    async def drained() -> bool:
        runs = [await _sdk.has_run(server.handler, task_id) for task_id in streams]
        return not any(runs) and not tasks_since(before)

    await eventually(drained, 10)
    return set(outcomes)


async def _forget_stored_tasks(server) -> None:
    """Delete the finished tasks: the store keeps them by design, which is not a leak."""
    for task_id in list(_sdk.memory_tasks(server.store.wrapped).tasks.get("alice", {})):
        await server.store.delete(task_id, caller())


def _live(kind: type) -> int:
    """How many objects of ``kind`` are alive."""
    gc.collect()
    return sum(1 for thing in gc.get_objects() if isinstance(thing, kind))
