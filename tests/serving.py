"""What the tests' server processes share (crash_server.py, replica_server.py, sigterm_server.py).

A test starts one with `start`: it serves on a free port of 127.0.0.1, prints ``READY <port>``,
and exits when its standard input closes, so that it never outlives the test that started it.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import threading
from pathlib import Path
from typing import IO

import uvicorn
from a2a.helpers import new_task
from a2a.server.agent_execution import RequestContext
from a2a.server.events.event_queue import EventQueue
from a2a.server.tasks import TaskUpdater
from a2a.types import TaskState

ROOT = Path(__file__).resolve().parent.parent


async def start(
    module: str, *arguments: str, errors: IO[bytes] | None = None, **environment: str
) -> tuple[asyncio.subprocess.Process, int]:
    """Start ``python -m tests.<module> ARGUMENTS``; the process and its port, once it serves."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        f"tests.{module}",
        *arguments,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=errors,
        cwd=str(ROOT),
        env={**os.environ, **environment},
    )
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), 60)
    if not line.startswith(b"READY "):
        process.kill()
        raise RuntimeError(f"{module} did not start: {line!r}")
    return process, int(line.split()[1])


async def serve(server: uvicorn.Server) -> None:
    """Serve on a free port, say which, and exit once the standard input closes."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)  # Connections wait in the backlog until uvicorn accepts them.
    threading.Thread(target=_exit_when_stdin_closes, args=(server,), daemon=True).start()
    print(f"READY {sock.getsockname()[1]}", flush=True)
    await server.serve(sockets=[sock])


def _exit_when_stdin_closes(server: uvicorn.Server) -> None:
    sys.stdin.read()
    server.should_exit = True


async def begin(context: RequestContext, event_queue: EventQueue) -> TaskUpdater:
    """A run's first step: its task SUBMITTED, if new; the updater of its task."""
    task_id, context_id = context.task_id or "", context.context_id or ""
    if context.current_task is None:
        history = [context.message] if context.message else []
        await event_queue.enqueue_event(
            new_task(task_id, context_id, TaskState.TASK_STATE_SUBMITTED, history=history)
        )
    return TaskUpdater(event_queue, task_id, context_id)
