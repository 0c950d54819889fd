"""How long `a2a-cancelfix sweep --released` takes on a user's token-streaming executor.

The executor: 40 steps (a fake model's tokens, 0.1 s each, each streamed as an artifact), a
tool call every tenth step, a claim held throughout. ``Tokens`` releases its claim in a
``finally``; ``BrokenTool`` swallows the cancel at its tool call and goes on. Each is swept
twice, in the same run, through the command line:

- after: as the sweep runs by default (repeated code paths folded, virtual time);
- before: with ``--every-occurrence --real-time``, as every sweep ran before both.

    python benchmarks/sweep_speed.py            # after, then before (about half an hour)
    python benchmarks/sweep_speed.py --after    # after only

The broken executor must be named at its tool's line in both.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

from a2a.helpers import new_task
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events.event_queue import EventQueue
from a2a.server.tasks import TaskUpdater
from a2a.types import Part, TaskState

STEPS = 40
TOKEN = 0.1  # Seconds per token of the fake model.


async def model() -> str:
    await asyncio.sleep(TOKEN)
    return "token "


async def tool() -> None:
    await asyncio.sleep(TOKEN)


class Tokens(AgentExecutor):
    """Streams 40 tokens, calls a tool every tenth, holds a claim until the run ends."""

    def __init__(self) -> None:
        self.claims = 0

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        task_id, context_id = context.task_id or "", context.context_id or ""
        updater = TaskUpdater(event_queue, task_id, context_id)
        if context.current_task is None:
            await event_queue.enqueue_event(new_task(task_id, context_id, TaskState.TASK_STATE_SUBMITTED))
        await updater.start_work()
        self.claims += 1
        try:
            for step in range(STEPS):
                text = await model()
                await updater.add_artifact([Part(text=text)], artifact_id="answer", append=step > 0)
                if step % 10 == 9:
                    await self.call_tool()
        finally:
            self.claims -= 1
        await updater.complete()

    async def call_tool(self) -> None:
        await tool()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        return None


class BrokenTool(Tokens):
    """Swallows the cancel that lands during its tool call, and goes on streaming."""

    async def call_tool(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await tool()  # The defect's line: the sweep must name it.


def released(executor: Tokens) -> bool:
    return executor.claims == 0


def swept(name: str, *options: str) -> tuple[float, str, str]:
    command = [sys.executable, "-m", "a2a_cancelfix", "sweep", f"sweep_speed:{name}"]
    command += ["--released", "sweep_speed:released", *options]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=_env(), timeout=7200)
    return time.perf_counter() - started, done.stdout, done.stderr


def _env() -> dict[str, str]:
    here = str(Path(__file__).parent)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}


def _line(kind: str, name: str, took: float, out: str) -> str:
    count = next((line for line in out.splitlines() if line.endswith("rows hold.")), "?")
    fails = [line for line in out.splitlines() if line.startswith("FAILS:")]
    named = (
        "named at the tool's line"
        if any("> call_tool > tool (sweep_speed.py:" in line for line in fails)
        else ""
    )
    return f"{kind:<7} {name:<10} {took:7.1f} s  {count}  {named}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--after", action="store_true", help="only the sweep as it runs by default")
    arguments = parser.parse_args()
    runs = [("after", ())] + ([] if arguments.after else [("before", ("--every-occurrence", "--real-time"))])
    for kind, options in runs:
        for name in ("Tokens", "BrokenTool"):
            took, out, _ = swept(name, *options)
            print(_line(kind, name, took, out), flush=True)


if __name__ == "__main__":
    main()
