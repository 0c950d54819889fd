"""The queues a run and a cancel see: the run's queue, where each enqueue is a checkpoint, and
the cancel's, which may publish CANCELED once; on both a terminal state is final."""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from a2a.server.agent_execution import RequestContext
from a2a.types import Message, Part, Role, TaskState, TaskStatus, TaskStatusUpdateEvent

from a2a_cancelfix._sdk import CANCELED, STATUS_EVENTS, TERMINAL_STATES, terminal_state

if TYPE_CHECKING:
    from a2a.server.events.event_queue import EventQueue

    from a2a_cancelfix._cancel.work import Work

    AQueue = EventQueue  # What a `QueueProxy` is to the checker, as it is to ``isinstance``.
else:
    AQueue = object

logger = logging.getLogger("a2a_cancelfix")

# The run queues that have carried a terminal state, so no later event (from a late run, or
# from a cancel) follows it: weak references, each discarded with its queue. Not a WeakSet,
# whose lookup is a Python call: every event looks here.
_ended: set[weakref.ref[Any]] = set()


def has_ended(queue: Any, context: RequestContext) -> bool:
    """Whether the run's queue carried a terminal state, or the task was stored terminal."""
    if _ended and weakref.ref(queue) in _ended:  # Often empty: no weak reference made then.
        return True
    task = context.current_task
    return task is not None and task.status.state in TERMINAL_STATES


def may_enqueue(queue: Any, event: Any, task_id: str, terminal: bool) -> bool:
    """Whether ``event`` may go in: not once the queue carried a terminal state, which is final.

    Not a coroutine that enqueues too: it runs for every event, and a frame fewer counts.
    """
    if weakref.ref(queue) in _ended:
        logger.debug("Dropped %s after task %s ended", type(event).__name__, task_id)
        return False
    if terminal:
        _ended.add(weakref.ref(queue, _ended.discard))
    return True


class QueueProxy(AQueue):
    """A run's queue as ``execute()`` or ``cancel()`` sees it: what they may call of a queue is
    ``enqueue_event``, which a subclass checks; anything else is the real queue's, and to
    ``isinstance`` this is one.

    Not a wrapt proxy: every message builds one and sends each of its events through it, and
    a subclass of wrapt's C proxy reads its own attributes through CPython's generic
    ``__getattr__`` hook (see BENCHMARKS.md); slots are read through the interpreter's caches.
    """

    __slots__ = ("__wrapped__",)

    def __init__(self, queue: EventQueue) -> None:
        self.__wrapped__ = queue

    @property  # type: ignore[misc]  # `isinstance(queue, EventQueue)` holds, as for the real one.
    def __class__(self) -> type:
        return type(self.__wrapped__)

    def __getattr__(self, name: str) -> Any:
        if name == "__wrapped__":  # Not set (a copy made without __init__): no recursion.
            raise AttributeError(name)
        return getattr(self.__wrapped__, name)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} of {self.__wrapped__!r}>"


class RunQueue(QueueProxy):
    """The queue ``execute()`` sees: every enqueue is a checkpoint; a terminal state is final."""

    __slots__ = ("_run",)

    def __init__(self, queue: EventQueue, run: Work) -> None:
        self.__wrapped__ = queue  # Not super().__init__(): one is built for every message.
        self._run = run

    def enqueue_event(self, event: Any) -> Coroutine[Any, Any, None]:
        """Enqueue ``event`` unless the run was cancelled (then raise) or the task has ended.

        Not a coroutine function: every event of every run comes through here, and a run
        with nothing to look for and no cancel hands back the queue's own coroutine, a frame
        fewer for each event.
        """
        run = self._run
        # Only a cancel (which cancels the run first) or the run's own end can end its queue
        # while it runs: until then, `_ended` need not be asked.
        if run.cancelled or run.watched or run.task_ended:
            return self._enqueue_looked(event)
        queue = self.__wrapped__
        if type(event) in STATUS_EVENTS and event.status.state in TERMINAL_STATES:
            run.task_ended = True
            _ended.add(weakref.ref(queue, _ended.discard))
        return queue.enqueue_event(event)

    async def _enqueue_looked(self, event: Any) -> None:
        run = self._run
        terminal = terminal_state(event) is not None
        if not run.cancelled and (terminal or time.monotonic() >= run.next_look):
            # Before ending the task above all: another replica may have cancelled it.
            await run.look_in_run()
        if run.cancelled:
            if run.shielded:
                logger.debug("Dropped %s enqueued by cancelled task %s", type(event).__name__, run.task_id)
                return
            run.raise_if_cancelled()
        if may_enqueue(self.__wrapped__, event, run.task_id, terminal):
            run.task_ended = run.task_ended or terminal
            await self.__wrapped__.enqueue_event(event)


class CancelQueue(QueueProxy):
    """The queue ``cancel()`` sees: it may publish CANCELED once; a terminal state is final."""

    __slots__ = ("_context",)

    def __init__(self, queue: EventQueue, context: RequestContext) -> None:
        super().__init__(queue)
        self._context = context

    async def enqueue_event(self, event: Any) -> None:
        state = terminal_state(event)
        if state is not None and state != CANCELED:
            logger.warning(
                "cancel() of task %s published state %s; the task ends CANCELED instead",
                self._context.task_id,
                state,
            )
            return
        task_id = self._context.task_id or ""
        if may_enqueue(self.__wrapped__, event, task_id, state is not None):
            await self.__wrapped__.enqueue_event(event)

    async def publish(self, state: TaskState, why: str | None = None) -> bool:
        """Publish the framework's terminal ``state``, unless the run already ended; ``why``
        is its status message's text."""
        context = self._context
        if weakref.ref(self.__wrapped__) in _ended or context.current_task is None:
            return False  # Already ended, or no task stored yet that a status could update.
        status = TaskStatus(state=state)
        if why is not None:
            status.message.CopyFrom(
                Message(
                    role=Role.ROLE_AGENT,
                    message_id=f"{context.task_id}-canceled",
                    task_id=context.task_id or "",
                    context_id=context.context_id or "",
                    parts=[Part(text=why)],
                )
            )
        status.timestamp.FromNanoseconds(time.time_ns())  # GetCurrentTime() goes through datetime.
        event = TaskStatusUpdateEvent(
            task_id=context.task_id, context_id=context.context_id or "", status=status
        )
        if not may_enqueue(self.__wrapped__, event, context.task_id or "", True):
            return False
        await self.__wrapped__.enqueue_event(event)
        return True
