"""Where a cancel comes from: one class per origin, each knowing where it lands at a point,
how its cancel is made, and what it expects of the run and its observers."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import ClassVar

from a2a.types import GetTaskRequest

from a2a_cancelfix import _sdk
from a2a_cancelfix._aio import bounded
from a2a_cancelfix.checkpoints import Run
from a2a_cancelfix.testing._probe import Point, raised_in
from a2a_cancelfix.testing._report import Row
from a2a_cancelfix.testing._world import MARGIN, PARKED, TERMINAL, World
from a2a_cancelfix.testing.servers import caller
from a2a_cancelfix.testing.waits import answer_or_hang, wait_all_tasks_blocked

ORIGINS = ("local", "remote", "client leaves")
"""Where a cancel comes from: a request to the replica running the task; a request to another
replica sharing its store; a request to the replica running it whose client goes away. The
sweep's default; ``"unwatched"`` is asked for by name (see `UNWATCHED_AFTER`)."""
UNWATCHED_AFTER = 0.2
"""The handler's ``cancel_unwatched_after`` in an ``unwatched`` row: the sender's client leaves,
nobody else watches, and the task must be cancelled (as unwatched) this long after."""


@dataclass(frozen=True)
class Aim:
    """What a cancel is made at, and for."""

    world: World
    row: Row
    applies: bool  # The task is stored and not ended: the cancel must cancel it.
    run: Run | None  # The run it must stop, when it applies and one runs at the point.
    bound: float  # How long its answer may take.


class Origin:
    """One origin of a cancel; `land` makes it at the point the run is held at."""

    name: ClassVar[str]
    unwatched_after: ClassVar[float | None] = None
    """Replica A's ``cancel_unwatched_after``; None: a subscriber and push watch the run, and
    the sender's client stays."""
    recorded_first: ClassVar[bool] = False
    """Whether another replica records CANCELED before the executor's ``cancel()`` runs: that
    ``cancel()`` raising cannot fail the task then."""

    def landings(self, point: Point) -> tuple[str, ...]:
        """Where the cancel lands at ``point``: as an await returns; for a parked task, alone or
        with a follow-up racing it; elsewhere at the point itself."""
        if point.kind == "await":
            return ("as it returns",)
        if point.kind == "parked":
            return ("alone", "follow-up racing")
        return ("",)

    def cancels(self, before: str) -> bool:
        """Whether it must cancel a live task that is stored as ``before``."""
        return True

    async def make(self, aim: Aim) -> str:
        """Make the cancel, let the held run go on as it lands; what it answered."""
        raise NotImplementedError

    def stop_within(self, left: float) -> float | None:
        """How long ``execute()`` may still run after the answer, ``left`` seconds of the answer's
        bound remaining; None: judged by `make`."""
        return left

    def store_ends(self, final: str, applies: bool) -> tuple[str, ...]:
        """The states the store may end on."""
        return (final,)

    async def land(self, world: World, row: Row) -> None:
        """Make the cancel at the point the run is held at; let the run go on as it lands; note
        in ``row`` what it answered, what went wrong, and what each observer must see."""
        point, probe, client = row.point, world.probe, world.client
        assert point is not None
        client.find_task()
        before = await client.stored()
        expected = "TaskNotFound" if before in ("nothing", "TaskNotFound") else "CANCELED"
        if before in TERMINAL:
            expected = "TaskNotCancelable"
        applies = expected == "CANCELED" and self.cancels(before)
        run = probe.run if applies and point.kind not in ("parked", "ended") else None
        # Past an await of its own (or before execute()), the run must notice before it starts
        # another: at a checkpoint or an event it publishes.
        probe.must_notice(applies and point.kind in ("await", "start"))
        if point.kind == "parked":
            client.stop()
        bound = world.plan.grace_period + MARGIN + 1.0
        loop = asyncio.get_running_loop()
        started = loop.time()
        row.answer = await self.make(Aim(world, row, applies, run, bound))
        took = loop.time() - started
        row.seen["answer"] = row.answer
        final = "CANCELED" if applies else ("COMPLETED" if expected != "TaskNotCancelable" else before)
        executor = world.executor
        if executor.error is not None:
            error = executor.error
            row.failures.append(
                f"{world.name}.cancel() raised {type(error).__name__}: {error}{raised_in(error)}"
            )
            if not self.recorded_first:  # The documented end of that: FAILED, the caller told so.
                expected, final = "Internal", "FAILED"
        if row.answer == "HANG":
            row.failures.append(f"the cancel did not answer within {bound:.1f} s")
        elif row.answer not in (expected, "client left"):
            row.failures.append(f"the cancel answered {row.answer}, not {expected}")
            expected = row.answer  # Said once: the comparison need not say it again.
        if run is not None:
            stop_by = self.stop_within(max(bound - took, 0.0))
            if stop_by is not None and not await _set_within(probe.finished, stop_by):
                row.failures.append("execute() still ran when the cancel returned: it ignored the cancel")
            if executor.called.is_set() and (executor.cut is not None or not executor.returned.is_set()):
                row.failures.append(
                    f"{world.name}.cancel() did not return within the grace period: it hangs{executor.cut or ''}"
                )
        row.expected["answer"] = (expected,)
        row.expected.update({key: (final,) for key in world.observers() if key != "sender"})
        row.expected["store"] = self.store_ends(final, applies)
        if client.followed_up is not None and world.watched:
            row.expected["sender"] = (final, "UnsupportedOperation") if applies else (final,)
        if applies and row.answer != "HANG":
            await world.check_released(row, "the cancel returned")


def _let_go(aim: Aim, interrupted: bool = False) -> None:
    """Let the held run go on: once the cancel signals it, or at once if it signals none. An
    interrupted await is let go by the interrupt itself."""
    if aim.run is None:
        aim.world.probe.open()
    elif not interrupted:
        aim.run.add_callback(aim.world.probe.open)


class Local(Origin):
    """A request to the replica running the task."""

    name = "local"

    def landings(self, point: Point) -> tuple[str, ...]:
        if point.kind == "await":  # During it too: the interrupt lands on it, or, shielded, waits.
            return ("as it returns", "while pending" if point.shielded else "interrupted")
        return super().landings(point)

    async def make(self, aim: Aim) -> str:
        request = asyncio.ensure_future(aim.world.client.cancel(aim.world.a))
        _let_go(aim, interrupted=aim.row.landing == "interrupted")
        return await answer_or_hang(request, aim.bound)

    def stop_within(self, left: float) -> float | None:
        return 0.0  # Its answer comes once execute() has returned.


class Remote(Origin):
    """A request to replica B, which records it in the shared store; A hears it as a notice."""

    name = "remote"
    recorded_first = True

    async def make(self, aim: Aim) -> str:
        heard = asyncio.Event()
        if aim.run is not None:
            aim.run.add_callback(heard.set)
            # A heard B's cancel: the run goes on as it does, in that very loop turn, as after
            # a local cancel (`_let_go`), not once B's answer has come back too: how many turns
            # that takes is asyncio's (up to Python 3.11, wait_for ran it in a task of its own).
            aim.run.add_callback(aim.world.probe.open)
        answer = await answer_or_hang(aim.world.client.cancel(aim.world.b), aim.bound)
        if aim.run is not None:
            await _set_within(heard, aim.bound)
        aim.world.probe.open()
        return answer


class ClientLeaves(Origin):
    """A request to the replica running the task, whose client goes away while it is in progress."""

    name = "client leaves"

    async def make(self, aim: Aim) -> str:
        world = aim.world
        request = asyncio.ensure_future(world.client.cancel(world.a))
        _let_go(aim)
        if not aim.applies:
            return await answer_or_hang(request, aim.bound)
        underway = asyncio.ensure_future(world.executor.called.wait())
        await asyncio.wait({underway, request}, timeout=aim.bound, return_when=asyncio.FIRST_COMPLETED)
        underway.cancel()
        request.cancel()  # The client goes away while its cancel is in progress.
        return "client left"


class Unwatched(Origin):
    """Nobody asks: the sender's client leaves, nobody else watches the task, and replica A's
    ``cancel_unwatched_after`` must cancel it."""

    name = "unwatched"
    unwatched_after = UNWATCHED_AFTER

    def landings(self, point: Point) -> tuple[str, ...]:
        if point.kind in ("parked", "ended"):
            return ()  # Nothing runs there: a task nobody watches is left alone (by default).
        return super().landings(point)

    def cancels(self, before: str) -> bool:
        return before not in PARKED  # Stored as parked: left alone, as the option leaves it by default.

    async def make(self, aim: Aim) -> str:
        _let_go(aim)
        await self._leave(aim)
        return "client left"

    def stop_within(self, left: float) -> float | None:
        return None

    def store_ends(self, final: str, applies: bool) -> tuple[str, ...]:
        if applies:
            return (final,)
        # Nobody saw it: it parks, runs to its end, or, running on unwatched, is cancelled.
        return (final, "CANCELED", *sorted(PARKED))

    async def _leave(self, aim: Aim) -> None:
        """The sender's client goes away and nobody else watches: the task must be cancelled
        as unwatched within the option's interval, the grace period and the margin."""
        world, row, plan = aim.world, aim.row, aim.world.plan
        probe, executor = world.probe, world.executor
        world.client.leave()
        bound = UNWATCHED_AFTER + plan.grace_period + MARGIN
        if not aim.applies:  # The run goes on: to its end, to a parking, or to the option's cancel.
            if not await _set_within(probe.finished, bound + plan.took):
                row.failures.append(
                    f"execute() still ran {bound + plan.took:.1f} s after its client left: nothing stopped it"
                )
            return
        if not await _set_within(probe.finished, bound):
            called_not = "" if executor.called.is_set() else f", and {world.name}.cancel() was not called"
            row.failures.append(
                f"execute() still ran {bound:g} s after its client left and nobody watched the task{called_not}"
            )
            probe.must_notice(False)  # No cancel came: what it does next is not late.
            probe.open()  # Let it go on: the row has said what went wrong.
            return
        if not executor.called.is_set():
            row.failures.append(f"the task went unwatched and {world.name}.cancel() was not called")
        else:  # Nobody waits for this cancel's answer: the row waits for its end (cut, if it hangs).
            await _set_within(executor.returned, plan.grace_period + MARGIN)
        await wait_all_tasks_blocked()
        task = await world.a.on_get_task(GetTaskRequest(id=world.client.task_id), caller())
        if task is not None and _sdk.state_name(task.status.state) == "CANCELED":
            said = " ".join(part.text for part in task.status.message.parts)
            if "nobody watched" not in said:
                row.failures.append(f"the CANCELED task's status does not say nobody watched it: {said!r}")


BY_NAME: dict[str, Origin] = {
    origin.name: origin for origin in (Local(), Remote(), ClientLeaves(), Unwatched())
}
"""Every origin, by the name a row and a scenario file give it; ``ORIGINS`` first."""


async def _set_within(event: asyncio.Event, seconds: float) -> bool:
    if not event.is_set() and seconds > 0:
        with contextlib.suppress(asyncio.TimeoutError):
            await bounded(event.wait(), seconds)
    return event.is_set()
