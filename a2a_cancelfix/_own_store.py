"""A task store of the user's own: what our handler does with a ``TaskStore`` that is none of
the SDK's (docs/stores.md).

With a ``save_unless_final(task, context)`` of its own (a compare-and-set save: the write,
unless the stored task has ended, in one atomic step of its backend), `FinalStateTaskStore`
guards through it as through the SDK's stores, across replicas. Without one, the handler guards
it within this process: a read, then the store's own save unless the stored task has ended,
under a lock per task that every handler of this process on that store takes. Either way,
leases stay off (they need the SDK's database tables), and the handler says so, once, as it is
built.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from a2a.server.context import ServerCallContext
from a2a.server.tasks import InMemoryTaskStore
from a2a.types import Task

from a2a_cancelfix._lease_store import LeaseStore
from a2a_cancelfix._sdk import TERMINAL_STATES
from a2a_cancelfix.store import _SAVE_UNLESS_FINAL as SAVE_UNLESS_FINAL
from a2a_cancelfix.store import FinalStateTaskStore, _to_the_end, guardable
from a2a_cancelfix.store import _save_unless_final_of as save_unless_final_of

if TYPE_CHECKING:
    from a2a_cancelfix._cancel.settings import Settings
    from a2a_cancelfix.notices import LocalNotices

try:  # Public from a2a-sdk 1.2.0 (its cluster mode): the SDK's handler uses such a store as it is.
    from a2a.server.cluster.task_store import VersionedTaskStore as _VersionedTaskStore
except ImportError:  # 1.0.0-1.1.x
    _VersionedTaskStore = None  # type: ignore[assignment, misc, unused-ignore]

logger = logging.getLogger("a2a_cancelfix")

# A whole guarded save: the write, then what a recorded cancel or a refusal calls for.
_Save = Callable[[Task, ServerCallContext], Awaitable[None]]


def guarded(store: Any, peers: LocalNotices | None) -> Any:
    """The store our handler is given, guarded by a `FinalStateTaskStore` if it is not yet: one
    of the SDK's, or one of the user's own with ``save_unless_final``, in one step (a bare
    ``InMemoryTaskStore`` with the notices of the handlers sharing it); any other within this
    process only. A ``VersionedTaskStore`` of the user's own (a2a-sdk 1.2+) is used as it is."""
    if store is None or isinstance(store, FinalStateTaskStore) or used_unguarded(store):
        return store
    if guardable(store):
        return FinalStateTaskStore(store, notices=peers)
    return _GuardedHere(store)


def used_unguarded(store: Any) -> bool:
    """Whether our handler uses ``store`` unguarded: a ``VersionedTaskStore`` (a2a-sdk 1.2+) of
    the user's own, which the SDK's handler uses as it is."""
    return _VersionedTaskStore is not None and isinstance(store, _VersionedTaskStore) and not guardable(store)


def say_what_is_off(store: Any, settings: Settings) -> None:
    """One line as our handler is built, for a store of the user's own: what it does not get
    (the final-state guard across replicas, leases), and how to get it (docs/stores.md)."""
    if store is None:
        return
    inner = store.wrapped if isinstance(store, FinalStateTaskStore) else store
    name = type(inner).__name__
    if isinstance(store, _GuardedHere):
        guard = (
            f"has no {SAVE_UNLESS_FINAL}(task, context): a task's end is final within this process "
            "only, a save from another replica can overwrite it"
        )
    elif not isinstance(store, FinalStateTaskStore):
        guard = "is used unguarded (a VersionedTaskStore of your own): a save may overwrite a task's end"
    elif save_unless_final_of(inner) is not None:
        guard = f"is guarded through its {SAVE_UNLESS_FINAL}"
    else:
        return  # One of the SDK's stores (or a subclass of one its user wrapped): nothing is off.
    leases = ""
    wanted = settings.lease_time is not None or settings.sole_replica
    if wanted and not isinstance(inner, InMemoryTaskStore) and LeaseStore.of(store) is None:
        leases = (
            "; leases are off (they need the SDK's DatabaseTaskStore): the tasks of a replica that "
            "dies stay as stored"
        )
        if settings.sole_replica:
            leases += ", and sole_replica ends none at start"
    if isinstance(store, _GuardedHere):
        logger.warning(
            "task store %s %s%s. Implement %s to guard it across replicas (docs/stores.md)",
            name,
            guard,
            leases,
            SAVE_UNLESS_FINAL,
        )
    elif not isinstance(store, FinalStateTaskStore):
        logger.warning("task store %s %s%s (docs/stores.md)", name, guard, leases)
    elif leases:
        logger.info("task store %s %s%s (docs/stores.md)", name, guard, leases)


class _GuardedHere(FinalStateTaskStore):
    """A store of the user's own without ``save_unless_final``, as our handler guards it: a
    terminal state is final within this process (see `_locked_save`)."""

    def _guard(self, store: Any) -> Any:
        return _locked_save(store, self)


def _locked_save(store: Any, guard: FinalStateTaskStore) -> _Save:
    """The guarded save for a store without ``save_unless_final``: a read, then the store's own
    save unless the stored task has ended, under a lock per task that every guard of this
    store in this process takes. Atomic within this process only: another process's save may
    land between the read and the write."""
    locks = _task_locks(store)

    async def write(task: Task, context: ServerCallContext) -> int | None:
        async with locks.held(task.id):
            try:
                kept = await store.get(task.id, context)
            except Exception:  # The store's own save may still land: it is not ours to fail.
                logger.warning(
                    "task %s: could not read it to keep its end final; saved unchecked, as the "
                    "SDK's handler saves it",
                    task.id,
                    exc_info=True,
                )
                kept = None
            if kept is not None and kept.status.state in TERMINAL_STATES:
                return kept.status.state  # type: ignore[no-any-return]
            await store.save(task, context)
            return None

    whole = _to_the_end(write)  # Once begun, its lock is held to its end.

    async def save(task: Task, context: ServerCallContext) -> None:
        await guard._saved(task, await whole(task, context), context)

    return save


class _TaskLocks:
    """A lock per task id, there while someone holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}

    @contextlib.asynccontextmanager
    async def held(self, task_id: str) -> AsyncIterator[None]:
        entry = self._locks.get(task_id)
        if entry is None:
            entry = self._locks[task_id] = (asyncio.Lock(), [0])
        lock, users = entry
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if not users[0]:
                del self._locks[task_id]


# By store: the handlers of this process that share a store share its locks.
_locks_of: weakref.WeakKeyDictionary[Any, _TaskLocks] = weakref.WeakKeyDictionary()


def _task_locks(store: Any) -> _TaskLocks:
    try:
        locks = _locks_of.get(store)
        if locks is None:
            locks = _locks_of[store] = _TaskLocks()
    except TypeError:  # Neither hashable nor weakly referenced: locks of this guard's own.
        return _TaskLocks()
    return locks
