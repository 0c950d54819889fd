"""What the handler's streams share: their end at a task's terminal event, and their count for a shutdown."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from a2a.types import InternalError, TaskStatusUpdateEvent

from a2a_cancelfix import _sdk
from a2a_cancelfix._aio import Once

if TYPE_CHECKING:
    from a2a.server.context import ServerCallContext

    from a2a_cancelfix._lifecycle import Lifecycle

logger = logging.getLogger("a2a_cancelfix")


async def until_terminal(events: AsyncGenerator[Any, None]) -> AsyncGenerator[Any, None]:
    """Yield a stream's events and end it right after a terminal one, as the spec says.

    Ending here, rather than when the SDK closes the run's queues, also keeps a subscriber
    from taking the SDK's end-of-request marker, which a2a-sdk up to 1.2.x never marks done:
    the run's teardown would then wait for it forever.
    """
    async with contextlib.aclosing(events):
        async for event in events:
            yield event
            if _sdk.terminal_state(event) is not None:
                return


async def drain(events: AsyncGenerator[Any, None]) -> None:
    """Read the SDK's stream to its end, for nobody: what follows a terminal event is not news."""
    try:
        async for _ in events:
            pass
    except Exception:
        logger.debug("a stream raised after its terminal event", exc_info=True)
    finally:
        await events.aclose()


class OpenStreams:
    """The streams open here of runs here, senders' and subscribers', that a shutdown waits for."""

    __slots__ = ("_changed", "_subscribers", "senders")

    def __init__(self) -> None:
        self.senders = 0
        self._subscribers: dict[str, int] = {}
        self._changed: Once | None = None  # Given as a stream closes, while a shutdown waits.

    def sender_opened(self) -> None:
        self.senders += 1

    def sender_closed(self) -> None:
        self.senders -= 1
        if self._changed is not None:  # Inline: one call fewer on every stream.
            self._changed.give()

    def subscriber_opened(self, task_id: str) -> None:
        self._subscribers[task_id] = self._subscribers.get(task_id, 0) + 1

    def subscriber_closed(self, task_id: str) -> None:
        left = self._subscribers.pop(task_id) - 1
        if left:
            self._subscribers[task_id] = left
        if self._changed is not None:
            self._changed.give()

    def subscribed(self) -> list[str]:
        """The tasks with a subscriber's stream open."""
        return list(self._subscribers)

    async def until(self, done: Callable[[], Awaitable[bool]], deadline: float) -> bool:
        """Wait until ``done()``, asked again as each stream closes, or until ``deadline``;
        whether it is done."""
        while True:
            changed = self._changed = Once()  # Before asking: a close meanwhile is not missed.
            if await done():
                return True
            if not await changed.wait(deadline):
                return False


async def end_being_recorded(
    lifecycle: Lifecycle, task_id: str, context: ServerCallContext
) -> TaskStatusUpdateEvent | None:
    """The end of a stream of ``task_id`` that ended with no terminal event: where its run was
    closed while a cancel's CANCELED was still being written (the store slow, locked or
    failing), the end the store holds once the write is over; else None.

    Raises:
        InternalError: the store never recorded it.
    """
    if not task_id:
        return None
    stored = await lifecycle.stored_end(task_id, context)
    if stored is None:
        return None
    if stored.status.state not in _sdk.TERMINAL_STATES:
        raise InternalError(message=f"The task store did not record the end of task {task_id}")
    return TaskStatusUpdateEvent(task_id=task_id, context_id=stored.context_id, status=stored.status)
