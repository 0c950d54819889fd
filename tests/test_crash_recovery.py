"""Real replicas that die: a task whose process stopped is ended by the living, within a bound.

Each replica is its own uvicorn process (tests/crash_server.py) on a shared store; runs never
end by themselves. A replica is killed (SIGKILL), stopped (SIGTERM), killed and started again,
or cut off from its database by a proxy that freezes its traffic; the store (with a trigger
recording every state it takes), the replicas' run log, a push receiver and a subscriber on a
survivor say what happened. The stock handler beside ours, each time.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from .crash import (
    ACTIVE,
    HEADERS,
    TERMINAL,
    Client,
    Proxy,
    Replica,
    Saved,
    Shared,
    client,
    holds,
    message_params,
    poll,
    replicas,
    rpc,
    shared,
)

# Server processes, killed and started again, and a bound of seconds to wait out each time:
# what they add to the in-process tests does not differ between releases (noxfile.py).
pytestmark = pytest.mark.edges_only

# The replicas' lease: the least the handler takes with their grace period (0.5 s) and the
# default margins is 2 x (0.5 + 3 x 1.0) = 7 s.
LEASE = 7.0
# The documented bound from a replica's death to its tasks ended: a lease, then the survivor's
# next look (a sixth of a lease), and room for a loaded machine (3 s was once too little with
# CI's four test workers beside these processes on two cores).
SLACK = 6.0
BOUND = LEASE + LEASE / 6 + SLACK
LAPSED = "the server process running this task stopped (lease lapsed)"


def options(handler: str, notices: str | None = None, **more: str) -> dict[str, str]:
    """A replica's environment: its handler, our lease, notices on a channel of this test's own."""
    environment = {"A2ACF_HANDLER": handler, "A2ACF_LEASE_TIME": str(LEASE), **more}
    if notices:
        environment |= {"A2ACF_NOTICES": notices, "A2ACF_CHANNEL": f"a2acf_crash_{uuid.uuid4().hex[:12]}"}
    return environment


def ended_by_lease(history: list[Saved], died_at: float) -> Saved:
    """The task's last stored state: FAILED saying its process stopped, stored after the
    process died, after most of a lease, within the bound; the only end it was stored with."""
    end = history[-1]
    assert (end.state, end.message) == ("TASK_STATE_FAILED", LAPSED), history
    assert died_at + LEASE * 2 / 3 < end.at < died_at + BOUND, (end.at - died_at, history)
    assert [saved.state for saved in history if saved.state.removeprefix("TASK_STATE_") in TERMINAL] == [
        "TASK_STATE_FAILED"
    ], history
    return end


REDIS = "redis://127.0.0.1:6379/0"
KILLED = [
    pytest.param("postgresql", "stock", None, id="postgresql-stock"),
    pytest.param("postgresql", "ours", "postgres", id="postgresql-ours-notify"),
    pytest.param("postgresql", "ours", REDIS, id="postgresql-ours-redis"),
    # MariaDB has no NOTIFY: its replicas hear Redis (their polling: test_replicas.py, test_cluster.py).
    pytest.param("mysql", "stock", None, id="mysql-stock"),
    pytest.param("mysql", "ours", REDIS, id="mysql-ours-redis"),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(("database", "handler", "notices"), KILLED)
async def test_a_killed_replicas_tasks_end_failed_on_a_survivor(
    database: str, handler: str, notices: str | None, tmp_path: Path
) -> None:
    """SIGKILL of the replica running two tasks: ours ends both FAILED, once between the two
    survivors, within a lease and a sixth (and slack); a subscriber on a survivor ends on it,
    each push config hears it once; the parked task and the survivors' own stay, and only the
    survivors' lease rows are left. Stock leaves them WORKING past that bound, its subscriber
    waiting on."""
    async with (
        shared(database, tmp_path) as world,
        client() as c,
        replicas(world, 3, **options(handler, notices)) as (a, b, d),
    ):
        (_, one), (_, two), (_, parked) = [await c.working(a, text) for text in ("go", "go", "park")]
        (_, own), (_, own_d) = await c.working(b), await c.working(d)
        follower = c.subscribe(b, one)
        await follower.until(lambda: bool(follower.events) or follower.task.done(), BOUND)
        await a.kill()
        if handler == "stock":
            await holds(world.states, lambda states: states[one] == states[two] == "WORKING", BOUND)
            assert not {*c.pushes(one), *c.pushes(two)} & set(TERMINAL)
            assert follower.last == "WORKING" and not follower.task.done()  # It waits on, forever.
            return
        states = await poll(world.states, lambda states: states[one] == states[two] == "FAILED", BOUND)
        assert (states[parked], states[own], states[own_d]) == ("INPUT_REQUIRED", "WORKING", "WORKING")
        assert a.died_at is not None
        for task_id in (one, two):
            ended_by_lease(await world.history(task_id), a.died_at)
            await c.pushed_once(task_id, "FAILED")
        assert await follower.ended(BOUND) and follower.last == "FAILED"
        await poll(world.lease_rows, lambda rows: rows == (2, {own, own_d}), BOUND)


@pytest.mark.asyncio
@pytest.mark.parametrize("handler", ["stock", "ours"])
@pytest.mark.parametrize(("database", "notices"), [("postgresql", "postgres"), ("mysql", REDIS)])
async def test_sigterm_drains_then_cancels_what_runs(
    database: str, notices: str, handler: str, tmp_path: Path
) -> None:
    """SIGTERM of the replica running two tasks (uvicorn's graceful exit, its lifespan closing
    the handler): when it has exited, ours stored both CANCELED saying the server shut down,
    their runs stopped, each push config heard CANCELED once, the parked task is as it was and
    the process left no lease row; stock leaves them WORKING and pushes nothing."""
    async with (
        shared(database, tmp_path) as world,
        client() as c,
        replicas(world, 2, **options(handler, notices, A2ACF_DRAIN="1")) as (a, b),
    ):
        (_, one), (_, two), (_, parked) = [await c.working(a, text) for text in ("go", "go", "park")]
        _, own = await c.working(b)
        await a.terminate()
        states = await world.states()
        if handler == "stock":
            assert states[one] == states[two] == "WORKING"
            assert not {*c.pushes(one), *c.pushes(two)} & set(TERMINAL)
            return
        assert (states[one], states[two], states[parked]) == ("CANCELED", "CANCELED", "INPUT_REQUIRED")
        for task_id in (one, two):
            end = (await world.history(task_id))[-1]
            assert end.message == "Canceled: the server shut down before the task finished"
            await c.pushed_once(task_id, "CANCELED")
            stops = [noted for noted in world.runs() if noted.task_id == task_id and noted.event == "stop"]
            assert [noted.pid for noted in stops] == [a.pid]
        assert await world.lease_rows() == (1, {own})  # The survivor's alone.


@pytest.mark.asyncio
@pytest.mark.parametrize("handler", ["stock", "ours"])
async def test_sigterm_while_cut_off_from_the_store_exits_and_a_survivor_ends_the_task(
    handler: str, tmp_path: Path
) -> None:
    """SIGTERM of a replica whose connections to PostgreSQL are frozen: it exits all the same
    (its store unreachable, it cannot end its task); ours' survivor ends the task FAILED within
    the bound, pushed once. Stock exits too, and the task stays WORKING."""
    environment = options(handler, "postgres", A2ACF_DRAIN="1")
    async with shared("postgresql", tmp_path) as world, client() as c, Proxy() as proxy:
        a = await Replica.start(world, "a", proxy, **environment)
        b = await Replica.start(world, "b", **environment)
        try:
            _, task_id = await c.working(a)
            _, own = await c.working(b)
            proxy.freeze()
            frozen_at = time.time()
            await a.terminate()
            if handler == "stock":
                await holds(world.states, lambda states: states[task_id] == "WORKING", BOUND)
                return
            await poll(world.states, lambda states: states[task_id] == "FAILED", BOUND)
            ended_by_lease(await world.history(task_id), frozen_at)
            await c.pushed_once(task_id, "FAILED")
            assert (await world.states())[own] == "WORKING"
        finally:
            proxy.thaw()
            await asyncio.gather(a.stop(), b.stop())


SOLE_BOUND = 10.0  # From a process's start to its sweep's end, on a loaded machine.


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("handler", "sole"),
    [("stock", ""), ("ours", "1"), ("ours", "")],
    ids=["stock", "ours-sole_replica", "ours-lease"],
)
@pytest.mark.parametrize("database", ["sqlite", "mysql"])
async def test_a_process_killed_and_started_again(
    database: str, handler: str, sole: str, tmp_path: Path
) -> None:
    """One process on a SQLite file or a MariaDB database, killed (SIGKILL) with two tasks running, started again,
    a client polling the tasks there: ours with ``sole_replica`` ends them FAILED as it starts,
    before any request reaches it, without it after a lease; the parked task stays; stock
    leaves them WORKING past the bound."""
    environment = options(handler, A2ACF_SOLE_REPLICA=sole)
    async with shared(database, tmp_path) as world, client() as c:
        first = await Replica.start(world, "first", **environment)
        try:
            (_, one), (_, two), (_, parked) = [await c.working(first, text) for text in ("go", "go", "park")]
        finally:
            await first.kill()
        again = await Replica.start(world, "again", **environment)
        try:
            if sole:  # Its lifespan's start ends them: the store shows it before any request.
                await poll(world.states, lambda states: states[one] == states[two] == "FAILED", SOLE_BOUND)
            polled_from = time.time()
            polled = await c.states(again, one, two, parked)  # The polling client's first look.

            async def polling() -> dict[str, str]:
                return await c.states(again, one, two, parked)

            if handler == "stock":
                await holds(polling, lambda states: states[one] == states[two] == "WORKING", BOUND)
                return
            if sole:
                states = await poll(
                    polling, lambda states: states[one] == states[two] == "FAILED", SOLE_BOUND
                )
            else:
                assert polled[one] == polled[two] == "WORKING"  # Not before a lease has passed.
                states = await poll(polling, lambda states: states[one] == states[two] == "FAILED", BOUND)
            assert states[parked] == "INPUT_REQUIRED"
            assert await world.states() == states
            for task_id in (one, two):
                end = (await world.history(task_id))[-1]
                assert (end.state, end.message) == ("TASK_STATE_FAILED", LAPSED)
                if not sole:
                    assert end.at > polled_from + LEASE - 0.5  # Its first sighting, then a lease.
                await c.pushed_once(task_id, "FAILED")
        finally:
            await again.stop()


@pytest.mark.asyncio
@pytest.mark.parametrize("handler", ["stock", "ours"])
async def test_a_runner_cut_off_from_its_store_stops_its_runs_before_a_survivor_ends_them(
    handler: str, tmp_path: Path
) -> None:
    """A's connections to PostgreSQL freeze past a lease: ours has A call cancel() and stop
    the run before B ends the task FAILED; once the traffic flows again, A's late CANCELED is
    refused: the task ended once, FAILED, pushed once. Stock's run goes on, WORKING."""
    environment = options(handler, "postgres")
    async with shared("postgresql", tmp_path) as world, client() as c, Proxy() as proxy:
        a = await Replica.start(world, "a", proxy, **environment)
        b = await Replica.start(world, "b", **environment)
        try:
            _, task_id = await c.working(a)
            _, own = await c.working(b)
            proxy.freeze()
            frozen_at = time.time()
            if handler == "stock":
                await holds(world.states, lambda states: states[task_id] == "WORKING", BOUND)
                proxy.thaw()
                assert [noted.event for noted in world.runs() if noted.task_id == task_id] == ["start"]
                return
            await poll(world.states, lambda states: states[task_id] == "FAILED", BOUND)
            end = ended_by_lease(await world.history(task_id), frozen_at)
            noted = {n.event: n.at for n in world.runs() if n.task_id == task_id and n.pid == a.pid}
            assert noted.keys() == {"start", "cancel", "stop"}
            assert noted["cancel"] < end.at and noted["stop"] < end.at  # Never while the run lives.
            proxy.thaw()

            async def refused() -> bool:  # A's cancel, writing at last, found the task FAILED.
                return a.said(f"cancel task={task_id} path=lease_lost outcome=FAILED")

            await poll(refused, bool, BOUND)
            ended_by_lease(await world.history(task_id), frozen_at)
            await c.pushed_once(task_id, "FAILED")
            assert (await world.states())[own] == "WORKING"
        finally:
            proxy.thaw()
            await asyncio.gather(a.stop(), b.stop())


SOAK = float(os.environ.get("A2ACF_SOAK_SECONDS", 60))
SENDERS = 3  # Clients sending at once: one waits out a frozen replica's answer, the others go on.


@dataclass
class Chaos:
    """Three replicas, each behind a proxy, killed, stopped, restarted and cut off at random."""

    world: Shared
    proxies: list[Proxy]
    environment: dict[str, str]
    rng: random.Random
    slots: list[Replica | None] = field(default_factory=list)
    died: dict[int, float] = field(default_factory=dict)  # By pid: when its death was seen.
    actions: list[str] = field(default_factory=list)
    thawing: list[asyncio.TimerHandle] = field(default_factory=list)

    def live(self) -> list[Replica]:
        return [replica for replica in self.slots if replica is not None]

    async def start(self, index: int) -> None:
        self.slots[index] = await Replica.start(
            self.world, f"r{index}", self.proxies[index], **self.environment
        )

    async def act(self) -> None:
        index = self.rng.randrange(len(self.slots))
        replica, action = self.slots[index], self.rng.choice(["kill", "term", "freeze"])
        if action == "freeze" or replica is None:
            if not self.proxies[index].flowing.is_set():
                return
            self.actions.append(f"freeze r{index}")
            print(f"{time.time():.3f} {self.actions[-1]}", flush=True)
            self.proxies[index].freeze()
            # The cut's length is the chaos; other chaos goes on meanwhile.
            thawing = asyncio.get_running_loop().call_later(
                self.rng.uniform(1.0, 1.5 * LEASE), self.proxies[index].thaw
            )
            self.thawing.append(thawing)
            return
        cut_off = "" if self.proxies[index].flowing.is_set() else " (cut off)"
        self.actions.append(f"{action} r{index}{cut_off}")
        print(f"{time.time():.3f} {self.actions[-1]} (pid {replica.pid})", flush=True)
        self.slots[index] = None
        await (replica.kill() if action == "kill" else replica.terminate())
        assert replica.died_at is not None
        self.died[replica.pid] = replica.died_at
        await self.start(index)

    async def run(self, seconds: float) -> None:
        stop_at = time.monotonic() + seconds
        try:
            while time.monotonic() < stop_at:
                await asyncio.sleep(self.rng.uniform(0.5, 2.0))  # Chaos at random moments.
                await self.act()
        finally:
            for thawing in self.thawing:
                thawing.cancel()
            for proxy in self.proxies:
                proxy.thaw()


async def keep_sending(c: Client, chaos: Chaos, rng: random.Random, stop: asyncio.Event) -> int:
    """Start tasks one after another on live replicas (some parked), cancel some; how many sent."""
    sent, known = 0, []
    while not stop.is_set():
        live = chaos.live()
        if not live:
            await asyncio.sleep(0.1)
            continue
        replica = rng.choice(live)
        with contextlib.suppress(httpx.HTTPError, asyncio.TimeoutError, KeyError, ValueError):
            if known and rng.random() < 0.4:
                task_id = known.pop(rng.randrange(len(known)))
                await asyncio.wait_for(
                    c.http.post(f"{replica.url}/rest/tasks/{task_id}:cancel", headers=HEADERS), 3
                )
            else:
                text = "park" if rng.random() < 0.15 else "go"
                params = message_params(text, f"{c.pushed.url}push/chaos", returnImmediately=True)
                response = await asyncio.wait_for(
                    c.http.post(replica.url + "/", json=rpc("SendMessage", params), headers=HEADERS), 3
                )
                sent += 1
                known.append(response.json()["result"]["task"]["id"])
        await asyncio.sleep(rng.uniform(0.1, 0.5))  # The client's pace.
    return sent


@pytest.mark.asyncio
@pytest.mark.soak
async def test_chaos_kills_stops_and_cuts_off_replicas_at_random(tmp_path: Path) -> None:
    """A minute of three replicas killed, stopped and restarted and cut off from PostgreSQL at
    random while a client starts and cancels tasks: afterwards no task is SUBMITTED or WORKING
    without a run, none was ended by a lease while its run lived, none lost its terminal state."""
    seed = int(os.environ.get("A2ACF_CHAOS_SEED", random.randrange(2**32)))
    print(f"chaos seed {seed} (A2ACF_CHAOS_SEED={seed} repeats it)")
    rng = random.Random(seed)
    async with contextlib.AsyncExitStack() as stack:
        world = await stack.enter_async_context(shared("postgresql", tmp_path))
        c = await stack.enter_async_context(client())
        proxies = [await stack.enter_async_context(Proxy()) for _ in range(3)]
        chaos = Chaos(
            world, proxies, options("ours", "postgres", A2ACF_DRAIN="1"), random.Random(rng.random())
        )
        chaos.slots = [None] * 3
        stack.push_async_callback(lambda: asyncio.gather(*(replica.stop() for replica in chaos.live())))
        await asyncio.gather(*(chaos.start(index) for index in range(3)))
        stop = asyncio.Event()
        senders = [keep_sending(c, chaos, random.Random(rng.random()), stop) for _ in range(SENDERS)]
        sending = asyncio.gather(*senders)
        try:
            await chaos.run(SOAK)
        finally:
            stop.set()
            sent = sum(await asyncio.wait_for(sending, BOUND))
        print(f"{sent} tasks sent; chaos: {', '.join(chaos.actions)}")
        assert sent > 0 and chaos.actions
        pids = {replica.pid for replica in chaos.live()}

        def running() -> dict[str, set[int]]:
            """The runs alive: started, not stopped, in a process that lives; by task."""
            alive: dict[str, set[int]] = {}
            for noted in world.runs():
                runs = alive.setdefault(noted.task_id, set())
                if noted.event == "start" and noted.pid in pids:
                    runs.add(noted.pid)
                elif noted.event == "stop":
                    runs.discard(noted.pid)
            return alive

        async def unsettled() -> list[tuple[str, str, set[int]]]:
            """Tasks SUBMITTED or WORKING with no run alive, and ended tasks whose run goes on."""
            states, alive = await world.states(), running()
            return [
                (task_id, state, alive.get(task_id, set()))
                for task_id, state in states.items()
                if (state in ACTIVE) != bool(alive.get(task_id))
            ]

        try:
            await poll(unsettled, lambda found: not found, BOUND)
        except AssertionError:
            for task_id, *_ in await unsettled():
                print(f"task {task_id}: {await world.history(task_id)}")
                print(f"  its runs: {[noted for noted in world.runs() if noted.task_id == task_id]}")
            print(f"replicas died: {chaos.died}; alive: {sorted(pids)}; leases: {await world.lease_rows()}")
            raise
        histories, runs = await world.histories(), world.runs()
        lapsed = 0
        for task_id, history in histories.items():
            ends = [saved for saved in history if saved.state.removeprefix("TASK_STATE_") in TERMINAL]
            if not ends:
                continue
            # Once stored ended, the task is stored with that end only.
            assert {saved.state for saved in history[history.index(ends[0]) :]} == {ends[0].state}, history
            if ends[0].message == LAPSED:
                lapsed += 1
                mine = [noted for noted in runs if noted.task_id == task_id]
                for start in (noted for noted in mine if noted.event == "start"):
                    stopped = [
                        n.at for n in mine if n.event == "stop" and n.pid == start.pid and n.at >= start.at
                    ]
                    gone = min([*stopped, chaos.died.get(start.pid, math.inf)])
                    assert gone < ends[0].at, (task_id, start, history)  # Never while the run lived.
        ended = Counter(history[-1].state.removeprefix("TASK_STATE_") for history in histories.values())
        print(f"stored at the end: {dict(ended)}; {lapsed} ended by a lapsed lease")
