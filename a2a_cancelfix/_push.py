"""Push notifications sent behind the run, so that a slow receiver delays only its own pushes.

The SDK's consumer of a run's events sends each push notification before it takes the next
event: a webhook that takes seconds to answer holds back the run's later events, CANCELED
included, from the store and every stream, past any cancel's bound. Our handler hands the SDK
a `BackgroundPushSender` around the sender it is given instead.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any

from a2a.server.tasks import PushNotificationSender

from a2a_cancelfix._aio import in_background, wait_done

logger = logging.getLogger("a2a_cancelfix")


class BackgroundPushSender(PushNotificationSender):
    """Send each task's push notifications in order, in the background.

    One worker per task with pushes waiting, ending when none are left: a task's pushes keep
    their order, and a slow receiver delays only the pushes of its own task. As the SDK's own
    sender, a failure is logged and never reaches the run.

    Args:
        sender: the push sender the handler was given.
    """

    def __init__(self, sender: PushNotificationSender) -> None:
        self.sender = sender
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
                    await self.sender.send_notification(task_id, waiting[0])
                except Exception:
                    logger.exception("push notification sender raised for task %s", task_id)
                waiting.popleft()
        finally:
            del self._waiting[task_id], self._workers[task_id]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sender, name)  # What else the SDK or its user reads of the sender.
