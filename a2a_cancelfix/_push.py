"""Push notifications sent behind the run, so that a slow receiver delays only its own pushes.

The SDK's consumer of a run's events sends each push notification before it takes the next
event: a webhook that takes seconds to answer holds back the run's later events, CANCELED
included, from the store and every stream, past any cancel's bound. Our handler hands the SDK
a `BackgroundPushSender` around the sender it is given instead.

The SDK pushes each event whether or not the store saved it: a run's end that the store
refused (another replica ended the task first) would announce an end the task never had.
Such an end is handed on as the end the store holds (see `RemoteCancels.as_stored`), unless
a survivor recorded it for a lapsed lease: that one pushed it already.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import TYPE_CHECKING, Any, Protocol

from a2a.server.tasks import PushNotificationSender
from a2a.types import Task, TaskStatusUpdateEvent

from a2a_cancelfix._aio import in_background, wait_done
from a2a_cancelfix._liveness import lapsed
from a2a_cancelfix._sdk import TERMINAL_STATES

if TYPE_CHECKING:
    from a2a_cancelfix._replicas import RemoteCancels

logger = logging.getLogger("a2a_cancelfix")


class Refusals(Protocol):
    """Where the handler's look-out for refused saves is, once the handler is built (a `Lifecycle`)."""

    @property
    def remote(self) -> RemoteCancels | None: ...


class BackgroundPushSender(PushNotificationSender):
    """Send each task's push notifications in order, in the background.

    One worker per task with pushes waiting, ending when none are left: a task's pushes keep
    their order, and a slow receiver delays only the pushes of its own task. As the SDK's own
    sender, a failure is logged and never reaches the run.

    A terminal event of a task a save of whose the store refused is sent as the end the store
    holds: the same end passes as it is (a remote cancel's CANCELED, which only the replica
    running the task pushes); another one is replaced by the stored end, never sent, or dropped
    where the stored end is a lapsed lease's FAILED, which the survivor that recorded it pushed.

    Args:
        sender: the push sender the handler was given.
        refusals: what tells the tasks whose save the store refused, and their stored ends.
    """

    def __init__(self, sender: PushNotificationSender, refusals: Refusals) -> None:
        self.sender = sender
        self._refusals = refusals
        self._waiting: dict[str, collections.deque[Any]] = {}
        self._workers: dict[str, asyncio.Future[None]] = {}

    async def send_notification(self, task_id: str, event: Any) -> None:
        """Queue ``event``'s push for ``task_id``; it is sent after the task's earlier ones."""
        waiting = self._waiting.get(task_id)
        if waiting is not None:
            waiting.append(event)
            return
        self._waiting[task_id] = collections.deque([event])
        self._workers[task_id] = in_background(self._send_all(task_id))

    async def drain(self, deadline: float) -> None:
        """For the handler's shutdown: send what is queued until ``deadline``, then drop what is
        left, with a WARNING for each task whose pushes were not all sent."""
        loop = asyncio.get_running_loop()
        while self._workers and loop.time() < deadline:
            for worker in list(self._workers.values()):  # Those started meanwhile: next round.
                await wait_done(worker, deadline)
        for task_id, worker in list(self._workers.items()):
            logger.warning(
                "task %s: %d push notification(s) not sent by the end of shutdown_drain_time; dropped",
                task_id,
                len(self._waiting[task_id]),
            )
            worker.cancel()

    async def _send_all(self, task_id: str) -> None:
        waiting = self._waiting[task_id]
        try:
            while waiting:
                try:
                    event = waiting[0]
                    remote = self._refusals.remote
                    if remote is not None and remote.refused_tasks:  # Empty unless a save was refused.
                        event = await _as_stored(remote, task_id, event)
                    if event is not None:
                        await self.sender.send_notification(task_id, event)
                except Exception:
                    logger.exception("push notification sender raised for task %s", task_id)
                waiting.popleft()
        finally:
            del self._waiting[task_id], self._workers[task_id]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sender, name)  # What else the SDK or its user reads of the sender.


async def _as_stored(remote: RemoteCancels, task_id: str, event: Any) -> Any:
    """``event``, or for the end of a task whose save was refused, the end the store holds;
    None where that end is a lapsed lease's, already pushed by the survivor that recorded it."""
    caller = remote.refused_tasks.get(task_id)
    if caller is None or not isinstance(event, (Task, TaskStatusUpdateEvent)):
        return event
    if event.status.state not in TERMINAL_STATES:
        return event
    ended: Any = event  # A Task or a status update: as_stored answers with one of its kind.
    stored = await remote.as_stored(ended, caller)
    return None if stored.status.state != event.status.state and lapsed(stored) else stored
