"""`sweep`: does YOUR executor stop cleanly, wherever the cancel lands?

The sweep runs the executor once uncancelled (it must still complete), records its cancel
points (see `Point`), then runs it again once per point, origin and landing, with the cancel
landing exactly there: the run is held at the point until the cancel has reached it, so no
row depends on timing. Each run builds its own world (`World`: the handlers, the store, who
watches); each origin (`Origin`) makes its cancel there and says what it expects; each run
gives a `Row` of the `Report`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from a2a.server.agent_execution import AgentExecutor

from a2a_cancelfix.testing._clock import VirtualTimeLoop
from a2a_cancelfix.testing._origins import BY_NAME, ORIGINS, Origin
from a2a_cancelfix.testing._probe import Point
from a2a_cancelfix.testing._report import Report, Row, compare, spec, with_scenario
from a2a_cancelfix.testing._world import MARGIN, RUN_BOUND, Factory, Plan, Released, World
from a2a_cancelfix.testing.waits import BOUND, in_own_loop, wait_all_tasks_blocked

EVERY_ORIGIN = tuple(BY_NAME)
Progress = Callable[[Row, int, int], None]


async def sweep(
    executor_factory: Factory,
    *,
    message: str | Sequence[str] = "hello",
    origins: Sequence[str] = ORIGINS,
    grace_period: float = 1.0,
    released: Released | None = None,
    every_occurrence: bool = False,
    fail_fast: bool = False,
    real_time: bool = False,
    progress: Progress | None = None,
) -> Report:
    """Cancel a fresh executor at each of its cancel points; report what every observer saw.

    Args:
        executor_factory: makes the executor (an ``AgentExecutor``), once per run.
        message: the message that starts the task; or several, each next one answering the
            task when it parks for input (INPUT_REQUIRED, AUTH_REQUIRED).
        origins: which of `ORIGINS` to cancel from; ``"unwatched"`` too, to see that the task
            is cancelled once its sender's client leaves and nobody else watches it.
        grace_period: the handler's ``cancel_grace_period`` in these runs.
        released: ``released(executor)`` (may be async) is true once the executor has let go
            of what it holds (a claim, a lease); checked when the cancel returns.
        every_occurrence: cancel at every occurrence of a code path that repeats (a loop's
            iterations), not only at its first, second and last: for a defect that shows on
            one iteration only.
        fail_fast: stop at the first failing row.
        real_time: run on the real clock. By default a run's clock skips the waits only its
            own timers can end (an ``asyncio.sleep``), which leaves what a row sees the same;
            for an executor that reads the wall clock (``time.monotonic()``) to pace itself.
        progress: ``progress(row, done, total)``, called as each row is done.

    Raises:
        ValueError: an origin that is not one of `EVERY_ORIGIN`, a grace period that is not a
            positive number of seconds, or a factory that does not make an executor.
    """
    messages = [message] if isinstance(message, str) else list(message)
    unknown = set(origins) - set(EVERY_ORIGIN)
    if unknown or not messages:
        raise ValueError(
            f"origins must be among {EVERY_ORIGIN}, not {sorted(unknown)}; and one message at least"
        )
    check_setup(executor_factory, grace_period)
    plan = Plan(executor_factory, messages, grace_period, released, spec(executor_factory))
    contrast, points, took = await asyncio.to_thread(in_own_loop, uncancelled, plan, real_time=real_time)
    plan = dataclasses.replace(plan, took=took)
    moments, folded = [], 0
    if contrast.ok:
        kept = set(map(id, points if every_occurrence else fold(points)))
        for point in points:
            for origin in origins:
                landings = BY_NAME[origin].landings(point)
                if id(point) in kept:
                    moments += [(point, origin, landing) for landing in landings]
                else:
                    folded += len(landings)
    rows, total = [contrast], 1 + len(moments)
    if progress is not None:
        progress(contrast, 1, total)
    for point, origin, landing in moments:
        row = await asyncio.to_thread(
            in_own_loop, cancelled, plan, point, origin, landing, real_time=real_time
        )
        rows.append(row)
        if progress is not None:
            progress(row, len(rows), total)
        if fail_fast and not row.ok:
            break
    return Report(rows, folded, total - len(rows), claims_judged=released is not None)


def fold(points: Sequence[Point]) -> list[Point]:
    """The points to cancel at: of those on one code path (one kind, path and stack, as a
    loop's iterations are), the first, the second (what an iteration carries over from the
    one before) and the last."""
    paths: dict[tuple[str, str, tuple[str, ...]], list[Point]] = {}
    for point in points:
        paths.setdefault((point.kind, point.path, point.stack), []).append(point)
    kept = {id(point) for same in paths.values() for point in same[:2] + same[-1:]}
    return [point for point in points if id(point) in kept]


def check_setup(factory: Any, grace_period: float) -> None:
    """Refuse, before any run, what no row could say anything useful about.

    A factory that is not a class is called once, to see that it makes an executor.

    Raises:
        ValueError: naming what is wrong.
    """
    if not isinstance(grace_period, (int, float)) or not math.isfinite(grace_period) or grace_period <= 0:
        raise ValueError(f"the grace period must be a positive number of seconds, not {grace_period!r}")
    name = getattr(factory, "__qualname__", None) or repr(factory)
    if not callable(factory):
        raise ValueError(f"{name} is not an executor class nor a factory that makes one")
    try:
        inspect.signature(factory).bind()
    except TypeError as error:
        raise ValueError(
            f"{name} cannot be called without arguments ({error}): give a factory that can"
        ) from None
    except ValueError:  # No signature to read (a builtin): calling it will tell.
        pass
    if isinstance(factory, type):
        made: Any = factory
    else:
        try:
            made = factory()
        except Exception as error:
            raise ValueError(f"{name}() raised {error!r}") from error
    if not _executor_like(made):
        what = (
            made.__qualname__ if isinstance(made, type) else f"{name}() made {type(made).__qualname__}, which"
        )
        raise ValueError(f"{what} is not an AgentExecutor: it needs async execute() and cancel()")


def _executor_like(made: Any) -> bool:
    if isinstance(made, AgentExecutor) or (isinstance(made, type) and issubclass(made, AgentExecutor)):
        return True
    return all(inspect.iscoroutinefunction(getattr(made, name, None)) for name in ("execute", "cancel"))


# One run: the uncancelled one, or one row's.


async def uncancelled(plan: Plan) -> tuple[Row, list[Point], float]:
    """The run with no cancel: its row, the points it reached, and how long it took."""
    row, world, took = Row(None, "", ""), None, plan.took
    try:
        world = World(plan)
        took = await _uncancelled(row, world)
    except Exception as error:  # The executor's or the SDK's: the row says so.
        row.failures.append(f"the run raised {error!r}")
    return row, [] if world is None else world.probe.points, took  # Those it reached, if it raised.


async def _uncancelled(row: Row, world: World) -> float:
    loop = asyncio.get_running_loop()
    started, really = loop.time(), time.monotonic()  # The bounds of the rows are on the loop's clock too.
    async with world:
        await world.client.converse(RUN_BOUND)
        took = loop.time() - started
        await world.observe(row)
        row.expected.update(dict.fromkeys(world.observers(), ("COMPLETED",)))
        if world.client.parked_stream:
            row.expected["stream"] = (world.client.parked_stream,)
        compare(row)
        if not row.ok and took >= RUN_BOUND and isinstance(loop, VirtualTimeLoop):
            # Out of time on a clock that skipped its waits: a wall-clock pace never got there.
            row.failures.append(
                f"the run had not ended after {took:.0f} s of the sweep's clock ({time.monotonic() - really:.1f} s"
                " of real time: waits on timers are skipped); if it paces itself by the wall clock"
                " (time.monotonic(), time.time()), sweep it with --real-time (real_time=True)"
            )
        await world.check_released(row, "the uncancelled run ended")
        await world.check_leftovers(row, "the uncancelled run ended")
    return took


async def cancelled(plan: Plan, point: Point, origin: str, landing: str) -> Row:
    """The run with a cancel from ``origin`` landing at ``point``: its row, with the scenario
    file that replays it."""
    row = Row(point, origin, landing)
    try:
        await _cancelled(plan, row, BY_NAME[origin])
    except Exception as error:
        row.failures.append(f"the run raised {error!r}")
    released = spec(plan.released) if plan.released is not None else ""
    return with_scenario(row, plan.spec, plan.messages, plan.grace_period, released)


async def _cancelled(plan: Plan, row: Row, origin: Origin) -> None:
    point = row.point
    assert point is not None
    pending = row.landing in ("interrupted", "while pending")
    bound = plan.took + plan.grace_period + MARGIN + BOUND
    async with World(plan, point.key, pending, origin.unwatched_after) as world:
        probe, client = world.probe, world.client
        conversation = asyncio.ensure_future(client.converse(bound, race=row.landing == "follow-up racing"))
        reached = asyncio.ensure_future(probe.reached.wait())
        await asyncio.wait({conversation, reached}, timeout=bound, return_when=asyncio.FIRST_COMPLETED)
        if not probe.reached.is_set():
            reached.cancel()
            row.failures.append(
                f"the run never reached {_ordinal(point.occurrence)} {point.kind} {point.path}:"
                " it took another path"
            )
            return
        row.point = next(here for here in probe.points if here.key == point.key)  # This run's.
        await wait_all_tasks_blocked()
        stream_over, stream_parked = client.stream_so_far()  # As the cancel lands.
        await origin.land(world, row)
        await asyncio.wait({conversation}, timeout=bound)
        parked = world.watched and (stream_parked or client.parked_stream)
        if parked and (stream_over or row.expected["answer"] != ("CANCELED",)):
            row.expected["stream"] = (parked,)  # Its request had ended, parked.
        elif parked:  # It had the parked state: it may end there, as its request did.
            row.expected["stream"] = (*row.expected["stream"], parked)
        await world.observe(row)
        if plan.expect is not None:  # A scenario file says what each must see.
            row.expected = dict(plan.expect)
        compare(row)
        await world.check_leftovers(row, "the cancel returned")


def _ordinal(number: int) -> str:
    suffix = "th" if 10 <= number % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(number % 10, "th")
    return f"{number}{suffix}"
