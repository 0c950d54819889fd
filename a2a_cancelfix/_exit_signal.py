"""A uvicorn server's exit signal, taken before uvicorn and sse-starlette act on it.

At SIGTERM (or SIGINT) uvicorn stops taking connections and waits for the open ones, while
sse-starlette ends every event stream at once, each on whatever event it last sent; the
lifespan's shutdown, and so ``aclose()``, comes only after both. Our hook goes first: each of
our handlers in the process begins its ``aclose()`` at the signal, and sse-starlette's ending
of the streams is held until those are over (each closes its runs only once their streams
have shown their tasks' ends) or their bound has passed; then it is done as sse-starlette
would have done it. A second signal ends the hold at once (and uvicorn forces its exit on a
second SIGINT, as ever).

Only this module touches uvicorn's and sse-starlette's internals, each access with the
releases it was seen in. They are probed when a handler starts (``async with handler`` in the
lifespan) or else takes its first message, in the server's loop; where the probe fails, the shutdown is as it was (it begins with the
lifespan's ``aclose()``), with one WARNING.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import signal
import sys
import threading
import weakref
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any

from a2a_cancelfix._aio import in_background

logger = logging.getLogger("a2a_cancelfix")

# A handler's aclose(): begins its shutdown, or joins the one begun.
Shutdown = Callable[[Any], Awaitable[None]]
SignalHandler = Callable[[int, "FrameType | None"], Any]

_hook: ExitHook | None = None
_warned = False


def watch(handler: object, shutdown: Shutdown, bound: float) -> None:
    """Have ``shutdown(handler)`` begin at the exit signal of the uvicorn server running this
    loop, and sse-starlette's ending of streams wait for it, ``bound`` seconds at most; while
    the handler lives.

    Called in the server's loop. Not under uvicorn (another server, no server, a thread
    other than the main one), nothing is done: the shutdown begins with ``aclose()``.
    """
    global _hook, _warned
    if threading.current_thread() is not threading.main_thread():
        return  # Signals reach the main thread only; uvicorn hooks none elsewhere.
    current = signal.getsignal(signal.SIGTERM)
    hook = _hook if current is _hook else None  # A server started anew has signal handlers anew.
    if hook is None:
        exit_handler = _uvicorn_exit(current)
        if exit_handler is None:
            logger.debug("not under uvicorn: the shutdown begins with aclose()")
            return
        streams = _sse_starlette()
        if streams is None:
            if not _warned:
                _warned = True
                logger.warning(
                    "sse-starlette %s cannot hold its ending of event streams at the exit signal "
                    "(3.2 and later can): the shutdown begins with aclose(), once the streams of "
                    "running tasks have ended without their tasks' ends (see docs/behaviour.md)",
                    _version("sse-starlette"),
                )
            return
        hook = _hook = ExitHook(exit_handler, asyncio.get_running_loop(), streams)
        for sig in _SIGNALS:
            signal.signal(sig, hook)  # uvicorn puts its own saved handlers back as it exits.
    hook.add(handler, shutdown, bound)


class ExitHook:
    """The signal handler put in front of uvicorn's: see the module's docstring."""

    def __init__(
        self, exit_handler: SignalHandler, loop: asyncio.AbstractEventLoop, streams: Streams
    ) -> None:
        self._exit_handler = exit_handler
        self._loop = loop
        self._streams = streams
        self._shutdowns: list[tuple[weakref.ref[object], Shutdown, float]] = []
        self._signals = 0

    def add(self, handler: object, shutdown: Shutdown, bound: float) -> None:
        """Begin ``shutdown(handler)`` at the signal, while the handler lives; wait for it
        ``bound`` seconds at most."""
        self._shutdowns = [entry for entry in self._shutdowns if entry[0]() is not None]
        self._shutdowns.append((weakref.ref(handler), shutdown, bound))

    def __call__(self, sig: int, frame: FrameType | None) -> None:
        self._signals += 1
        if self._signals == 1:
            self._streams.hold()  # Before uvicorn's handler, which sse-starlette's wraps.
        else:
            self._streams.release()
        self._exit_handler(sig, frame)
        if self._signals == 1:
            # A signal handler runs between two bytecodes of whatever the loop was doing.
            try:
                self._loop.call_soon_threadsafe(self._begin)
            except RuntimeError:  # The loop has closed: nothing of ours is left to end.
                self._streams.release()

    def _begin(self) -> None:
        alive = [
            (handler, shutdown, bound)
            for ref, shutdown, bound in self._shutdowns
            if (handler := ref()) is not None
        ]
        if not alive:
            self._streams.release()
            return
        self._loop.call_later(max(bound for _, _, bound in alive), self._streams.release)
        in_background(self._shut_down([shutdown(handler) for handler, shutdown, _ in alive]))

    async def _shut_down(self, shutdowns: list[Awaitable[None]]) -> None:
        try:
            outcomes = await asyncio.gather(*shutdowns, return_exceptions=True)
            for outcome in outcomes:
                if isinstance(outcome, Exception):
                    logger.warning("a shutdown begun at the exit signal failed", exc_info=outcome)
        finally:
            self._streams.release()


class Streams:
    """sse-starlette's ending of every event stream at the exit signal, held, then done.

    Seen in sse-starlette 3.2.0-3.7.1 (3.1 has no such switch):
    ``AppStatus.disable_automatic_graceful_drain()`` keeps its patched ``Server.handle_exit``
    and its per-loop watcher from ending the streams when uvicorn's ``should_exit`` is set;
    ``AppStatus.should_exit = True`` ends them (its watcher looks every half second), as its
    own ``handle_exit`` would have. Both documented there.
    """

    def __init__(self, status: Any) -> None:
        self._status = status
        self._held = False
        self._released = False

    def hold(self) -> None:
        # Where the application turned the automatic ending off, it ends the streams itself.
        if self._status.enable_automatic_graceful_drain and not self._status.should_exit:
            self._held = True
            self._status.disable_automatic_graceful_drain()

    def release(self) -> None:
        if self._held and not self._released:
            self._released = True
            self._status.should_exit = True
            self._status.enable_automatic_graceful_drain_mode()


# uvicorn's HANDLED_SIGNALS on POSIX (seen in 0.29.0-0.55.0).
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _uvicorn_exit(current: Any) -> SignalHandler | None:
    """uvicorn's exit handler, if it handles SIGINT and SIGTERM in this thread.

    Seen in uvicorn 0.29.0-0.55.0: ``Server.capture_signals`` sets ``signal.signal(sig,
    self.handle_exit)`` for both, as ``serve()`` begins; ``handle_exit`` sets ``should_exit``
    (a second SIGINT, ``force_exit``). sse-starlette's import replaces the class's
    ``handle_exit`` with its own, which calls uvicorn's: bound to the server all the same.
    """
    server_module = sys.modules.get("uvicorn.server")
    server = getattr(current, "__self__", None)
    if server_module is None or not isinstance(server, getattr(server_module, "Server", ())):
        return None
    if not hasattr(server, "should_exit") or signal.getsignal(signal.SIGINT) != current:
        return None
    handler: SignalHandler = current
    return handler


def _sse_starlette() -> Streams | None:
    """The hold of sse-starlette's ending of streams; None if the installed release has none
    (before 3.2). With sse-starlette not imported, this process serves no SSE stream through the
    SDK's routes: nothing to hold, and nothing is."""
    module = sys.modules.get("sse_starlette.sse")
    if module is None:
        return Streams(_NothingToHold())
    status = getattr(module, "AppStatus", None)
    wanted = ("should_exit", "enable_automatic_graceful_drain", "disable_automatic_graceful_drain")
    if not all(hasattr(status, name) for name in (*wanted, "enable_automatic_graceful_drain_mode")):
        return None
    return Streams(status)


class _NothingToHold:
    """An ``AppStatus`` whose automatic ending is off: `Streams` holds nothing."""

    enable_automatic_graceful_drain = False
    should_exit = False


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"
