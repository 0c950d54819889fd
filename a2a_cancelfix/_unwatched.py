"""Who watches each task, and the cancel of one nobody has watched for a while.

Behind the handler's ``cancel_unwatched_after``. An observer is an open stream (the sender's or a
``SubscribeToTask``) or a blocking sender; each is counted as it opens and as it closes, never per
event. A task that runs here (or is parked here, with ``cancel_unwatched_parked``) and has no
observer starts a clock; an observer stops it, a GetTask or the deletion of a push config starts
it again. When it runs out,
and the task has no push config and no other replica watches it either, the task is cancelled
through the lifecycle, as a client's cancel is (`Lifecycle.unwatched`).

Other replicas: each one announces the tasks it watches and does not run (on the store's notices,
or straight to the handlers sharing an ``InMemoryTaskStore`` in this process) as an observer opens
and every quarter of the interval while it stays open; a task announced counts as watched for half
the interval after. A replica that cannot hear the others (a store shared without notices, or
notices not heard right now) cancels nothing as unwatched; once it hears them again, nothing
before the interval is over.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Protocol

from a2a.types import Task

from a2a_cancelfix import _sdk
from a2a_cancelfix._aio import in_background

if TYPE_CHECKING:
    from a2a.server.agent_execution import RequestContext
    from a2a.server.context import ServerCallContext
    from a2a.server.tasks import PushNotificationConfigStore

    from a2a_cancelfix.notices import CancelNotices, LocalNotices

logger = logging.getLogger("a2a_cancelfix")

# A notice that names tasks watched on the replica that sent it, not a cancel: "watched:ID ID ...".
WATCHED = "watched:"
# PostgreSQL's NOTIFY takes payloads under 8000 bytes.
_PAYLOAD = 7000


class Hearing(Protocol):
    """How the replica hears the others (a `_replicas.RemoteCancels`)."""

    notices: CancelNotices | None
    peers: LocalNotices | None  # The handlers sharing this process's store, told directly.
    hearing: bool
    heard_since: float  # The loop's time when the notices were last heard again.


class Cancelling(Protocol):
    """What cancels an unwatched task (a `_lifecycle.Lifecycle`)."""

    cancellations: Any
    handler: Any

    def busy(self, task_id: str) -> bool:
        """Whether an ``execute()`` of ``task_id`` runs here, or a cancel of it."""

    async def read(self, task_id: str, caller: ServerCallContext) -> Task | None:
        """The task as ``caller`` may see it."""

    async def unwatched(self, task: Task, live: Any, caller: ServerCallContext, after: float) -> None:
        """Cancel ``task``, whose run here is ``live``, as nobody watched it for ``after`` s."""


class Observer:
    """One open stream or blocking sender; its task once known (a new task's id comes with its run)."""

    __slots__ = ("message_id", "task_id")

    def __init__(self, task_id: str, message_id: str) -> None:
        self.task_id = task_id
        self.message_id = message_id


class Watchers:
    """The observers of one handler's tasks, and the clock of each task that has none.

    Args:
        lifecycle: what cancels an unwatched task, and reads it.
        after: seconds a task may go unwatched.
        parked_too: whether a parked task's clock runs too.
        push_configs: the handler's push config store, if any: a task with a config is watched.
        remote: how this replica hears the others.
    """

    def __init__(
        self,
        lifecycle: Cancelling,
        after: float,
        parked_too: bool,
        push_configs: PushNotificationConfigStore | None,
        remote: Hearing,
    ) -> None:
        self.after = after
        self.parked_too = parked_too
        self._lifecycle = lifecycle
        self._push_configs = push_configs
        self._remote = remote
        self._open: dict[str, int] = {}  # Open observers here, by task.
        self._senders: dict[str, Observer] = {}  # Senders of a new task, by message id, until it runs.
        self._here: dict[str, ServerCallContext] = {}  # Tasks run (or parked) here, with their caller.
        self._parked: set[str] = set()
        self._since: dict[str, float] = {}  # When each clock started.
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._elsewhere: dict[str, float] = {}  # Until when another replica watches a task run here.
        self._announced: set[str] = set()  # Tasks announced in this round.
        self._round: asyncio.TimerHandle | None = None
        self._peers = remote.peers
        if self._peers is None and remote.notices is None:
            logger.warning(
                "cancel_unwatched_after needs the store's notices to hear what other replicas "
                "watch; without them no task is cancelled as unwatched (see docs/replicas.md)"
            )

    # The observers.

    def open(self, task_id: str, message_id: str = "") -> Observer:
        """An observer opens: of ``task_id``, or of the new task that message ``message_id`` starts."""
        observer = Observer(task_id, message_id)
        if task_id:
            self._add(task_id)
        else:
            self._senders[message_id] = observer
        return observer

    def close(self, observer: Observer) -> None:
        """An observer closes (its stream ended, its client left, its sender has its answer)."""
        if observer.task_id:
            self._remove(observer.task_id)
        elif self._senders.get(observer.message_id) is observer:
            del self._senders[observer.message_id]

    def touch(self, task_id: str) -> None:
        """The task's owner read it (GetTask) or deleted a push config of it: its clock
        starts again."""
        if task_id in self._here:
            if task_id not in self._open:
                self._start_clock(task_id)
        else:
            self._announce_soon(task_id)

    def _add(self, task_id: str) -> None:
        count = self._open.get(task_id, 0)
        self._open[task_id] = count + 1
        if count:
            return
        self._since.pop(task_id, None)
        timer = self._timers.pop(task_id, None)
        if timer is not None:
            timer.cancel()
        if task_id not in self._here:
            self._announce_soon(task_id)

    def _remove(self, task_id: str) -> None:
        count = self._open[task_id] - 1
        if count:
            self._open[task_id] = count
            return
        del self._open[task_id]
        if task_id in self._here:
            self._start_clock(task_id)

    # The runs.

    def run_started(self, context: RequestContext) -> None:
        """A run of ``execute()`` begins: its sender, if new, now watches its task; a clock
        starts (again) if nobody does."""
        task_id = context.task_id or ""
        self._here[task_id] = context.call_context
        self._parked.discard(task_id)
        message = context.message
        sender = None if message is None else self._senders.pop(message.message_id, None)
        if sender is not None:
            sender.task_id = task_id
            self._add(task_id)
        elif task_id not in self._open:
            self._start_clock(task_id)

    def parked(self, task_id: str) -> None:
        """The run returned with its task parked."""
        self._parked.add(task_id)

    def run_ended(self, task_id: str) -> None:
        """A run has returned: its task is forgotten, unless it is parked and parked tasks count."""
        if task_id in self._parked and self.parked_too:
            return
        self._forget(task_id)

    def _forget(self, task_id: str) -> None:
        self._here.pop(task_id, None)
        self._parked.discard(task_id)
        self._since.pop(task_id, None)
        self._elsewhere.pop(task_id, None)
        timer = self._timers.pop(task_id, None)
        if timer is not None:
            timer.cancel()

    # The clocks.

    def _start_clock(self, task_id: str) -> None:
        loop = asyncio.get_running_loop()
        self._since[task_id] = loop.time()
        self._arm(task_id, loop.time() + self.after)

    def _arm(self, task_id: str, when: float) -> None:
        timer = self._timers.get(task_id)
        if timer is not None:
            if timer.when() <= when:
                return  # It fires first, and looks again.
            timer.cancel()
        self._timers[task_id] = asyncio.get_running_loop().call_at(when, self._due, task_id)

    def _due(self, task_id: str) -> None:
        self._timers.pop(task_id, None)
        since = self._since.get(task_id)
        if since is None or task_id in self._open or task_id not in self._here:
            return
        now = asyncio.get_running_loop().time()
        # What the others told while this replica did not hear them is lost: its tasks count as
        # watched until it hears again, and so are given a whole interval of announcements.
        heard = since if self._peers is not None else self._remote.heard_since
        due = max(since, self._elsewhere.get(task_id, since), heard) + self.after
        if now < due:
            self._arm(task_id, due)
        elif not self._hears_others():
            self._arm(task_id, now + self.after / 4)  # Cannot tell: not now, look again later.
        else:
            in_background(self._expire(task_id, since))

    def _hears_others(self) -> bool:
        return self._peers is not None or (self._remote.notices is not None and self._remote.hearing)

    async def _expire(self, task_id: str, since: float) -> None:
        """Cancel the task, unless it ended, parked (and parked tasks are kept), has a push
        config, or someone came back meanwhile."""
        caller = self._here.get(task_id)
        if caller is None:
            return  # Its run ended between the clock running out and this task's start.
        lifecycle = self._lifecycle
        try:
            task = await lifecycle.read(task_id, caller)
            live = await _sdk.live_task(lifecycle.handler, task_id)
            configs = [] if self._push_configs is None else await self._push_configs.get_info(task_id, caller)
        except Exception:
            logger.warning("could not read task %s to cancel it as unwatched", task_id, exc_info=True)
            if self._since.get(task_id) == since:
                self._arm(task_id, asyncio.get_running_loop().time() + self.after)
            return
        if self._since.get(task_id) != since or task_id in self._open or task_id in lifecycle.cancellations:
            return  # Watched again, or being cancelled already.
        if live is None or (task is not None and task.status.state in _sdk.TERMINAL_STATES):
            self._forget(task_id)
            return
        if task is None or (task.status.state in _sdk.PARKED_STATES and not self.parked_too):
            # Not stored yet, or parked in the store while a follow-up's execute() runs here and
            # has not published WORKING yet: look again, or the clock would never run out.
            if lifecycle.busy(task_id):
                self._arm(task_id, asyncio.get_running_loop().time() + self.after)
            elif task is None:
                self._forget(task_id)
            return
        # A webhook watches it; one deleted later lets the clock run out again. A config with no
        # URL reaches nobody (a2a-sdk 1.0.0 stores an empty one for a message that set none).
        if any(config.url for config in configs):
            self._start_clock(task_id)
            return
        self._forget(task_id)
        await lifecycle.unwatched(task, live, caller, self.after)

    # The other replicas.

    def heard(self, notice: str) -> None:
        """Another replica announced tasks it watches: those run here count as watched a while."""
        until = asyncio.get_running_loop().time() + self.after / 2
        for task_id in notice[len(WATCHED) :].split():
            if task_id in self._here:
                self._elsewhere[task_id] = until

    def _announce_soon(self, task_id: str) -> None:
        """Tell the other replicas that ``task_id`` is watched here, unless told this round."""
        if task_id in self._announced:
            return
        self._announced.add(task_id)
        self._tell([task_id])
        if self._round is None:
            self._round = asyncio.get_running_loop().call_later(self.after / 4, self._renew)

    def _renew(self) -> None:
        """Each quarter of the interval: announce again what is still watched here, run elsewhere."""
        self._round = None
        self._announced.clear()
        watched = [task_id for task_id in self._open if task_id not in self._here]
        if watched:
            self._announced.update(watched)
            self._tell(watched)
            self._round = asyncio.get_running_loop().call_later(self.after / 4, self._renew)

    def _tell(self, task_ids: list[str]) -> None:
        if self._peers is not None:
            self._peers.deliver(WATCHED + " ".join(task_ids))
        elif self._remote.notices is not None:
            for notice in _notices(task_ids):
                in_background(self._remote.notices.tell(notice))


def _notices(task_ids: list[str]) -> list[str]:
    """The announcements of ``task_ids``, each short enough for one notice."""
    notices: list[str] = []
    ids: list[str] = []
    size = len(WATCHED)
    for task_id in task_ids:
        if ids and size + len(task_id) + 1 > _PAYLOAD:
            notices.append(WATCHED + " ".join(ids))
            ids, size = [], len(WATCHED)
        ids.append(task_id)
        size += len(task_id) + 1
    if ids:
        notices.append(WATCHED + " ".join(ids))
    return notices
