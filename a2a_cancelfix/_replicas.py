"""How a replica learns that another one cancelled a task it runs, or holds parked.

Three ways, one outcome. A notice (PostgreSQL's NOTIFY, Redis pub/sub: notices.py) says "look
now"; so does a save the store refused over the stored end (``FinalStateTaskStore.subscribe``);
and while no notices are heard, a run's checkpoints poll the store and the parked tasks are
looked at once per interval. Every look reads the store, which stays the truth; one that finds
CANCELED carries the cancel out here, through the same lifecycle as a cancel asked for here.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
from collections.abc import AsyncGenerator, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from a2a.server.agent_execution import RequestContext
from a2a.types import Task, TaskStatusUpdateEvent

from a2a_cancelfix import _sdk
from a2a_cancelfix._aio import deadline_in, in_background, wait_done, wait_set
from a2a_cancelfix._cancel.settings import DEFAULT_POLL_INTERVAL
from a2a_cancelfix._unwatched import WATCHED
from a2a_cancelfix.notices import LocalNotices, keep_listening
from a2a_cancelfix.store import FinalStateTaskStore

if TYPE_CHECKING:
    from a2a.server.context import ServerCallContext
    from a2a.server.request_handlers import DefaultRequestHandlerV2

    from a2a_cancelfix._unwatched import Watchers
    from a2a_cancelfix.checkpoints import Run

logger = logging.getLogger("a2a_cancelfix")

# A terminal event a stream or a sender hands on: as_stored answers with one of the same type.
Ending = TypeVar("Ending", Task, TaskStatusUpdateEvent)

# How many tasks with a refused save a handler remembers, to end their streams on the store's end.
_REFUSALS_KEPT = 10_000

# Seconds `aclose` waits for the cancelled listener to end (it hands its connection back).
LISTENER_STOP = 2.0


class Watched(Protocol):
    """What the look-out looks after: a `Lifecycle`'s runs, parked tasks and cancels."""

    # The lifecycle's own dicts, of its own types: the look-out reads them, and deletes from
    # `parked` only, a parked task it found ended elsewhere or whose run closed.
    @property
    def works(self) -> Mapping[str, Run]: ...
    @property
    def parked(self) -> dict[str, ServerCallContext]: ...
    @property
    def cancellations(self) -> Mapping[str, object]: ...
    @property
    def watchers(self) -> Watchers | None: ...

    async def noticed_parked(self, stored: Task, live: _sdk.LiveRun, caller: ServerCallContext) -> None:
        """Carry out here the cancel another replica recorded for a task parked here."""

    async def close_run(self, task_id: str) -> None:
        """See that the run here of a task whose end the store refused closes."""


class RemoteCancels:
    """One handler's look-out for cancels recorded by other replicas.

    Built by the lifecycle it serves once the handler is built (`Lifecycle.bind`).

    Attributes:
        on_lookout: whether the lifecycle's runs and parked tasks look for remote cancels: not
            on a bare ``InMemoryTaskStore`` only one handler has, nor with ``poll`` None and
            no notices.
        interval: seconds between two looks of a run, now: ``poll``, or ``math.inf`` while
            notices are heard.
        hearing: whether the store's notices are heard now.
        heard_since: the loop's time when they were last heard again (listening began anew):
            what the other replicas told before is unknown here.

    Args:
        lifecycle: the handler's lifecycle, whose runs and parked tasks look.
        handler: our handler, whose store is read and whose runs are found.
        store: the task store the handler was given.
        poll: seconds between two polls while no notices are heard; None never polls.
        peers: the notices of the handlers of this process that share the handler's
            ``InMemoryTaskStore``, if it has one: what they watch is told through them. Where
            they are the store's own notices too (the handler guards a bare store itself),
            only such handlers write there: the runs look once a second one shares it.
    """

    def __init__(
        self,
        lifecycle: Watched,
        handler: DefaultRequestHandlerV2,
        store: Any,
        poll: float | None,
        peers: LocalNotices | None = None,
    ) -> None:
        self.handler, self.lifecycle = handler, lifecycle
        self.on_lookout = self.hearing = False
        self.heard_since = -math.inf
        # The store tells of its refusals until `aclose`.
        self._guarded = store if isinstance(store, FinalStateTaskStore) else None
        self.notices = None if self._guarded is None else self._guarded.notices
        self.peers = peers
        self._unsubscribe = None if self._guarded is None else self._guarded.subscribe(refused=self.refused)
        self.poll = self.interval = math.inf if poll is None else poll
        # The peers' notices come to `noticed` directly: nothing to listen to, nothing lost.
        told_directly = peers is not None and self.notices is peers
        self._listens = self.notices is not None and not told_directly
        if self._listens or (poll is not None and not told_directly):
            self._look()
        self._parked_looks: asyncio.TimerHandle | None = None
        # Tasks a save of whose was refused over a stored end, the last ones, oldest first,
        # each with the refused save's caller (who may read it): read for every stream's end
        # and push to tell whether `as_stored` has anything to do.
        self.refused_tasks: collections.OrderedDict[str, ServerCallContext] = collections.OrderedDict()
        # Subscriptions served from the store here, by task: each is woken by a notice.
        self._followers: dict[str, set[asyncio.Event]] = {}
        self._listener: asyncio.Future[None] | None = None
        # Whether `listen` has something to start: read for every message, a call is not.
        self.must_listen = self._listens
        if peers is not None:
            peers.join(self)  # Last: it may call `store_shared` at once.

    def _look(self) -> None:
        """Look for cancels recorded elsewhere: runs poll until notices are heard, and whenever
        they are not; so do the parked tasks."""
        self.on_lookout = True

    def store_shared(self) -> None:
        """A second handler shares the store: if it tells its cancels here directly, look for
        them from now on, hearing them all (no poll)."""
        if self.notices is not None and self.notices is self.peers:
            self.on_lookout = self.hearing = True
            self.interval = math.inf

    def noticed(self, task_id: str) -> None:
        """Another replica may have ended ``task_id``: its run or parked task here looks now.

        A notice of what another replica watches goes to the lifecycle's watchers instead.
        """
        if task_id.startswith(WATCHED):
            if self.lifecycle.watchers is not None:
                self.lifecycle.watchers.heard(task_id)
            return
        for woken in self._followers.get(task_id, ()):
            woken.set()
        lifecycle = self.lifecycle
        if task_id in lifecycle.cancellations:
            return
        work = lifecycle.works.get(task_id)
        if work is not None:
            in_background(work.look())  # Finding CANCELED, it cancels the run here.
        elif task_id in lifecycle.parked:
            in_background(self._end_parked_if_cancelled(task_id))

    def refused(self, task_id: str, caller: ServerCallContext) -> None:
        """The store refused a save of ``task_id`` (by ``caller``) over the end it holds: look
        now, and let what this replica streams and pushes of the task end on that end (see
        `as_stored`)."""
        self.refused_tasks[task_id] = caller
        self.refused_tasks.move_to_end(task_id)
        if len(self.refused_tasks) > _REFUSALS_KEPT:
            self.refused_tasks.popitem(last=False)
        self.noticed(task_id)
        lifecycle = self.lifecycle
        if not (
            task_id in lifecycle.works or task_id in lifecycle.cancellations or task_id in lifecycle.parked
        ):
            # Its execute() has returned (its cancel too, if it had one): nothing of ours ends
            # it, and the SDK's own teardown of it may never end (see Lifecycle.close_run).
            in_background(lifecycle.close_run(task_id))

    async def as_stored(self, event: Ending, caller: ServerCallContext) -> Ending:
        """A terminal ``event`` of this replica's, or the end the store holds instead.

        A run's end that the store refused (another replica's CANCELED came first) still
        reaches the SDK's streams, its blocking sender and push: they must show what the store
        holds. For a task in `refused_tasks` only: one read per stream end of such a task.
        """
        task_id = event.id if isinstance(event, Task) else event.task_id
        stored = await _sdk.read_task(self.handler, task_id, caller)
        if stored is None or stored.status.state not in _sdk.TERMINAL_STATES:
            return event
        if stored.status.state == event.status.state:
            return event
        if isinstance(event, Task):
            return stored
        return TaskStatusUpdateEvent(task_id=task_id, context_id=event.context_id, status=stored.status)

    async def follow(self, task: Task, caller: ServerCallContext) -> AsyncGenerator[Any, None]:
        """Serve a subscription to a task no run here feeds, from the store, until it ends.

        The task first, then its status each time the stored one changes: read once per poll
        interval (the default one if polling is off), and at once when a notice names it.
        Ends after a terminal state, or when the caller can no longer read the task.
        """
        woken = asyncio.Event()
        followers = self._followers.setdefault(task.id, set())
        followers.add(woken)
        interval = self.poll if self.poll != math.inf else DEFAULT_POLL_INTERVAL
        loop = asyncio.get_running_loop()
        try:
            yield task
            status = task.status
            while status.state not in _sdk.TERMINAL_STATES:
                await wait_set(woken, loop.time() + interval)
                woken.clear()
                stored = await _sdk.read_task(self.handler, task.id, caller)
                if stored is None:
                    return
                if stored.status != status:
                    status = stored.status
                    yield TaskStatusUpdateEvent(task_id=task.id, context_id=task.context_id, status=status)
        finally:
            followers.discard(woken)
            if not followers and self._followers.get(task.id) is followers:
                del self._followers[task.id]

    def listen(self) -> None:
        """Hear the store's notices from the first message on, for as long as the loop runs."""
        if self._listener is None and self.notices is not None:
            self._listener = in_background(
                keep_listening(self.notices, self.noticed, self._heard, self._unheard)
            )
            self.must_listen = False

    async def aclose(self) -> None:
        """Stop hearing notices and the store's refusals (the server shuts down)."""
        if self._unsubscribe is not None:
            self._unsubscribe()
        listener, self._listener = self._listener, None
        self.must_listen = self._listens
        if listener is not None:
            listener.cancel()
            if not await wait_done(listener, deadline_in(LISTENER_STOP)):
                logger.warning(
                    "the listener for cancels (%s) did not stop within %g s of aclose(); left behind",
                    type(self.notices).__name__,
                    LISTENER_STOP,
                )

    def _heard(self) -> None:
        """Listening (again): stop polling, and look once at every task here, in case."""
        self.hearing = True
        self.heard_since = asyncio.get_running_loop().time()
        self._poll_every(math.inf)
        lifecycle = self.lifecycle
        for work in list(lifecycle.works.values()):
            in_background(work.look())
        if lifecycle.parked:
            in_background(self._look_at_every_parked())

    def _unheard(self) -> None:
        """The notices are lost: poll as without them until they are back."""
        self.hearing = False
        self._poll_every(self.poll)
        if self.lifecycle.parked:
            self.look_at_parked_soon()

    def _poll_every(self, interval: float) -> None:
        if interval == self.interval:
            return  # A reconnect that failed again: each run keeps the look it has due.
        self.interval = interval
        for work in self.lifecycle.works.values():
            work.poll_every(interval)
        if interval == math.inf and self._parked_looks is not None:
            self._parked_looks.cancel()
            self._parked_looks = None

    async def read_for(self, context: RequestContext) -> Task | None:
        """The task as stored, read as the run's caller (a run checks it for remote cancels)."""
        return await _sdk.read_task(self.handler, context.task_id or "", context.call_context)

    def look_at_parked_soon(self) -> None:
        """Look at the parked tasks after one poll interval: one timer for all of them."""
        interval = self.interval
        if self._parked_looks is None and interval != math.inf:
            self._parked_looks = asyncio.get_running_loop().call_later(interval, self._parked_looks_due)

    def _parked_looks_due(self) -> None:
        self._parked_looks = None
        in_background(self._look_at_every_parked())

    async def _look_at_every_parked(self) -> None:
        """Look at each parked task; while polling, again after one interval."""
        parked = self.lifecycle.parked
        for task_id in list(parked):
            await self._end_parked_if_cancelled(task_id)
        if parked:
            self.look_at_parked_soon()

    async def _end_parked_if_cancelled(self, task_id: str) -> None:
        """Cancel here a parked task that another replica cancelled in the store.

        Its run here is still live (the SDK keeps it for the follow-up), with its subscribers
        and push configs: they end on CANCELED as for a cancel made here. A task that ended or
        whose run closed is forgotten; one that resumed forgot itself.
        """
        parked = self.lifecycle.parked
        caller = parked.get(task_id)
        if caller is None:
            return
        live = await _sdk.live_task(self.handler, task_id)
        if live is None:  # Its run here closed (a2a-sdk 1.3's idle timeout): nothing to tell.
            if parked.get(task_id) is caller:
                del parked[task_id]
            return
        try:
            stored = await _sdk.read_task(self.handler, task_id, caller)
        except Exception:  # A store hiccup must not end the looking; the next look retries.
            logger.warning(
                "could not read parked task %s to look for a remote cancel", task_id, exc_info=True
            )
            return
        if parked.get(task_id) is not caller:
            # Resumed or cancelled here meanwhile. A resumed run looks no sooner than its next
            # poll (never, while notices are heard): what this look found is passed on to it.
            if stored is not None and stored.status.state == _sdk.CANCELED:
                self.noticed(task_id)
            return
        if stored is None or stored.status.state not in _sdk.TERMINAL_STATES:
            return  # Still parked; or parked here before the store has saved it (so).
        del parked[task_id]
        if stored.status.state == _sdk.CANCELED:
            await self.lifecycle.noticed_parked(stored, live, caller)
