"""Leases: the tasks of a replica whose process died are ended by the living.

Each handler over a database task store is a replica, with a lease in two tables of ours in
the store's database: ``a2a_cancelfix_replicas`` (a row per replica, its ``beat`` renewed every
``lease_time / 6``) and ``a2a_cancelfix_runs`` (a row per run of ``execute()``, inserted before
it starts, deleted once it has returned and the store shows its task no longer running). A
replica that has seen another's beat unchanged for that one's ``lease_time``, on its own clock,
counted from the read that first showed it (a timer set at that read: the registration's read, or
a renewal's), takes it for dead: it removes its row, and then ends, once, each task of a run whose replica
row is gone, FAILED if the store shows it SUBMITTED or WORKING. A replica that has not renewed for half its lease stops its own runs (the
``lease_lost`` cancel), so that none is still running when another can take it for dead.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from a2a.types import Task, TaskState, TaskStatusUpdateEvent

from a2a_cancelfix import _telemetry
from a2a_cancelfix._aio import deadline_in, in_background, wait_done
from a2a_cancelfix._lease_tables import GONE_SQL, LeaseTables

if TYPE_CHECKING:
    from a2a.server.agent_execution import RequestContext
    from a2a.server.tasks import PushNotificationSender

    from a2a_cancelfix._lease_store import LeaseStore

logger = logging.getLogger("a2a_cancelfix")

LAPSED = "the server process running this task stopped (lease lapsed)"
# Lapsed runs' ends under way at once: a few rows held elsewhere do not hold up the rest, and
# most of the store's connection pool stays for the requests.
ENDS_AT_ONCE = 4


def lapsed(ended: Task | TaskStatusUpdateEvent) -> bool:
    """Whether ``ended`` is the FAILED a survivor recorded for a lapsed lease (and pushed)."""
    status = ended.status
    return status.state == TaskState.TASK_STATE_FAILED and any(
        part.text == LAPSED for part in status.message.parts
    )


class Leased(Protocol):
    """What the leases look after: a `Lifecycle`'s runs, and how it stops one."""

    @property
    def works(self) -> Mapping[str, object]: ...

    async def lease_lost(self, task_id: str, context_id: str) -> None:
        """Cancel the run here of ``task_id``: this replica could not renew its lease."""


class Leases:
    """One handler's lease on its runs, and its watch over the other replicas' leases.

    Built by the lifecycle it serves once the handler is built (`Lifecycle.bind`); begun at the
    handler's start, else its first request (`begin`); ended by its ``aclose()`` (`aclose`).

    Args:
        lifecycle: the handler's lifecycle, whose runs are leased and stopped.
        store: the handler's guarded database store, whose database holds the leases.
        lease_time: seconds; see the handler's ``lease_time``.
        sole_replica: end every task the store shows running when the leases begin.
        pushes: the handler's push sender, which sends the end of a task ended here.
        noticed: told the id of each task ended here (its subscribers here look at the store).
    """

    def __init__(
        self,
        lifecycle: Leased,
        store: LeaseStore,
        lease_time: float,
        sole_replica: bool,
        pushes: PushNotificationSender | None,
        noticed: Callable[[str], None],
    ) -> None:
        self.lifecycle, self.store = lifecycle, store
        self.lease_time = lease_time
        self.period = lease_time / 6
        self.sole_replica = sole_replica
        self.pushes, self.noticed = pushes, noticed
        self.replica_id = _new_id()
        self.fenced = False  # No renewal for half a lease: the runs here are being stopped.
        self.tables = LeaseTables(store.dialect)
        self._tables_ready = False
        # The runs here: task id -> (the owner the store files it under, its context id).
        self._runs: dict[str, tuple[str, str]] = {}
        # The runs here that have returned: task id -> when. A row goes once the store shows
        # its task no longer running: a run can return before its end is stored (a cancel's
        # CANCELED being retried, a consumer behind, a store that failed), and should this
        # replica stop before, the survivors must find the row.
        self._returned: dict[str, float] = {}
        self._unleased: set[str] = set()  # Runs whose row could not be inserted: the next renewal's.
        self._registered: asyncio.Future[None] | None = None
        self._inserted = False  # This replica's row was inserted once: a missing one was removed.
        self._listed = False  # Its row is committed: a run row of its own is no orphan's.
        self._renewing: asyncio.Future[None] | None = None
        self._attempt: asyncio.Future[None] | None = None
        self._ending: asyncio.Future[None] | None = None
        self._fence: asyncio.TimerHandle | None = None
        # Each other replica's beat, with when it was first seen at that value (this clock),
        # and the timer that judges it once that beat's lease has run out.
        self._seen: dict[str, tuple[int, float]] = {}
        self._lapses: dict[str, asyncio.TimerHandle] = {}
        self._dead: dict[str, int] = {}  # Replicas taken for dead, their last beat: to remove.
        self._orphans_due = -math.inf  # When the runs of removed replicas are looked for next.
        self._closed = False
        self._writes: set[asyncio.Future[Any]] = set()  # Run rows being inserted or deleted.
        self._ends: dict[str, asyncio.Future[None]] = {}  # Lapsed runs' ends under way, by task.
        self._ending_slots = asyncio.Semaphore(ENDS_AT_ONCE)

    # The handler's side.

    def begin(self) -> asyncio.Future[None]:
        """Register this replica (once), then renew and watch until `aclose`; the registration."""
        if self._registered is None:
            self._registered = in_background(self._register())
        return self._registered

    async def begun(self) -> None:
        """Begin; and for a sole replica, whose first pass must come before any new task, wait
        for it, at most half a lease (a store that does not answer delays the first requests only)."""
        registered = self.begin()
        if self.sole_replica:
            await wait_done(registered, deadline_in(self.lease_time / 2))

    async def run_started(self, task_id: str, context: RequestContext) -> None:
        """Lease a run before its ``execute()`` starts: one round trip (the first run also waits
        for the registration, at most a renewal period). A failure is logged and the run goes
        on, its row left to the next renewal, as it is while this replica's own row is not
        in. A run that starts while this replica cannot renew is stopped."""
        registered = self.begin()
        if not registered.done():
            await wait_done(registered, deadline_in(self.period))
        try:
            owner = self.store.owner(context.call_context)
            self._runs[task_id] = owner, context.context_id or ""
            self._returned.pop(task_id, None)
            if not self._listed:  # Alone, its row would be an orphan's: ended by the survivors.
                self._unleased.add(task_id)
            else:
                await self._write(self._insert_run(task_id, owner))
        except Exception:
            self._unleased.add(task_id)
            logger.warning("task %s: could not lease its run; the next renewal does", task_id, exc_info=True)
        if self.fenced:
            in_background(self.lifecycle.lease_lost(task_id, context.context_id or ""))

    def run_ended(self, task_id: str) -> None:
        """A run's ``execute()`` has returned: its lease row goes with the first renewal, a
        period on, that finds its task stored no longer running (or not stored at all)."""
        if self._runs.pop(task_id, None) is not None:
            self._returned[task_id] = asyncio.get_running_loop().time()

    async def aclose(self, deadline: float) -> None:
        """Stop renewing, and remove this replica's rows, by ``deadline``: its runs have ended
        (the handler's ``aclose`` drained them), nothing is left for the survivors."""
        self._closed = True
        if self._renewing is not None:
            self._renewing.cancel()  # Between two attempts: those under way are left to end.
        if self._fence is not None:
            self._fence.cancel()
        for timer in self._lapses.values():
            timer.cancel()
        if self._registered is None:
            return
        for pending in [self._registered, self._attempt, self._ending, *self._writes, *self._ends.values()]:
            await wait_done(pending, deadline)
        # Not cut at the deadline: a statement cut midway can leave its connection stuck.
        if not await wait_done(in_background(self._remove_self()), deadline):
            logger.warning(
                "replica %s: its lease rows were not removed by the end of shutdown_drain_time; "
                "the other replicas take it for dead after lease_time",
                self.replica_id,
            )

    # Registration and renewal.

    async def _register(self) -> None:
        if self._closed:
            return  # A request after the shutdown: nothing to lease.
        sent = asyncio.get_running_loop().time()
        try:
            await self._ready()
            if self.sole_replica:
                await self._end_every_running()
            async with self.store.engine.begin() as connection:
                await self._insert_self(connection)
                rows = await self._beats(connection)  # The others' beats: watched from now.
            self._listed = True
            self._renewed(sent)
            self._judge(rows, sent, asyncio.get_running_loop().time())
        except Exception:
            logger.warning("could not register this replica's lease; renewing retries it", exc_info=True)
        finally:
            if not self._closed:
                self._renewing = in_background(self._renew_forever())

    async def _ready(self) -> None:
        """Our tables, created once. Not the store's own: its first save makes them, and two
        creations at once collide (PostgreSQL)."""
        if self._tables_ready:
            return
        try:
            async with self.store.engine.begin() as connection:
                await connection.run_sync(self.tables.create)
        except Exception:
            # Another replica created them at the same time (PostgreSQL): they are there now.
            async with self.store.engine.begin() as connection:
                await connection.run_sync(self.tables.create)
        self._tables_ready = True

    async def _insert_self(self, connection: Any) -> None:
        import sqlalchemy as sa

        replicas = self.tables.replicas
        values = {"replica_id": self.replica_id, "beat": 0, "lease_ms": round(self.lease_time * 1000)}
        await connection.execute(sa.insert(replicas).values(values))
        self._inserted = True

    async def _renew_forever(self) -> None:
        """Renew every ``period``; an attempt that hangs is not stacked upon, and fails by the
        fence's own timer (`_renewed`), not by this one's."""
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:  # The registration was the first beat.
            due += self.period
            await asyncio.sleep(max(due - loop.time(), 0.0))
            if self._attempt is None or self._attempt.done():
                self._attempt = in_background(self._renew(loop.time()))

    async def _renew(self, sent: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                rows = await self._beat()
            except Exception as error:
                logger.log(
                    logging.DEBUG if self.fenced else logging.WARNING,
                    "could not renew this replica's lease: %r",
                    error,
                )
                return
            if self._closed or loop.time() < sent + self.lease_time / 2:
                break
            # Done past the fence time it would set: it vouches for no time to come; a fresh one does.
            sent = loop.time()
        self._renewed(sent)
        self._judge(rows, sent, loop.time())

    async def _beat(self) -> list[Any]:
        """One transaction: this replica's beat, and every replica's. A row of ours that is gone
        was removed by a replica that took this one for dead: it registers anew, its runs too."""
        import sqlalchemy as sa

        await self._ready()
        replicas = self.tables.replicas
        async with self.store.engine.begin() as connection:
            mine = replicas.c.replica_id == self.replica_id
            updated = await connection.execute(
                sa.update(replicas).where(mine).values(beat=replicas.c.beat + 1)
            )
            if updated.rowcount == 0:
                if self._inserted:
                    logger.warning(
                        "replica %s was taken for dead by another replica (its lease lapsed); "
                        "it registers again, with %d run(s)",
                        self.replica_id,
                        len(self._runs),
                    )
                    self.replica_id = _new_id()
                    self._listed = False
                    self._returned.clear()  # Their rows went with the old id's: nothing to keep.
                await self._insert_self(connection)
            attempted = set(self._unleased)
            await self._insert_runs(connection, self._runs if updated.rowcount == 0 else attempted)
            if self._returned:
                await self._forget_returned(connection, asyncio.get_running_loop().time() - self.period)
            rows = await self._beats(connection)
        self._listed = True
        self._unleased -= attempted  # Committed: each is leased, or its run has returned.
        return rows

    async def _beats(self, connection: Any) -> list[Any]:
        """Every replica's id, beat and lease (ms)."""
        import sqlalchemy as sa

        replicas = self.tables.replicas
        return list(
            await connection.execute(sa.select(replicas.c.replica_id, replicas.c.beat, replicas.c.lease_ms))
        )

    def _renewed(self, sent: float) -> None:
        """A renewal sent at ``sent`` succeeded: the runs here are safe until half a lease from then."""
        if self._closed:
            return
        if self._fence is not None:
            self._fence.cancel()
        self._fence = asyncio.get_running_loop().call_at(sent + self.lease_time / 2, self._lost)
        if self.fenced:
            self.fenced = False
            logger.warning("replica %s renewed its lease again; its new runs are leased", self.replica_id)

    def _lost(self) -> None:
        """No renewal for half a lease: stop every run here before anyone takes it for dead."""
        self._fence = None
        self.fenced = True
        logger.warning(
            "replica %s could not renew its lease for %g s (lease_time / 2): its %d run(s) are cancelled",
            self.replica_id,
            self.lease_time / 2,
            len(self._runs),
        )
        for task_id, (_, context_id) in list(self._runs.items()):
            in_background(self.lifecycle.lease_lost(task_id, context_id))

    # The others' leases.

    def _judge(self, rows: list[Any], sent: float, read: float) -> None:
        """Note each other replica's beat, and set a timer at the end of its lease for each new
        one: a replica whose beat this one has seen unchanged for its lease is taken for dead
        then (`_lapse`), not at a renewal after. Seen from ``read``, the end of the read that
        first showed the value: whatever renewal made it was sent before. A pass also comes
        for the replicas gone meanwhile (their runs may be left), and every ``lease_time``.
        """
        loop = asyncio.get_running_loop()
        present = set()
        for replica_id, beat, lease_ms in rows:
            present.add(replica_id)
            if replica_id == self.replica_id:
                continue
            seen = self._seen.get(replica_id)
            if seen is None or seen[0] != beat:
                self._seen[replica_id] = beat, read
                self._unwatch(replica_id)
                self._lapses[replica_id] = loop.call_at(read + lease_ms / 1000, self._lapse, replica_id)
        gone = self._seen.keys() - present
        for replica_id in gone:
            del self._seen[replica_id]
            self._unwatch(replica_id)
        if gone or sent >= self._orphans_due:
            self._pass()

    def _lapse(self, replica_id: str) -> None:
        """The lease of the beat last seen of ``replica_id`` ran out unrenewed: it is dead
        (its row goes only if that beat is still the stored one)."""
        self._lapses.pop(replica_id, None)
        seen = self._seen.get(replica_id)
        if seen is None or self._closed:
            return
        self._dead[replica_id] = seen[0]
        self._pass()

    def _unwatch(self, replica_id: str) -> None:
        timer = self._lapses.pop(replica_id, None)
        if timer is not None:
            timer.cancel()

    def _pass(self) -> None:
        """A pass over the lapsed leases, unless one is under way (it looks again at its end)."""
        if self._ending is None or self._ending.done():
            self._ending = in_background(self._end_lapsed())

    async def _end_lapsed(self) -> None:
        """Remove the rows of the replicas taken for dead (each unless it renewed meanwhile),
        then end the tasks of the runs whose replica row is gone."""
        import sqlalchemy as sa

        replicas, bound = self.tables.replicas, self.store.dialect.bound_lock_waits
        try:
            while True:
                for replica_id, beat in list(self._dead.items()):
                    async with self.store.engine.begin() as connection:
                        if bound is not None:  # A renewal frozen before its COMMIT holds the row.
                            await bound(connection, self.period)
                        removed = await connection.execute(
                            sa.delete(replicas).where(
                                replicas.c.replica_id == replica_id, replicas.c.beat == beat
                            )
                        )
                    del self._dead[replica_id]
                    self._seen.pop(replica_id, None)
                    self._unwatch(replica_id)
                    if removed.rowcount:
                        logger.warning(
                            "replica %s has not renewed its lease for its lease_time: its tasks are ended",
                            replica_id,
                        )
                self._orphans_due = asyncio.get_running_loop().time() + self.lease_time
                for task_id, replica_id, owner in await self._orphans():
                    self._end_soon(task_id, replica_id, owner)
                if not self._dead:  # Else another lapsed meanwhile: at once, not a renewal on.
                    break
        except Exception:
            self._orphans_due = -math.inf
            logger.warning(
                "could not end the tasks of lapsed leases; the next renewal retries", exc_info=True
            )

    def _end_soon(self, task_id: str, replica_id: str, owner: str) -> None:
        """End a lapsed run's task in a task of its own (`ENDS_AT_ONCE` at a time), unless its
        end is under way: a row held elsewhere delays its own end only, and the passes go on."""
        if task_id in self._ends or self._closed:
            return
        ending = in_background(self._end_retried(task_id, replica_id, owner))
        self._ends[task_id] = ending
        ending.add_done_callback(lambda _: self._ends.pop(task_id, None))

    async def _end_retried(self, task_id: str, replica_id: str, owner: str) -> None:
        """`_end`; one that fails (its task's row held past the bound, the store failing) is
        rolled back whole, its run row kept: the next renewal's pass tries it again."""
        try:
            async with self._ending_slots:
                await self._end(task_id, replica_id, owner)
        except Exception as error:
            self._orphans_due = -math.inf
            if self.store.dialect.lock_unavailable(error):
                logger.info(
                    "task %s of lapsed replica %s: its row is held by another transaction; "
                    "the next renewal retries",
                    task_id,
                    replica_id,
                )
            else:
                logger.warning(
                    "task %s of lapsed replica %s: could not end it; the next renewal retries",
                    task_id,
                    replica_id,
                    exc_info=True,
                )

    async def _orphans(self) -> list[tuple[str, str, str]]:
        """The runs of this store whose replica row is gone, read by the replica ids: a read
        proportional to the replicas and the orphans, not to the runs."""
        import sqlalchemy as sa

        runs = self.tables.runs
        async with self.store.engine.connect() as connection:
            gone = [replica_id for (replica_id,) in await connection.execute(sa.text(GONE_SQL))]
            if not gone:
                return []
            rows = await connection.execute(
                sa.select(runs.c.task_id, runs.c.replica_id, runs.c.owner).where(
                    runs.c.store == self.store.table_name, runs.c.replica_id.in_(gone)
                )
            )
            return [(task_id, replica_id, owner) for task_id, replica_id, owner in rows]

    async def _end(self, task_id: str, replica_id: str, owner: str) -> None:
        """End one lapsed run's task, once among the replicas: the one whose delete of the run
        row takes it writes FAILED, in the same transaction, if the task still runs. Its lock
        waits are bounded (a renewal period: `Dialect.bound_lock_waits`, `Dialect.for_update`)."""
        import sqlalchemy as sa

        runs, store = self.tables.runs, self.store
        span = _telemetry.lease_lapsed_span(task_id, replica_id)
        started = time.monotonic()
        outcome = "left"
        try:
            async with store.transaction() as session:
                if store.dialect.bound_lock_waits is not None:
                    await store.dialect.bound_lock_waits(session, self.period)
                claimed = await session.execute(
                    sa.delete(runs).where(
                        runs.c.store == store.table_name,
                        runs.c.task_id == task_id,
                        runs.c.replica_id == replica_id,
                    )
                )
                if claimed.rowcount != 1:
                    outcome = "taken"  # Another replica ended it, or its run came back.
                    return
                failed = await store.fail(session, task_id, owner, LAPSED, bounded=True)
                if failed is not None and store.notices is not None:
                    await store.notices.announce_in(session, task_id)
            if failed is None:
                return  # Parked, or ended: nothing runs it, it stays as it is.
            outcome = "FAILED"
            await self._told(task_id, failed)
            logger.warning(
                "end task=%s path=lease_lapsed outcome=FAILED took=%.3fs replica=%s",
                task_id,
                time.monotonic() - started,
                replica_id,
            )
        finally:
            if outcome != "FAILED":
                logger.debug("task %s of lapsed replica %s: %s", task_id, replica_id, outcome)
            _telemetry.lease_lapsed(span, outcome)
            _telemetry.end(span)

    async def _told(self, task_id: str, failed: Any) -> None:
        """Tell of a task ended here: the other replicas, the subscribers here, its push configs."""
        notices = self.store.notices
        if notices is not None:
            await notices.announce(task_id)
        self.noticed(task_id)
        if self.pushes is not None:
            event = TaskStatusUpdateEvent(task_id=task_id, context_id=failed.context_id, status=failed.status)
            await self.pushes.send_notification(task_id, event)

    async def _end_every_running(self) -> None:
        """As the only server of the store: end every task it shows SUBMITTED or WORKING but
        those running here, leased or not (a previous process's, of any version)."""
        import sqlalchemy as sa

        runs, store = self.tables.runs, self.store
        await store.ready()  # The first requests wait for this pass: nothing else creates them now.
        async with store.transaction() as session:
            running = await store.running(session)
        for task_id, owner in running:
            if task_id in self.lifecycle.works or task_id in self._runs:
                continue
            async with store.transaction() as session:
                await session.execute(
                    sa.delete(runs).where(runs.c.store == store.table_name, runs.c.task_id == task_id)
                )
                failed = await store.fail(session, task_id, owner, LAPSED)
                if failed is not None and store.notices is not None:
                    await store.notices.announce_in(session, task_id)
            if failed is not None:
                await self._told(task_id, failed)
                logger.warning("end task=%s path=lease_lapsed outcome=FAILED sole_replica=True", task_id)

    # The run rows.

    def _run_row(self, task_id: str, owner: str) -> Any:
        """Insert, or take over, the lease row of a run of ``task_id`` here."""
        values = {
            "store": self.store.table_name,
            "task_id": task_id,
            "replica_id": self.replica_id,
            "owner": owner,
        }
        return self.store.dialect.upsert(self.tables.runs, values, ("replica_id", "owner"))

    async def _insert_run(self, task_id: str, owner: str) -> None:
        async with self.store.engine.begin() as connection:
            await connection.execute(self._run_row(task_id, owner))

    async def _insert_runs(self, connection: Any, task_ids: Collection[str]) -> None:
        """Insert the rows of those of ``task_ids`` that run here."""
        running = [(task_id, self._runs[task_id][0]) for task_id in task_ids if task_id in self._runs]
        for task_id, owner in running:  # Taken first: a run may return during the awaits.
            await connection.execute(self._run_row(task_id, owner))

    async def _forget_returned(self, connection: Any, before: float) -> None:
        """Delete the rows of the runs returned by ``before`` whose tasks the store shows no
        longer running, or does not hold (a run answered with a message alone)."""
        import sqlalchemy as sa

        returned = [task_id for task_id, at in self._returned.items() if at <= before]
        if not returned:
            return
        running = await self.store.running_among(connection, returned)
        gone = [task_id for task_id in returned if task_id in self._returned and not running.get(task_id)]
        if not gone:
            return
        runs = self.tables.runs
        await connection.execute(
            sa.delete(runs).where(
                runs.c.store == self.store.table_name,
                runs.c.replica_id == self.replica_id,
                runs.c.task_id.in_(gone),
            )
        )
        for task_id in gone:
            self._returned.pop(task_id, None)
            run = self._runs.get(task_id)
            if run is not None:  # Run again meanwhile: its insert may have come before the delete.
                await connection.execute(self._run_row(task_id, run[0]))

    async def _write(self, write: Any) -> None:
        """Await a run row's write, known to `aclose` until it ends."""
        future = asyncio.ensure_future(write)
        self._writes.add(future)
        future.add_done_callback(self._writes.discard)
        await future

    async def _remove_self(self) -> None:
        """Remove this replica's rows; but leave those of runs here that have not returned, and
        of returned runs whose tasks the store shows still running: the survivors end those
        tasks, once the lease lapses where a run has not returned, else at once."""
        try:
            await self._remove_rows()
        except Exception:
            logger.warning(
                "replica %s: could not remove its lease rows at shutdown; the other replicas "
                "take it for dead after lease_time",
                self.replica_id,
                exc_info=True,
            )

    async def _remove_rows(self) -> None:
        import sqlalchemy as sa

        runs, replicas = self.tables.runs, self.tables.replicas
        mine = sa.and_(runs.c.store == self.store.table_name, runs.c.replica_id == self.replica_id)
        async with self.store.engine.begin() as connection:
            await self._insert_runs(connection, self._unleased)  # Late, but before the lease lapses.
            await self._forget_returned(connection, math.inf)
            if self._returned:
                logger.warning(
                    "replica %s shut down before the store showed %d task(s) of its returned "
                    "runs ended: the other replicas look at them",
                    self.replica_id,
                    len(self._returned),
                )
            kept = [*self._runs, *self._returned]
            await connection.execute(sa.delete(runs).where(mine, runs.c.task_id.not_in(kept)))
            if self._runs:
                logger.warning(
                    "replica %s shut down with %d run(s) not returned: the other replicas end "
                    "their tasks once its lease lapses",
                    self.replica_id,
                    len(self._runs),
                )
                return
            await connection.execute(sa.delete(replicas).where(replicas.c.replica_id == self.replica_id))


def _new_id() -> str:
    return uuid.uuid4().hex
