"""Executors written as agents in the field are: waits inside library calls (``fakelib``, an
installed package), blocking calls on thread pools, a ``cancel()`` that starts work. The sweep
must pass the correct ones and catch the two that leak."""

from __future__ import annotations

import _thread
import asyncio
import concurrent.futures
import threading
from typing import Any

import anyio.to_thread
import fakelib
from a2a.server.agent_execution import RequestContext
from a2a.server.events.event_queue import EventQueue

from a2a_cancelfix import checkpoint

from .sweep_executors import Agent


class CallsALibrary(Agent):
    """One call into an installed package that suspends twice."""

    async def work(self) -> None:
        await fakelib.two_sleeps()


class StreamsFromALibrary(Agent):
    """Iterates an installed package's stream (two suspensions an item), a checkpoint an item."""

    async def work(self) -> None:
        async for _ in fakelib.chunks():
            await checkpoint()


def blocking() -> int:
    return sum(range(1000))  # Stands in for a blocking client call that returns at once.


class OnAnyioThreads(Agent):
    """Runs a blocking call as Starlette's ``run_in_threadpool`` does."""

    async def work(self) -> None:
        await anyio.to_thread.run_sync(blocking)


class OnItsOwnPool(Agent):
    """Runs a blocking call on a thread pool of its own, kept for the executor's life."""

    def __init__(self) -> None:
        self.pool = concurrent.futures.ThreadPoolExecutor(2)

    async def work(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self.pool, blocking)


class ForeignThread:
    """A thread started below `threading`, as pytest-xdist's I/O thread is (execnet starts it
    with ``_thread``): `threading.enumerate()` lists it only from the moment it first asks for
    ``threading.current_thread()``, which a log call does, or a finalizer the garbage collector
    happens to run in it. Then it goes on in Python code, as that thread reading its socket."""

    def __init__(self) -> None:
        self.asked = threading.Event()
        self.known = threading.Event()
        self.done = threading.Event()
        _thread.start_new_thread(self._run, ())

    def _run(self) -> None:
        self.asked.wait()
        threading.current_thread()  # A _DummyThread for it, from now on in threading.enumerate().
        self.known.set()
        self.done.wait()


class WakesAForeignThread(Agent):
    """Its run makes a thread of the process that nobody started through `threading` known to it."""

    def __init__(self, foreign: ForeignThread) -> None:
        self.foreign = foreign

    async def work(self) -> None:
        self.foreign.asked.set()
        await asyncio.to_thread(self.foreign.known.wait, 5.0)


class PoolWorkOutlivesRun(OnItsOwnPool):
    """Its pool's thread goes on with work that never looks for the cancel."""

    def __init__(self) -> None:
        super().__init__()
        self.stop = threading.Event()

    async def work(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self.pool, self.stop.wait, 0.8)


class CancelStartsAPoller(Agent):
    """Its ``cancel()`` starts a task that calls the model every 50 ms, forever."""

    def __init__(self) -> None:
        self.calls = 0

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        self.poller = asyncio.ensure_future(self.poll())

    async def poll(self) -> None:
        while True:
            self.calls += 1  # Stands in for a call to the model.
            await asyncio.sleep(0.05)


def released_with_a_wrong_signature(executor: Any, claims: Any) -> bool:
    return True
