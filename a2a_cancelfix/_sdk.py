"""The one place that touches a2a-sdk internals.

Every private name is reached through a small function named for what it does, probed once
at import, with the SDK releases it was seen in. Dropping support for an old release means
editing this module only.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import importlib
import importlib.metadata
import inspect
import logging
import warnings
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from a2a.server.request_handlers import DefaultRequestHandlerV2
from a2a.server.tasks import BasePushNotificationSender, PushNotificationConfigStore, TaskStore
from a2a.types import CancelTaskRequest, Task, TaskArtifactUpdateEvent, TaskState, TaskStatusUpdateEvent
from a2a.utils import telemetry as _telemetry_module
from google.protobuf.message import Message as ProtobufMessage

from a2a_cancelfix._aio import deadline_in, deadlines, in_background, wait_done, wait_set

if TYPE_CHECKING:
    import httpx
    from a2a.server.context import ServerCallContext
    from a2a.server.events.event_queue import EventQueue
    from a2a.server.events.event_queue_v2 import EventQueueSource  # 1.0.0-1.3.0
    from sqlalchemy.exc import DBAPIError

logger = logging.getLogger("a2a_cancelfix")

# The SDK's names that the other modules take from here.
__all__ = [
    "ConcurrentTaskModificationError",
    "QueueShutDown",
    "TaskVersion",
    "VersionedTaskStore",
    "check_required_fields",
]

F = TypeVar("F", bound=Callable[..., Any])

SDK_VERSION = importlib.metadata.version("a2a-sdk")

CANCELED = TaskState.TASK_STATE_CANCELED
MISSING: list[str] = []


def _private_module(name: str) -> ModuleType | None:
    """A release that moved a private module must not break a server at import: each is probed."""
    try:
        return importlib.import_module(name)
    except ImportError:  # pragma: no cover - a future release
        MISSING.append(name)
        return None


_active_task_module = _private_module("a2a.server.agent_execution.active_task")  # 1.0.0-1.3.0
# The class, for probes of its code only: a run is typed as the `LiveRun` we use of it.
_ActiveTask: Any = getattr(_active_task_module, "ActiveTask", None)


class _Closes(Protocol):
    async def close(self, immediate: bool = False) -> None: ...


class _ShutsDown(Protocol):
    def shutdown(self, immediate: bool = False) -> None: ...


class LiveRun(Protocol):
    """What we use of the SDK's ``ActiveTask``, a task's run live in this process: 1.0.0-1.3.0.

    Outside this module a run is only handed back to it. Read-only members, so the SDK's
    class matches whatever it declares them as, as long as it offers what we use.
    """

    @property
    def _is_finished(self) -> asyncio.Event: ...
    @property
    def _producer_task(self) -> asyncio.Task[None] | None: ...
    @property
    def _consumer_task(self) -> asyncio.Task[None] | None: ...
    @property
    def _event_queue_agent(self) -> EventQueueSource: ...
    @property
    def _event_queue_subscribers(self) -> _Closes: ...
    @property
    def _request_queue(self) -> _ShutsDown: ...
    async def _maybe_cleanup(self) -> None: ...


try:  # 1.0.0-1.3.0
    from a2a.server.events.event_queue import QueueShutDown
except ImportError:  # pragma: no cover - a future release

    class QueueShutDown(Exception):  # type: ignore[no-redef]
        """Stands in for the SDK's; never raised."""


try:  # request_handler.py's request validators, on the methods we override: 1.0.0-1.3.0
    from a2a.server.request_handlers.request_handler import validate, validate_request_params

    # The SDK's refusal of a stream, its message and its log line, as its stream methods have it.
    _refuse_streaming: Callable[[DefaultRequestHandlerV2], object] | None = validate(
        lambda _: False, "Streaming is not supported by the agent"
    )(lambda _: None)
except ImportError:  # pragma: no cover - a future release
    _refuse_streaming = None

    def validate_request_params(method: Callable[..., Any]) -> Callable[..., Any]:
        return method


try:  # The check validate_request_params makes: 1.0.0-1.3.0
    from a2a.utils.proto_utils import validate_proto_required_fields as check_required_fields
except ImportError:  # pragma: no cover - a future release

    def check_required_fields(msg: ProtobufMessage) -> None:
        return None


async def _a_coroutine(*_: Any) -> None:
    return None


async def _a_stream(*_: Any) -> AsyncGenerator[None, None]:
    yield None


# The code every validate_request_params wrapper shares, a coroutine's or a stream's.
_PARAMS_CHECKS = {validate_request_params(f).__code__ for f in (_a_coroutine, _a_stream)}


def check_streaming(handler: DefaultRequestHandlerV2) -> None:
    """Refuse a stream when the agent card says the agent does not stream, as the SDK does."""
    if _refuse_streaming is not None and not handler._agent_card.capabilities.streaming:  # 1.0.0-1.3.0
        _refuse_streaming(handler)


def validated(method: F) -> F:
    """The SDK's request check (``validate_request_params``) around ``method``, whose
    signature it keeps (the SDK types it as returning a bare Callable)."""
    return cast(F, validate_request_params(method))


def untraced(method: F) -> F:
    """The SDK handler's ``method`` without the span its ``trace_class`` puts around it.

    Our override carries that span (``_telemetry.traced_as_sdk``); calling the SDK's method
    traced would open a second one of the same name inside it.
    """
    # trace_function's wrappers are defined in a2a/utils/telemetry.py and keep the method as
    # __wrapped__ (functools.wraps): 1.0.0-1.3.0.
    inner = getattr(method, "__wrapped__", None)
    if inner is not None and method.__code__.co_filename == _telemetry_module.__file__:
        return cast(F, inner)
    return method  # pragma: no cover - a future release that traces otherwise


def unchecked(method: F) -> F:
    """The SDK handler's ``method`` without its ``validate_request_params`` wrapper.

    Our override checks the request itself, first (``check_required_fields``): checked again
    inside, every message would pay twice; a layer fewer is also a frame fewer per resume.
    """
    inner = getattr(method, "__wrapped__", None)
    if inner is not None and method.__code__ in _PARAMS_CHECKS:
        return cast(F, inner)
    return method  # pragma: no cover - a future release that validates otherwise: twice, then


_untraced_cancel = untraced(DefaultRequestHandlerV2.on_cancel_task)


async def sdk_cancel(handler: DefaultRequestHandlerV2, task_id: str, context: ServerCallContext) -> Task:
    """The SDK's own cancel of ``task_id``, without its span (ours carries it)."""
    # Untyped: validate_request_params, around it, returns a bare Callable.
    task: Task = await _untraced_cancel(handler, CancelTaskRequest(id=task_id), context)
    return task


def state_name(state: int) -> str:
    """A task state's name as people say it: ``CANCELED``, not ``TASK_STATE_CANCELED``."""
    return TaskState.Name(state).removeprefix("TASK_STATE_")


# The SDK's state sets; both are module constants of active_task.py in 1.0.0-1.3.0.
_TERMINAL = {
    TaskState.TASK_STATE_COMPLETED,
    TaskState.TASK_STATE_CANCELED,
    TaskState.TASK_STATE_FAILED,
    TaskState.TASK_STATE_REJECTED,
}
_PARKED = {TaskState.TASK_STATE_INPUT_REQUIRED, TaskState.TASK_STATE_AUTH_REQUIRED}
TERMINAL_STATES: frozenset[int] = frozenset(getattr(_active_task_module, "TERMINAL_TASK_STATES", _TERMINAL))
PARKED_STATES: frozenset[int] = frozenset(getattr(_active_task_module, "INTERRUPTED_TASK_STATES", _PARKED))

# ActiveTask attributes we read, all assigned in ActiveTask.__init__ in 1.0.0-1.3.0.
_ACTIVE_TASK_ATTRIBUTES = (
    "_is_finished",
    "_producer_task",
    "_consumer_task",
    "_event_queue_agent",
    "_event_queue_subscribers",
    "_request_queue",
    "_lock",
)


def _probe() -> list[str]:
    if _ActiveTask is None:
        return []
    names = _ActiveTask.__init__.__code__.co_names
    missing = [name for name in _ACTIVE_TASK_ATTRIBUTES if name not in names]
    # The handler's registry of live runs: 1.0.0-1.3.0.
    if "_active_task_registry" not in DefaultRequestHandlerV2.__init__.__code__.co_names:
        missing.append("DefaultRequestHandlerV2._active_task_registry")
    return missing


MISSING += _probe()
SUPPORTED = not MISSING

# The SDK writes CANCELED itself for a task with no live run here (1.2.0+, `_cancel_remote`).
SDK_CANCELS_WHERE_NOT_LIVE = hasattr(DefaultRequestHandlerV2, "_cancel_remote")


def _runs_close_themselves() -> bool:
    """Whether a run's teardown ends by itself once its streams are done (1.2.3+).

    Up to 1.2.2 a stream never acknowledges the SDK's own request events, so closing the run's
    queues waits for them forever. The fix has no name to probe for: its source line is.
    """
    try:
        source = inspect.getsource(_ActiveTask.subscribe)
    except (AttributeError, OSError, TypeError):
        return False
    return "isinstance(event, _RequestStarted | _RequestCompleted)" in source


RUNS_CLOSE_THEMSELVES = _runs_close_themselves()

# The push sender reads its configs under the owner it is built with up to 1.0.1; from 1.0.2 it
# dispatches to every owner, and logs that the context it still accepts is deprecated.
_PUSH_SENDER_NEEDS_OWNER = (
    inspect.signature(BasePushNotificationSender).parameters["context"].default is inspect.Parameter.empty
)


def push_sender(
    client: httpx.AsyncClient, configs: PushNotificationConfigStore, owner: ServerCallContext
) -> BasePushNotificationSender:
    """Build the SDK's push sender, with ``owner`` only where the release requires it."""
    context: dict[str, Any] = {"context": owner} if _PUSH_SENDER_NEEDS_OWNER else {}
    return BasePushNotificationSender(client, configs, **context)


_warned = False


def warn_if_unsupported() -> None:
    """Warn once that this a2a-sdk release lacks what the full fix needs."""
    global _warned
    if SUPPORTED or _warned:
        return
    _warned = True
    message = (
        f"a2a-cancelfix does not know a2a-sdk {SDK_VERSION} (missing {', '.join(MISSING)}): "
        "cancels fall back to the SDK's own path, bounded by the grace period and owner-checked. "
        "Run `a2a-cancelfix check` to see what this release still needs."
    )
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    logger.warning(message)


async def live_task(handler: DefaultRequestHandlerV2, task_id: str) -> LiveRun | None:
    """Return the run of ``task_id`` live in this process, if any."""
    if not SUPPORTED:
        return None
    # ActiveTaskRegistry.get(task_id): async, does not create; 1.0.0-1.3.0.
    live = await handler._active_task_registry.get(task_id)
    if live is None or live._is_finished.is_set():
        return None
    return live


def streams_remote_tasks(handler: DefaultRequestHandlerV2) -> bool:
    """Whether the handler streams tasks that other replicas run (upstream's cluster mode)."""
    return getattr(handler, "_event_stream", None) is not None  # 1.2.0+: its TaskEventStream


async def run_of(handler: DefaultRequestHandlerV2, task_id: str) -> LiveRun | None:
    """The run of ``task_id`` the handler's registry still holds, finished or not."""
    return await handler._active_task_registry.get(task_id) if SUPPORTED else None  # 1.0.0-1.3.0


async def has_run(handler: DefaultRequestHandlerV2, task_id: str) -> bool:
    """Whether the handler's registry still holds a run of ``task_id``, finished or not."""
    return await run_of(handler, task_id) is not None


async def read_task(
    handler: DefaultRequestHandlerV2, task_id: str, context: ServerCallContext
) -> Task | None:
    """Read a task as the caller may see it (owner-scoped), or None."""
    # A VersionedTaskStore answers with a StoredTask wrapper: 1.2.0+.
    store = _versioned_store(handler)
    if store is not None:
        stored = await store.get(task_id, context)
        return None if stored is None else stored.task
    return await _task_store(handler).get(task_id, context)


def _versioned_store(handler: DefaultRequestHandlerV2) -> VersionedTaskStore | None:
    """The handler's versioned view of its store, whichever it was given: 1.2.0+."""
    store: VersionedTaskStore | None = getattr(handler, "_versioned_store", None)
    return store


def _task_store(handler: DefaultRequestHandlerV2) -> TaskStore:
    """The handler's store, on a release without the versioned view (1.0.0-1.1.x): a TaskStore.

    From 1.2.0 it is annotated ``TaskStore | VersionedTaskStore``; this is never called there.
    """
    return handler.task_store  # type: ignore[return-value, unused-ignore]


def agent_queue(live: LiveRun) -> EventQueue:
    """The run's event queue; what goes in is saved, streamed and pushed by the SDK."""
    return live._event_queue_agent  # 1.0.0-1.3.0


def drop_backlog(queue: EventQueue) -> dict[str, int]:
    """Take out of a run's event queue the updates that a cancel makes moot; count them by type.

    Moot: artifact updates and non-terminal status updates that the SDK's consumer has not
    taken yet. It saves them one by one, so a backlog (token streaming ahead of a slow
    store) would hold CANCELED back past the cancel's bound. What else is queued stays, in
    order: the task, the SDK's request markers, errors. Nothing is dropped once a terminal
    state is queued: that run has ended, its output is not moot. Out of reach: the event the
    consumer is saving, and one that the dispatcher is handing on. Synchronous, so nothing
    is enqueued or taken meanwhile; each queue's own methods keep its count for ``join()``.
    """
    # EventQueueSource: enqueue_event() puts into _incoming_queue, a dispatcher task moves
    # each event on to _default_sink's queue, which the consumer reads: 1.0.0-1.3.0.
    incoming = getattr(queue, "_incoming_queue", None)
    if incoming is None or getattr(queue, "_is_closed", True):  # closing: its teardown's
        return {}
    held = [incoming]
    sink = getattr(queue, "_default_sink", None)
    if sink is not None and not getattr(sink, "_is_closed", True):  # EventQueueSink: 1.0.0-1.3.0
        held.insert(0, sink.queue)  # the older events
    taken = [[q.get_nowait() for _ in range(q.qsize())] for q in held]
    if not any(taken):  # The usual cancel: the consumer is waiting, nothing to sort.
        return {}
    ended = any(terminal_state(event) is not None for events in taken for event in events)
    dropped: collections.Counter[str] = collections.Counter()
    for q, events in zip(held, taken, strict=True):
        for event in events:
            if not ended and _is_moot(event):
                dropped[type(event).__name__] += 1
            else:
                q.put_nowait(event)
        for _ in events:
            q.task_done()
    return dict(dropped)


def _is_moot(event: object) -> bool:
    if isinstance(event, TaskArtifactUpdateEvent):
        return True
    return isinstance(event, TaskStatusUpdateEvent) and event.status.state not in TERMINAL_STATES


# The events that carry a task's status, tested as ``type(event) in STATUS_EVENTS``: protobuf's
# message classes cannot be subclassed, and ``isinstance`` of one goes through its metaclass's
# costly ``__instancecheck__`` (see BENCHMARKS.md).
STATUS_EVENTS = frozenset((Task, TaskStatusUpdateEvent))


def terminal_state(event: Any) -> int | None:
    """The terminal state an event records, if any."""
    if type(event) in STATUS_EVENTS:
        state: int = event.status.state
        if state in TERMINAL_STATES:
            return state
    return None


async def wait_finished(live: LiveRun, deadline: float) -> bool:
    """Wait until the SDK recorded a terminal state for the run (or it died), by ``deadline``."""
    return await wait_set(live._is_finished, deadline)  # 1.0.0-1.3.0


def unless_closed_by(live: LiveRun, deadline: float, stuck: Callable[[], Any]) -> None:
    """Call ``stuck`` if the run has not closed on its own by ``deadline``.

    The producer's teardown closes the queues and ends the streams; cancelling it instead
    could land inside that teardown and leave them open, so only a run still open at
    ``deadline`` is left to `force_close`. No task and no wait: done-callbacks on the run's
    tasks and one entry in the loop's `deadlines`.
    """
    # ActiveTask._producer_task and _consumer_task: 1.0.0-1.3.0
    tasks = (live._producer_task, live._consumer_task)
    running = [task for task in tasks if task is not None and not task.done()]
    if not running:
        return
    timers = deadlines()
    entry = timers.at(deadline, stuck)

    def closed(_: object) -> None:
        if all(task.done() for task in running):
            timers.drop(entry)

    for task in running:
        task.add_done_callback(closed)


async def force_close(live: LiveRun, seconds: float) -> None:
    """Tear a run down without its cooperation: queues closed, tasks cancelled, registry freed.

    Within ``seconds``, even when the work swallows its cancellation and so never ends.
    """
    aclose: Callable[[], Awaitable[None]] | None = getattr(live, "aclose", None)  # ActiveTask.aclose: 1.1.2+
    if aclose is not None:
        # It ends by awaiting the run's tasks: left to finish when they do, if not in time.
        await wait_done(in_background(aclose()), deadline_in(seconds))
    else:  # 1.0.0-1.1.1: the same steps by hand.
        live._request_queue.shutdown(immediate=True)
        await live._event_queue_agent.close(immediate=True)
        await live._event_queue_subscribers.close(immediate=True)
        live._is_finished.set()
        for task in (live._producer_task, live._consumer_task):
            if task is not None:
                task.cancel()
    # The registry drops a finished run once its last subscriber leaves: 1.0.0-1.3.0.
    with contextlib.suppress(Exception):
        await live._maybe_cleanup()


async def close_runs(handler: DefaultRequestHandlerV2, seconds: float) -> None:
    """Close every run the handler holds, as the SDK's ``aclose`` does, on a release without it.

    Left to the loop's shutdown, a run whose consumer was saving when it was cancelled never ends:
    its producer waits for queues nobody drains (seen on 1.0.3-1.3.0).
    """
    if not SUPPORTED:
        return
    runs = list(handler._active_task_registry._active_tasks.values())  # 1.0.0-1.3.0: runs by id
    await asyncio.gather(*(force_close(run, seconds) for run in runs))


async def write_canceled(
    handler: DefaultRequestHandlerV2, task_id: str, context: ServerCallContext
) -> Task | None:
    """Record CANCELED in the store, bypassing any run; return the task as it ends up.

    Only the store sees this write: no stream, no push. It is the path for a task with no
    live run here, and the last resort when a run never recorded its terminal state.
    """
    versioned = _versioned_store(handler)  # 1.2.0+
    if versioned is not None:
        stored = await versioned.get(task_id, context)
        if stored is None or stored.task.status.state in TERMINAL_STATES:
            return None if stored is None else stored.task
        # The SDK's own versioned CANCELED write (publishes to its event stream): 1.2.0+,
        # so not in the annotations of older releases.
        await handler._cancel_remote(task_id, stored.task, stored.version, context)  # type: ignore[attr-defined, unused-ignore]
        # Read back: it answers with its own copy, even where a guarded store refused it.
        stored = await versioned.get(task_id, context)
        return None if stored is None else stored.task
    store = _task_store(handler)
    task = await store.get(task_id, context)
    if task is None or task.status.state in TERMINAL_STATES:
        return task
    canceled = Task()
    canceled.CopyFrom(task)
    canceled.status.state = CANCELED
    await store.save(canceled, context)
    # Read back: a store that keeps terminal states final may have refused the write.
    return await store.get(task_id, context)


# The stores' insides, for FinalStateTaskStore's one-step guarded write.


def database_row(store: Any, task: Task, context: ServerCallContext) -> Any:
    """The ORM row ``DatabaseTaskStore.save`` would merge for ``task``."""
    return store._to_orm(task, store.owner_resolver(context))  # 1.0.0-1.3.0


def database_transaction(store: Any) -> Any:
    """A session in a transaction on the store's engine (``async with``)."""
    return store.async_session_maker.begin()  # 1.0.0-1.3.0


def database_row_of(store: Any, task: Task, owner: str) -> Any:
    """The ORM row ``DatabaseTaskStore.save`` would merge for ``task`` of ``owner``."""
    return store._to_orm(task, owner)  # 1.0.0-1.3.0


def database_owner(store: Any, context: ServerCallContext) -> str:
    """The owner a DatabaseTaskStore files the caller's tasks under."""
    owner: str = store.owner_resolver(context)  # 1.0.0-1.3.0
    return owner


def database_engine(store: Any) -> Any:
    """The engine a DatabaseTaskStore writes with (a SQLAlchemy ``AsyncEngine``)."""
    return store.engine  # 1.0.0-1.3.0


def database_model(store: Any) -> Any:
    """The ORM model of a DatabaseTaskStore's task table (its ``table_name``)."""
    return store.task_model  # 1.0.0-1.3.0


async def database_ready(store: Any) -> None:
    """Create a DatabaseTaskStore's task table once, as its own save does."""
    await store.initialize()  # 1.0.0-1.3.0


def task_from_row(store: Any, row: Any) -> Task:
    task: Task = store._from_orm(row)  # 1.0.0-1.3.0
    return task


@dataclass(frozen=True)
class MemoryTasks:
    """An InMemoryTaskStore's dict ``tasks[owner][task_id]``, its lock and how it saves."""

    tasks: dict[str, dict[str, Task]]
    lock: contextlib.AbstractContextManager[Any]  # Taken with ``with``, around code that never awaits.
    owner_resolver: Any
    copying: bool  # saves a copy unless built with use_copying=False


def memory_tasks(store: Any) -> MemoryTasks:
    impl = store._impl  # _InMemoryTaskStoreImpl behind the copying adapter: 1.0.0-1.3.0
    lock = impl.lock  # threading.RLock: 1.1.3-1.3.0
    if isinstance(lock, asyncio.Lock):
        # 1.0.0-1.1.2: an asyncio.Lock that the store never holds across an await, so that code
        # with no await in it (the guard's check and write) is atomic without taking it.
        lock = contextlib.nullcontext()
    return MemoryTasks(impl.tasks, lock, impl.owner_resolver, store._store is not impl)


# a2a-sdk's cluster mode (a2a/server/cluster/): a versioned store over SQLAlchemy and an
# event stream, for FinalStateTaskStore's guarded versioned save. Probed as a whole: a
# release without one of these pieces is not guarded, and FinalStateTaskStore refuses it.
try:  # 1.2.0-1.3.0 (the cluster package is the same in 1.2.0-1.2.3)
    from a2a.server.cluster import ConcurrentTaskModificationError, TaskVersion, VersionedTaskStore
    from a2a.server.cluster.database_task_store import VersionedDatabaseTaskStore, _is_transient
    from a2a.server.cluster.database_task_store import _as_int as _version_number
    from a2a.utils.proto_utils import to_stream_response

    _CLUSTER_IMPORTED = True
except ImportError:  # 1.0.0-1.1.x, or no SQLAlchemy (a2a-sdk without its database extras)
    _CLUSTER_IMPORTED = False  # Then none of these names is read: each use is behind HAS_CLUSTER.

# What VersionedDatabaseTaskStore.__init__ assigns and the methods its _save_once calls: 1.2.0-1.3.0.
_VERSIONED_ATTRIBUTES = ("_db", "_version_model", "_event_model", "_max_attempts", "_retry_delay_s")
_VERSIONED_METHODS = ("_ensure_cluster_tables", "_lock_version", "_current_task", "_insert_version")


def _has_cluster() -> bool:
    if not _CLUSTER_IMPORTED:
        return False
    names = VersionedDatabaseTaskStore.__init__.__code__.co_names
    return all(name in names for name in _VERSIONED_ATTRIBUTES) and all(
        callable(getattr(VersionedDatabaseTaskStore, name, None)) for name in _VERSIONED_METHODS
    )


HAS_CLUSTER = _has_cluster()


def is_versioned_database_store(store: object) -> bool:
    """Whether ``store`` is the SDK's ``VersionedDatabaseTaskStore``, in a release we can guard."""
    return HAS_CLUSTER and isinstance(store, VersionedDatabaseTaskStore)


def versioned_engine(store: Any) -> Any:
    return store._db.engine  # The DatabaseTaskStore it delegates to: 1.2.0-1.3.0


async def versioned_tables_ready(store: Any) -> None:
    """Create the task, version and journal tables once, as its own save does."""
    await store._db._ensure_initialized()  # 1.2.0-1.3.0
    await store._ensure_cluster_tables()  # 1.2.0-1.3.0


def versioned_owner(store: Any, context: ServerCallContext) -> str:
    owner: str = store._db.owner_resolver(context)  # 1.2.0-1.3.0
    return owner


def versioned_database(store: Any) -> Any:
    """The DatabaseTaskStore a VersionedDatabaseTaskStore keeps its tasks in."""
    return store._db  # 1.2.0-1.3.0


def versioned_row(store: Any, task: Task, owner: str) -> Any:
    """The ORM row its save merges for ``task``."""
    return store._db._to_orm(task, owner)  # 1.2.0-1.3.0


def versioned_transaction(store: Any) -> Any:
    """A session in a transaction on the store's engine (``async with``)."""
    return store._db.async_session_maker.begin()  # 1.2.0-1.3.0


def version_model(store: Any) -> Any:
    """The ORM model of the ``task_versions`` table: task_id, owner, version."""
    return store._version_model  # 1.2.0-1.3.0


def journal_model(store: Any) -> Any:
    """The ORM model of the ``task_events`` table that DatabaseTaskEventStream tails."""
    return store._event_model  # 1.2.0-1.3.0


async def lock_version(store: Any, session: Any, task_id: str, owner: str) -> int | None:
    """The stored version number, its row locked (``FOR UPDATE``; SQLite ignores that)."""
    version: int | None = await store._lock_version(session, task_id, owner)  # 1.2.0-1.3.0
    return version


async def current_task(store: Any, session: Any, task_id: str, owner: str) -> Task | None:
    """The stored task, its row locked (``FOR UPDATE``; SQLite ignores that)."""
    task: Task | None = await store._current_task(session, task_id, owner)  # 1.2.0-1.3.0
    return task


async def insert_version(store: Any, session: Any, task_id: str, owner: str, version: int) -> None:
    """Insert the first version row; ``ConcurrentTaskModificationError`` if one exists."""
    await store._insert_version(session, task_id, owner, version)  # 1.2.0-1.3.0


def version_number(version: Any) -> int:
    """The integer a VersionedDatabaseTaskStore's TaskVersion wraps."""
    number: int = _version_number(version)  # 1.2.0-1.3.0
    return number


def journal_entry(event: Any) -> bytes:
    """An event as the journal stores it (a serialised StreamResponse)."""
    return to_stream_response(event).SerializeToString()  # 1.2.0-1.3.0


def save_retries(store: Any) -> tuple[int, float]:
    """How often, and how far apart, its save retries transient database errors."""
    return store._max_attempts, store._retry_delay_s  # 1.2.0-1.3.0


def is_transient(error: DBAPIError) -> bool:
    """Whether a DBAPIError is contention the SDK's store retries (lock, serialization)."""
    transient: bool = _is_transient(error)  # 1.2.0-1.3.0
    return transient
