"""The asyncio plumbing: thousands of deadlines on one loop timer, signals waited for by deadline."""

from __future__ import annotations

import asyncio
import contextvars
import gc
import weakref

import pytest

from a2a_cancelfix._aio import Once, deadline_in, deadlines, wait_done, wait_patiently, wait_set
from a2a_cancelfix.testing import within

_seen: contextvars.ContextVar[str] = contextvars.ContextVar("seen", default="none")


@pytest.mark.asyncio
async def test_many_deadlines_fire_in_order_on_one_loop_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    """1,000 deadlines arm the loop's timer once each time the earliest changes, not once each;
    a dropped one never fires; each fires once, in order, and none before its time."""
    loop = asyncio.get_running_loop()
    armed: list[float] = []
    real_call_at = loop.call_at

    timers = deadlines()

    def call_at(when: float, callback, *args, **kwargs):  # type: ignore[no-untyped-def]
        if getattr(callback, "__self__", None) is timers:
            armed.append(when)
        return real_call_at(when, callback, *args, **kwargs)

    monkeypatch.setattr(loop, "call_at", call_at)
    fired: list[tuple[int, bool]] = []
    all_fired = asyncio.Event()
    start = loop.time() + 0.05
    whens = [start + (index % 10) * 0.001 for index in range(1000)]  # Ten instants, shuffled in.

    def fire(index: int) -> None:
        fired.append((index, loop.time() >= whens[index]))
        if len(fired) == 999:
            all_fired.set()

    entries = [timers.at(when, lambda index=index: fire(index)) for index, when in enumerate(whens)]
    timers.drop(entries[500])
    await within(all_fired.wait())
    assert len(armed) <= 10  # The first entry, then each later instant after one fires.
    assert sorted(index for index, _ in fired) == [index for index in range(1000) if index != 500]
    assert all(on_time for _, on_time in fired)
    assert [whens[index] for index, _ in fired] == sorted(whens[index] for index, _ in fired)


@pytest.mark.asyncio
async def test_dropping_a_deadline_that_fired_is_nothing() -> None:
    """A cancel's call drops its cut-off as it ends, also after the cut-off fired: the entry
    is out of the heap by then, and must not be counted among the dropped ones waiting in it
    (the count decides when the heap is swept)."""
    timers = deadlines()
    fired = asyncio.Event()
    due = deadline_in(0.001)  # One instant for all: a loaded machine's loop must not spread them.
    entries = [timers.at(due, fired.set) for _ in range(100)]
    pending = timers.at(deadline_in(60), lambda: None)
    await within(fired.wait())
    for entry in entries:
        timers.drop(entry)
    timers.drop(pending)
    assert timers._dropped == sum(1 for entry in timers._heap if entry[2] is None) == 1


@pytest.mark.asyncio
async def test_a_deadline_fires_outside_the_context_that_set_it() -> None:
    """The loop's timer must not keep a run's context (and the run) alive as long as it waits."""
    seen: list[str] = []
    done = asyncio.Event()

    def fire() -> None:
        seen.append(_seen.get())
        done.set()

    token = _seen.set("a run's")
    try:
        deadlines().at(deadline_in(0.01), fire)
    finally:
        _seen.reset(token)
    await within(done.wait())
    assert seen == ["none"]


def test_a_loop_left_with_deadlines_pending_is_not_kept_alive() -> None:
    """A deadline's entry holds its loop's futures; the loop must still be collectable."""

    async def leave_one_pending() -> None:
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        deadlines().at(deadline_in(3600), lambda: waiter.set_result(None))

    loop = asyncio.new_event_loop()
    loop.run_until_complete(leave_one_pending())
    loop.close()
    gone = weakref.ref(loop)
    del loop
    gc.collect()
    assert gone() is None


@pytest.mark.asyncio
async def test_once_wakes_its_waiters_or_lets_them_go_at_their_deadline() -> None:
    """Given, every waiter returns True; not given, each returns False at its own deadline."""
    signal = Once()
    early = asyncio.ensure_future(signal.wait(deadline_in(0.01)))
    late = asyncio.ensure_future(signal.wait(deadline_in(60)))
    assert await within(early) is False
    assert not late.done()
    signal.give()
    signal.give()
    assert await within(late) is True
    assert await signal.wait(deadline_in(-1)) is True  # Given: no wait at all.


@pytest.mark.asyncio
async def test_wait_done_ends_with_the_future_or_at_the_deadline() -> None:
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    assert await within(wait_done(future, deadline_in(0.01))) is False
    asyncio.get_running_loop().call_soon(future.set_result, None)
    assert await within(wait_done(future, deadline_in(60))) is True
    assert await wait_done(None, deadline_in(-1)) is True


@pytest.mark.parametrize(
    ("lateness", "outcome", "waits"),
    [
        ((0.01,), False, 1),  # On time: the deadline meant what it said.
        ((0.5, 0.3, 0.0), True, 3),  # Late twice: extended by each lateness, then done.
        ((5.0, 5.0, 5.0), False, 2),  # Late without end: the limit holds.
    ],
)
@pytest.mark.asyncio
async def test_a_wait_is_patient_only_where_the_loop_ran_late(
    monkeypatch: pytest.MonkeyPatch, lateness: tuple[float, ...], outcome: bool, waits: int
) -> None:
    """A deadline that passed while the loop was late by ``LATE`` or more is extended by
    that lateness, up to the limit; one that passed on time ends the wait."""
    clock = [100.0]
    monkeypatch.setattr(asyncio.get_running_loop(), "time", lambda: clock[0])
    asked: list[float] = []

    async def wait(deadline: float) -> bool:  # Times out, the loop ``late`` past the deadline.
        late = lateness[len(asked)]
        asked.append(deadline)
        clock[0] = deadline + late
        return late == 0.0

    assert await wait_patiently(wait, 101.0, 110.0) is outcome
    assert len(asked) == waits
    assert asked[0] == 101.0
    for before, after, late in zip(asked, asked[1:], lateness, strict=False):
        assert after == pytest.approx(min(before + 2 * late, 110.0))


@pytest.mark.asyncio
async def test_wait_set_times_out_on_the_shared_deadlines_without_a_timer_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past its deadline the wait returns False, its task not left cancelling; set in time,
    True. Neither arms a loop timer of its own: the loop's `Deadlines` time it."""
    loop = asyncio.get_running_loop()
    timers = deadlines()
    own_timers: list[object] = []
    real_call_at = loop.call_at

    def call_at(when: float, callback, *args, **kwargs):  # type: ignore[no-untyped-def]
        if getattr(callback, "__self__", None) not in (timers, bound):
            own_timers.append(callback)
        return real_call_at(when, callback, *args, **kwargs)

    monkeypatch.setattr(loop, "call_at", call_at)
    event = asyncio.Event()
    task = asyncio.current_task()
    assert task is not None
    bound = asyncio.timeout(10)  # In this task, as the wait's own cancel is: the test's bound.
    async with bound:
        assert await wait_set(event, deadline_in(0.01)) is False
        assert task.cancelling() == 0
        loop.call_soon(event.set)
        assert await wait_set(event, deadline_in(5)) is True
    assert own_timers == []


@pytest.mark.asyncio
async def test_wait_set_lets_a_cancel_from_outside_through() -> None:
    """A cancel of the waiting task is not the wait's timeout: it propagates, also when it
    comes in the loop turn in which the deadline fires."""
    event = asyncio.Event()
    waiting = asyncio.ensure_future(wait_set(event, deadline_in(60)))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await within(waiting)
    deadline = deadline_in(0.01)
    waiting = asyncio.ensure_future(wait_set(event, deadline))
    # Due at the deadline's own time: it runs in the same loop turn as the deadline's callback.
    asyncio.get_running_loop().call_at(deadline, waiting.cancel)
    with pytest.raises(asyncio.CancelledError):
        await within(waiting)
