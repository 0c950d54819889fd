"""DefaultRequestHandler: the SDK's handler, with a cancel that always ends."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import warnings
from collections.abc import AsyncGenerator, Awaitable, Callable
from types import TracebackType
from typing import Any, Literal

from a2a.server.agent_execution import AgentExecutor
from a2a.server.context import ServerCallContext
from a2a.server.request_handlers import DefaultRequestHandlerV2
from a2a.server.tasks import InMemoryTaskStore
from a2a.types import (
    CancelTaskRequest,
    DeleteTaskPushNotificationConfigRequest,
    GetTaskRequest,
    Message,
    SendMessageRequest,
    SubscribeToTaskRequest,
    Task,
    TaskNotFoundError,
    UnsupportedOperationError,
)
from a2a.utils.errors import A2AError

from a2a_cancelfix import _exit_signal, _sdk, _telemetry
from a2a_cancelfix._aio import deadline_in, in_background, wait_done
from a2a_cancelfix._cancel.settings import (
    DEFAULT_DRAIN_TIME,
    DEFAULT_GRACE_PERIOD,
    DEFAULT_LEASE_TIME,
    DEFAULT_POLL_INTERVAL,
    Settings,
)
from a2a_cancelfix._errors import ended, ended_first, raise_for, refuse_if_ended, shutting_down
from a2a_cancelfix._executor import CancellableExecutor, require_executor
from a2a_cancelfix._lifecycle import Lifecycle
from a2a_cancelfix._own_store import guarded, say_what_is_off
from a2a_cancelfix._push import BackgroundPushSender
from a2a_cancelfix._sdk import STATUS_EVENTS, TERMINAL_STATES
from a2a_cancelfix._streams import OpenStreams, drain, end_being_recorded, until_terminal
from a2a_cancelfix._unwatched import Observer
from a2a_cancelfix.checkpoints import Probe
from a2a_cancelfix.notices import LocalNotices
from a2a_cancelfix.store import FinalStateTaskStore

logger = logging.getLogger("a2a_cancelfix")

# The SDK's methods without their spans: our overrides carry them. A message's request is
# checked by our overrides, first: the SDK's own check is left out. Typed here: the SDK's
# request validator, around each, returns a bare Callable.
_sdk_send: Callable[
    [DefaultRequestHandlerV2, SendMessageRequest, ServerCallContext], Awaitable[Message | Task]
] = _sdk.unchecked(_sdk.untraced(DefaultRequestHandlerV2.on_message_send))
_sdk_stream: Callable[
    [DefaultRequestHandlerV2, SendMessageRequest, ServerCallContext], AsyncGenerator[Any, None]
] = _sdk.unchecked(_sdk.untraced(DefaultRequestHandlerV2.on_message_send_stream))
_sdk_subscribe: Callable[
    [DefaultRequestHandlerV2, SubscribeToTaskRequest, ServerCallContext], AsyncGenerator[Any, None]
] = _sdk.untraced(DefaultRequestHandlerV2.on_subscribe_to_task)
_sdk_get: Callable[[DefaultRequestHandlerV2, GetTaskRequest, ServerCallContext], Awaitable[Task | None]] = (
    _sdk.untraced(DefaultRequestHandlerV2.on_get_task)
)
_sdk_delete_config: Callable[
    [DefaultRequestHandlerV2, DeleteTaskPushNotificationConfigRequest, ServerCallContext], Awaitable[None]
] = _sdk.untraced(DefaultRequestHandlerV2.on_delete_task_push_notification_config)


class DefaultRequestHandler(DefaultRequestHandlerV2):
    """``a2a.server.request_handlers.DefaultRequestHandler`` whose cancel always ends.

    Takes exactly the SDK's constructor arguments, plus these keyword-only options.

    Args:
        cancel_grace_period: seconds that the executor's ``cancel()`` and the running
            ``execute()`` get, together, to wind down before the run is torn down and
            CANCELED is written by the framework. A cancel returns within this plus about
            one second.
        on_parked: ``"cancel"`` (default) cancels a task parked in INPUT_REQUIRED or
            AUTH_REQUIRED; ``"refuse"`` raises ``TaskNotCancelableError`` for it.
        on_canceled: ``"raise"`` (default, as the SDK does) raises
            ``TaskNotCancelableError`` when the task is already CANCELED; ``"return"``
            returns the CANCELED task (the spec calls cancel idempotent).
        replica_poll_interval: at most this often (seconds), a run's awaited checkpoints and
            enqueued events read the task store to learn of a cancel that another replica
            recorded there, and so often the tasks parked here are read for one; ``None``
            turns both off. A run also reads it before it publishes a terminal state. While
            the store's ``notices`` are heard (see `FinalStateTaskStore`), nothing polls; on
            a bare ``InMemoryTaskStore`` that no other handler shares, nothing is ever read.
        cancel_unwatched_after: off (None) by default. Seconds after which a task that runs
            here and that nobody watches (no open stream, sender's or ``SubscribeToTask``, no
            blocking sender, no push config, on no replica) is cancelled as a client's cancel
            is; its CANCELED status message says why. A subscription, a follow-up message or
            a GetTask by its owner starts the clock again.
        cancel_unwatched_parked: also cancel a parked task (INPUT_REQUIRED, AUTH_REQUIRED)
            nobody watches; by default such a task, which runs nothing, is left alone.
        shutdown_drain_time: seconds that ``aclose()`` takes at most: it sends the pushes
            queued behind the runs and tries each pending CANCELED write once more meanwhile,
            and logs a WARNING naming each task whose pushes or write it could not finish.
            Under uvicorn the shutdown begins at the exit signal (see docs/behaviour.md).
        lease_time: where the task store is a database one (a ``DatabaseTaskStore``, or a
            ``VersionedDatabaseTaskStore``, guarded by `FinalStateTaskStore`), this handler
            is a replica with a lease on its runs, renewed every ``lease_time / 6`` in two
            tables of ours in that database, from its start (``async with handler``, or its
            construction in a running loop), else from its first request. When another
            replica's lease has not been renewed for its ``lease_time`` (its process died),
            this one ends the tasks it was running FAILED, with a status message saying so,
            once; a replica that cannot renew for ``lease_time / 2`` cancels its own runs
            first. At least ``2 x (cancel_grace_period + 3)`` seconds (the default, 30, is
            raised to that; a value given, 30 too, is refused below it); ``None`` turns leases
            off. An in-memory store never leases, nor a store of your own (docs/stores.md).
        sole_replica: this process is the only server of its task store: at its start (else
            its first request) it ends FAILED every task the store shows SUBMITTED or WORKING
            (a previous process's, leased or not) but its own runs. Off by default: where replicas of
            another kind share the store, nothing tells that their tasks are not running.

    Enter it in the server's lifespan (``async with handler: yield``): it starts there, and its
    exit awaits ``aclose()``.

    Each handler has its cancels to itself: given a `CancellableExecutor`, it uses the
    executor inside it with its own options, whatever the proxy was built with.

    Raises:
        TypeError: ``agent_executor`` is not an executor.
        TypeError, ValueError: an option outside its documented values.
    """

    def __init__(
        self,
        agent_executor: AgentExecutor,
        *args: Any,
        cancel_grace_period: float = DEFAULT_GRACE_PERIOD,
        on_parked: Literal["cancel", "refuse"] = "cancel",
        on_canceled: Literal["raise", "return"] = "raise",
        replica_poll_interval: float | None = DEFAULT_POLL_INTERVAL,
        cancel_unwatched_after: float | None = None,
        cancel_unwatched_parked: bool = False,
        shutdown_drain_time: float = DEFAULT_DRAIN_TIME,
        lease_time: float | None = DEFAULT_LEASE_TIME,
        sole_replica: bool = False,
        **kwargs: Any,
    ) -> None:
        settings = Settings(
            cancel_grace_period,
            replica_poll_interval,
            on_parked,
            on_canceled,
            cancel_unwatched_after=cancel_unwatched_after,
            cancel_unwatched_parked=cancel_unwatched_parked,
            shutdown_drain_time=shutdown_drain_time,
            lease_time=lease_time,
            sole_replica=sole_replica,
        )
        DefaultRequestHandler._set_up(
            self, settings, None, agent_executor, args, kwargs
        )  # Patched: the SDK's class.

    @classmethod
    def _with(
        cls,
        settings: Settings,
        agent_executor: AgentExecutor,
        *args: Any,
        probe: Probe | None = None,
        **kwargs: Any,
    ) -> DefaultRequestHandler:
        """The testing kit's handler: ``settings`` as they are (a `Timing` too), and its sweep's
        ``probe``, which sees each run's cancel points (see `a2a_cancelfix.checkpoints.Probe`)."""
        handler = cls.__new__(cls)
        handler._set_up(settings, probe, agent_executor, args, kwargs)
        return handler

    def _set_up(
        self,
        settings: Settings,
        probe: Probe | None,
        agent_executor: AgentExecutor,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        require_executor("agent_executor", agent_executor)
        _sdk.warn_if_unsupported()
        if isinstance(agent_executor, CancellableExecutor):
            agent_executor = agent_executor.__wrapped__
        arguments = _SDK_INIT.bind(self, agent_executor, *args, **kwargs)
        given = arguments.arguments.get("task_store")
        peers = _peers_of(given)
        store = arguments.arguments["task_store"] = guarded(given, peers)
        say_what_is_off(store, settings)
        self._lifecycle = Lifecycle(agent_executor, settings, probe=probe)
        arguments.arguments["agent_executor"] = CancellableExecutor._of(self._lifecycle)
        self._pushes: BackgroundPushSender | None = None
        if arguments.arguments.get("push_sender") is not None:
            self._pushes = BackgroundPushSender(arguments.arguments["push_sender"], self._lifecycle)
            arguments.arguments["push_sender"] = self._pushes
        # What the SDK warns of here (no event_stream, a queue_manager) is about the caller's
        # arguments: said again at the caller's line, not at this one.
        with warnings.catch_warnings(record=True) as raised:
            warnings.simplefilter("always")
            _sdk_init(*arguments.args, **arguments.kwargs)
        for warning in raised:
            warnings.warn(warning.message, warning.category, stacklevel=3)
        push_configs = arguments.arguments.get("push_config_store")
        self._remote = self._lifecycle.bind(self, store, push_configs, peers, self._pushes)
        # Whether the leases (see lease_time) are still to begin: read by every request.
        leases = self._lifecycle.leases
        self._leases_due = leases is not None
        if leases is not None and _loop_running():
            leases.begin()  # Built in the server's loop: the lease begins now, not at a request.
        self.cancel_grace_period = settings.cancel_grace_period
        self.on_parked = settings.on_parked
        self.on_canceled = settings.on_canceled
        self._closing = False  # aclose() has begun: no new message is taken.
        self._shutdown: asyncio.Future[None] | None = None  # aclose()'s work, begun once.
        self._exit_watched = False  # The server's exit signal begins the shutdown (_exit_signal.py).
        self._open = OpenStreams()  # Of runs here: the shutdown waits for them to end.

    @_telemetry.traced_as_sdk
    @_sdk.validated
    async def on_cancel_task(self, params: CancelTaskRequest, context: ServerCallContext) -> Task:
        """Cancel a task; return it CANCELED or raise an A2A error, within the grace bound.

        Raises:
            TaskNotFoundError: unknown id, or a task the caller does not own.
            TaskNotCancelableError: already terminal, or parked under ``on_parked="refuse"``.
            InternalError: the executor's ``cancel()`` raised (the task ends FAILED), or the
                task store failed, or has not recorded CANCELED within the bound (the write
                goes on behind the answer).
        """
        if self._leases_due:
            await DefaultRequestHandler._begin_leases(self)
        return await self._lifecycle.request(params.id, context)

    @_telemetry.traced_as_sdk
    async def on_get_task(self, params: GetTaskRequest, context: ServerCallContext) -> Task | None:
        """Get a task, as the SDK does; its owner's read stops its unwatched clock (see
        ``cancel_unwatched_after``)."""
        if self._leases_due:
            await DefaultRequestHandler._begin_leases(self)
        task = await _sdk_get(self, params, context)
        watchers = self._lifecycle.watchers
        if watchers is not None and task is not None:
            watchers.touch(task.id)
        return task

    @_telemetry.traced_as_sdk
    async def on_delete_task_push_notification_config(
        self, params: DeleteTaskPushNotificationConfigRequest, context: ServerCallContext
    ) -> None:
        """Delete a push config, as the SDK does; the task's unwatched clock starts then (the
        config may have been its last observer; see ``cancel_unwatched_after``)."""
        await _sdk_delete_config(self, params, context)
        watchers = self._lifecycle.watchers
        if watchers is not None:
            watchers.touch(params.task_id)

    async def __aenter__(self) -> DefaultRequestHandler:
        """Start, in the server's loop (its lifespan: ``async with handler: yield``): this replica's
        lease begins (see ``lease_time``; with ``sole_replica``, its first pass is awaited, at most
        ``lease_time / 2``), and under uvicorn the exit signal begins the shutdown. Without it,
        both begin at the first request."""
        if self._leases_due:
            await DefaultRequestHandler._begin_leases(self)
        if not self._exit_watched:
            DefaultRequestHandler._watch_exit_signal(self)
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Shut down: ``aclose()``, whatever ended the block."""
        await self.aclose()

    async def _begin_leases(self) -> None:
        """At the start, or else the first requests: this replica's lease begins (see ``lease_time``)."""
        leases = self._lifecycle.leases
        if leases is not None:
            await leases.begun()
        self._leases_due = False

    async def aclose(self) -> None:
        """Shut down: end what this process runs, within ``shutdown_drain_time`` plus
        ``cancel_grace_period`` plus 3 s (see docs/behaviour.md).

        New messages are refused from the start. The runs get ``shutdown_drain_time`` to finish;
        those still going are then cancelled as a client's cancel would be (within their grace
        period), ending CANCELED with a status message saying the server shut down; parked
        tasks stay as they are. Then, for the rest of ``shutdown_drain_time`` (at least a
        second after such cancels), the pushes queued behind the runs are sent and each pending
        CANCELED write is tried once more; meanwhile the runs left are closed, as the SDK's own
        ``aclose`` does from a2a-sdk 1.1.2. A WARNING names each task whose pushes or CANCELED
        did not land.

        Under uvicorn, this begins at the exit signal already, before uvicorn waits for the open
        connections and sse-starlette ends their streams (see docs/behaviour.md); a call
        then waits for that shutdown, as a second call waits for the first.
        """
        if self._shutdown is None:
            self._closing = True
            # The class's, named: under patch(), self is of the SDK's class.
            self._shutdown = in_background(DefaultRequestHandler._shut_down(self))
        await asyncio.shield(self._shutdown)

    def _watch_exit_signal(self) -> None:
        """Have the exit signal of the server this runs in begin the shutdown (once)."""
        self._exit_watched = True
        bound = _shutdown_bound(self._lifecycle.settings)
        _exit_signal.watch(self, DefaultRequestHandler.aclose, bound)

    async def _ends_delivered(self) -> bool:
        """Whether every stream here that is to show its task's end has closed: no sender's
        stream is open (each closes on its task's end, or as the task parks), nor a subscriber's
        to a task whose run here is going or has just ended (one parked here has no end to
        show; one run elsewhere is not this shutdown's to end)."""
        if self._open.senders:
            return False
        for task_id in self._open.subscribed():
            if task_id in self._lifecycle.works:
                return False
            if await _sdk.run_of(self, task_id) is not None and await _sdk.live_task(self, task_id) is None:
                return False  # Its run here has ended: its end is on its way to the stream.
        return True

    async def _shut_down(self) -> None:
        lifecycle = self._lifecycle
        settings = lifecycle.settings
        margin = settings.timing.margin
        self._closing = True
        drain_by = deadline_in(settings.shutdown_drain_time)
        await self._remote.aclose()
        if not await lifecycle.runs_ended(drain_by):
            cancels = in_background(asyncio.gather(*map(lifecycle.shutdown, list(lifecycle.works))))
            # Each cancel answers within its grace period and the margins of its recording.
            await wait_done(cancels, deadline_in(settings.cancel_grace_period + 2 * margin))
            drain_by = max(drain_by, deadline_in(margin))
        # Before the runs' queues close: the class's, named, as self may be of the SDK's class.
        await self._open.until(functools.partial(DefaultRequestHandler._ends_delivered, self), drain_by)
        closing = in_background(_sdk_close(self) if _sdk_close is not None else _sdk.close_runs(self, margin))
        drains = [lifecycle.drain(drain_by)]
        if self._pushes is not None:
            drains.append(self._pushes.drain(drain_by))
        await asyncio.gather(*drains)
        if not await wait_done(closing, drain_by):
            logger.warning("the handler's runs were not all closed by the end of shutdown_drain_time")
        # After the runs closed: a lease row left for a task still stored running is the
        # survivors' to end, and must not be one whose end a run was still storing.
        await lifecycle.end_leases(max(drain_by, deadline_in(margin)))

    @_telemetry.traced_as_sdk
    async def on_message_send(self, params: SendMessageRequest, context: ServerCallContext) -> Message | Task:
        """Send a message, as the SDK does; a task that ended or is being canceled refuses it,
        as does one that ended before a follow-up it had accepted was processed, and a server
        shutting down refuses every message."""
        _sdk.check_required_fields(params)
        if self._closing:
            raise shutting_down()
        if not self._exit_watched:
            DefaultRequestHandler._watch_exit_signal(self)
        if self._leases_due:
            await DefaultRequestHandler._begin_leases(self)
        if self._remote.must_listen:
            self._remote.listen()
        watchers = self._lifecycle.watchers
        # A blocking sender watches its task until it has its answer; a follow-up's, once the
        # task is known to be the caller's: a stranger's message must not keep it alive.
        observer: Observer | None = None
        if self._closing:  # Begun while the leases did: refused as before.
            raise shutting_down()
        self._lifecycle.message_taken()  # In the turn of the check: a shutdown begun later waits for it.
        try:
            if not params.message.task_id:
                if watchers is not None:
                    observer = watchers.open("", params.message.message_id)
                try:
                    result = await _sdk_send(self, params, context)
                except A2AError:
                    raise
                except Exception as error:
                    raise_for("", error)
                refused = self._remote.refused_tasks  # Empty unless a save was refused.
                if refused and isinstance(result, Task) and result.id in refused:
                    return await self._remote.as_stored(result, context)
                return result
            if await refuse_if_ended(self._lifecycle, params, context) and watchers is not None:
                observer = watchers.open(params.message.task_id)
            lifecycle, message_id = self._lifecycle, params.message.message_id
            lifecycle.follow_up_accepted(message_id)
            try:
                result = await _sdk_send(self, params, context)
            except _sdk.QueueShutDown as error:
                raise ended(params) from error
            except A2AError:
                raise
            except Exception as error:
                raise_for(params.message.task_id, error)
            finally:
                unprocessed = lifecycle.follow_up_unprocessed(message_id)
            if unprocessed and isinstance(result, Task) and _ended_without_it(result.status.state):
                raise ended_first(params, result.status.state)
            refused = self._remote.refused_tasks  # Empty unless a save was refused.
            if refused and isinstance(result, Task) and result.id in refused:
                return await self._remote.as_stored(result, context)
            return result
        finally:
            self._lifecycle.message_answered()
            if watchers is not None and observer is not None:
                watchers.close(observer)

    @_telemetry.traced_as_sdk
    async def on_message_send_stream(
        self, params: SendMessageRequest, context: ServerCallContext
    ) -> AsyncGenerator[Any, None]:
        """Stream a message, as the SDK does; a task that ended or is being canceled refuses it,
        as does a server shutting down."""
        _sdk.check_required_fields(params)
        _sdk.check_streaming(self)
        if self._closing:
            raise shutting_down()
        if not self._exit_watched:
            DefaultRequestHandler._watch_exit_signal(self)
        if self._leases_due:
            await DefaultRequestHandler._begin_leases(self)
        if self._remote.must_listen:
            self._remote.listen()
        lifecycle, message = self._lifecycle, params.message
        watchers, follow_up = lifecycle.watchers, bool(message.task_id)
        # Read only where it is used: each read of a protobuf field builds a Python object.
        message_id = message.message_id if follow_up or watchers is not None else ""
        owned = True  # A stranger's message must not keep the task alive: not an observer.
        if follow_up:
            owned = await refuse_if_ended(self._lifecycle, params, context)
        if self._closing:  # Begun while the leases or the task's read were awaited: refused as before.
            raise shutting_down()
        if follow_up:
            lifecycle.follow_up_accepted(message_id)
        observer = None if watchers is None or not owned else watchers.open(message.task_id, message_id)
        events = _sdk_stream(self, params, context)
        drained = False
        event: Any = None
        lifecycle.message_taken()  # In the turn of the check: a shutdown begun later waits for it.
        self._open.sender_opened()
        taken = True  # Until its first event: by then its run is one the shutdown waits for.
        try:
            async for event in events:
                if taken:
                    taken = False
                    lifecycle.message_answered()
                # _sdk.terminal_state(), inline: every event of every stream comes through here.
                if type(event) in STATUS_EVENTS and (state := event.status.state) in TERMINAL_STATES:
                    break
                yield event
            else:
                task_id = message.task_id or ("" if event is None else _task_id_of(event))
                end = await end_being_recorded(lifecycle, task_id, context)
                if end is not None:
                    yield end
                return
            task_id = event.id if type(event) is Task else event.task_id  # _task_id_of(), inline.
            if follow_up and _ended_without_it(state) and lifecycle.follow_up_unprocessed(message_id):
                raise ended_first(params, state)
            if self._remote.refused_tasks and task_id in self._remote.refused_tasks:
                event = await self._remote.as_stored(event, context)
            yield event
            # The spec ends the stream here. The SDK's own stream ends as the run closes: it is
            # read to there (closing it instead would leave its inner stream to the garbage
            # collector's finalizer, a cost on every message), at once if the run has returned,
            # else in the background.
            if task_id in lifecycle.works or task_id in lifecycle.cancellations:  # busy(), inline.
                drained = True
                in_background(drain(events))
                return
            try:  # drain(), inline: the run has returned, so its stream ends at once.
                async for _ in events:
                    pass
            except Exception:
                logger.debug("a stream raised after its terminal event", exc_info=True)
            drained = True  # To its end: nothing to close.
        except _sdk.QueueShutDown as error:
            raise ended(params) from error
        except A2AError:
            raise
        except Exception as error:
            raise_for(params.message.task_id, error)
        finally:
            if taken:
                lifecycle.message_answered()
            self._open.sender_closed()
            if watchers is not None and observer is not None:
                watchers.close(observer)
            if follow_up:
                lifecycle.follow_up_unprocessed(message_id)
            if not drained:
                await events.aclose()

    @_telemetry.traced_as_sdk
    @_sdk.validated
    async def on_subscribe_to_task(
        self, params: SubscribeToTaskRequest, context: ServerCallContext
    ) -> AsyncGenerator[Any, None]:
        """Subscribe to a task the caller owns; anyone else gets ``TaskNotFoundError``.

        A terminal task has nothing more to stream: ``UnsupportedOperationError``, as the SDK
        says from 1.2.0, checked before the SDK would set up (and leak) a run for it. A task no
        run here feeds (it runs on another replica, outside upstream's cluster mode) is served
        from the store until it ends, where the SDK would set up a run that never ends.
        """
        _sdk.check_streaming(self)
        if self._leases_due:
            await DefaultRequestHandler._begin_leases(self)
        task = await self._lifecycle.read(params.id, context)
        if task is None:
            raise TaskNotFoundError
        if task.status.state in _sdk.TERMINAL_STATES:
            raise UnsupportedOperationError(
                message=f"Task {task.id} is in terminal state {_state_name(task)}"
            )
        if (
            _sdk.SUPPORTED
            and not _sdk.streams_remote_tasks(self)
            and await _sdk.live_task(self, task.id) is None
        ):
            events = self._remote.follow(task, context)
            here = False  # Its run is elsewhere: this replica's shutdown does not end it.
        else:
            events = _sdk_subscribe(self, params, context)
            here = True
        watchers = self._lifecycle.watchers
        observer = None if watchers is None else watchers.open(task.id)
        if here:
            self._open.subscriber_opened(task.id)
        try:
            ended = False
            async for event in until_terminal(events):
                if _sdk.terminal_state(event) is not None:
                    ended = True
                    if params.id in self._remote.refused_tasks:
                        event = await self._remote.as_stored(event, context)
                yield event
            end = None if ended else await end_being_recorded(self._lifecycle, params.id, context)
            if end is not None:
                yield end
        except A2AError:
            raise
        except Exception as error:
            raise_for(params.id, error)
        finally:
            if here:
                self._open.subscriber_closed(task.id)
            if watchers is not None and observer is not None:
                watchers.close(observer)


def _shutdown_bound(settings: Settings) -> float:
    """Seconds within which ``aclose()`` returns: the drain, a cancel's grace, the margins."""
    return settings.shutdown_drain_time + settings.cancel_grace_period + 3.0


def _task_id_of(event: Any) -> str:
    return event.id if type(event) is Task else event.task_id


def _ended_without_it(state: int) -> bool:
    """Whether a task's end tells a follow-up's sender nothing of its message: a cancel that
    raced it does (its sender sees CANCELED); an end the task reached before it was run does not."""
    return state != _sdk.CANCELED


def _state_name(task: Task) -> str:
    return _sdk.state_name(task.status.state)


def _peers_of(store: Any) -> LocalNotices | None:
    """The notices of the handlers sharing ``store``'s ``InMemoryTaskStore`` (bare or guarded), if so."""
    inner = store.wrapped if isinstance(store, FinalStateTaskStore) else store
    return LocalNotices.of(inner) if type(inner) is InMemoryTaskStore else None


# The SDK's own constructor and shutdown, as the SDK defines them: ours call them, also once
# `a2a_cancelfix.patch()` has put ours in their place on the SDK's class.
_sdk_init = DefaultRequestHandlerV2.__init__
_sdk_close = getattr(DefaultRequestHandlerV2, "aclose", None)  # 1.1.2+
# The SDK's constructor's parameters, to find the task store among the arguments it is given.
_SDK_INIT = inspect.signature(_sdk_init)


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
